"""Load benchmark of OpenAI-compatible streaming servers: `edgespec serve` and llama.cpp's
llama-server, each started fresh per run, under 1, 2, 4, 8 concurrent clients.

A run: one server on a free port, then C client threads sharing one queue of prompts (the
first turn of each Spec-Bench row, as one user message); each takes the next prompt and
streams a greedy chat reply (temperature 0, --max-tokens). Per target and client count
(medians over --repeat sweeps, the targets interleaved within each sweep):

  tok/s      all completion tokens / (end of the last reply - first request sent)
  x ref      tok/s over the reference's (edgespec -p1) at the same client count
  TTFT       first text chunk - request sent, the wait for a free slot included
  gap        time between consecutive text chunks of a reply; both servers send a token a
             chunk, and the tokens one speculative round accepts arrive together
  accepted   drafted tokens accepted, where the server reports drafts
  identical  replies equal to the same target's reply at 1 client (for llama.cpp, for
             information: it does not promise the same tokens at every batch size)
  others' CPU  the machine's CPU that processes other than the client and the server used
             during the run; above a few percent the run measured a shared machine

Targets: edgespec (`edgespec serve --parallel C`) and edgespec -p1 (--parallel 1, requests
one at a time) at every client count; llama (llama-server -np C on the GGUF the artifact was
exported from) and llama-ngram (the same with --spec-type ngram-simple). `make peers` builds
llama-server into .peers/. onnxruntime-genai is not a target: its continuous batching needs
the CUDA provider. Then:

    .venv/bin/python benchmarks/server_load.py models/smollm2-135m-instruct \\
        --threads 2 --clients 1 2 4 8
"""
import argparse
import contextlib
import datetime
import http.client
import json
import os
import platform
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from edgespec.bench import load_prompts

REPO = Path(__file__).resolve().parent.parent
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
              "humanities")
TARGETS = ("edgespec", "llama", "llama-ngram")
BASELINE = "edgespec -p1"


