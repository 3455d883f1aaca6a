"""The `edgespec` command: export, generate."""
import argparse
import json
import sys

from .errors import EdgespecError

EXAMPLES = """examples:
  edgespec export                          # the bundled SmolLM2-135M-Instruct -> models/smollm2-135m-instruct
  edgespec export path/to/model.gguf -o models/mine
  edgespec generate models/smollm2-135m-instruct -p "Name three primes."
  edgespec generate models/smollm2-135m-instruct -p "Hi" --temperature 0.7 --seed 1 --json
"""


def _common(debug_default=False):
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--debug", action="store_true", default=debug_default,
                        help="show full tracebacks on errors")
    return parent


def _export_args(sub, common):
    p = sub.add_parser("export", parents=[common], help="export a model to an edgespec artifact",
                       description="Turn a model into a quantized ONNX artifact: lower.onnx "
                       "(embeddings + layers below the exit), upper.onnx (the rest), head.onnx "
                       "(final norm + lm_head), sharing every weight once.")
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file, a Hugging Face checkpoint directory or hub id "
                   "(default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("-o", "--output", help="artifact directory (default: models/NAME)")
    p.add_argument("--exit-layer", type=int, default=None,
                   help="layer after which the draft exits (default: 3/4 of the depth)")
    p.add_argument("--precision", default="int4", choices=("int4", "fp16", "fp32"),
                   help="weight format (default: int4, block 32)")
    p.add_argument("--max-context", type=int, default=None,
                   help="tokens the KV cache holds (default: min(4096, the model's limit))")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the artifact will run: cpu (fp32 activations) or cuda (fp16)")
    p.set_defaults(run=_export)


def _generate_args(sub, common):
    p = sub.add_parser("generate", parents=[common], help="reply to one prompt (for scripts)",
                       description="Generate a reply to one prompt, streaming text to stdout.")
    p.add_argument("artifact", help="an artifact directory made by `edgespec export`")
    p.add_argument("-p", "--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="default: 256")
    p.add_argument("--plain", action="store_true",
                   help="plain decoding (the only mode until speculative decoding lands)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", help="a system message for the chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min-p times the likeliest (0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 (default) is off")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, tokens, timings) instead of streaming")
    _runtime_args(p)
    p.set_defaults(run=_generate)


def _runtime_args(p):
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="execution provider (default: CUDA if the artifact was built for it "
                   "and onnxruntime-gpu sees a GPU, else CPU)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: ORT's)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the sha256 check of the artifact's files (sizes are still checked)")


def _export(args):
    try:
        from export.pipeline import export_model
    except ImportError as e:
        raise EdgespecError(f"edgespec export needs the export extra ({e.name} is missing): "
                            "pip install 'edgespec[export]'") from e
    export_model(args.model, args.output, args.exit_layer, args.precision, args.max_context,
                 args.device, log=lambda msg: print(msg, file=sys.stderr))


def _generate(args):
    from .model import load
    model = load(args.artifact, device=args.device, threads=args.threads,
                 verify=not args.no_verify)
    stream = None if args.json else (lambda piece: print(piece, end="", flush=True))
    result = model.generate(args.prompt, max_new_tokens=args.max_new_tokens, raw=args.raw,
                            system=args.system, mode="plain", on_text=stream,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed)
    if args.json:
        print(json.dumps(result.to_dict()))
        return
    print()
    if result.finish_reason == "context_full":
        print(f"[stopped: the context of {model.engine.max_context} tokens is full]",
              file=sys.stderr)
    print(f"[{result.n_prompt} prompt tokens, {result.n_generated} generated, "
          f"{result.decode_tokens_per_s:.1f} tokens/s, {result.mode}]", file=sys.stderr)


def parser():
    common = _common()
    p = argparse.ArgumentParser(prog="edgespec", parents=[common], epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Self-speculative decoding on ONNX Runtime.")
    sub = p.add_subparsers(dest="command", required=True)
    _export_args(sub, _common(argparse.SUPPRESS))
    _generate_args(sub, _common(argparse.SUPPRESS))
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except EdgespecError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or an unforeseen failure: say so in one line
        if args.debug:
            raise
        print(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
