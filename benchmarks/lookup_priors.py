"""Lookup's acceptance priors (edgespec/lookup.py PRIOR, PRIOR_SAMPLED), measured.

The artifact replies to development prompts (plain decoding, up to --new-tokens, greedy and
then sampled with its default settings, seeded); lookup is replayed along each reply exactly
as the decode loop would offer it (this text and the replies before it remembered), and
every position's draft (up to --k tokens) is scored against what the reply really said, up
to the first miss: the rate per match length bucket and kind. Buckets seen fewer than
--min-tries times take the shorter bucket's rate, and rates never fall with the length.

    .venv/bin/python benchmarks/lookup_priors.py models/smollm2-135m-instruct --per-category 5
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import edgespec  # noqa: E402
from edgespec.drafter import PlainSpeed  # noqa: E402
from edgespec.lookup import LENGTHS, PRIOR, PromptLookup  # noqa: E402
from benchmarks.plain_decode import pick_prompts  # noqa: E402


def replay(texts, k) -> tuple:
    """(hits, tries) by (bucket, kind) over (prompt ids, reply ids) pairs, in order."""
    lookup = PromptLookup(None, PlainSpeed(), k_max=k, adaptive=False)
    hits, tries = {}, {}
    for prompt, reply in texts:
        lookup.new_text()
        for j in range(1, len(reply)):
            offer = lookup.offer(prompt + reply[:j], budget=k)
            if offer is None:
                continue
            match, _ = offer.plan
            for i, (draft, key) in enumerate(zip(match.continuation(offer.k),
                                                 match.keys(offer.k))):
                tries[key] = tries.get(key, 0) + 1
                if j + i >= len(reply) or draft != reply[j + i]:
                    break
                hits[key] = hits.get(key, 0) + 1
    return hits, tries


def rates(hits, tries, min_tries) -> dict:
    table = {}
    for kind in PRIOR:
        row, last = [], 0.0
        for b in range(len(LENGTHS)):
            n = tries.get((b, kind), 0)
            rate = hits.get((b, kind), 0) / n if n >= min_tries else last
            last = max(last, rate)
            row.append(round(last, 2))
        table[kind] = tuple(row)
    return table


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", nargs="?", default="models/smollm2-135m-instruct")
    p.add_argument("--prompts", default=str(Path(__file__).parent / "data" / "spec_bench_dev.jsonl"))
    p.add_argument("--per-category", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--min-tries", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    model = edgespec.load(args.artifact, threads=args.threads)
    prompts = [model.encode(row["turns"][0])
               for row in pick_prompts(args.prompts, args.per_category)]
    for name, options in (("greedy", {"temperature": 0}), ("sampled", {})):
        texts = []
        for n, ids in enumerate(prompts):
            g = model.generate_ids(ids, args.new_tokens, mode="plain", seed=n, **options)
            texts.append((ids, g.tokens))
        hits, tries = replay(texts, args.k)
        print(f"{name}: {len(texts)} replies; tries by bucket {LENGTHS}:")
        for kind in PRIOR:
            print(f"  {kind:7} tries {[tries.get((b, kind), 0) for b in range(len(LENGTHS))]}")
        print(f"  rates {rates(hits, tries, args.min_tries)}", flush=True)


if __name__ == "__main__":
    main()
