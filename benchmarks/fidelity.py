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
from edgespec.export import fidelity  # noqa: E402
from benchmarks.peers import Edgespec, LlamaCpp, judge_fidelity, source_gguf  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifacts", nargs="*", default=["models/smollm2-135m-instruct"],
                   help="artifacts exported from the same model (judged in turn)")
    p.add_argument("--questions", default=str(fidelity.QUESTIONS))
    p.add_argument("--llama-cpp", action="store_true", help="also judge llama.cpp on the GGUF")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    engines = {path: Edgespec(path, args.threads) for path in args.artifacts}
    first = engines[args.artifacts[0]].model
    if args.llama_cpp:
        engines["llama.cpp"] = LlamaCpp(source_gguf(first.artifact.manifest), args.threads)
    judge_fidelity(first, first.artifact.manifest, engines, args.questions)


if __name__ == "__main__":
    main()