def server_commands(args, clients) -> dict:
    """label -> argv, less the port, of every server to run at `clients` clients."""
    commands = {}
    if "edgespec" in args.targets:
        edgespec = [str(args.edgespec), "serve", str(args.artifact), "--threads", str(args.threads)]
        if args.edgespec_parallel:
            commands["edgespec"] = edgespec + ["--parallel", str(clients)]
            commands[BASELINE] = edgespec + ["--parallel", "1"]
        else:
            commands["edgespec"] = edgespec
    llama = [str(args.llama_server), "-m", str(args.gguf), "-t", str(args.threads),
             "-tb", str(args.threads), "-np", str(clients), "-c", str(args.ctx * clients),
             "--no-webui"]
    if "llama" in args.targets:
        commands["llama"] = llama
    if "llama-ngram" in args.targets:
        commands["llama-ngram"] = llama + ["--spec-type", "ngram-simple"]
    return commands


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def log_tail(log, lines=20) -> str:
    log.seek(0)
    return "\n".join(log.read().decode(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def serving(argv, start_timeout):
    """(port, process) of a fresh server started from `argv`, answering /health; stopped
    after."""
    port = free_port()
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(argv + ["--port", str(port)], stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + start_timeout
            while not healthy(port):
                if process.poll() is not None or time.monotonic() > deadline:
                    why = (f"exited with status {process.returncode}" if process.poll() is not None
                           else f"did not answer /health in {start_timeout:.0f} s")
                    raise SystemExit(f"server {' '.join(argv)} {why}; the end of its log:\n"
                                     f"{log_tail(log)}")
                time.sleep(0.2)
            yield port, process
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def stream_reply(port, prompt, max_tokens, timeout) -> dict:
    """One streamed chat reply: when it was sent and ended, each text chunk's time and text,
    and the usage (and llama-server's timings) of its last chunk."""
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": prompt}],
                       "stream": True, "stream_options": {"include_usage": True},
                       "temperature": 0, "max_tokens": max_tokens})
    reply = {"chunk_times": [], "pieces": [], "usage": None, "timings": None, "error": None}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    reply["sent"] = time.perf_counter()
    try:
        connection.request("POST", "/v1/chat/completions", body,
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            reply["error"] = f"HTTP {response.status}: {response.read(300).decode(errors='replace')}"
        else:
            read_stream(response, reply)
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        reply["error"] = repr(e)
    finally:
        reply["end"] = time.perf_counter()
        connection.close()
    return reply


def read_stream(response, reply):
    for line in response:
        now = time.perf_counter()  # before parsing: the chunk's arrival
        data = line[len(b"data:"):].strip() if line.startswith(b"data:") else None
        if data == b"[DONE]":
            return
        if data:
            read_chunk(json.loads(data), now, reply)


def read_chunk(chunk, now, reply):
    for choice in chunk.get("choices") or ():
        text = (choice.get("delta") or {}).get("content")
        if text:
            reply["chunk_times"].append(now)
            reply["pieces"].append(text)
    reply["usage"] = chunk.get("usage") or reply["usage"]
    reply["timings"] = chunk.get("timings") or reply["timings"]


def run_clients(port, prompts, clients, args) -> list:
    """Every prompt answered once, by `clients` threads taking the next from one queue."""
    todo = queue.Queue()
    for index in range(len(prompts)):
        todo.put(index)
    replies = [None] * len(prompts)

    def client():
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            replies[index] = stream_reply(port, prompts[index]["turns"][0], args.max_tokens,
                                          args.timeout)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for reply in replies:
        reply["text"] = "".join(reply.pop("pieces"))
    return replies


def cpu_seconds(pid):
    """(busy CPU seconds of the whole machine, of this process, of process `pid`)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        machine = [int(v) for v in f.readline().split()[1:]]
    with open(f"/proc/{pid}/stat") as f:
        server = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    own = os.times()
    return (sum(machine[i] for i in (0, 1, 2, 5, 6)) / tick, own.user + own.system,
            (int(server[11]) + int(server[12])) / tick)


def measure(port, pid, prompts, clients, args):
    """(replies, the share of the machine's CPU that processes other than this one and the
    server used meanwhile): a busy machine makes the run's numbers meaningless."""
    before, start = cpu_seconds(pid), time.perf_counter()
    replies = run_clients(port, prompts, clients, args)
    after, elapsed = cpu_seconds(pid), time.perf_counter() - start
    machine, own, server = (a - b for a, b in zip(after, before))
    return replies, max(0.0, machine - own - server) / (elapsed * os.cpu_count())


def completion_tokens(reply) -> int:
    """The server's count from usage; the text chunks where it sent none."""
    usage = reply["usage"] or {}
    return usage.get("completion_tokens", len(reply["chunk_times"]))


def drafts(reply):
    """(accepted, drafted) as the server reports them: edgespec under usage.edgespec,
    llama-server in timings (only when it drafted)."""
    ours = (reply["usage"] or {}).get("edgespec")
    if ours:
        return ours["accepted"], ours["drafted"]
    timings = reply["timings"] or {}
    return timings.get("draft_n_accepted", 0), timings.get("draft_n", 0)


def percentile(values, q):
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(replies) -> dict:
    ok = [r for r in replies if not r["error"]]
    elapsed = max(r["end"] for r in replies) - min(r["sent"] for r in replies)
    tokens = sum(completion_tokens(r) for r in ok)
    ttft = [r["chunk_times"][0] - r["sent"] for r in ok if r["chunk_times"]]
    gaps = [b - a for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    counts = [drafts(r) for r in ok]
    accepted, drafted = sum(a for a, _ in counts), sum(d for _, d in counts)
    return {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed,
            "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
            "gap_p50": percentile(gaps, 50), "gap_p95": percentile(gaps, 95),
            "acceptance": accepted / drafted if drafted else None,
            "errors": len(replies) - len(ok)}


def identical(replies, solo) -> int:
    return sum(not r["error"] and r["text"] == s["text"] for r, s in zip(replies, solo))


def raw(replies, prompts) -> list:
    """Replies for --json: times in seconds from the run's first request."""
    t0 = min(r["sent"] for r in replies)
    return [{"question_id": p.get("question_id"), "category": p["category"],
             "sent": r["sent"] - t0, "end": r["end"] - t0,
             "chunk_times": [t - r["sent"] for t in r["chunk_times"]],
             **{k: r[k] for k in ("text", "usage", "timings", "error")},
             "completion_tokens": completion_tokens(r),
             "tokens_from": "usage" if r["usage"] else "chunks"}
            for r, p in zip(replies, prompts)]


def sweep(args, prompts) -> list:
    """Every target at every client count, --repeat times; a server command that two targets
    share at one client count (edgespec and edgespec -p1 at 1 client) runs once for both."""
    runs = []
    for repeat in range(args.repeat):
        for clients in args.clients:
            measured = {}
            for label, argv in server_commands(args, clients).items():
                if tuple(argv) not in measured:
                    with serving(argv, args.start_timeout) as (port, process):
                        measured[tuple(argv)] = measure(port, process.pid, prompts, clients,
                                                        args)
                replies, others = measured[tuple(argv)]
                runs.append({"target": label, "clients": clients, "repeat": repeat,
                             "argv": argv, "replies": replies,
                             "summary": {**summarize(replies), "others_cpu": others}})
                s = runs[-1]["summary"]
                print(f"[{repeat + 1}/{args.repeat}] {label}, {clients} clients: "
                      f"{s['tokens']} tokens in {s['seconds']:.1f} s, {s['tok_s']:.1f} tok/s, "
                      f"{s['errors']} errors, others used {others:.0%} of the CPU",
                      file=sys.stderr, flush=True)
    return runs


def medians(runs) -> dict:
    """Each summary number's median over the repeats of one target at one client count."""
    fields = ("tok_s", "tokens", "ttft_p50", "ttft_p95", "gap_p50", "gap_p95", "others_cpu")
    m = {field: statistics.median(run["summary"][field] for run in runs) for field in fields}
    rates = [run["summary"]["acceptance"] for run in runs
             if run["summary"]["acceptance"] is not None]
    m["accepted"] = f"{statistics.median(rates):.0%}" if rates else "-"
    return m


def table(runs, reference) -> list:
    """Markdown rows, one per target and client count."""
    groups = {}
    for run in runs:
        groups.setdefault((run["target"], run["clients"]), []).append(run)
    m = {key: medians(group) for key, group in groups.items()}
    rows = ["| target | clients | tok/s | x ref | TTFT p50 s | TTFT p95 s | gap p50 ms | "
            "gap p95 ms | tokens | accepted | identical | others' CPU |", "|" + " --- |" * 12]
    for (target, clients), group in groups.items():
        mine, ref = m[(target, clients)], m.get((reference, clients))
        ratio = f"{mine['tok_s'] / ref['tok_s']:.2f}" if ref else "-"
        rows.append(f"| {target} | {clients} | {mine['tok_s']:.1f} | {ratio} | "
                    f"{mine['ttft_p50']:.2f} | {mine['ttft_p95']:.2f} | "
                    f"{mine['gap_p50'] * 1e3:.1f} | {mine['gap_p95'] * 1e3:.1f} | "
                    f"{mine['tokens']:.0f} | {mine['accepted']} | "
                    f"{same_as_solo(runs, group, target)} | {mine['others_cpu']:.0%} |")
    return rows


def same_as_solo(runs, group, target) -> str:
    """Replies equal to the target's first 1-client run's, over the group's other runs."""
    solo = next((r for r in runs if r["target"] == target and r["clients"] == 1), None)
    compared = [r for r in group if r is not solo]
    if solo is None or not compared:
        return "solo" if solo else "-"
    same = sum(identical(r["replies"], solo["replies"]) for r in compared)
    return f"{same}/{sum(len(r['replies']) for r in compared)}"


def print_errors(runs, most=5):
    failed = [(run, reply) for run in runs for reply in run["replies"] if reply["error"]]
    for run, reply in failed[:most]:
        print(f"error, {run['target']} at {run['clients']} clients: {reply['error']}")
    if len(failed) > most:
        print(f"... {len(failed) - most} more errors (--json keeps them all)")


def has_parallel(edgespec) -> bool:
    """Whether this edgespec's server takes --parallel (serves several requests at once)."""
    shown = subprocess.run([str(edgespec), "serve", "--help"], capture_output=True, text=True)
    return "--parallel" in shown.stdout


def source_gguf(artifact) -> Path:
    """The GGUF the artifact was exported from (llama-server runs it as it is)."""
    from edgespec.export.source import default_model_path, model_argument
    manifest = json.loads((Path(artifact) / "manifest.json").read_text())
    given = model_argument(manifest["source"]["model"])
    gguf = Path(given) if given else default_model_path()
    if gguf.suffix != ".gguf":
        raise SystemExit(f"{artifact} was exported from {gguf}, not a GGUF: pass --gguf")
    return gguf


def find_llama_server(given):
    if given:
        if not Path(given).is_file():
            raise SystemExit(f"--llama-server {given} is not a file; `make peers` builds one")
        return Path(given)
    built = REPO / ".peers" / "llama-server"
    return built if built.exists() else shutil.which("llama-server")


def version(program) -> str:
    """llama-server's own 'version: ...' line."""
    shown = subprocess.run([str(program), "--version"], capture_output=True, text=True)
    lines = (shown.stdout + shown.stderr).splitlines()
    return next((line for line in lines if line.startswith("version")), "version unknown")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"{cpu}, {os.cpu_count()} logical CPUs"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", type=Path, help="an edgespec artifact directory")
    p.add_argument("--prompts", type=Path, default=REPO / "benchmarks/data/spec_bench_dev.jsonl",
                   help="Spec-Bench style JSONL (question_id, category, turns): the first "
                   "turn of each row is sent (default: the repository's dev prompts)")
    p.add_argument("--categories", nargs="+", default=list(CATEGORIES), metavar="CATEGORY",
                   help=f"default: {' '.join(CATEGORIES)}")
    p.add_argument("--per-category", type=int, default=2, metavar="N",
                   help="the first N prompts of each category (default: %(default)s)")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"comma list of {', '.join(TARGETS)} (default: all)")
    p.add_argument("--gguf", type=Path,
                   help="the model for llama-server (default: the artifact's source GGUF)")
    p.add_argument("--llama-server", help="default: .peers/llama-server (`make peers`), "
                   "else llama-server on PATH")
    p.add_argument("--threads", type=int, default=2, help="per server (default: %(default)s)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8], metavar="C",
                   help="concurrent clients per run; 1 gives the solo replies "
                        "(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="default: %(default)s")
    p.add_argument("--ctx", type=int, default=4096,
                   help="llama-server's context per slot (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=1, help="sweeps (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds a request may take (default: %(default)s)")
    p.add_argument("--start-timeout", type=float, default=300,
                   help="seconds a server may take to answer /health (default: %(default)s)")
    p.add_argument("--json", type=Path, help="write every run's replies and numbers here")
    args = p.parse_args()
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        p.error(f"unknown --targets {', '.join(sorted(unknown))}; known: {', '.join(TARGETS)}")
    return args


def prepare(args):
    """Fill in the programs and model each target needs; drop llama's when it is not built."""
    args.edgespec = Path(sys.executable).parent / "edgespec"
    if "edgespec" in args.targets:
        if not args.edgespec.exists():
            raise SystemExit(f"no {args.edgespec}: run this with the python of edgespec's venv")
        args.edgespec_parallel = has_parallel(args.edgespec)
    llama_targets = [t for t in args.targets if t.startswith("llama")]
    if llama_targets:
        args.llama_server = find_llama_server(args.llama_server)
        if not args.llama_server:
            print("llama-server not found (.peers/llama-server or on PATH): `make peers` builds "
                  "it; running the edgespec targets only", file=sys.stderr)
            args.targets = [t for t in args.targets if t not in llama_targets]
        else:
            args.gguf = args.gguf or source_gguf(args.artifact)


def header(args, prompts, started):
    print(f"server load, {started:%Y-%m-%d %H:%M} UTC: {machine()}, --threads {args.threads}")
    print(f"command: {' '.join(sys.argv)}")
    print(f"{len(prompts)} prompts ({args.per_category} per category of {args.prompts}), "
          f"max_tokens {args.max_tokens}, greedy, {args.repeat} sweep(s)")
    if "edgespec" in args.targets:
        parallel = "" if args.edgespec_parallel else " (no --parallel: one request at a time)"
        print(f"edgespec: {args.artifact}{parallel}")
    if any(t.startswith("llama") for t in args.targets):
        print(f"llama-server: {args.llama_server} ({version(args.llama_server)}), {args.gguf}")
    print("onnxruntime-genai: not run (its continuous batching needs the CUDA provider)")
    print(f"x ref: tok/s over {reference(args)}'s at the same clients; identical: replies equal "
          "to the target's own at 1 client (for llama.cpp, for information); others' CPU: the "
          "machine's CPU that other processes used during the run\n", flush=True)


def reference(args) -> str:
    return BASELINE if "edgespec" in args.targets and args.edgespec_parallel else "edgespec"


def main():
    args = parse_args()
    prepare(args)
    prompts = load_prompts(args.prompts, per_category=args.per_category,
                           categories=args.categories)
    started = datetime.datetime.now(datetime.timezone.utc)
    header(args, prompts, started)
    runs = sweep(args, prompts)
    print("\n".join(table(runs, reference(args))))
    print_errors(runs)
    if args.json:
        args.json.write_text(json.dumps({
            "date": started.isoformat(), "machine": machine(), "threads": args.threads,
            "command": sys.argv, "runs": [{**{k: v for k, v in run.items() if k != "replies"},
                                           "replies": raw(run["replies"], prompts)}
                                          for run in runs]}, indent=1))

if __name__ == "__main__":
    main()
