"""edgespec side by side with onnxruntime-genai and llama.cpp, in one process, prompt by prompt.

The engines get the same token ids (the first turn of each prompt through the artifact's chat
template), the same sampling settings (--sampling: greedy, the artifact's defaults, or given;
seeded per prompt and run), the same number of new tokens with end-of-turn ignored, the same
thread count. Per prompt, every mode runs once per repeat, the modes interleaved (their order
rotating from one repeat to the next), so drift of the machine hits all of them alike; a run
during which other processes used the CPU is redone.
decode tok/s = (n - 1) / (time of the last token - time of the first): prefill excluded.

Modes: plain and spec (edgespec's plain and default speculative decoding), genai (plain
int4) and genai-ngram (its n-gram speculative decoding, ngram 3, k 4), llama (llama.cpp
through llama-cpp-python on the GGUF the artifact came from, its own kernels and sampler;
repetition penalty over the whole context, as edgespec's), all with the settings of
--sampling (repeatable: one pass over the prompts each); greedy-plain is edgespec's plain
greedy decoding whatever --sampling says. --fidelity adds, in the same run, export's
fidelity gate (export/fidelity.py) for each engine: greedy replies to short questions
against the float32 source model. --quality instead scores genai's model on export's
quality passage, beside the artifact's own numbers.

Needs a venv with edgespec, onnxruntime-genai and llama-cpp-python, and genai's int4 model
of the same weights; `make peers` makes them (.venv-peers, models/peers/genai-int4), then:

    .venv-peers/bin/python benchmarks/peers.py models/smollm2-135m-instruct \\
        --per-category 2 --repeat 3 --threads 2     # or: make peers-bench
    .venv-peers/bin/python benchmarks/peers.py models/smollm2-135m-instruct --quality
    .venv-peers/bin/python benchmarks/peers.py models/smollm2-135m-instruct \\
        --sampling greedy --sampling default --sampling temperature=0.7 --fidelity \\
        --modes spec,plain,genai,genai-ngram,llama
"""
import argparse
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import edgespec  # noqa: E402
from edgespec.bench import prompt_ids  # noqa: E402
from edgespec.export import fidelity  # noqa: E402
from edgespec.sampling import SAMPLING_FIELDS, SamplingParams  # noqa: E402
from benchmarks.plain_decode import pick_prompts  # noqa: E402

NGRAM = {"ngram_size": 3, "max_draft_tokens": 4}
MODES = ("plain", "spec", "genai", "genai-ngram", "llama")
GREEDY = SamplingParams()


class Edgespec:
    def __init__(self, artifact, threads, until_eos=False):
        self.model = edgespec.load(artifact, threads=threads)
        self.until_eos = until_eos

    def encode(self, text):
        return self.model.encode(text)

    def decode(self, ids, new_tokens, speculative, sampling=GREEDY):
        self.model.forget()  # each run as a first request: no repeat copies its earlier reply
        g = self.model.generate_ids(ids, new_tokens, ignore_eos=not self.until_eos,
                                    mode="speculative" if speculative else "plain",
                                    **asdict(sampling))
        return g.tokens, g.decode_s, g.stats.to_dict()

    def answers(self, stop_ids):
        return fidelity.ArtifactAnswers(self.model)


class PeerAnswers:
    """A peer judged by export's fidelity gate: its greedy reply up to the first end of turn
    (the same tokens as stopping there) and its teacher-forced top-1."""

    def __init__(self, engine, stop_ids):
        self.engine, self.stop_ids = engine, stop_ids

    def reply(self, ids):
        tokens, decode_s, _ = self.engine.decode(ids, fidelity.REPLY_TOKENS, False)
        ends = [i for i, t in enumerate(tokens) if t in self.stop_ids]
        return tokens[:ends[0] if ends else None], (len(tokens) - 1) / decode_s

    def top1(self, ids):
        return self.engine.top1(ids)


