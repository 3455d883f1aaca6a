"""Dequantize GGUF tensor data to float32 with numpy, block-vectorized and in bounded chunks.

The block layouts are llama.cpp's (ggml-common.h). Every block holds BLOCK_ELEMENTS values
in BLOCK_BYTES bytes; a row of a tensor is a whole number of blocks. The arithmetic follows
llama.cpp's order (scale products in float32, then times the code, minus the minimum), so
the results equal the `gguf` package's dequantizer bit for bit (tests/test_gguf.py).
Tensors are converted CHUNK_BLOCKS blocks at a time into one preallocated output, so the
temporaries stay small next to the float32 result.
"""
import numpy as np

QK, QK_K = 32, 256
CHUNK_BLOCKS = 1 << 16

# ggml type ids (gguf.GGMLQuantizationType) -> name; the ones read here
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
              Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", BF16: "BF16"}
# names of the types llama.cpp writes that this reader does not (for the error message)
OTHER_TYPE_NAMES = {9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
                    18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
                    23: "IQ4_XS", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}


def type_name(type_id: int) -> str:
    return TYPE_NAMES.get(type_id) or OTHER_TYPE_NAMES.get(type_id) or f"type {type_id}"


def _f16(blocks, start):
    """The float16 at byte `start` of every block, as float32 [n, 1]."""
    return blocks[:, start:start + 2].view(np.float16).astype(np.float32)


def _nibbles(qs):
    """[n, 16] bytes -> [n, 32] codes: the low nibbles, then the high ones (llama.cpp's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh):
    """[n, 4] bytes (a little-endian uint32) -> [n, 32] bits, bit j for value j."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)).astype(np.float32)


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:20]).astype(np.float32) + _f16(b, 2)


def _q5_0(b):
    q = _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.astype(np.int8) - np.int8(16)).astype(np.float32)


def _q5_1(b):
    q = _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.astype(np.float32) + _f16(b, 2)


def _q8_0(b):
    return b[:, 2:34].view(np.int8).astype(np.float32) * _f16(b, 0)


def _k_scales(s):
    """Q4_K/Q5_K: 12 bytes -> the 6-bit scale and minimum of each of 8 sub-blocks."""
    lo, mid, top = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = np.concatenate([lo & 0x3F, (top & 0x0F) | ((lo >> 6) << 4)], axis=1)
    minimum = np.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 6) << 4)], axis=1)
    return scale.astype(np.float32), minimum.astype(np.float32)


def _k_codes_4bit(qs):
    """128 bytes as 4 groups of 32: low nibbles are sub-block 2g, high nibbles 2g + 1."""
    g = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([g & 0x0F, g >> 4], axis=2).reshape(-1, 8, 32)


def _q4_k(b):
    scale, minimum = _k_scales(b[:, 4:16])
    d, dm = (_f16(b, 0) * scale)[..., None], (_f16(b, 2) * minimum)[..., None]
    return (d * _k_codes_4bit(b[:, 16:144]).astype(np.float32) - dm).reshape(-1, QK_K)


def _q5_k(b):
    scale, minimum = _k_scales(b[:, 4:16])
    d, dm = (_f16(b, 0) * scale)[..., None], (_f16(b, 2) * minimum)[..., None]
    # bit s of byte l of qh is the fifth bit of value l of sub-block s
    high = np.unpackbits(b[:, 16:48], axis=1, bitorder="little").reshape(-1, 32, 8)
    q = _k_codes_4bit(b[:, 48:176]) | (high.transpose(0, 2, 1) << 4)
    return (d * q.astype(np.float32) - dm).reshape(-1, QK_K)


def _q6_k(b):
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 64)       # two halves of 128 values
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # values l, l+32, l+64, l+96
    high = ((qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03).reshape(n, 2, 128)
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    scale = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)  # one per 16 values
    return (scale.reshape(n, 16, 1) * q.reshape(n, 16, 16)).reshape(n, QK_K)


# type id -> (values per block, bytes per block, block dequantizer)
BLOCKS = {Q4_0: (QK, 18, _q4_0), Q4_1: (QK, 20, _q4_1), Q5_0: (QK, 22, _q5_0),
          Q5_1: (QK, 24, _q5_1), Q8_0: (QK, 34, _q8_0), Q4_K: (QK_K, 144, _q4_k),
          Q5_K: (QK_K, 176, _q5_k), Q6_K: (QK_K, 210, _q6_k)}
