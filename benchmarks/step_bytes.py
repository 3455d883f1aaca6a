"""What one plain decode step reads: every MatMulNBits of an artifact's lower, upper and head
graphs (or of an onnxruntime-genai model) at the size ONNX Runtime's CPU kernel holds it in
(the codes, then a float scale and a float block sum per block: MLAS's int8-activation
layout), beside the bytes the same tensors take in the GGUF it came from.

    .venv/bin/python benchmarks/step_bytes.py models/qwen2.5-coder-1.5b \\
        [--genai models/peers/genai-int4-qwen2.5-coder-1.5b]
"""
import argparse
import collections
import json
from pathlib import Path

import onnx

PACKED_FLOATS_PER_BLOCK = 2  # the scale and the block sum, float32 each


def matmuls(paths):
    """(N, K, bits, block) of every MatMulNBits in the graphs."""
    for path in paths:
        graph = onnx.load(str(path), load_external_data=False).graph
        for node in graph.node:
            if node.op_type == "MatMulNBits":
                a = {x.name: x.i for x in node.attribute}
                yield a["N"], a["K"], a["bits"], a["block_size"]


def packed_bytes(n, k, bits, block):
    return n * k * bits // 8 + n * -(-k // block) * 4 * PACKED_FLOATS_PER_BLOCK


def table(title, paths):
    by_kind = collections.Counter()
    weights = collections.Counter()
    for n, k, bits, block in matmuls(paths):
        kind = f"{bits}-bit, blocks of {block}"
        by_kind[kind] += packed_bytes(n, k, bits, block)
        weights[kind] += n * k
    total = sum(by_kind.values())
    print(f"{title}: {total / 1e6:.0f} MB a step, {total / sum(weights.values()):.3f} bytes a weight")
    for kind, size in by_kind.most_common():
        print(f"  {kind:22s} {weights[kind] / 1e6:8.1f} M weights  {size / 1e6:7.1f} MB  "
              f"{size / weights[kind]:.3f} B/w")
    return total


def gguf_bytes(path):
    """Bytes per GGUF type of the matrices a step reads: the layers' and the head's (the
    embedding table is a lookup, unless tied: then it is the head)."""
    import gguf
    tensors = gguf.GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    per_type = collections.Counter()
    for t in tensors:
        if len(t.shape) == 2 and (tied or t.name != "token_embd.weight"):
            per_type[t.tensor_type.name] += int(t.n_bytes)
    return per_type


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact")
    p.add_argument("--genai", help="an onnxruntime-genai model directory, measured alike")
    args = p.parse_args()
    artifact = Path(args.artifact)
    ours = table(f"edgespec {artifact.name}",
                 [artifact / f"{g}.onnx" for g in ("lower", "upper", "head")])
    source = json.loads((artifact / "manifest.json").read_text())["source"].get("model", "")
    if source.endswith(".gguf") and Path(source).exists():
        per_type = gguf_bytes(source)
        total = sum(per_type.values())
        print(f"GGUF {Path(source).name}: {total / 1e6:.0f} MB a step ("
              + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in per_type.most_common())
              + f"); edgespec reads {ours / total:.2f}x")
    if args.genai:
        theirs = table("onnxruntime-genai", Path(args.genai).glob("*.onnx"))
        print(f"edgespec reads {ours / theirs:.2f}x genai's bytes")


if __name__ == "__main__":
    main()