class Genai:
    """onnxruntime-genai on its own model directory; unless until_eos, its end-of-turn id is
    replaced by one that greedy decoding never makes, so every run decodes all the tokens
    asked for."""

    def __init__(self, model_dir, threads, workdir, until_eos=False):
        import onnxruntime_genai as og
        self.og, self.model_dir = og, Path(model_dir)
        config = json.loads((Path(model_dir) / "genai_config.json").read_text())
        decoder = config["model"]["decoder"]
        self.kv_heads, self.head_size = decoder["num_key_value_heads"], decoder["head_size"]
        if not until_eos:
            config["model"]["eos_token_id"] = config["model"]["vocab_size"] - 1
        options = config["model"]["decoder"].setdefault("session_options", {})
        options.update(intra_op_num_threads=threads, inter_op_num_threads=1)
        workdir.mkdir(parents=True, exist_ok=True)
        for item in Path(model_dir).iterdir():
            link = workdir / item.name
            if item.name != "genai_config.json" and not link.exists():
                link.symlink_to(item.resolve())
        (workdir / "genai_config.json").write_text(json.dumps(config))
        self.model = og.Model(str(workdir))
        self.vocab_size = config["model"]["vocab_size"]

    def decode(self, ids, new_tokens, speculative, sampling=GREEDY):
        params = self.og.GeneratorParams(self.model)
        search = {"do_sample": False}
        if not sampling.greedy:  # genai's top-k is on unless set to the vocabulary
            search = {"do_sample": True, "temperature": sampling.temperature,
                      "top_k": sampling.top_k or self.vocab_size, "top_p": sampling.top_p,
                      "repetition_penalty": sampling.repetition_penalty,
                      "random_seed": sampling.seed % 2**31}
        params.set_search_options(max_length=len(ids) + new_tokens, **search)
        if speculative:
            params.set_speculative_options(**NGRAM)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.asarray([ids], dtype=np.int32))
        first = None
        while not generator.is_done():
            generator.generate_next_token()
            first = first or time.perf_counter()
        decode_s = time.perf_counter() - first
        return [int(t) for t in generator.get_sequence(0)][len(ids):], decode_s, {}

    def top1(self, ids):
        return self.logits(ids).argmax(-1).tolist()

    def logits(self, ids):
        """Next-token logits after every prefix of ids: genai's graph run directly, one call
        from an empty cache."""
        import onnxruntime as ort
        if not hasattr(self, "session"):
            shared = ort.SessionOptions()
            shared.use_per_session_threads = False  # where edgespec made the process's pool
            path = str(self.model_dir / "model.onnx")
            try:
                self.session = ort.InferenceSession(path, shared)
            except RuntimeError:  # no pool yet: a pool of its own
                self.session = ort.InferenceSession(path)
        feeds = {"input_ids": np.array([ids], np.int64),
                 "attention_mask": np.ones((1, len(ids)), np.int64)}
        empty = np.zeros((1, self.kv_heads, 0, self.head_size), np.float32)
        feeds.update({t.name: empty for t in self.session.get_inputs()
                      if t.name.startswith("past_")})
        return self.session.run(["logits"], feeds)[0][0]

    def answers(self, stop_ids):
        return PeerAnswers(self, stop_ids)


class LlamaCpp:
    """llama.cpp through llama-cpp-python on a GGUF. Its repetition penalty covers the whole
    context (its default is the last 64 tokens) as edgespec's covers the whole history; its
    generator never stops at end of turn by itself: it stops at stop_ids when given."""

    def __init__(self, gguf, threads, stop_ids=(), n_ctx=2048):
        from llama_cpp import Llama
        self.stop_ids = set(stop_ids)
        self.options = dict(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads,
                            n_threads_batch=threads, last_n_tokens_size=n_ctx, verbose=False)
        self.llm = Llama(**self.options)

    @functools.cached_property
    def scorer(self):
        """A second instance that keeps the logits of every position (the fast one does not)."""
        from llama_cpp import Llama
        return Llama(**self.options, logits_all=True)

    def decode(self, ids, new_tokens, speculative, sampling=GREEDY):
        self.llm.reset()
        self.llm.set_seed((sampling.seed or 0) % 2**31)
        search = dict(temp=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                      min_p=sampling.min_p, repeat_penalty=sampling.repetition_penalty,
                      presence_penalty=sampling.presence_penalty,
                      frequency_penalty=sampling.frequency_penalty)
        tokens, first = [], None
        for token in self.llm.generate(ids, **search):
            first = first or time.perf_counter()
            if token in self.stop_ids:
                break
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
        return tokens, time.perf_counter() - first, {}

    def top1(self, ids):
        self.scorer.reset()
        self.scorer.eval(ids)
        return np.asarray(self.scorer.scores[:len(ids)]).argmax(-1).tolist()

    def answers(self, stop_ids):
        return PeerAnswers(self, stop_ids)


