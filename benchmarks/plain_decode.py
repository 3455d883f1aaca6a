"""Plain decode speed: edgespec (int4 artifact) vs transformers fp32 `generate`, same prompts.

Greedy, first turn of each prompt through the chat template, the same thread count for both,
the two interleaved prompt by prompt in one process. Prints per-prompt tokens/s and medians.

    .venv/bin/python benchmarks/plain_decode.py models/smollm2-135m-instruct \
        --prompts benchmarks/data/spec_bench_dev.jsonl --per-category 2 --threads 2
"""
import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path


def pick_prompts(path, per_category):
    rows = [json.loads(line) for line in open(path)]
    by_category = defaultdict(list)
    for row in sorted(rows, key=lambda r: r["question_id"]):
        by_category[row["category"]].append(row)
    return [r for rows in by_category.values() for r in rows[:per_category]]


def transformers_reference(source, threads):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    from edgespec.export.source import locate
    where, gguf_file, _, _ = locate(source)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs).eval()

    def generate(ids, max_new_tokens):
        with torch.no_grad():
            start = time.perf_counter()
            # the first new token needs the prefill: time it apart, as edgespec does
            out = model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 do_sample=False)
            total = time.perf_counter() - start
        n = out.shape[1] - len(ids)
        return (n - 1) / max(total - prefill, 1e-9)
    return generate


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("--prompts", default=str(Path(__file__).parent / "data" / "spec_bench_dev.jsonl"))
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-transformers", action="store_true", help="edgespec only")
    args = p.parse_args()

    import edgespec
    model = edgespec.load(args.artifact, threads=args.threads, verify=False)
    from edgespec.export.source import model_argument
    reference = None if args.no_transformers else transformers_reference(
        model_argument(model.artifact.manifest["source"]["model"]), args.threads)
    model.generate("warm up", max_new_tokens=8, mode="plain")
    ours, theirs = [], []
    print(f"{'id':>4} {'category':15} {'prompt':>6} {'new':>4} {'edgespec':>9} {'transformers':>12}")
    for row in pick_prompts(args.prompts, args.per_category):
        ids = model.encode(row["turns"][0])
        if len(ids) + args.max_new_tokens >= model.engine.max_context:
            continue
        result = model.generate_ids(ids, max_new_tokens=args.max_new_tokens, mode="plain")
        ours.append(result.decode_tokens_per_s)
        line = (f"{row['question_id']:>4} {row['category']:15} {len(ids):>6} "
                f"{result.n_generated:>4} {ours[-1]:>9.1f}")
        if reference:
            theirs.append(reference(ids, args.max_new_tokens))
            line += f" {theirs[-1]:>12.1f}"
        print(line, flush=True)
    print(f"median decode tokens/s: edgespec {statistics.median(ours):.1f}"
          + (f", transformers fp32 {statistics.median(theirs):.1f}, ratio "
             f"{statistics.median(ours) / statistics.median(theirs):.2f}x" if theirs else "")
          + f" ({len(ours)} prompts, {args.threads} threads)")


if __name__ == "__main__":
    main()
