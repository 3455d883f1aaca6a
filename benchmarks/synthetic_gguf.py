"""Write a GGUF file with Llama-3.1-8B's shapes and random Q4_K_M weights, without a download.

A stand-in for a real 7-8B Q4_K_M GGUF, to measure what exporting one costs (time, peak
memory, artifact size) where none can be fetched. The weights are random, so an export of it
runs at full size but its replies are meaningless.

    .venv/bin/python benchmarks/synthetic_gguf.py models/sources/synthetic-llama-8b.gguf
    .venv/bin/python benchmarks/synthetic_gguf.py tiny.gguf --layers 2 --hidden 256 \\
        --intermediate 512 --heads 4 --kv-heads 2 --vocab 49408

Tensor types follow llama.cpp's Q4_K_M recipe: Q4_K, with Q6_K for the output and for attn_v
and ffn_down on the layers it gives more bits; norms are F32 near 1. The tokenizer is the
bundled SmolLM2's, padded with reserved control tokens up to the vocabulary size. Blocks are
made and written a chunk at a time, so memory stays small whatever the file's size, and the
same --seed writes the same bytes. After writing, the first rows of every tensor are
dequantized with the exporter's own dequantizer and checked: finite, mean near 0, std near
0.02 (norms: mean near 1).
"""
import argparse
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

import gguf
import numpy as np

from edgespec.export import gguf_quants
from edgespec.export.gguf import GGUFFile
from edgespec.export.source import default_model_path

F32 = gguf.GGMLQuantizationType.F32
Q4_K = gguf.GGMLQuantizationType.Q4_K
Q6_K = gguf.GGMLQuantizationType.Q6_K
QK_K = 256  # values per K-quant block
CHUNK_BLOCKS = 1 << 16  # blocks made and written at once

WEIGHT_STD = 0.02   # about a trained Llama's; 32 layers of it stay well inside float16
NORM_SPREAD = 0.02  # norm weights are 1 plus noise of this std

# Q4_K: w = d * scale * code - dmin * min, 4-bit codes, a 6-bit scale and min per 32 values.
# min = scale with dmin = 7.5 d centres every sub-block on 0; the scales use all six bits.
Q4_K_SCALES = np.arange(32, 64, dtype=np.uint8)
Q4_K_D = np.float16(WEIGHT_STD / (np.std(np.arange(16)) * np.sqrt(np.mean(Q4_K_SCALES ** 2.0))))
Q4_K_DMIN = np.float16(7.5 * float(Q4_K_D))
# Q6_K: w = d * scale * (code - 32), 6-bit codes, an int8 scale per 16 values. Random signs
# cancel the codes' mean of -0.5; this range keeps d a normal float16.
Q6_K_SCALES = np.array([*range(-15, -7), *range(8, 16)], np.int8)
Q6_K_D = np.float16(WEIGHT_STD / (np.sqrt(np.mean((np.arange(64) - 32.0) ** 2))
                                  * np.sqrt(np.mean(Q6_K_SCALES ** 2.0))))