def cpu_used_by_others(run):
    """run(), and the share of the machine's CPU that other processes used meanwhile."""
    def snapshot():
        with open("/proc/stat") as f:
            busy = sum(int(v) for i, v in enumerate(f.readline().split()[1:]) if i in (0, 1, 2, 5, 6))
        own = os.times()
        return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system
    before = snapshot()
    result = run()
    after = snapshot()
    others = (after[1] - before[1]) - (after[2] - before[2])
    return result, max(0.0, others / ((after[0] - before[0]) * os.cpu_count()))


def timed(engine, ids, new_tokens, speculative, sampling, max_foreign=0.05, tries=5):
    for _ in range(tries):
        time.sleep(0.2)  # the other engine's thread pool stops spinning before this run
        (tokens, decode_s, stats), foreign = cpu_used_by_others(
            lambda: engine.decode(ids, new_tokens, speculative, sampling))
        if foreign <= max_foreign:
            break
        time.sleep(2)  # someone else is on the CPU: let them pass, then redo the run
    return tokens, (len(tokens) - 1) / decode_s, stats


def build_genai(model, out: Path):
    """genai's int4 CPU model of MODEL (None: the bundled SmolLM2), made by its own builder
    from a float32 Hugging Face checkpoint (a GGUF is dequantized by transformers first)."""
    import subprocess
    from transformers import AutoModelForCausalLM
    from edgespec.export.source import load_source
    source = load_source(model)
    config = source.torch_model.config
    if hasattr(config, "quantization_config"):  # set by the GGUF reader; not a real one
        del config.quantization_config
    checkpoint = out.parent / (out.name + "-hf")
    fresh = AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(source.torch_model.state_dict())
    fresh.save_pretrained(checkpoint)
    source.tokenizer.save_pretrained(checkpoint)
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                    str(checkpoint), "-o", str(out), "-p", "int4", "-e", "cpu",
                    "-c", str(out.parent / "genai-cache")], check=True)


def genai_quality(artifact, genai):
    """The quality passage scored by genai's model (one ONNX Runtime call, empty cache) and
    by the artifact (its manifest), against the same full-precision reference."""
    from edgespec.export import quality
    manifest = json.loads((Path(artifact) / "manifest.json").read_text())
    source = load_source(manifest)
    ids = quality.passage_ids(source.tokenizer)
    reference = quality.reference_scores(reference_model(source), ids)
    theirs = quality.compare(reference, quality.scores(genai.logits(ids), ids), ids)
    print("| model | top-1 agreement | perplexity (full precision: "
          f"{theirs['reference_perplexity']:.2f}) |\n|---|---|---|")
    for name, q in (("edgespec " + Path(artifact).name, manifest["quality"]),
                    ("onnxruntime-genai int4", theirs)):
        print(f"| {name} | {q['top1_agreement']:.4f} | {q['perplexity']:.3f} |")


def load_source(manifest):
    """The model an artifact was exported from (export/source.py's SourceModel)."""
    from edgespec.export.source import load_source, model_argument
    return load_source(model_argument(manifest["source"]["model"]))


def reference_model(source):
    """The source in float32 for export's gates, one layer in memory at a time."""
    from edgespec.export.reference import Reference
    return Reference(source.arch, source.weights)


