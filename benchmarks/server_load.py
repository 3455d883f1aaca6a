"""Load an `edgespec serve` instance: N concurrent streaming chat clients for a while.

    .venv/bin/edgespec serve models/smollm2-135m-instruct --port 8000 &
    .venv/bin/python benchmarks/server_load.py --port 8000 --clients 16 --seconds 120

Each client loops: a streaming chat request (a built-in prompt, max_tokens 64), timing the
first content chunk (time to first token) and the tokens/s of the stream after it. The
server runs one request at a time, so time to first token includes the wait in its queue.
"""
import argparse
import statistics
import threading
import time

import openai

from edgespec.bench import load_prompts


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def client_loop(base_url, prompts, max_tokens, deadline, results, errors, index):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    turn = index
    while time.time() < deadline:
        prompt = prompts[turn % len(prompts)]["turns"][0]
        turn += 1
        start = time.perf_counter()
        first, tokens = None, 0
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
        except Exception as e:  # every failure counts, whatever its kind
            errors.append(repr(e))
            continue
        end = time.perf_counter()
        if first is not None:
            results.append({"ttft": first - start,
                            "tokens_per_s": (tokens - 1) / (end - first) if end > first else 0})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    prompts = load_prompts()
    results, errors = [], []
    deadline = time.time() + args.seconds
    threads = [threading.Thread(target=client_loop, args=(
        f"http://{args.host}:{args.port}/v1", prompts, args.max_tokens, deadline, results,
        errors, i)) for i in range(args.clients)]
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
    for e in errors[:5]:
        print("error:", e)


if __name__ == "__main__":
    main()