@dataclass
class Shape:
    """The model's numbers; the defaults are Llama-3.1-8B's."""
    layers: int = field(default=32, metadata={"help": "decoder layers"})
    hidden: int = field(default=4096, metadata={"help": "hidden size, a multiple of 256"})
    intermediate: int = field(default=14336, metadata={"help": "MLP size, a multiple of 256"})
    heads: int = field(default=32, metadata={"help": "attention heads"})
    kv_heads: int = field(default=8, metadata={"help": "key/value heads, a divisor of heads"})
    vocab: int = field(default=128256,
                       metadata={"help": "vocabulary size, at least the tokenizer's 49152"})

    def error(self, tokenizer_size: int):
        """What is wrong with these numbers, in a sentence (None: nothing)."""
        if min(getattr(self, f.name) for f in fields(self)) < 1:
            return "every size must be at least 1"
        if self.hidden % QK_K or self.intermediate % QK_K:
            return (f"--hidden {self.hidden} and --intermediate {self.intermediate} must be "
                    f"multiples of {QK_K} (a K-quant block)")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            return f"--hidden {self.hidden} must split into --heads {self.heads} of even size"
        if self.heads % self.kv_heads:
            return f"--kv-heads {self.kv_heads} must divide --heads {self.heads}"
        if self.vocab < tokenizer_size:
            return f"--vocab {self.vocab} is below the tokenizer's {tokenizer_size} tokens"
        return None


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for attn_v and ffn_down: Q6_K on the first and last eighth of
    the layers and on every third layer between."""
    return (layer < layers // 8 or layer >= 7 * layers // 8
            or (layer - layers // 8) % 3 == 2)


def tensor_plan(s: Shape) -> list:
    """(name, shape in numpy order, type) of every tensor, layer by layer."""
    kv = s.kv_heads * (s.hidden // s.heads)
    plan = [("token_embd.weight", (s.vocab, s.hidden), Q4_K)]
    for i in range(s.layers):
        more = Q6_K if use_more_bits(i, s.layers) else Q4_K
        plan += [(f"blk.{i}.{name}.weight", shape, kind) for name, shape, kind in [
            ("attn_norm", (s.hidden,), F32),
            ("attn_q", (s.hidden, s.hidden), Q4_K),
            ("attn_k", (kv, s.hidden), Q4_K),
            ("attn_v", (kv, s.hidden), more),
            ("attn_output", (s.hidden, s.hidden), Q4_K),
            ("ffn_norm", (s.hidden,), F32),
            ("ffn_gate", (s.intermediate, s.hidden), Q4_K),
            ("ffn_up", (s.intermediate, s.hidden), Q4_K),
            ("ffn_down", (s.hidden, s.intermediate), more)]]
    return plan + [("output_norm.weight", (s.hidden,), F32),
                   ("output.weight", (s.vocab, s.hidden), Q6_K)]


def _random_bytes(rng, n, size):
    # raw 64-bit draws are the fastest source of uniform bytes
    words = rng.bit_generator.random_raw(-(-n * size // 8))
    return words.view(np.uint8)[:n * size].reshape(n, size)


def _f16_bytes(value):
    return np.frombuffer(np.float16(value).tobytes(), np.uint8)


def _pack_k_scales(scale, minimum):
    """[n, 8] 6-bit scales and mins -> llama.cpp's 12 packed bytes (the top two bits of
    sub-blocks 4-7 ride in the spare bits of 0-3)."""
    lo, hi, mlo, mhi = scale[:, :4], scale[:, 4:], minimum[:, :4], minimum[:, 4:]
    return np.concatenate([lo | (hi >> 4) << 6, mlo | (mhi >> 4) << 6,
                           (hi & 0x0F) | (mhi & 0x0F) << 4], axis=1)


def q4_k_blocks(rng, n):
    """n random Q4_K blocks: d, dmin, packed scales and mins, 128 bytes of 4-bit codes."""
    blocks = _random_bytes(rng, n, 144)
    scale = rng.choice(Q4_K_SCALES, (n, 8))
    blocks[:, 0:2], blocks[:, 2:4] = _f16_bytes(Q4_K_D), _f16_bytes(Q4_K_DMIN)
    blocks[:, 4:16] = _pack_k_scales(scale, scale)
    return blocks


def q6_k_blocks(rng, n):
    """n random Q6_K blocks: 128 bytes of low bits, 64 of high bits, 16 int8 scales, d."""
    blocks = _random_bytes(rng, n, 210)
    blocks[:, 192:208] = rng.choice(Q6_K_SCALES, (n, 16)).view(np.uint8)
    blocks[:, 208:210] = _f16_bytes(Q6_K_D)
    return blocks


MAKE_BLOCKS = {Q4_K: q4_k_blocks, Q6_K: q6_k_blocks}


class RandomTensor:
    """One tensor's random data, made a chunk at a time while it is written.

    GGUFWriter.write_tensor_data needs of a tensor only `nbytes` and `tofile(file)`, so this
    stands in for the array that would otherwise hold the whole tensor in memory."""

    def __init__(self, shape, kind, rng):
        self.shape, self.kind, self.rng = shape, kind, rng
        self.nbytes = gguf_quants.nbytes(int(kind), int(np.prod(shape)))

    def tofile(self, file):
        if self.kind == F32:
            norm = 1 + NORM_SPREAD * self.rng.standard_normal(self.shape)
            file.write(norm.astype(np.float32).data)
            return
        blocks = int(np.prod(self.shape)) // QK_K
        for start in range(0, blocks, CHUNK_BLOCKS):
            file.write(MAKE_BLOCKS[self.kind](self.rng, min(CHUNK_BLOCKS, blocks - start)).data)


def bundled_tokenizer() -> dict:
    """The tokenizer.* metadata of the bundled SmolLM2 GGUF."""
    meta = GGUFFile(default_model_path()).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def add_tokenizer(writer, tok: dict, vocab: int):
    """SmolLM2's tokenizer, its token list padded to `vocab` with reserved control tokens
    (as Llama 3 reserves its own): they are never produced by the merges, so text encodes as
    SmolLM2 encodes it."""
    g = "tokenizer.ggml."
    pad = vocab - len(tok[g + "tokens"])
    writer.add_tokenizer_model(tok[g + "model"])
    writer.add_tokenizer_pre(tok[g + "pre"])
    writer.add_token_list(list(tok[g + "tokens"]) + [f"<|reserved_{i}|>" for i in range(pad)])
    writer.add_token_types([int(t) for t in tok[g + "token_type"]]
                           + [gguf.TokenType.CONTROL] * pad)
    if g + "scores" in tok:
        scores = [float(s) for s in tok[g + "scores"]]
        writer.add_token_scores(scores + [min(scores)] * pad)
    writer.add_token_merges(list(tok[g + "merges"]))
    for key, add in [("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id),
                     ("padding_token_id", writer.add_pad_token_id),
                     ("add_bos_token", writer.add_add_bos_token),
                     ("add_space_prefix", writer.add_add_space_prefix)]:
        if g + key in tok:
            add(tok[g + key])
    if "tokenizer.chat_template" in tok:
        writer.add_chat_template(tok["tokenizer.chat_template"])


def add_hyperparameters(writer, s: Shape):
    writer.add_name("synthetic-llama-8b")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(s.layers)
    writer.add_context_length(131072)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_dimension_count(s.hidden // s.heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(s.vocab)


def write(path, shape: Shape, tokenizer: dict, seed=0, log=print) -> Counter:
    """Write the file, one tensor at a time; returns the count of each tensor type."""
    plan = tensor_plan(shape)
    writer = gguf.GGUFWriter(str(path), "llama")
    add_hyperparameters(writer, shape)
    add_tokenizer(writer, tokenizer, shape.vocab)
    rng = np.random.default_rng(seed)
    tensors = [RandomTensor(dims, kind, rng) for _, dims, kind in plan]
    for (name, dims, kind), tensor in zip(plan, tensors):
        # dims count values, not bytes: a dtype other than uint8 tells the writer so
        writer.add_tensor_info(name, dims, np.dtype(np.float32), tensor.nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = sum(t.nbytes for t in tensors)
    start = last = time.perf_counter()
    done = 0
    for i, tensor in enumerate(tensors):
        writer.write_tensor_data(tensor)
        done += tensor.nbytes
        now = time.perf_counter()
        if now - last >= 5 or i == len(tensors) - 1:
            log(f"  {i + 1}/{len(tensors)} tensors, {done / 1e9:.2f}/{total / 1e9:.2f} GB, "
                f"{now - start:.1f} s")
            last = now
    writer.close()
    return Counter(kind.name for _, _, kind in plan)


def check(path, rows=16, log=print) -> dict:
    """Dequantize the first `rows` rows of every tensor with the exporter's dequantizer and
    check each type's values: all finite, mean and std near the intended ones. Returns
    {type name: (values, mean, std)}; raises ValueError if a type is off."""
    file = GGUFFile(path)
    sums = {}  # type -> [values, sum, sum of squares, all finite]
    with open(path, "rb") as data:
        for name, (kind, shape, offset) in file.tensors.items():
            take = shape if len(shape) == 1 else (min(rows, shape[0]), shape[1])
            data.seek(file.data_start + offset)  # only the rows checked are read
            raw = np.frombuffer(data.read(gguf_quants.nbytes(kind, int(np.prod(take)))), np.uint8)
            w = gguf_quants.dequantize(raw, kind, take).astype(np.float64)
            s = sums.setdefault(kind, [0, 0.0, 0.0, True])
            s[0], s[1], s[2] = s[0] + w.size, s[1] + w.sum(), s[2] + np.square(w).sum()
            s[3] = s[3] and bool(np.isfinite(w).all())
    stats = {}
    for kind, (n, total, squares, finite) in sums.items():
        mean_wanted, std_wanted = (1.0, NORM_SPREAD) if kind == F32 else (0.0, WEIGHT_STD)
        mean = total / n
        std = float(np.sqrt(max(squares / n - mean * mean, 0.0)))
        stats[gguf_quants.type_name(kind)] = (n, mean, std)
        log(f"  check {gguf_quants.type_name(kind)}: {n} values, mean {mean:+.5f}, "
            f"std {std:.5f} (wanted {mean_wanted:g} and {std_wanted:g}), "
            f"{'all finite' if finite else 'NOT FINITE'}")
        if not (finite and abs(mean - mean_wanted) < 0.1 * std_wanted
                and abs(std - std_wanted) < 0.1 * std_wanted):
            raise ValueError(f"{path}: {gguf_quants.type_name(kind)} values are off "
                             f"(mean {mean}, std {std}, finite {finite})")
    return stats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    for f in fields(Shape):
        parser.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default,
                            help=f"{f.metadata['help']} (default {f.default})")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed; the same seed writes the same bytes (default 0)")
    args = parser.parse_args(argv)
    shape = Shape(**{f.name: getattr(args, f.name) for f in fields(Shape)})
    tokenizer = bundled_tokenizer()
    error = shape.error(len(tokenizer["tokenizer.ggml.tokens"]))
    if error:
        parser.error(error)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    counts = write(args.out, shape, tokenizer, args.seed)
    print(f"wrote {args.out}: {sum(counts.values())} tensors "
          f"({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}), "
          f"{args.out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s")
    check(args.out)


if __name__ == "__main__":
    main()