def source_gguf(manifest) -> Path:
    """The GGUF an artifact was exported from (llama.cpp runs it as it is)."""
    from edgespec.export.source import default_model_path, model_argument
    given = model_argument(manifest["source"]["model"])
    gguf = Path(given) if given else default_model_path()
    if gguf.suffix != ".gguf":
        raise SystemExit(f"llama.cpp needs a GGUF source; {gguf} is not one")
    return gguf


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", nargs="?", default="models/smollm2-135m-instruct")
    p.add_argument("--genai", default="models/peers/genai-int4",
                   help="onnxruntime-genai model directory (default: models/peers/genai-int4)")
    p.add_argument("--build-genai", metavar="MODEL", nargs="?", const="",
                   help="build --genai from MODEL (default: the bundled SmolLM2) and stop")
    p.add_argument("--quality", action="store_true",
                   help="compare quality on export's passage instead of speed")
    p.add_argument("--prompts", default=str(Path(__file__).parent / "data" / "spec_bench_dev.jsonl"),
                   help="JSON lines with a category and the first of `turns` as the user's "
                   "message or `messages` as the conversation (benchmarks/data/workloads.jsonl)")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--until-eos", action="store_true",
                   help="stop each reply at its end of turn (default: decode all --new-tokens)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES[:4]),
                   help=f"of {', '.join(MODES)}, greedy-plain (default: the first four)")
    p.add_argument("--sampling", action="append",
                   help="greedy (default), default (the artifact's defaults), or settings "
                   "such as temperature=0.8,top_k=40,top_p=0.9,repetition_penalty=1.1; "
                   "repeat it for several passes in one run")
    p.add_argument("--fidelity", action="store_true",
                   help="also judge each engine by export's fidelity gate")
    p.add_argument("--json", help="also write every measurement here")
    args = p.parse_args()
    work = Path(args.genai).with_name(Path(args.genai).name + "-run")
    if args.build_genai is not None:
        return build_genai(args.build_genai or None, Path(args.genai))
    if args.quality:
        return genai_quality(args.artifact, Genai(args.genai, args.threads, work))
    modes = args.modes.split(",")
    ours = Edgespec(args.artifact, args.threads, args.until_eos)
    manifest = ours.model.artifact.manifest
    genai = (Genai(args.genai, args.threads, work, args.until_eos)
             if {"genai", "genai-ngram"} & set(modes) else None)
    stops = ours.model.stop_ids if args.until_eos else ()
    llama = LlamaCpp(source_gguf(manifest), args.threads, stops) if "llama" in modes else None
    engines = {"plain": (ours, False), "spec": (ours, True), "genai": (genai, False),
               "genai-ngram": (genai, True), "llama": (llama, False),
               "greedy-plain": (ours, False)}
    prompts = pick_prompts(args.prompts, args.per_category)
    for mode in modes:  # warm-up: first runs allocate and page in
        engines[mode][0].decode(ours.encode("Hello"), 16, engines[mode][1])
    results = {}
    for text in args.sampling or ["greedy"]:
        sampling = sampling_settings(text, ours.model)
        print(f"\nsampling: {sampling.describe()}", flush=True)
        rows = speeds(engines, modes, prompts, ours, sampling, args)
        report(rows, modes)
        results[sampling.describe()] = rows
    if args.fidelity:
        judged = {"edgespec": ours, "genai": genai, "llama.cpp": llama}
        results["fidelity"] = judge_fidelity(
            ours.model, manifest, {name: e for name, e in judged.items() if e is not None})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def speeds(engines, modes, prompts, ours, sampling, args) -> list:
    """Per prompt, every mode's median decode tok/s over the repeats, its tokens and stats."""
    rows = []
    for n, prompt in enumerate(prompts, 1):
        ids = prompt_ids(ours.model, prompt)
        runs = {mode: [] for mode in modes}
        for run in range(args.repeat):
            seeded = replace(sampling, seed=1000 * n + run)
            first = run % len(modes)  # the order rotates: no mode always runs after another
            for mode in modes[first:] + modes[:first]:
                engine, speculative = engines[mode]
                runs[mode].append(timed(engine, ids, args.new_tokens, speculative,
                                        GREEDY if mode == "greedy-plain" else seeded))
        row = {"id": prompt["question_id"], "category": prompt["category"]}
        for mode in modes:
            row[mode] = statistics.median(speed for _, speed, _ in runs[mode])
            row[mode + "_tokens"] = runs[mode][0][0]
            row[mode + "_stats"] = runs[mode][0][2]
        rows.append(row)
        print(f"[{n}/{len(prompts)}] {row['category']:<15}" + "".join(
            f" {mode} {row[mode]:6.1f}" for mode in modes), flush=True)
    return rows


