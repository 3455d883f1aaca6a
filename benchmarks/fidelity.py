"""Fidelity: how artifacts' greedy answers follow the model they were exported from.

Export's fidelity gate (export/fidelity.py: first 16 greedy tokens equal to the float32
source's, right answers, teacher-forced top-1, on short chat questions), run on one or more
artifacts of the same model and, with --llama-cpp, on llama.cpp with the GGUF they came from
(llama-cpp-python, its own kernels); --questions takes another set of the same form.
`benchmarks/peers.py --fidelity` judges the peers the same way in its speed run.

    .venv-peers/bin/python benchmarks/fidelity.py models/smollm2-135m-instruct --llama-cpp
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import edgespec  # noqa: E402
from edgespec.export import fidelity  # noqa: E402
from benchmarks.peers import LlamaCpp, PeerAnswers, load_source, source_gguf  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifacts", nargs="*", default=["models/smollm2-135m-instruct"],
                   help="artifacts exported from the same model (judged in turn)")
    p.add_argument("--questions", default=str(fidelity.QUESTIONS))
    p.add_argument("--llama-cpp", action="store_true", help="also judge llama.cpp on the GGUF")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    models = [edgespec.load(path, threads=args.threads) for path in args.artifacts]
    first = models[0]
    manifest = first.artifact.manifest
    rows = fidelity.questions(args.questions)
    prompts = [first.encode(row["question"]) for row in rows]
    stop_ids = set(first.stop_ids)
    references = fidelity.reference_replies(load_source(manifest).torch_model, prompts, stop_ids)
    decode = first.codec.decode
    n_right = sum(fidelity.is_right(decode(r), row["answer"]) for r, row in zip(references, rows))
    print(f"{len(rows)} questions; float32 reference right on {n_right}/{len(rows)}")
    engines = [(path, fidelity.ArtifactAnswers(m)) for path, m in zip(args.artifacts, models)]
    if args.llama_cpp:
        llama = LlamaCpp(source_gguf(manifest), args.threads)
        engines.append(("llama.cpp", PeerAnswers(llama, stop_ids)))
    print("| engine | first 16 tokens equal | right | teacher-forced top-1 | greedy tok/s |")
    print("|---|---|---|---|---|")
    n = len(rows)
    for name, engine in engines:
        r = fidelity.judge(engine, rows, prompts, references, decode)
        print(f"| {name} | {r['first16_equal']}/{n} | {r['right']}/{n} | {r['top1_agreement']} "
              f"| {r['decode_tokens_per_s']} |", flush=True)


if __name__ == "__main__":
    main()
