"""Drafting ablation: what each drafting piece adds, per category, on the same prompts.

    .venv/bin/python benchmarks/ablation.py models/smollm2-135m-instruct \
        --prompts benchmarks/data/spec_bench_dev.jsonl --per-category 2 --threads 2

Five configurations, each an `edgespec bench` run (plain and speculative interleaved, greedy):
raw early exit (no adapter, full draft head, fixed k 1), + exit adapter, + calibration (the
calibrated k and threshold, adaptive scheduling), + prompt lookup, + shortlisted draft head
(the default calibrated artifact as exported). The first two need artifacts without the
adapter or shortlist: they are exported next to the given one, at its exit layer, once.
Other options (--prompts, --per-category, --threads, --repeat) go to every `edgespec bench`.
Prints a markdown table of median speedups per category and, per configuration, the
milliseconds per generated token split into draft, verify, head and host work.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

EDGESPEC = [sys.executable, "-m", "edgespec"]


def export_variant(artifact: Path, name: str, adapter: str, model: list) -> Path:
    manifest = json.loads((artifact / "manifest.json").read_text())
    out = artifact.parent / f"{artifact.name}-{name}"
    if not (out / "manifest.json").exists():
        subprocess.run(EDGESPEC + ["export", *model, "-o", str(out),
                                   "--exit-layer", str(manifest["exit_layer"]),
                                   "--adapter", adapter, "--shortlist", "0", "--no-calibrate"],
                       check=True)
    return out


def configurations(artifact: Path, adapter_file: str, model: list):
    calibrated = json.loads((artifact / "manifest.json").read_text())["draft"]
    fixed = ["--draft-k", "1", "--lookup-k", "0", "--no-adaptive"]
    calibrated_exit = ["--draft-k", str(max(1, calibrated["k"])),
                       "--draft-threshold", str(calibrated["threshold"]), "--adaptive"]
    exit_only = calibrated_exit + ["--lookup-k", "0"]
    with_lookup = calibrated_exit + ["--lookup-k", str(max(1, calibrated["lookup_k"]))]
    raw = export_variant(artifact, "raw", "none", model)
    adapted = export_variant(artifact, "adapter", adapter_file, model)
    return [("raw early exit", raw, fixed), ("+ adapter", adapted, fixed),
            ("+ calibration", adapted, exit_only), ("+ prompt lookup", adapted, with_lookup),
            ("+ shortlist (default)", artifact, [])]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("artifact", type=Path, help="the default calibrated artifact")
    p.add_argument("--model", help="the model the artifact was exported from (default: the "
                   "bundled SmolLM2)")
    p.add_argument("--adapter", default="export/data/adapters/smollm2-135m-instruct.npz",
                   help="the exit adapter for the '+ adapter' artifact")
    p.add_argument("--out", type=Path, default=Path("ablation"), help="folder for bench JSON")
    args, bench_args = p.parse_known_args()  # the rest goes to every `edgespec bench`
    args.out.mkdir(exist_ok=True)
    reports = {}
    for i, (name, artifact, flags) in enumerate(configurations(args.artifact, args.adapter,
                                                                   [args.model] if args.model else [])):
        out = args.out / f"{i}.json"
        print(f"== {name}: {artifact} {' '.join(flags)}", flush=True)
        subprocess.run(EDGESPEC + ["bench", str(artifact), *flags, "--json", str(out),
                                   *bench_args], check=True)
        reports[name] = json.loads(out.read_text())
    print(markdown(reports))


def markdown(reports) -> str:
    names = list(reports)
    categories = list(next(iter(reports.values()))["summary"])
    lines = ["| category | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for c in categories:
        cells = [f"{r['summary'][c]['median_speedup']:.2f}x "
                 f"({r['summary'][c]['median_tokens_per_round']:.2f})" for r in reports.values()]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("\nCells: median speedup over plain (median tokens per round). Identical "
                 "outputs: " + ", ".join(f"{n} {100 * r['summary']['overall']['identical']:.0f}%"
                                         for n, r in reports.items()))
    lines.append("\nPer generated token (ms, medians over prompts): plain decoding, then each "
                 "configuration's time split into draft (lower runs), verify (upper runs), "
                 "head (draft and verifier heads) and host (choosing, accepting, lookup)")
    for name, r in reports.items():
        plain = statistics.median(1000 / p["plain_tokens_per_s"] for p in r["prompts"])
        parts = {k: statistics.median(1000 * p["time_shares"][k] / p["spec_tokens_per_s"]
                                      for p in r["prompts"])
                 for k in ("draft", "verify", "head", "sampling")}
        lines.append(f"- {name}: plain {plain:.1f}; speculative " +
                     ", ".join(f"{'host' if k == 'sampling' else k} {v:.1f}"
                               for k, v in parts.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
