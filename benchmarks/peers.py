"""edgespec side by side with onnxruntime-genai, in one process, prompt by prompt.

Both engines get the same token ids (the first turn of each prompt through the artifact's chat
template), the same sampling settings (--sampling: greedy, the artifact's defaults, or given;
seeded per prompt and run), the same number of new tokens with end-of-turn ignored, the same
thread count. Per prompt, every mode runs once per repeat, the modes interleaved, so drift of
the machine hits all of them alike; a run during which other processes used the CPU is redone.
decode tok/s = (n - 1) / (time of the last token - time of the first): prefill excluded.

Modes: plain and spec (edgespec's plain and default speculative decoding), genai (plain
int4) and genai-ngram (its n-gram speculative decoding, ngram 3, k 4), all with the settings
of --sampling; greedy-plain is edgespec's plain greedy decoding whatever --sampling says.
--quality instead scores genai's model on export's quality passage, beside the artifact's
own numbers.

Needs a venv with edgespec and onnxruntime-genai, and genai's int4 model of the same
weights; `make peers` makes both (.venv-peers, models/peers/genai-int4), then:

    .venv-peers/bin/python benchmarks/peers.py models/smollm2-135m-instruct \\
        --per-category 2 --repeat 3 --threads 2     # or: make peers-bench
    .venv-peers/bin/python benchmarks/peers.py models/smollm2-135m-instruct --quality
    .venv-peers/bin/python benchmarks/peers.py models/smollm2-135m-instruct \
        --sampling temperature=0.8,top_k=40,top_p=0.9,repetition_penalty=1.1 \
        --modes spec,plain,genai,greedy-plain
"""
import argparse
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
from edgespec.sampling import SAMPLING_FIELDS, SamplingParams  # noqa: E402
from benchmarks.plain_decode import pick_prompts  # noqa: E402

NGRAM = {"ngram_size": 3, "max_draft_tokens": 4}
MODES = ("plain", "spec", "genai", "genai-ngram")
GREEDY = SamplingParams()


class Edgespec:
    def __init__(self, artifact, threads):
        self.model = edgespec.load(artifact, threads=threads)

    def encode(self, text):
        return self.model.encode(text)

    def decode(self, ids, new_tokens, speculative, sampling=GREEDY):
        g = self.model.generate_ids(ids, new_tokens, ignore_eos=True,
                                    mode="speculative" if speculative else "plain",
                                    **asdict(sampling))
        return g.tokens, g.decode_s, g.stats.to_dict()


class Genai:
    """onnxruntime-genai on its own model directory; its end-of-turn id is replaced by one
    that greedy decoding never makes, so every run decodes all the tokens asked for."""

    def __init__(self, model_dir, threads, workdir):
        import onnxruntime_genai as og
        self.og = og
        config = json.loads((Path(model_dir) / "genai_config.json").read_text())
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


def genai_quality(artifact, genai_dir):
    """The quality passage scored by genai's model (one ONNX Runtime call, empty cache) and
    by the artifact (its manifest), against the same full-precision reference."""
    import onnxruntime as ort
    from edgespec.export import quality
    from edgespec.export.source import load_source
    manifest = json.loads((Path(artifact) / "manifest.json").read_text())
    source = load_source(None if manifest["source"]["model"].startswith("bundled:")
                         else manifest["source"]["model"])
    ids = quality.passage_ids(source.tokenizer)
    session = ort.InferenceSession(str(Path(genai_dir) / "model.onnx"))
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    decoder = json.loads((Path(genai_dir) / "genai_config.json").read_text())["model"]["decoder"]
    empty = np.zeros((1, decoder["num_key_value_heads"], 0, decoder["head_size"]), np.float32)
    feeds.update({t.name: empty for t in session.get_inputs() if t.name.startswith("past_")})
    logits = session.run(["logits"], feeds)[0][0]
    reference = quality.scores(quality.reference_logits(source.torch_model, ids), ids)
    theirs = quality.compare(reference, quality.scores(logits, ids), ids)
    print("| model | top-1 agreement | perplexity (full precision: "
          f"{theirs['reference_perplexity']:.2f}) |\n|---|---|---|")
    for name, q in (("edgespec " + Path(artifact).name, manifest["quality"]),
                    ("onnxruntime-genai int4", theirs)):
        print(f"| {name} | {q['top1_agreement']:.4f} | {q['perplexity']:.3f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", nargs="?", default="models/smollm2-135m-instruct")
    p.add_argument("--genai", default="models/peers/genai-int4",
                   help="onnxruntime-genai model directory (default: models/peers/genai-int4)")
    p.add_argument("--build-genai", metavar="MODEL", nargs="?", const="",
                   help="build --genai from MODEL (default: the bundled SmolLM2) and stop")
    p.add_argument("--quality", action="store_true",
                   help="compare quality on export's passage instead of speed")
    p.add_argument("--prompts", default="../shared/data/spec_bench_dev.jsonl")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"of {', '.join(MODES)}, greedy-plain (default: the first four)")
    p.add_argument("--sampling", default="greedy",
                   help="greedy (default), default (the artifact's defaults), or settings "
                   "such as temperature=0.8,top_k=40,top_p=0.9,repetition_penalty=1.1")
    p.add_argument("--json", help="also write every measurement here")
    args = p.parse_args()
    if args.build_genai is not None:
        return build_genai(args.build_genai or None, Path(args.genai))
    if args.quality:
        return genai_quality(args.artifact, args.genai)
    modes = args.modes.split(",")
    ours = Edgespec(args.artifact, args.threads)
    genai = Genai(args.genai, args.threads, Path(args.genai).with_name(Path(args.genai).name + "-run"))
    engines = {"plain": (ours, False), "spec": (ours, True), "genai": (genai, False),
               "genai-ngram": (genai, True), "greedy-plain": (ours, False)}
    sampling = sampling_settings(args.sampling, ours.model)
    print(f"sampling: {sampling.describe()}", flush=True)
    prompts = pick_prompts(args.prompts, args.per_category)
    for mode in modes:  # warm-up: first runs allocate and page in
        engines[mode][0].decode(ours.encode("Hello"), 16, engines[mode][1])
    rows = []
    for n, prompt in enumerate(prompts, 1):
        ids = ours.encode(prompt["turns"][0])
        runs = {mode: [] for mode in modes}
        for run in range(args.repeat):
            seeded = replace(sampling, seed=1000 * n + run)
            for mode in modes:
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
    report(rows, modes)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


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
    """Median tok/s per mode, ratios to genai plain, and outputs identical to the plain ones."""
    print(f"\n{len(rows)} prompts; median decode tok/s (ratio to genai plain, computed per "
          "prompt, then the median):")
    print("| mode | tok/s | vs genai plain | vs edgespec greedy plain | identical to its plain |"
          "\n|---|---|---|---|---|")

    def ratio(mode, base):
        return (f"{statistics.median(r[mode] / r[base] for r in rows):.2f}x"
                if base in modes else "-")
    for mode in modes:
        speed = statistics.median(r[mode] for r in rows)
        plain = {"spec": "plain", "genai-ngram": "genai"}.get(mode)
        same = (f"{sum(r[mode + '_tokens'] == r[plain + '_tokens'] for r in rows)}/{len(rows)}"
                if plain in modes else "-")
        print(f"| {mode} | {speed:.1f} | {ratio(mode, 'genai')} | {ratio(mode, 'greedy-plain')} "
              f"| {same} |")


if __name__ == "__main__":
    main()
