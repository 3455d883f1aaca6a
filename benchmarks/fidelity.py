"""Fidelity: how an artifact's greedy answers follow the model it was exported from.

The export's fidelity gate (export/fidelity.py: first 16 greedy tokens equal to the float32
source's, right answers, teacher-forced top-1, on short chat questions), run on an artifact
and, with --llama-cpp, on llama.cpp with the GGUF the artifact came from (llama-cpp-python,
its own kernels); --questions takes another set of the same form.

    .venv-peers/bin/python benchmarks/fidelity.py models/smollm2-135m-instruct --llama-cpp
"""
import argparse
import time
from pathlib import Path

import numpy as np

import edgespec
from edgespec.export import fidelity


class LlamaCpp:
    def __init__(self, gguf, threads, stop_ids):
        from llama_cpp import Llama
        self.llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads,
                         n_threads_batch=threads, logits_all=True, verbose=False)
        self.stop_ids = stop_ids

    def reply(self, ids):
        self.llm.reset()
        tokens, first = [], None
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            first = first or time.perf_counter()
            if token in self.stop_ids or len(tokens) == fidelity.REPLY_TOKENS:
                break
            tokens.append(token)
        speed = (len(tokens) - 1) / (time.perf_counter() - first) if len(tokens) > 1 else 0.0
        return tokens, speed

    def top1(self, ids):
        self.llm.reset()
        self.llm.eval(ids)
        return np.asarray(self.llm.scores[:len(ids)]).argmax(-1).tolist()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifacts", nargs="*", default=["models/smollm2-135m-instruct"],
                   help="artifacts exported from the same model (judged in turn)")
    p.add_argument("--questions", default=str(fidelity.QUESTIONS))
    p.add_argument("--llama-cpp", action="store_true", help="also judge llama.cpp on the GGUF")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from edgespec.export.source import default_model_path, load_source
    models = [edgespec.load(path, threads=args.threads) for path in args.artifacts]
    first = models[0]
    origin = first.artifact.manifest["source"]["model"]
    bundled = origin.startswith("bundled:")
    source = load_source(None if bundled else origin)
    rows = fidelity.questions(args.questions)
    prompts = [first.encode(row["question"]) for row in rows]
    stop_ids = set(first.stop_ids)
    references = fidelity.reference_replies(source.torch_model, prompts, stop_ids)
    decode = first.codec.decode
    n_right = sum(fidelity.is_right(decode(r), row["answer"]) for r, row in zip(references, rows))
    print(f"{len(rows)} questions; float32 reference right on {n_right}/{len(rows)}")
    engines = [(path, fidelity.ArtifactAnswers(m)) for path, m in zip(args.artifacts, models)]
    if args.llama_cpp:
        gguf = default_model_path() if bundled else Path(origin)
        if gguf.suffix != ".gguf":
            raise SystemExit(f"--llama-cpp needs a GGUF source; {origin} is not one")
        engines.append(("llama.cpp", LlamaCpp(gguf, args.threads, stop_ids)))
    print("| engine | first 16 tokens equal | right | teacher-forced top-1 | greedy tok/s |")
    print("|---|---|---|---|---|")
    n = len(rows)
    for name, engine in engines:
        r = fidelity.judge(engine, rows, prompts, references, decode)
        print(f"| {name} | {r['first16_equal']}/{n} | {r['right']}/{n} | {r['top1_agreement']} "
              f"| {r['decode_tokens_per_s']} |", flush=True)


if __name__ == "__main__":
    main()
