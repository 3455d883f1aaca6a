"""Block-wise quantization of weight matrices W [N, K] (out, in) in blocks of BLOCK along K.

Float weights (a Hugging Face checkpoint, or `--int4-scheme zp`) are rounded for ONNX
Runtime's MatMulNBits:
- 4 bits, "zp": w = d * (q - z), q and the zero point z in 0..15, one scale d and one z per
  block. MatMulNBits takes z natively, so a linear layer is one op. d and z are searched per
  block for the least squared error: a grid of clipped min-max scales, then least-squares
  refits of scale and zero given the codes.
- 8 bits, symmetric: w = d * (q - 128), for vocabulary tables that decide the top token.
A quantized source (a GGUF, `--int4-scheme source`) keeps its own grid instead
(SourceWeight): its codes and scales, the minimum split into an integer zero point and what
is left of it, the residual.
"""
from dataclasses import dataclass

import numpy as np

BLOCK = 32
INT4_SCHEMES = ("source", "zp")
# Scales tried per block, as fractions of the min-max scale: clipping the extremes a little
# often lowers the error of the other 30 values more than it costs the two.
SCALE_GRID = np.linspace(0.80, 1.0, 11, dtype=np.float32)
REFINE_STEPS = 3
CHUNK_ROWS = 2048


@dataclass
class Int4Weight:
    packed: np.ndarray   # uint8 [N, K/BLOCK, BLOCK/2], low nibble first
    scales: np.ndarray   # float32 [N, K/BLOCK]
    zero_points: np.ndarray = None  # uint8 [N, ceil(blocks/2)], two per byte
    bits, block, residual = 4, BLOCK, None

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
def quantize_int4(w: np.ndarray) -> Int4Weight:
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


def dequantize_int4(qw: Int4Weight) -> np.ndarray:
    """The float weights the graphs compute with; used by tests."""
    w = (qw.codes().astype(np.float32) - qw.zeros()[..., None]) * qw.scales[..., None]
    return w.reshape(qw.shape)


@dataclass
class Int8Weight:
    """Symmetric 8-bit blocks: w = scale * (q - 128), the GGUF Q8_0 grid (exact for Q8_0)."""
    packed: np.ndarray  # uint8 [N, K/BLOCK, BLOCK]
    scales: np.ndarray  # float32 [N, K/BLOCK]
    zero_points = None  # 128, MatMulNBits' default for 8 bits
    bits, block, residual = 8, BLOCK, None

    @property
    def shape(self):
        n, blocks, _ = self.packed.shape
        return n, blocks * BLOCK


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


@dataclass
class SourceWeight:
    """A GGUF tensor's own grid as MatMulNBits computes it: w = scale * (code - zero) +
    residual, per block along K. The codes and scales are the file's; the zero point is the
    integer nearest -minimum / scale, and the residual what that leaves of the minimum (zero
    for the symmetric types: Q4_0, Q5_0, Q8_0, Q6_K). Codes of 5 or 6 bits are stored at 8."""
    codes: np.ndarray     # uint8 [N, K]
    scales: np.ndarray    # float32 [N, K/block]
    zeros: np.ndarray     # uint8 [N, K/block]
    residual: np.ndarray  # float32 [N, K/block], or None when zero
    block: int
    bits: int             # 4 or 8

    @classmethod
    def from_affine(cls, codes, scales, minima, block, code_bits):
        """From w = scale * code + minimum (export/gguf_quants.affine)."""
        bits = 4 if code_bits <= 4 else 8
        with np.errstate(divide="ignore", invalid="ignore"):  # a zero scale: all residual
            zeros = np.clip(np.nan_to_num(np.rint(-minima / scales)), 0, (1 << bits) - 1)
        residual = (minima + scales * zeros).astype(np.float32)
        return cls(codes, scales, zeros.astype(np.uint8),
                   residual if np.any(residual) else None, block, bits)

    @property
    def shape(self):
        return self.codes.shape

    def promoted(self, bits, block):
        """The same weights at more bits or smaller blocks (exact), to join another part."""
        repeat = self.block // block
        spread = lambda a: None if a is None else np.repeat(a, repeat, axis=1)
        return SourceWeight(self.codes, spread(self.scales), spread(self.zeros),
                            spread(self.residual), block, bits)

    @staticmethod
    def grouped(parts) -> list:
        """Parts stacked along N (q, k and v as one weight), joined where they share a grid:
        one weight per run of parts with the same bits and block. Promoting a 4-bit part to
        another's 8 bits would be exact but would read it at 8 bits every token."""
        groups = []
        for part in parts:
            if groups and (groups[-1][-1].bits, groups[-1][-1].block) == (part.bits, part.block):
                groups[-1].append(part)
            else:
                groups.append([part])
        return [SourceWeight.joined(group) for group in groups]

    @staticmethod
    def joined(parts):
        """Parts stacked along N at the most bits and smallest block any part needs."""
        bits, block = max(p.bits for p in parts), min(p.block for p in parts)
        parts = [p.promoted(bits, block) for p in parts]
        residual = None if all(p.residual is None for p in parts) else np.concatenate(
            [np.zeros_like(p.scales) if p.residual is None else p.residual for p in parts])
        return SourceWeight(*(np.concatenate([getattr(p, f) for p in parts])
                              for f in ("codes", "scales", "zeros")), residual, block, bits)

    def take(self, rows):
        """The given rows (a draft head's shortlist of the vocabulary table)."""
        pick = lambda a: None if a is None else a[rows]
        return SourceWeight(*(pick(getattr(self, f)) for f in ("codes", "scales", "zeros",
                                                                "residual")), self.block, self.bits)

    def dequantized(self) -> np.ndarray:
        n, k = self.shape
        w = (self.codes.reshape(n, -1, self.block).astype(np.float32)
             - self.zeros[..., None]) * self.scales[..., None]
        if self.residual is not None:
            w += self.residual[..., None]
        return w.reshape(n, k)

    @property
    def packed(self):
        """MatMulNBits' weight: [N, K/block, block * bits / 8]."""
        n, k = self.shape
        blocks = self.codes.reshape(n, k // self.block, self.block)
        return _pack(blocks) if self.bits == 4 else blocks

    @property
    def zero_points(self):
        return _pack(self.zeros) if self.bits == 4 else self.zeros


def residual_columns(q: SourceWeight) -> SourceWeight:
    """q with its residual moved into more input columns: the graph appends x's block sums
    to x, and the residual, rounded at q's bits in blocks of its own, multiplies them: one
    op a layer, as for zp. A block's minimum then differs from the file's by at most a 4-bit
    step over the spread of its row's residuals (each under half a code step), or an 8-bit
    one (DESIGN.md)."""
    n, k = q.shape
    blocks = k // q.block
    width = -(-blocks // BLOCK) * BLOCK
    padded = np.zeros((n, width), np.float32)
    padded[:, :blocks] = q.residual
    r = quantize_int4(padded) if q.bits == 4 else quantize_int8(padded)
    codes = r.codes().reshape(n, width) if q.bits == 4 else r.packed.reshape(n, width)
    zeros = r.zeros() if q.bits == 4 else np.full(r.scales.shape, 128, np.uint8)
    extra = SourceWeight(codes, r.scales, zeros, None, BLOCK, q.bits).promoted(q.bits, q.block)
    return SourceWeight(np.concatenate([q.codes, extra.codes], 1),
                        np.concatenate([q.scales, extra.scales], 1),
                        np.concatenate([q.zeros, extra.zeros], 1), None, q.block, q.bits)
