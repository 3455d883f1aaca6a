"""Block-wise quantization of weight matrices W [N, K] (out, in) in blocks of BLOCK along K.

Two 4-bit schemes, both for ONNX Runtime's MatMulNBits:
- "zp" (the default): w = d * (q - z), q and the zero point z in 0..15, one scale d and one
  z per block. MatMulNBits takes z natively, so a linear layer is one op. d and z are
  searched per block for the least squared error: a grid of clipped min-max scales, then
  least-squares refits of scale and zero given the codes.
- "q4_1": w = d * q + m with a float block minimum m, the GGUF Q4_1 grid: a dequantized Q4_1
  tensor comes back exactly, so an artifact computes with the GGUF's own weights. ONNX
  Runtime has no float minimum, so it is split off as w = d * (q - 8) + offset with
  offset = m + 8d, and the graph adds block_sums(x) @ offsets (three more ops a layer).
And 8-bit, symmetric: w = d * (q - 128), for vocabulary tables that decide the top token.
"""
from dataclasses import dataclass

import numpy as np

BLOCK = 32
ZERO_POINT = 8  # MatMulNBits' and GatherBlockQuantized's default for 4 bits in uint8
INT4_SCHEMES = ("zp", "q4_1")
# Scales tried per block, as fractions of the min-max scale: clipping the extremes a little
# often lowers the error of the other 30 values more than it costs the two.
SCALE_GRID = np.linspace(0.80, 1.0, 11, dtype=np.float32)
REFINE_STEPS = 3
CHUNK_ROWS = 2048


@dataclass
class Int4Weight:
    packed: np.ndarray   # uint8 [N, K/BLOCK, BLOCK/2], low nibble first
    scales: np.ndarray   # float32 [N, K/BLOCK]
    zero_points: np.ndarray = None  # uint8 [N, ceil(blocks/2)], two per byte ("zp")
    offsets: np.ndarray = None  # float32 [N, K/BLOCK]: minimum + ZERO_POINT * scale ("q4_1")

    @property
    def shape(self):
        n, blocks, _ = self.packed.shape
        return n, blocks * BLOCK

    def codes(self) -> np.ndarray:
        """The 4-bit codes q, [N, K/BLOCK, BLOCK]."""
        return _unpack(self.packed)

    def zeros(self) -> np.ndarray:
        """The zero point of every block, [N, K/BLOCK]."""
        return _unpack(self.zero_points)[:, :self.packed.shape[1]]


def _blocks(w: np.ndarray) -> np.ndarray:
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"input dimension {k} is not a multiple of the block size {BLOCK}")
    return w.astype(np.float32).reshape(n, k // BLOCK, BLOCK)


def _pack(q: np.ndarray) -> np.ndarray:
    """Pairs of 4-bit values along the last axis into bytes, low nibble first."""
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.zeros_like(q[..., :1])], -1)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _unpack(packed: np.ndarray) -> np.ndarray:
    """_pack undone: each byte back to its two 4-bit values, low nibble first."""
    return np.stack([packed & 0x0F, packed >> 4], -1).reshape(*packed.shape[:-1], -1)


def _by_rows(quantize):
    """Quantize a large matrix CHUNK_ROWS rows at a time (every block is independent, so
    the result is the same): the temporaries stay a few times one chunk, not the table."""
    def by_rows(w: np.ndarray, *args):
        if len(w) <= CHUNK_ROWS:
            return quantize(w, *args)
        parts = [quantize(w[i:i + CHUNK_ROWS], *args) for i in range(0, len(w), CHUNK_ROWS)]
        return type(parts[0])(*(None if getattr(parts[0], f) is None else
                                np.concatenate([getattr(p, f) for p in parts])
                                for f in parts[0].__dataclass_fields__))
    by_rows.__doc__ = quantize.__doc__
    return by_rows