FLOATS = {F32: 4, F16: 2, BF16: 2}


# The same blocks as w = scale * code + minimum, one scale and minimum per sub-block: every
# type above is of that form (the symmetric ones with minimum = -offset * scale). A graph that
# keeps the codes computes with the file's own grid (export/quantize.py: source_weight).
def _affine_q4_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8 * d


def _affine_q4_1(b):
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _affine_q5_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4), d, -16 * d


def _affine_q5_1(b):
    return _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4), _f16(b, 0), _f16(b, 2)


def _affine_q8_0(b):
    d = _f16(b, 0)
    return (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d


def _affine_q4_k(b):
    scale, minimum = _k_scales(b[:, 4:16])
    return _k_codes_4bit(b[:, 16:144]).reshape(-1, QK), (_f16(b, 0) * scale).reshape(-1, 1), \
        -(_f16(b, 2) * minimum).reshape(-1, 1)


def _affine_q5_k(b):
    scale, minimum = _k_scales(b[:, 4:16])
    high = np.unpackbits(b[:, 16:48], axis=1, bitorder="little").reshape(-1, 32, 8)
    q = _k_codes_4bit(b[:, 48:176]) | (high.transpose(0, 2, 1) << 4)
    return q.reshape(-1, QK), (_f16(b, 0) * scale).reshape(-1, 1), \
        -(_f16(b, 2) * minimum).reshape(-1, 1)


def _affine_q6_k(b):
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)
    high = ((qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03).reshape(n, 2, 128)
    scale = (_f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)).reshape(-1, 1)
    return (low | (high << 4)).reshape(-1, 16), scale, -32 * scale


# type id -> (values per sub-block, bits a code needs, sub-block decomposer)
AFFINE = {Q4_0: (QK, 4, _affine_q4_0), Q4_1: (QK, 4, _affine_q4_1), Q5_0: (QK, 5, _affine_q5_0),
          Q5_1: (QK, 5, _affine_q5_1), Q8_0: (QK, 8, _affine_q8_0), Q4_K: (QK, 4, _affine_q4_k),
          Q5_K: (QK, 5, _affine_q5_k), Q6_K: (16, 6, _affine_q6_k)}


def affine(raw: np.ndarray, type_id: int, shape) -> tuple:
    """A quantized tensor [rows, K] as (codes uint8 [rows, K], scales and minima float32
    [rows, K / sub-block], sub-block size, code bits): w = scale * code + minimum."""
    values, size, _ = BLOCKS[type_id]
    sub, bits, split = AFFINE[type_id]
    rows, k = shape
    codes, scales, minima = split(np.asarray(raw, np.uint8).reshape(-1, size))
    return (codes.astype(np.uint8).reshape(rows, k), scales.reshape(rows, k // sub),
            minima.astype(np.float32).reshape(rows, k // sub), sub, bits)


def supported(type_id: int) -> bool:
    return type_id in BLOCKS or type_id in FLOATS


def nbytes(type_id: int, n_elements: int) -> int:
    """Bytes that n_elements values of this type take in the file."""
    if type_id in FLOATS:
        return n_elements * FLOATS[type_id]
    values, size, _ = BLOCKS[type_id]
    return n_elements // values * size


def dequantize(raw: np.ndarray, type_id: int, shape) -> np.ndarray:
    """float32 array of `shape` from the raw uint8 bytes of a tensor of `type_id`."""
    raw = np.asarray(raw, np.uint8).reshape(-1)
    if type_id == F32:
        return raw.view(np.float32).reshape(shape).copy()
    if type_id == F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if type_id == BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if type_id not in BLOCKS:
        raise ValueError(f"GGUF tensor type {type_name(type_id)} is not supported")
    values, size, block_fn = BLOCKS[type_id]
    blocks = raw.reshape(-1, size)
    out = np.empty((len(blocks), values), np.float32)
    for start in range(0, len(blocks), CHUNK_BLOCKS):
        out[start:start + CHUNK_BLOCKS] = block_fn(blocks[start:start + CHUNK_BLOCKS])
    return out.reshape(shape)
