"""The `edgespec` command: export, chat, generate, bench, serve, desktop."""
import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from .errors import EdgespecError
from .options import CATALOGUE, DRAFT, SAMPLING
from .sampling import CHAT_DEFAULTS
from .tokenizer import check_utf8

EXAMPLES = """examples:
  edgespec export                          # the bundled SmolLM2-135M-Instruct -> models/smollm2-135m-instruct
  edgespec export path/to/model.gguf -o models/mine
  edgespec chat models/smollm2-135m-instruct --show-drafts
  edgespec generate models/smollm2-135m-instruct -p "Name three primes."
  edgespec generate models/smollm2-135m-instruct -p "Hi" --temperature 0.7 --seed 1 --json
  edgespec bench models/smollm2-135m-instruct --prompts benchmarks/data/spec_bench_dev.jsonl
  edgespec serve models/smollm2-135m-instruct --port 8000
  edgespec desktop models/smollm2-135m-instruct
"""


def _common(debug_default=False):
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--debug", action="store_true", default=debug_default,
                        help="show full tracebacks on errors")
    return parent


def _artifact_command(sub, common, name, help, description):
    """A subcommand that runs an artifact: its parser, with the artifact argument."""
    p = sub.add_parser(name, parents=[common], help=help, description=description)
    p.add_argument("artifact", help="an artifact directory made by `edgespec export`")
    return p


def _load(args, max_context=None):
    from .model import load
    return load(args.artifact, device=args.device, threads=args.threads,
                verify=not args.no_verify, max_context=max_context)


def _export_args(sub, common):
    p = sub.add_parser("export", parents=[common], help="export a model to an edgespec artifact",
                       description="Turn a model into a quantized ONNX artifact: lower.onnx "
                       "(embeddings + layers below the exit), upper.onnx (the rest), head.onnx "
                       "(final norm + lm_head), sharing every weight once.")
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file, a Hugging Face checkpoint directory or hub id "
                   "(default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("-o", "--output", help="artifact directory (default: models/NAME)")
    p.add_argument("--exit-layer", type=_auto_or(int), default="auto",
                   help="layer after which the draft exits: a number, or auto (default): the "
                   "fastest of a few candidates, measured on the artifact")
    p.add_argument("--adapter", default="auto",
                   help="exit adapter for the draft: auto (default: the shipped one for this "
                   "model, else train one if the calibration budget affords it, else the raw "
                   "exit), train, none (raw early exit), or an adapter file")
    p.add_argument("--calibration-minutes", type=float, default=5.0, metavar="M",
                   help="time for calibration after the graphs are built (default: 5). Plain "
                   "decoding's speed is measured first and the work sized to fit: held-out "
                   "prompts measured, whether an adapter is trained and on how many replies, "
                   "which screens (k, shortlist, exit layers) run; the plan is printed")
    p.add_argument("--adapter-minutes", type=float, default=8.0,
                   help="at most this much training for a new adapter, all exit layers tried "
                   "(default: 8; the calibration budget may give less)")
    p.add_argument("--save-adapter", metavar="FILE.npz",
                   help="also keep the chosen adapter here (fp16), for --adapter FILE later")
    p.add_argument("--shortlist", type=_auto_or(int), default="auto",
                   help="draft head vocabulary: auto (default: measured), a size, or 0 (full)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="measure nothing and train no adapter unless --adapter train; "
                   "needs a numeric --exit-layer")
    p.add_argument("--precision", default="auto",
                   choices=("auto", "int4", "int8", "fp16", "fp32"),
                   help="weight format: auto (default): int4 (a quantized GGUF's own grids, "
                   "see --int4-scheme), or int8 for a float source of an architecture int4 "
                   "follows too loosely (Gemma 3); int8: 8 bits everywhere, re-rounded")
    p.add_argument("--int4-scheme", default="auto", choices=("auto", "source", "zp"),
                   help="auto (default): source for a quantized GGUF, else zp. source: the "
                   "GGUF's own grids kept (its codes and scales; 5- to 8-bit codes at 8 "
                   "bits), so the artifact answers as the file's model does; zp: weights "
                   "re-rounded to 4-bit zero points by GPTQ, faster but answering "
                   "differently (export prints its fidelity)")
    p.add_argument("--no-gptq", action="store_true",
                   help="round each int4 weight on its own instead of GPTQ (which rounds a "
                   "layer's weights to keep its outputs on calibration text): a faster "
                   "export that follows the full model less closely")
    p.add_argument("--head-bits", default="mixed", choices=(8, 4, "mixed"),
                   type=lambda v: int(v) if v.isdigit() else v,
                   help="bits of a zp artifact's vocabulary table, the embedding and "
                   "lm_head (source keeps the file's): mixed (default): the first 8192 "
                   "token ids (in BPE vocabularies the most used) at 8 bits, the rest at 4; 8; 4 "
                   "(zero points), the fastest, agrees less with the full model")
    p.add_argument("--max-context", type=int, default=None,
                   help="tokens the KV cache holds (default: min(4096, the model's limit))")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the artifact will run: cpu (fp32 activations) or cuda (fp16; "
                   "without CUDA here, what runs the artifact is skipped)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="CPU threads the draft policy and the round costs are measured at, "
                   "recorded in the manifest; a runtime with another count measures the "
                   "round costs again (default: one per CPU here, what the runtime uses)")
    p.add_argument("--max-memory", type=_positive_number, default=None, metavar="GB",
                   help="refuse to start when the export's estimated peak memory (printed "
                   "first) is above this many GB (default: the memory available now)")
    p.set_defaults(run=_export)