def judge_fidelity(model, manifest, engines, questions=fidelity.QUESTIONS) -> dict:
    """Export's fidelity gate for each engine (anything with answers(stop_ids)), against the
    float32 source's greedy replies; `model` (an edgespec Model) tokenizes the questions and
    drafts the reference's replies."""
    rows = fidelity.questions(questions)
    prompts = [model.encode(row["question"]) for row in rows]
    stop_ids = set(model.stop_ids)
    replies, _ = fidelity.reference_replies(reference_model(load_source(manifest)), prompts,
                                            stop_ids, fidelity.ArtifactAnswers(model).continuation)
    references = [replies[i] for i in range(len(rows))]
    decode = model.codec.decode
    n = len(rows)
    right = sum(fidelity.is_right(decode(r), row["answer"]) for r, row in zip(references, rows))
    print(f"\nfidelity: {n} questions, {fidelity.REPLY_TOKENS} greedy tokens; the float32 "
          f"reference is right on {right}/{n}")
    print("| engine | first 16 tokens equal | right | teacher-forced top-1 | greedy tok/s |\n"
          "|---|---|---|---|---|")
    results = {}
    for name, engine in engines.items():
        r = fidelity.judge(engine.answers(stop_ids), rows, prompts, references, decode)
        print(f"| {name} | {r['first16_equal']}/{n} | {r['right']}/{n} | "
              f"{r['top1_agreement']} | {r['decode_tokens_per_s']} |", flush=True)
        results[name] = r
    return {"reference_right": right, **results}


def sampling_settings(text, model) -> SamplingParams:
    """--sampling: greedy, default (the model's), or name=value pairs over greedy."""
    if text == "greedy":
        return GREEDY
    if text == "default":
        return model.sampling
    given = dict(pair.split("=") for pair in text.split(","))
    kinds = {name: type(getattr(GREEDY, name)) for name in SAMPLING_FIELDS}
    return GREEDY.with_options(**{name: kinds[name](value) for name, value in given.items()})


def report(rows, modes):
    """Median tok/s per mode, its ratios to the baselines in the run (each the median of the
    per-prompt ratios), and how many outputs equal their engine's plain output."""
    bases = [m for m in ("genai", "plain", "greedy-plain", "genai-ngram") if m in modes]
    names = {"genai": "genai plain", "plain": "edgespec plain",
             "greedy-plain": "edgespec greedy plain", "genai-ngram": "genai n-gram"}
    print(f"\n{len(rows)} prompts; median decode tok/s, ratios to each baseline (median of the "
          "per-prompt ratios):")
    print("| mode | tok/s | " + " | ".join(f"vs {names[b]}" for b in bases) +
          " | identical to its plain |\n|---|---|" + "---|" * (len(bases) + 1))
    for mode in modes:
        speed = statistics.median(r[mode] for r in rows)
        ratios = [f"{statistics.median(r[mode] / r[b] for r in rows):.2f}x" for b in bases]
        plain = {"spec": "plain", "genai-ngram": "genai"}.get(mode)
        same = (f"{sum(r[mode + '_tokens'] == r[plain + '_tokens'] for r in rows)}/{len(rows)}"
                if plain in modes else "-")
        print(f"| {mode} | {speed:.1f} | " + " | ".join(ratios) + f" | {same} |")


if __name__ == "__main__":
    main()
