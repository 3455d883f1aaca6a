"""Load an `edgespec serve` instance: N concurrent streaming chat clients for a while.

    .venv/bin/edgespec serve models/smollm2-135m-instruct --port 8000 &
    .venv/bin/python benchmarks/server_load.py --port 8000 --clients 16 --seconds 120

Each client loops: a streaming chat request (a built-in prompt, max_tokens 64), timing the
first content chunk (time to first token) and the tokens/s of the stream after it. The
server runs one request at a time, so time to first token includes the wait in its queue.
The final usage chunk's `edgespec` numbers give the server's own decode speed and what
speculation accepted. A server with an API key: --api-key or $EDGESPEC_API_KEY.
"""
import argparse
import os
import statistics
import threading
import time

import openai

from edgespec.bench import load_prompts


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def client_loop(base_url, api_key, prompts, max_tokens, deadline, results, errors, index):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    turn = index
    while time.time() < deadline:
        prompt = prompts[turn % len(prompts)]["turns"][0]
        turn += 1
        start = time.perf_counter()
        first, tokens, numbers = None, 0, {}
        try:
            stream = client.chat.completions.create(
                model="edgespec", stream=True, max_tokens=max_tokens, temperature=0,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": prompt}])
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and first is None:
                    first = time.perf_counter()
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
                    numbers = (chunk.usage.model_extra or {}).get("edgespec", {})
        except Exception as e:  # every failure counts, whatever its kind
            errors.append(repr(e))
            continue
        end = time.perf_counter()
        if first is not None:
            results.append({"ttft": first - start,
                            "tokens_per_s": (tokens - 1) / (end - first) if end > first else 0,
                            **{f"server_{k}": numbers.get(k, 0) for k in (
                                "tokens_per_s", "accepted", "drafted", "rounds")}})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--api-key", default=os.environ.get("EDGESPEC_API_KEY") or "unused")
    args = p.parse_args()
    prompts = load_prompts()
    results, errors = [], []
    deadline = time.time() + args.seconds
    threads = [threading.Thread(target=client_loop, args=(
        f"http://{args.host}:{args.port}/v1", args.api_key, prompts, args.max_tokens, deadline,
        results, errors, i)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ttft = [r["ttft"] for r in results]
    rate = [r["tokens_per_s"] for r in results]
    print(f"{args.clients} clients, {args.seconds:.0f} s: {len(results)} requests, "
          f"{len(errors)} errors")
    print(f"time to first token: p50 {percentile(ttft, 0.5):.2f} s, p95 {percentile(ttft, 0.95):.2f} s")
    print(f"stream tokens/s: p50 {percentile(rate, 0.5):.1f}, p95 {percentile(rate, 0.95):.1f}, "
          f"median {statistics.median(rate) if rate else float('nan'):.1f}")
    served = [r["server_tokens_per_s"] for r in results]
    accepted, drafted, rounds = (sum(r[f"server_{k}"] for r in results)
                                 for k in ("accepted", "drafted", "rounds"))
    median_served = statistics.median(served) if served else float("nan")
    print(f"server decode tokens/s: median {median_served:.1f}; "
          f"accepted {accepted}/{drafted} drafts, {accepted / rounds if rounds else 0:.2f} "
          "accepted/round")
    for e in errors[:5]:
        print("error:", e)


if __name__ == "__main__":
    main()