def _generate_args(sub, common):
    p = _artifact_command(sub, common, "generate", "reply to one prompt (for scripts)",
                          "Generate a reply to one prompt, streaming text to stdout.")
    p.add_argument("-p", "--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", help="a system message for the chat template")
    _reply_args(p, per_reply=True)
    _sampling_args(p)
    _draft_args(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, tokens, timings, statistics) instead of "
                   "streaming")
    p.add_argument("--stats", action="store_true",
                   help="print the draft statistics line (acceptance, tokens/round, time shares)")
    _runtime_args(p)
    p.set_defaults(run=_generate)


def _reply_args(p, max_new_tokens=None, per_reply=False):
    """The reply's flags: --max-new-tokens (this command's default, else the catalogue's),
    --mode, --stop and, for a command that makes one reply, --ignore-eos."""
    _option_flag(p, CATALOGUE["max_new_tokens"], max_new_tokens)
    _option_flag(p, CATALOGUE["mode"])
    option = CATALOGUE["stop"]
    p.add_argument(option.flag, action="append", metavar="TEXT",
                   help=f"{option.help}; repeatable")
    if per_reply:
        _option_flag(p, CATALOGUE["ignore_eos"])


def _option_flag(group, option, default=None):
    """The flag of a catalogue option, its text read by the option's kind and checked with
    the others in _options (a bad value is one error line); its help gives the range and
    the default. Not given: `default`, else None (the model's, or the catalogue's)."""
    shown = default if default is not None else option.default_text or option.default
    if option.kind is bool:
        shown = {True: "on", False: "off"}.get(shown, shown)
        group.add_argument(option.flag, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{option.help} (default: {shown})")
    else:
        choices = "{" + ",".join(option.choices) + "}" if option.choices else None
        group.add_argument(option.flag, type=option.read, default=default, metavar=choices,
                           help=f"{option.help}; {option.expected} (default: {shown})")


def _sampling_args(p):
    group = p.add_argument_group(
        "sampling", "Settings not given are the model's: those its checkpoint recommends "
        f"(generation_config.json), else {CHAT_DEFAULTS.describe()}. --temperature 0 is "
        "plain greedy (penalties only if given).")
    for option in SAMPLING:
        _option_flag(group, option)


def _chat_args(sub, common):
    p = _artifact_command(sub, common, "chat", "streaming chat in the terminal",
                          "A streaming multi-turn chat. The KV cache is kept between turns, so "
                          "a new turn prefills only its new tokens. Type /help inside.")
    p.add_argument("--system", help="a system message")
    _reply_args(p, max_new_tokens=512)
    p.add_argument("--show-drafts", action="store_true",
                   help="colour the text that came from accepted drafts")
    _sampling_args(p)
    _draft_args(p)
    _runtime_args(p)
    p.set_defaults(run=_chat)


def _chat(args):
    from . import chat
    options = _options(args)
    check_utf8(args.system, "the system message (--system)")
    model = _load(args)
    chat.run(model, options, system=args.system, show_drafts=args.show_drafts)


def _draft_args(p):
    group = p.add_argument_group("drafting", "Settings not given are the artifact's, "
                                 "measured when it was exported.")
    for option in DRAFT:
        _option_flag(group, option)


def _options(args) -> dict:
    """The generation options given on the command line, by their flat names (None: the
    model's), checked before anything loads."""
    from .settings import Settings
    options = {name: getattr(args, name) for name in CATALOGUE if hasattr(args, name)}
    for text in options.get("stop") or ():
        check_utf8(text, "a stop string (--stop)")
    Settings().with_options(**options)
    return options


def _bench_args(sub, common):
    p = _artifact_command(sub, common, "bench", "plain vs speculative on a prompt set",
                          "For each prompt (first turn, chat template, the model's sampling "
                          "settings or those given, seeded by the prompt's id): plain decoding, "
                          "then speculative, same artifact, same process. Prints a table per "
                          "category (median speedup, share of identical outputs, acceptance). "
                          "With --parallel: the whole set decoded N replies at a time against "
                          "one at a time, plain and speculative, and each reply compared with "
                          "its solo run.")
    p.add_argument("--prompts", help="a JSONL file of {question_id, category, turns} "
                   "(default: a small built-in set; Spec-Bench's question.jsonl works)")
    _option_flag(p, CATALOGUE["max_new_tokens"], 128)
    p.add_argument("--limit", type=int, help="at most this many prompts")
    p.add_argument("--per-category", type=int, help="the N lowest question ids of each category")
    p.add_argument("--categories", nargs="+", help="only these categories")
    p.add_argument("--repeat", type=_positive, default=3, help="runs of each prompt and mode, "
                   "interleaved (which goes first alternates); speeds are their medians "
                   "(default: 3)")
    p.add_argument("--parallel", type=_parallel, nargs="+", metavar="N",
                   help="decode the prompts N at a time instead (1 to 8; several counts "
                   "compare them), continuously: a finished reply's sequence goes to the next "
                   "prompt. Prints aggregate decode tokens/s against --parallel 1 (one reply "
                   "at a time) and plain decoding, and how many replies equal their solo run")
    p.add_argument("--json", metavar="OUT", help="write per-prompt results and summaries here")
    p.add_argument("--plot", metavar="OUT.png", help="bar chart of speedup and acceptance")
    _sampling_args(p)
    _draft_args(p)
    _runtime_args(p)
    p.set_defaults(run=_bench)


def _parallel(text):
    from .batch import MOST_PARALLEL
    value = _positive(text)
    if value > MOST_PARALLEL:
        raise argparse.ArgumentTypeError(f"at most {MOST_PARALLEL}")
    return value


def _bench(args):
    from . import bench
    rows = bench.load_prompts(args.prompts, args.limit, args.per_category, args.categories)
    if not rows:
        raise EdgespecError("no prompts selected")
    options = _options(args)
    model = _load(args)
    settings = model.settings(**options)
    if args.parallel:
        return _bench_parallel(args, model, rows, settings)
    results = bench.run(model, rows, settings, args.repeat)
    summaries = bench.summarize(results)
    costs = model.engine.round_costs()
    policy, sampling = settings.draft, settings.sampling
    print(f"{args.artifact}: exit layer {model.artifact.exit_layer}, {policy.describe()}, "
          f"{args.max_new_tokens} new tokens, {sampling.describe()}")
    print(bench.table(summaries))
    print(bench.drafter_line(results))
    print(bench.cost_line(costs))
    if args.json:
        settings = {"artifact": str(args.artifact), "exit_layer": model.artifact.exit_layer,
                    "draft_policy": dataclasses.asdict(policy),
                    "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                    "sampling": dataclasses.asdict(sampling),
                    "repeat": args.repeat}
        Path(args.json).write_text(json.dumps({"settings": settings, "prompts": results,
                                               "summary": summaries, "round_ms": costs},
                                              indent=1))
    if args.plot:
        bench.plot(summaries, args.plot, f"{Path(args.artifact).name}: exit "
                   f"{model.artifact.exit_layer}, {policy.describe()}")


def _bench_parallel(args, model, rows, settings):
    from . import bench
    summary = bench.run_parallel(model, rows, settings, args.parallel, args.repeat)
    print(f"{args.artifact}: {len(rows)} prompts, {args.max_new_tokens} new tokens, "
          f"{settings.sampling.describe()}, {args.repeat} runs each (medians); per sequence "
          f"{model.engine.sequence_bytes / 2**20:.0f} MiB of KV cache")
    print(bench.parallel_table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "settings": {"artifact": str(args.artifact), "max_new_tokens": args.max_new_tokens,
                         "threads": args.threads, "repeat": args.repeat,
                         "sampling": dataclasses.asdict(settings.sampling),
                         "draft_policy": dataclasses.asdict(settings.draft)},
            "runs": list(summary.values())}, indent=1))


