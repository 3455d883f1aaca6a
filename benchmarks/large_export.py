"""What a 7-8B model needs: export a GGUF under GNU time, then run the artifact.

    .venv/bin/python benchmarks/large_export.py [GGUF] [--out DIR] [--tokens N]

Without GGUF, writes the Llama-3.1-8B-shaped file of random Q4_K_M weights
(benchmarks/synthetic_gguf.py) to models/sources/synthetic-llama-8b.gguf first. Prints
the export's wall time and peak resident memory, the artifact's size, the memory the loaded
artifact holds (its weights and one sequence's KV cache), and whether greedy speculative
decoding equals plain decoding on two prompts; one JSON line at the end.
"""
import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = ROOT / "models" / "sources" / "synthetic-llama-8b.gguf"
PROMPTS = ("Write a short poem about the sea.", "List three uses of a paperclip.")


def export(gguf, out) -> dict:
    """Export under GNU time: wall seconds and peak resident bytes."""
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "edgespec", "export", str(gguf),
               "-o", str(out)]
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    print(run.stderr[-3000:], file=sys.stderr)
    if run.returncode != 0:
        sys.exit(f"export failed (exit {run.returncode})")
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)[1])
    return {"export_seconds": round(seconds), "export_peak_bytes": peak_kb * 1024}


def resident_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) * 1024


def run_artifact(out, tokens) -> dict:
    """Load the artifact, then greedy plain and speculative replies to PROMPTS."""
    import edgespec
    before = resident_bytes()
    model = edgespec.load(out, verify=False)
    loaded = resident_bytes() - before
    equal = []
    for prompt in PROMPTS:
        ids = model.encode(prompt)
        plain = model.generate_ids(ids, tokens, mode="plain", temperature=0, ignore_eos=True)
        model.forget()  # speculative must not draft from the plain reply just made
        spec = model.generate_ids(ids, tokens, temperature=0, ignore_eos=True)
        equal.append(plain.tokens == spec.tokens)
        print(f"{prompt!r}: plain {plain.decode_tokens_per_s:.1f} tok/s, speculative "
              f"{spec.decode_tokens_per_s:.1f}, equal: {equal[-1]}", file=sys.stderr)
    return {"loaded_bytes": loaded, "kv_bytes": model.engine.sequence_bytes,
            "speculative_equals_plain": all(equal)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="?", type=Path, default=None,
                        help="a GGUF file (default: the synthetic 8B, written if absent)")
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "large-export",
                        help="the artifact directory (default: models/large-export)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens each reply decodes")
    args = parser.parse_args()
    gguf = args.gguf or SYNTHETIC
    if args.gguf is None and not SYNTHETIC.exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "synthetic_gguf.py"),
                        str(SYNTHETIC)], check=True)
    result = {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, **export(gguf, args.out)}
    result["artifact_bytes"] = sum(p.stat().st_size for p in args.out.glob("*.data"))
    result.update(run_artifact(args.out, args.tokens))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