@_by_rows
def quantize_int4(w: np.ndarray, scheme: str = "zp") -> Int4Weight:
    if scheme == "q4_1":
        return _quantize_q4_1(w)
    blocks = _blocks(w)
    lo, hi = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)  # 0 stays exact
    base = (hi - lo) / 15.0
    base[base == 0] = 1.0
    best = (np.full(base.shape, np.inf, np.float32), base, np.zeros(base.shape, np.float32))
    for fraction in SCALE_GRID:
        scale = base * fraction
        # the zero point that centres the clipped range on the block's values
        best = _keep_better(best, blocks, scale, np.rint(-(lo + hi - 15 * scale) / (2 * scale)))
    for _ in range(REFINE_STEPS):
        # given the codes, the least-squares line w ~ a q + b gives a new scale and zero
        q = _codes(blocks, best[1], best[2])
        q_mean, w_mean = q.mean(-1, keepdims=True), blocks.mean(-1, keepdims=True)
        slope = ((q - q_mean) * (blocks - w_mean)).sum(-1) / np.maximum(
            np.square(q - q_mean).sum(-1), 1e-12)
        scale = np.where(slope > 0, slope, best[1])
        best = _keep_better(best, blocks, scale, np.rint(q_mean[..., 0] - w_mean[..., 0] / scale))
    _, scale, zero = best
    return Int4Weight(_pack(_codes(blocks, scale, zero).astype(np.uint8)), scale.astype(np.float32),
                      zero_points=_pack(zero.astype(np.uint8)))


def _codes(blocks, scale, zero):
    return np.clip(np.rint(blocks / scale[..., None]) + zero[..., None], 0, 15)


def _keep_better(best, blocks, scale, zero):
    """(error, scale, zero) per block: `best`, or the new scale and zero where they err less."""
    zero = np.clip(zero, 0, 15)
    error = np.square((_codes(blocks, scale, zero) - zero[..., None]) * scale[..., None]
                      - blocks).sum(-1)
    better = error < best[0]
    return tuple(np.where(better, new, old) for new, old in zip((error, scale, zero), best))


def _quantize_q4_1(w: np.ndarray) -> Int4Weight:
    blocks = _blocks(w)
    lo, hi = blocks.min(-1), blocks.max(-1)
    scales = (hi - lo) / 15.0
    scales[scales == 0] = 1.0  # a constant block: q = 0 and the minimum reproduce it
    q = np.clip(np.rint((blocks - lo[..., None]) / scales[..., None]), 0, 15).astype(np.uint8)
    return Int4Weight(_pack(q), scales.astype(np.float32),
                      offsets=(lo + ZERO_POINT * scales).astype(np.float32))


def dequantize_int4(qw: Int4Weight) -> np.ndarray:
    """The float weights the graphs compute with; used by tests."""
    q = qw.codes().astype(np.float32)
    if qw.offsets is not None:
        w = (q - ZERO_POINT) * qw.scales[..., None] + qw.offsets[..., None]
    else:
        w = (q - qw.zeros()[..., None]) * qw.scales[..., None]
    return w.reshape(qw.shape)


@dataclass
class Int8Weight:
    """Symmetric 8-bit blocks: w = scale * (q - 128), the GGUF Q8_0 grid (exact for Q8_0)."""
    packed: np.ndarray  # uint8 [N, K/BLOCK, BLOCK]
    scales: np.ndarray  # float32 [N, K/BLOCK]
    zero_points = None  # 128, MatMulNBits' default for 8 bits


@_by_rows
def quantize_int8(w: np.ndarray) -> Int8Weight:
    blocks = _blocks(w)
    scales = np.abs(blocks).max(-1) / 127.0
    scales[scales == 0] = 1.0
    q = np.clip(np.rint(blocks / scales[..., None]), -127, 127) + 128
    return Int8Weight(q.astype(np.uint8), scales.astype(np.float32))


def dequantize_int8(qw: Int8Weight) -> np.ndarray:
    n, blocks, _ = qw.packed.shape
    return ((qw.packed.astype(np.float32) - 128) * qw.scales[..., None]).reshape(n, blocks * BLOCK)
