"""Fidelity: how an artifact's greedy answers follow the model it was exported from.

For each short chat question (benchmarks/data/fidelity_dev.jsonl: the question and words
of a right answer), the source model in float32 (transformers, the GGUF dequantized)
answers greedily, up to 48 tokens; then each engine judged answers the same token ids:
- first 16: its first 16 greedy tokens equal the reference's (all of them when shorter);
- right: a word of the answer is in its reply (the reference's own count beside it);
- top-1: teacher-forced along the reference's reply, how often its likeliest next token is
  the reference's.
Engines: the artifact (plain greedy decoding) and, with --llama-cpp, llama.cpp on the
GGUF the artifact came from (llama-cpp-python, its own kernels).

    .venv-peers/bin/python benchmarks/fidelity.py models/smollm2-135m-instruct --llama-cpp
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import edgespec  # noqa: E402

QUESTIONS = Path(__file__).parent / "data" / "fidelity_dev.jsonl"
REPLY_TOKENS, FIRST = 48, 16


def reference_replies(source, prompts, stop_ids) -> list:
    """The float32 model's greedy replies (token ids, end of turn excluded)."""
    import torch
    model = source.torch_model
    replies = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=REPLY_TOKENS,
                                 do_sample=False, eos_token_id=list(stop_ids))
        reply = out[0, len(ids):].tolist()
        replies.append([t for t in reply if t not in stop_ids][:REPLY_TOKENS])
    return replies


class Artifact:
    name = "edgespec"

    def __init__(self, path, threads):
        self.model = edgespec.load(path, threads=threads)

    def reply(self, ids):
        g = self.model.generate_ids(ids, REPLY_TOKENS, mode="plain", temperature=0)
        return [t for t in g.tokens if t not in self.model.stop_ids], g.decode_tokens_per_s

    def top1(self, ids):
        """The likeliest next token after every prefix of `ids` (one prefill, all rows)."""
        engine = self.model.engine
        engine.reset()
        engine.lower(np.asarray(ids, np.int64))
        engine.upper(len(ids))
        return engine.head(engine.final_states, range(len(ids))).argmax(-1).tolist()


class LlamaCpp:
    name = "llama.cpp"

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
            if token in self.stop_ids or len(tokens) == REPLY_TOKENS:
                break
            tokens.append(token)
        speed = (len(tokens) - 1) / (time.perf_counter() - first) if len(tokens) > 1 else 0.0
        return tokens, speed

    def top1(self, ids):
        self.llm.reset()
        self.llm.eval(ids)
        return np.asarray(self.llm.scores[:len(ids)]).argmax(-1).tolist()


def right(text, answers) -> bool:
    return any(a.lower() in text.lower() for a in answers)


def judge(engine, rows, prompts, references, decode) -> dict:
    first, correct, agree, total, speeds = 0, 0, 0, 0, []
    for row, ids, want in zip(rows, prompts, references):
        got, speed = engine.reply(ids)
        speeds.append(speed)
        first += got[:FIRST] == want[:FIRST]
        correct += right(decode(got), row["answer"])
        predicted = engine.top1(ids + want)[len(ids) - 1:len(ids) + len(want) - 1]
        agree += sum(p == w for p, w in zip(predicted, want))
        total += len(want)
    n = len(rows)
    return {"engine": engine.name, "first16": f"{first}/{n}", "right": f"{correct}/{n}",
            "top1": round(agree / total, 3), "tok_s": round(statistics.median(speeds), 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", nargs="?", default="models/smollm2-135m-instruct")
    p.add_argument("--questions", default=str(QUESTIONS))
    p.add_argument("--llama-cpp", action="store_true", help="also judge llama.cpp on the GGUF")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from export.source import default_model_path, load_source
    ours = Artifact(args.artifact, args.threads)
    origin = ours.model.artifact.manifest["source"]["model"]
    bundled = origin.startswith("bundled:")
    source = load_source(None if bundled else origin)
    rows = [json.loads(line) for line in Path(args.questions).read_text().splitlines() if line]
    prompts = [ours.model.encode(row["question"]) for row in rows]
    stop_ids = set(ours.model.stop_ids)
    references = reference_replies(source, prompts, stop_ids)
    decode = ours.model.codec.decode
    n_right = sum(right(decode(r), row["answer"]) for r, row in zip(references, rows))
    print(f"{len(rows)} questions; float32 reference right on {n_right}/{len(rows)}")
    engines = [ours]
    if args.llama_cpp:
        gguf = default_model_path() if bundled else Path(origin)
        if gguf.suffix != ".gguf":
            raise SystemExit(f"--llama-cpp needs a GGUF source; {origin} is not one")
        engines.append(LlamaCpp(gguf, args.threads, stop_ids))
    print("| engine | first 16 tokens equal | right | teacher-forced top-1 | greedy tok/s |")
    print("|---|---|---|---|---|")
    for engine in engines:
        r = judge(engine, rows, prompts, references, decode)
        print(f"| {r['engine']} | {r['first16']} | {r['right']} | {r['top1']} | {r['tok_s']} |",
              flush=True)


if __name__ == "__main__":
    main()