def _serve_args(sub, common):
    p = _artifact_command(sub, common, "serve", "OpenAI-compatible HTTP server and chat page",
                          "Serve a chat page at /, POST /v1/chat/completions, POST "
                          "/v1/completions (streaming or not), GET /v1/models, /health and "
                          "/metrics (Prometheus). One engine decodes up to --parallel requests "
                          "together, each reply exactly what it would be alone; the rest wait "
                          "in a queue, in arrival order, and a full queue answers 503 with "
                          "Retry-After.")
    p.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000")
    p.add_argument("--parallel", type=_parallel, default=None, metavar="N",
                   help="requests decoded at once, 1 to 8; each holds a KV cache of "
                   "--max-context tokens from the start (default: the most at which each "
                   "reply still decodes at least a third as fast as alone, by the "
                   "artifact's measured round costs, and whose caches fit in memory)")
    p.add_argument("--max-context", type=_positive, default=None, metavar="TOKENS",
                   help="tokens each conversation holds, prompt and reply (default: the "
                   "artifact's context; less holds less memory)")
    p.add_argument("--queue", type=_positive, default=32,
                   help="requests that may wait for a sequence (default: 32); more are "
                   "answered 503")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="BYTES",
                   help="largest request body; larger ones are refused with 413 (default: "
                   "1048576, 1 MiB)")
    p.add_argument("--client-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="time a client has to send a whole request, headers and body, from "
                   "when the server is ready for it; then its connection closes (default: 30)")
    p.add_argument("--max-connections", type=int, default=64, metavar="N",
                   help="open connections at most, one thread each; when all are open, one "
                   "waiting for its request is closed to make room, and only when all are "
                   "busy answering is a new one answered 503 (default: 64; keep it above "
                   "--queue)")
    p.add_argument("--max-connections-per-client", type=int, default=32, metavar="N",
                   help="open connections at most from one client address (default: 32)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on the API and /metrics (the "
                   "page and /health stay open); repeat it to give each client its own key: "
                   "cached prompts and the replies drafting copies from are never shared "
                   "between keys (without keys, between client addresses). Default: "
                   "$EDGESPEC_API_KEY (keys separated by spaces), which keeps them out of the "
                   "process list")
    p.add_argument("--max-tokens", type=_positive, default=None, metavar="N",
                   help="the most tokens a request may ask for; more is refused with 400 "
                   "(default: what the context leaves after the prompt)")
    p.add_argument("--allow-ignore-eos", action="store_true",
                   help="honour requests' ignore_eos, which lets one reply run to the full "
                   "context (for load tests; default: refused with 400)")
    _runtime_args(p)
    p.set_defaults(run=_serve)


