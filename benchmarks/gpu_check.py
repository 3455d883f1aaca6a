"""The first run on a GPU, in one command: does edgespec's CUDA path give plain decoding's
output, and what does it cost there?

    .venv/bin/python benchmarks/gpu_check.py [MODEL.gguf ...] [--json FILE]

1. The providers and the device. Without a CUDA device that runs a session, one line
   ("no CUDA device: ...") and exit code 3, before anything is exported.
2. Export the bundled SmolLM2-135M-Instruct and each MODEL given for CUDA (fp16 graphs;
   the shipped exit adapter and its exit layer if there is one, else the raw exit at 3/4
   of the depth; no calibration) into --out, or check --artifact DIRs instead.
3. Load each on CUDA (edgespec.load(device="cuda")): every graph's session on CUDA with
   ONNX Runtime's CPU fallback off.
4. On the 13 Spec-Bench dev prompts (the first of each category): greedy speculative ==
   greedy plain, and seeded sampled (temperature 0.8, top-k 40, top-p 0.9, repetition
   penalty 1.1) speculative == seeded plain, token for token; plain and speculative decode
   tok/s and tokens per round (edgespec.bench.bench_prompt, end of turn ignored).
5. Host-device copies per decoded token, plain and speculative, on the first prompt
   (benchmarks/host_copies.py): the tensors each run reads or writes in host memory
   through its io-binding plus the Memcpy nodes ONNX Runtime's profiler shows inside the
   graphs; and which provider ran each node.
6. One JSON verdict (--json; default OUT/verdict.json) and a short table.

Exit codes: 0 every check passed; 1 a check failed or a step raised (the verdict's
failures say which, with the traceback); 2 bad arguments; 3 no CUDA device. --device cpu
rehearses steps 2-6 on the CPU provider.
"""
import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import edgespec  # noqa: E402
from edgespec.bench import bench_prompt, load_prompts, prompt_ids  # noqa: E402
from edgespec.engine import cuda_problem  # noqa: E402
from edgespec.sampling import CHAT_DEFAULTS, SamplingParams  # noqa: E402
from benchmarks.host_copies import count_copies  # noqa: E402

PASSED, FAILED, USAGE, NO_CUDA = 0, 1, 2, 3
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
PROVIDER = {"cuda": CUDA, "cpu": CPU}
PROMPTS = Path(__file__).parent / "data" / "spec_bench_dev.jsonl"
SAMPLINGS = {"greedy": SamplingParams(), "sampled": CHAT_DEFAULTS}  # sampled: seeded per prompt


# -- the device --------------------------------------------------------------------------

