"""Block-wise 4-bit quantization with a float minimum per block (the GGUF Q4_1 scheme).

A weight W [N, K] (out, in) is cut into blocks of BLOCK values along K; each block keeps a
scale d and its minimum m, and every value becomes q in 0..15 with w = d * q + m. A GGUF
Q4_1 tensor, dequantized, is on exactly this grid (its blocks run along K too), so
quantizing it again gives back the same q, d and m: an int4 artifact of a Q4_1 GGUF computes
with the GGUF's own weights.

ONNX Runtime's MatMulNBits has integer zero points only, so the minimum is split off:
w = d * (q - 8) + offset, offset = m + 8d. MatMulNBits computes the first term (8 is its
default zero point) and the graph adds block_sums(x) @ offsets, where block_sums(x) sums
each BLOCK-wide slice of the input.
"""
from dataclasses import dataclass

import numpy as np

BLOCK = 32
ZERO_POINT = 8  # MatMulNBits' and GatherBlockQuantized's default for 4 bits in uint8


@dataclass
class Int4Weight:
    packed: np.ndarray   # uint8 [N, K/BLOCK, BLOCK/2], low nibble first
    scales: np.ndarray   # float32 [N, K/BLOCK]
    offsets: np.ndarray  # float32 [N, K/BLOCK]: block minimum + ZERO_POINT * scale

    @property
    def shape(self):
        n, blocks, _ = self.packed.shape
        return n, blocks * BLOCK


def quantize_int4(w: np.ndarray) -> Int4Weight:
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"input dimension {k} is not a multiple of the block size {BLOCK}")
    blocks = w.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    lo, hi = blocks.min(-1), blocks.max(-1)
    scales = (hi - lo) / 15.0
    scales[scales == 0] = 1.0  # a constant block: q = 0 and the minimum reproduce it
    q = np.clip(np.rint((blocks - lo[..., None]) / scales[..., None]), 0, 15).astype(np.uint8)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return Int4Weight(packed, scales.astype(np.float32),
                      (lo + ZERO_POINT * scales).astype(np.float32))


def dequantize_int4(qw: Int4Weight) -> np.ndarray:
    """The float weights the graphs compute with; used by tests."""
    q = np.stack([qw.packed & 0x0F, qw.packed >> 4], axis=-1).reshape(*qw.packed.shape[:2], BLOCK)
    w = (q.astype(np.float32) - ZERO_POINT) * qw.scales[..., None] + qw.offsets[..., None]
    return w.reshape(qw.shape)


@dataclass
class Int8Weight:
    """Symmetric 8-bit blocks: w = scale * (q - 128), the GGUF Q8_0 grid (exact for Q8_0)."""
    packed: np.ndarray  # uint8 [N, K/BLOCK, BLOCK]
    scales: np.ndarray  # float32 [N, K/BLOCK]


def quantize_int8(w: np.ndarray) -> Int8Weight:
    n, k = w.shape
    blocks = w.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    scales = np.abs(blocks).max(-1) / 127.0
    scales[scales == 0] = 1.0
    q = np.clip(np.rint(blocks / scales[..., None]), -127, 127) + 128
    return Int8Weight(q.astype(np.uint8), scales.astype(np.float32))


def dequantize_int8(qw: Int8Weight) -> np.ndarray:
    n, blocks, _ = qw.packed.shape
    return ((qw.packed.astype(np.float32) - 128) * qw.scales[..., None]).reshape(n, blocks * BLOCK)