def _serve(args):
    try:
        from .apps.server import capacity
        from .apps.server.server import Limits, check_api_key, serve
    except ImportError as e:
        raise EdgespecError(f"edgespec serve needs the apps package ({e})") from e
    limits = Limits(args.max_body_bytes, args.client_timeout, args.max_connections,
                    args.max_connections_per_client)
    keys = args.api_key or os.environ.get("EDGESPEC_API_KEY", "").split()
    for key in keys:
        check_api_key(key)  # before the model loads: a bad key fails at once
    model = _load(args, args.max_context)
    available = capacity.available_bytes()
    parallel = args.parallel or capacity.default_parallel(model, available)
    capacity.check_parallel(parallel, model.engine, available)

    def ready(address):
        url = f"http://{address[0]}:{address[1]}"
        auth = f"; the API needs {'a' if len(keys) > 1 else 'the'} key" if keys else ""
        print(f"serving {model.artifact.path.name}: {capacity.statement(parallel, model.engine)}"
              f"\nchat page {url}/, API {url}/v1{auth}", file=sys.stderr, flush=True)

    serve(model, args.host, args.port, args.queue, limits=limits,
          allow_ignore_eos=args.allow_ignore_eos, api_keys=keys,
          max_tokens=args.max_tokens, parallel=parallel, ready=ready)


