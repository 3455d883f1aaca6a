"""Block-wise int4 quantization in the layout of ONNX Runtime's MatMulNBits.

A weight W [N, K] (out, in) is cut into blocks of BLOCK values along K. Each block gets a
scale and a 4-bit zero point: w ~ (q - zp) * scale, q in 0..15 (round to nearest,
asymmetric, zero exactly representable). The same bytes also feed GatherBlockQuantized, so a
tied embedding table is quantized and stored once for both the lookup and the lm_head.
"""
from dataclasses import dataclass

import numpy as np

BLOCK = 32


@dataclass
class Int4Weight:
    packed: np.ndarray       # uint8 [N, K/BLOCK, BLOCK/2], low nibble first
    scales: np.ndarray       # float32 [N, K/BLOCK]
    zero_points: np.ndarray  # uint8 [N, ceil(K/BLOCK/2)], packed like `packed`

    @property
    def shape(self):
        n, blocks, _ = self.packed.shape
        return n, blocks * BLOCK


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Pack uint8 values < 16 pairwise along the last axis, the first in the low nibble."""
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.zeros(q.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def quantize_int4(w: np.ndarray) -> Int4Weight:
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"input dimension {k} is not a multiple of the block size {BLOCK}")
    blocks = w.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    lo = np.minimum(blocks.min(-1), 0.0)
    hi = np.maximum(blocks.max(-1), 0.0)
    scales = (hi - lo) / 15.0
    scales[scales == 0] = 1.0  # an all-zero block: any scale reproduces it
    zero_points = np.clip(np.rint(-lo / scales), 0, 15)
    q = np.clip(np.rint(blocks / scales[..., None]) + zero_points[..., None], 0, 15)
    return Int4Weight(_pack_nibbles(q.astype(np.uint8)), scales.astype(np.float32),
                      _pack_nibbles(zero_points.astype(np.uint8)))


def dequantize_int4(qw: Int4Weight) -> np.ndarray:
    """The float weights MatMulNBits computes with; used by tests."""
    low, high = qw.packed & 0x0F, qw.packed >> 4
    q = np.stack([low, high], axis=-1).reshape(qw.packed.shape[0], qw.packed.shape[1], BLOCK)
    zp = np.stack([qw.zero_points & 0x0F, qw.zero_points >> 4], axis=-1).reshape(q.shape[0], -1)
    zp = zp[:, : q.shape[1]]
    return ((q.astype(np.float32) - zp[..., None]) * qw.scales[..., None]).reshape(qw.shape)