def _line(error) -> str:
    """An exception's first line."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def describe_device(device: str) -> dict:
    """The runtime and the accelerator: versions, providers, nvidia-smi's line."""
    packages = {}
    for name in ("onnxruntime-gpu", "onnxruntime"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            packages[name] = metadata.version(name)
    gpu = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        gpu = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() \
            else None
    return {"device": device, "gpu": gpu, "packages": packages,
            "providers": ort.get_available_providers()}


# -- spec against plain ------------------------------------------------------------------

def pick_prompts(path=PROMPTS) -> list:
    """The first prompt (lowest question id) of each category."""
    return load_prompts(path, per_category=1)


def compare(model, rows, max_new_tokens, repeat=1, label="") -> dict:
    """Greedy and seeded sampled decoding of every prompt, plain against speculative, as
    `edgespec bench` runs them (interleaved, each run with no earlier reply to copy)."""
    model.generate("Hello", max_new_tokens=8)  # warm up sessions and allocators
    report = {}
    for name, sampling in SAMPLINGS.items():
        settings = model.settings(**asdict(sampling), max_new_tokens=max_new_tokens,
                                  ignore_eos=True)
        results = []
        for i, row in enumerate(rows, 1):
            print(f"\r{label} {name}: prompt {i}/{len(rows)}   ", end="", file=sys.stderr,
                  flush=True)
            results.append(bench_prompt(model, row, settings, repeat))
        report[name] = {
            "sampling": sampling.describe(),
            "identical": sum(r["identical"] for r in results), "prompts": len(results),
            "different": [r["question_id"] for r in results if not r["identical"]],
            "plain_tokens_per_s": statistics.median(r["plain_tokens_per_s"] for r in results),
            "spec_tokens_per_s": statistics.median(r["spec_tokens_per_s"] for r in results),
            "speedup": statistics.median(r["speedup"] for r in results),
            "tokens_per_round": statistics.median(r["tokens_per_round"] for r in results),
            "by_prompt": results}
    print(file=sys.stderr)
    return report


# -- one model, the verdict ----------------------------------------------------------------

def sessions_report(model) -> dict:
    """Each graph's providers and whether its CPU fallback is off."""
    report = {}
    for name, session in model.engine.sessions.items():
        try:
            off = session.get_session_options().get_session_config_entry(
                "session.disable_cpu_ep_fallback") == "1"
        except RuntimeError:  # ORT raises for an entry never set
            off = False
        report[name] = {"providers": session.get_providers(), "cpu_fallback_disabled": off}
    return report


def judge(report: dict, device: str) -> list:
    """What failed, a line each: the sessions' providers, the nodes' placement, spec vs plain
    (of the steps the report holds)."""
    want, failures = PROVIDER[device], []
    for graph, s in report.get("sessions", {}).items():
        if s["providers"][0] != want:
            failures.append(f"{graph} runs on {s['providers'][0]}, not {want}")
        if device == "cuda" and not s["cpu_fallback_disabled"]:
            failures.append(f"{graph}: ONNX Runtime's CPU fallback is not disabled")
    for graph, g in report.get("copies", {}).get("graphs", {}).items():
        elsewhere = {p: n for p, n in g["nodes_by_provider"].items() if p != want}
        if elsewhere:
            failures.append(f"{graph}: nodes ran on {elsewhere}, not all on {want}")
    for name in SAMPLINGS:
        c = report.get(name, {})
        if c.get("different"):
            failures.append(f"{name}: speculative differs from plain on question ids "
                            f"{', '.join(map(str, c['different']))}")
    return failures


def check_model(artifact, device, rows, max_new_tokens, repeat=1) -> dict:
    """Load `artifact` on `device` and run every check on it; the model's verdict. A step
    that raises is a failure in the verdict (with its traceback), and the checks go on."""
    report, step = {"model": Path(artifact).name, "artifact": str(artifact)}, "load"
    try:
        model = edgespec.load(artifact, device=device)
        report["sessions"] = sessions_report(model)
        step = "decode"
        report.update(compare(model, rows, max_new_tokens, repeat, label=report["model"]))
        ids = prompt_ids(model, rows[0])
        del model  # its sessions and KV caches, before the profiled copy loads its own
        gc.collect()
        step = "copies"
        report["copies"] = {"question_id": rows[0]["question_id"],
                            **count_copies(artifact, device, ids)}
    except Exception as e:  # on a device run for the first time, anything may: record it
        report["error"] = traceback.format_exc()
        report["failures"] = [f"{step}: {_line(e)}"]
    report["failures"] = judge(report, device) + report.get("failures", [])
    report["passed"] = not report["failures"]
    return report


def export(source, out: Path, device) -> dict:
    """Export `source` (None: the bundled SmolLM2) for `device` into `out`."""
    from edgespec.export.pipeline import export_model
    start = time.perf_counter()
    try:
        export_model(source, out, device=device, adapter="auto",
                     log=lambda msg: print(msg, file=sys.stderr))
    except Exception as e:  # as check_model: the verdict says what failed
        return {"model": out.name, "source": source, "passed": False,
                "failures": [f"export: {_line(e)}"], "error": traceback.format_exc()}
    return {"source": source, "export_s": round(time.perf_counter() - start, 1)}


def table(verdict) -> str:
    head = (f"{'model':28} {'decoding':8} {'identical':>9} {'plain tok/s':>11} "
            f"{'spec tok/s':>10} {'speedup':>7} {'tok/round':>9}")
    lines = [head, "-" * len(head)]
    for m in verdict["models"]:
        for name in (n for n in SAMPLINGS if n in m):
            c = m[name]
            lines.append(f"{m['model'][:28]:28} {name:8} {c['identical']:>5}/{c['prompts']:<3} "
                         f"{c['plain_tokens_per_s']:>11.1f} {c['spec_tokens_per_s']:>10.1f} "
                         f"{c['speedup']:>6.2f}x {c['tokens_per_round']:>9.2f}")
    for m in verdict["models"]:
        copies = m.get("copies", {})
        for mode in (mode for mode in ("plain", "speculative") if mode in copies):
            c = copies[mode]
            lines.append(f"{m['model']}, {mode}: {c['copies']:.1f} host-device copies per token "
                         f"({c['to_device']:.1f} to the device, {c['to_host']:.1f} back, "
                         f"{c['memcpy']:.1f} Memcpy nodes), {c['runs']:.1f} graph runs")
        lines += [f"{m['model']}: FAILED {failure}" for failure in m["failures"]]
    lines.append(f"verdict: {verdict['verdict']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="a .gguf file (or checkpoint) to export and check besides SmolLM2")
    p.add_argument("--artifact", action="append", default=[], metavar="DIR",
                   help="check this exported artifact (repeatable); SmolLM2 is then not exported")
    p.add_argument("--out", type=Path, default=Path("models/gpu-check"),
                   help="where exports go (default: models/gpu-check)")
    p.add_argument("--json", type=Path, help="the verdict (default: OUT/verdict.json)")
    p.add_argument("--prompts", type=Path, default=PROMPTS,
                   help="Spec-Bench style JSONL; the first prompt of each category is run")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=1, help="runs per prompt and mode (median)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: rehearse the checks on the CPU provider")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.repeat < 1:
        p.error("--max-new-tokens and --repeat must be at least 1")
    if args.device == "cuda":
        problem = cuda_problem()
        if problem:
            print(f"no CUDA device: {problem}")
            return NO_CUDA
    try:
        rows = pick_prompts(args.prompts)
    except edgespec.EdgespecError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    verdict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command,
               **describe_device(args.device), "prompts": str(args.prompts),
               "max_new_tokens": args.max_new_tokens, "repeat": args.repeat, "models": []}
    targets = [(Path(a), {"source": None}) for a in args.artifact]
    sources = ([] if args.artifact else [None]) + args.models
    for source in sources:
        out = args.out / (Path(source).stem if source else "smollm2-135m-instruct")
        targets.append((out, export(source, out, args.device)))
    for artifact, made in targets:
        if made.get("failures"):
            verdict["models"].append(made)
            continue
        verdict["models"].append({**made, **check_model(artifact, args.device, rows,
                                                        args.max_new_tokens, args.repeat)})
    verdict["verdict"] = "pass" if all(m["passed"] for m in verdict["models"]) else "fail"
    path = args.json or args.out / "verdict.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(verdict, indent=1, default=str) + "\n")
    print(table(verdict))
    print(f"written to {path}")
    return PASSED if verdict["verdict"] == "pass" else FAILED


if __name__ == "__main__":
    sys.exit(main())