def _desktop_args(sub, common):
    p = _artifact_command(sub, common, "desktop", "a chat window on the desktop (Tk)",
                          "A desktop chat window that runs the model in this process: the "
                          "reply streams in while the window stays responsive, Stop ends it, "
                          "and the status line gives its numbers (tokens/s, acceptance).")
    _reply_args(p)
    _sampling_args(p)
    _draft_args(p)
    _runtime_args(p)
    p.set_defaults(run=_desktop)


def _desktop(args):
    try:
        from .apps.desktop.chat_window import run
    except ImportError as e:  # tkinter is a separate package on some systems
        raise EdgespecError(f"edgespec desktop needs tkinter ({e}): install your Python's Tk "
                            "(on Debian and Ubuntu: apt-get install python3-tk)") from e
    options = _options(args)
    run(_load(args), **options)


def _runtime_args(p):
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="execution provider (default: the one the artifact was built for; "
                   "a cuda artifact where CUDA does not run is refused, cpu runs it there "
                   "slowly)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="CPU threads, >= 1 (default: one per CPU this process may use)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the sha256 check of the artifact's files (sizes are still checked)")


def _export(args):
    try:
        from .export.pipeline import export_model
    except ImportError as e:
        raise EdgespecError(f"edgespec export needs the export extra ({e.name} is missing): "
                            "pip install 'edgespec[export]'") from e
    if args.no_calibrate and args.exit_layer == "auto":
        raise EdgespecError("--exit-layer auto is chosen by calibration: give a number with "
                            "--no-calibrate")
    export_model(args.model, args.output, args.exit_layer, args.precision, args.max_context,
                 args.device, adapter=None if args.adapter == "none" else args.adapter,
                 shortlist=args.shortlist or None, calibrate=not args.no_calibrate,
                 adapter_minutes=args.adapter_minutes, save_adapter=args.save_adapter,
                 int4_scheme=args.int4_scheme, head_bits=args.head_bits,
                 calibration_minutes=args.calibration_minutes, gptq=not args.no_gptq,
                 threads=args.threads, max_memory=args.max_memory,
                 log=lambda msg: print(msg, file=sys.stderr))


def _positive(text):
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer: it must be >= 1")
    return value


def _positive_number(text):
    """An argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not a positive number: it must be > 0")
    return value


def _auto_or(kind):
    """An argparse type: the word auto, or a value of `kind`."""
    def parse(text):
        return text if text == "auto" else kind(text)
    parse.__name__ = kind.__name__
    return parse


def _generate(args):
    from .sampling import SamplingParams
    check_utf8(args.prompt, "the prompt (-p)")
    check_utf8(args.system, "the system message (--system)")
    options = _options(args)
    model = _load(args)
    stream = None if args.json else (lambda piece: print(piece, end="", flush=True))
    result = model.generate(args.prompt, raw=args.raw, system=args.system, on_text=stream,
                            **options)
    if args.json:
        print(json.dumps(result.to_dict()))
        return
    print()
    if result.finish_reason == "context_full":
        print(f"[stopped: the context of {model.engine.max_context} tokens is full]",
              file=sys.stderr)
    print(f"[{result.n_prompt} prompt tokens, {result.n_generated} generated, "
          f"{result.decode_tokens_per_s:.1f} tokens/s, {result.mode}; "
          f"{SamplingParams(**result.sampling).describe()}]", file=sys.stderr)
    if args.stats:
        print(result.stats.line(), file=sys.stderr)


def parser():
    common = _common()
    p = argparse.ArgumentParser(prog="edgespec", parents=[common], epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Self-speculative decoding on ONNX Runtime.")
    sub = p.add_subparsers(dest="command", required=True)
    _export_args(sub, _common(argparse.SUPPRESS))
    _chat_args(sub, _common(argparse.SUPPRESS))
    _generate_args(sub, _common(argparse.SUPPRESS))
    _bench_args(sub, _common(argparse.SUPPRESS))
    _serve_args(sub, _common(argparse.SUPPRESS))
    _desktop_args(sub, _common(argparse.SUPPRESS))
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
