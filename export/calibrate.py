"""Calibration: the exit layer, exit adapter, shortlist and draft policy, chosen by measured speed.

Everything is measured on the exported artifact itself, on the project's own calibration
instructions (data/calibration.jsonl; never benchmark prompts). Every eighth instruction is
held out: those measure speed (plain vs speculative, same artifact, same process) and
agreement; the rest are the adapter's training data (the model's own greedy replies).
"""
import json
import sys
from pathlib import Path

import numpy as np

from . import adapter as exit_adapter

CALIBRATION = Path(__file__).parent / "data" / "calibration.jsonl"
HELD_OUT_EVERY = 8
TRAIN_PROMPTS = None   # all but the held-out ones
MEASURE_PROMPTS = 12   # held-out instructions timed per policy
MEASURE_TOKENS = 96
TRAIN_TOKENS = 128
EXIT_FRACTIONS = (0.25, 0.5, 0.75)  # exit layer candidates, as fractions of the depth
K_CANDIDATES = (1, 2, 3, 4)
LOOKUP_K = 6
THRESHOLDS = (0.0, 0.3, 0.6)
SHORTLIST_COVERAGE = (0.95, 0.99)  # of the calibration replies' tokens
DEFAULT_K = 4  # early-exit drafts per round while nothing is measured


def instructions():
    """(training instructions, held-out instructions)."""
    rows = [json.loads(line) for line in CALIBRATION.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in rows]
    held = [p for i, p in enumerate(prompts) if i % HELD_OUT_EVERY == 0]
    return [p for i, p in enumerate(prompts) if i % HELD_OUT_EVERY][:TRAIN_PROMPTS], held


def candidate_exit_layers(num_layers: int) -> list:
    return sorted({max(1, min(num_layers - 1, round(num_layers * f))) for f in EXIT_FRACTIONS})


def reply_token_counts(sequences, vocab_size) -> np.ndarray:
    """How often the calibration replies used each token id."""
    replies = np.concatenate([s.tokens[s.start + 1:] for s in sequences])
    return np.bincount(replies, minlength=vocab_size)


def shortlist(counts, size) -> np.ndarray:
    """The `size` most used token ids (ties by id), sorted by id."""
    return np.sort(np.argsort(-counts, kind="stable")[:size])


def shortlist_sizes(counts) -> list:
    """Sizes that cover SHORTLIST_COVERAGE of the replies' tokens, rounded up to 256."""
    covered = np.cumsum(np.sort(counts)[::-1]) / counts.sum()
    sizes = {-(-int(np.searchsorted(covered, c) + 1) // 256) * 256 for c in SHORTLIST_COVERAGE}
    return sorted(s for s in sizes if s < len(counts))


def fitting(artifact_dir, prompts, new_tokens) -> list:
    """The prompts that leave room for `new_tokens` in the artifact's context."""
    from edgespec.artifact import open_artifact
    from edgespec.tokenizer import TextCodec

    art = open_artifact(artifact_dir, verify=False)
    codec = TextCodec(art.path, (art.path / art.manifest["chat_template"]).read_text())
    return [p for p in prompts if len(codec.encode_chat([{"role": "user", "content": p}]))
            + new_tokens < art.max_context]


def with_exit_states(artifact_dir, sequences) -> list:
    """The same sequences with the exit states of another artifact (another exit layer)."""
    from edgespec.artifact import open_artifact
    from edgespec.engine import Engine, _chunks

    engine = Engine(open_artifact(artifact_dir, verify=False), threads=2)
    moved = []
    for s in sequences:
        engine.reset()
        for chunk in _chunks(s.tokens):
            engine.lower(chunk)
        states = engine.exit_states.numpy()[0, :len(s.tokens)].astype(np.float32)
        moved.append(exit_adapter.Sequence(states, s.start, s.top_ids, s.top_probs, s.tokens))
    return moved


def measure(artifact_dir, policies: list, prompts: list, log=print) -> list:
    """For each policy (keyword overrides of the draft policy): the median over prompts of
    speculative / plain tokens per second, tokens per round, and whether output matched."""
    import edgespec

    model = edgespec.load(artifact_dir, threads=2, verify=False)
    ratios = [[] for _ in policies]
    rounds = [[0, 0] for _ in policies]
    identical = [True] * len(policies)
    for prompt in prompts:
        ids = model.encode(prompt)
        plain = model.generate_ids(ids, MEASURE_TOKENS, mode="plain")
        for i, policy in enumerate(policies):
            spec = model.generate_ids(ids, MEASURE_TOKENS, **policy)
            ratios[i].append(spec.decode_tokens_per_s / plain.decode_tokens_per_s)
            rounds[i][0] += spec.stats["rounds"]
            rounds[i][1] += spec.stats["rounds"] + spec.stats["accepted"]
            identical[i] &= spec.tokens == plain.tokens
    results = [{"policy": policy, "speedup": round(float(np.median(r)), 3),
                "tokens_per_round": round(n_tokens / max(1, n_rounds), 2),
                "identical": same}
               for policy, r, (n_rounds, n_tokens), same in zip(policies, ratios, rounds, identical)]
    for r in results:
        log(f"  {_describe(r['policy'])}: {r['speedup']:.2f}x plain, "
            f"{r['tokens_per_round']:.2f} tokens/round")
    return results


def _describe(policy):
    return ", ".join(f"{name} {value}" for name, value in policy.items())


def best(results):
    return max(results, key=lambda r: r["speedup"])


def exit_policies(lookup_k=0):
    """Early-exit drafting at each k, fixed (the raw speed of the drafter)."""
    return [{"draft_k": k, "lookup_k": lookup_k, "adaptive": False} for k in K_CANDIDATES]


def final_policies(k):
    """The shipped policy is adaptive: measure it with and without early exit and lookup,
    and the confidence threshold."""
    return ([{"draft_k": k, "draft_threshold": t, "lookup_k": LOOKUP_K, "adaptive": True}
             for t in THRESHOLDS] +
            [{"draft_k": 0, "lookup_k": LOOKUP_K, "adaptive": True},
             {"draft_k": k, "lookup_k": 0, "adaptive": True}])




# -- adapter files: a trained adapter kept for reuse (fp16, small) --------------------------

READY = Path(__file__).resolve().parent.parent / "models" / "adapters"


def save_adapter(path, weights: dict, exit_layer: int, counts, meta: dict):
    """An adapter file: fp16 weights, the exit layer, the calibration replies' token counts
    (for the shortlist), and meta (source sha256, the command that made it, agreement)."""
    arrays = {f"weight/{name}": w.astype(np.float16) for name, w in weights.items()}
    np.savez_compressed(path, exit_layer=exit_layer, counts=counts.astype(np.int32),
                        meta=json.dumps(meta), **arrays)


def load_adapter(path):
    """(weights as float32, exit layer, token counts, meta) of an adapter file."""
    with np.load(path) as z:
        weights = {k[len("weight/"):]: z[k].astype(np.float32) for k in z.files
                   if k.startswith("weight/")}
        return weights, int(z["exit_layer"]), z["counts"], json.loads(str(z["meta"]))


def ready_adapter(source):
    """The shipped adapter file for this exact source model (by its sha256), if any."""
    for path in sorted(READY.glob("*.npz")):
        with np.load(path) as z:
            if json.loads(str(z["meta"])).get("source_sha256") == source.sha256:
                return path
    return None


def cache_dir(source) -> Path:
    """Where calibration keeps generations and training checkpoints between runs."""
    import os
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "edgespec" / source.sha256[:16]


def calibrate_draft(artifact, exit_layer, auto, adapter, shortlist_size, calibrate, minutes,
                    save=None, log=print):
    """Write the artifact with its draft graph, choosing what `auto`/`calibrate` leave open.

    Steps: the calibration replies (for training and for the shortlist's token counts) ->
    per candidate exit layer: an adapter (shipped, given or trained) and the measured speed
    of early-exit drafting -> at the best layer: the shortlist size -> the shipped policy."""
    source, arch = artifact.source, artifact.source.arch
    train_prompts, held = instructions()
    prompts = held[:MEASURE_PROMPTS]
    cache = cache_dir(source)
    (cache / "adapters").mkdir(parents=True, exist_ok=True)
    weights = counts = None
    ready = ready_adapter(source) if adapter == "auto" else \
        None if adapter in (None, "train") else Path(adapter)
    candidates = candidate_exit_layers(arch.num_layers) if auto else [exit_layer]
    if ready:
        weights, layer, counts, meta = load_adapter(ready)
        log(f"adapter: {ready} (exit layer {layer}; made by: {meta.get('command', '?')})")
        candidates = [layer]
    report = {"exit_layers": {}, "adapters": {}}
    fixed = {"k": DEFAULT_K, "threshold": 0.0, "lookup_k": 0, "adaptive": False}
    artifact.write(candidates[0], fixed)
    train_prompts = fitting(artifact.out, train_prompts, TRAIN_TOKENS)
    prompts = fitting(artifact.out, prompts, MEASURE_TOKENS)
    if counts is None or (adapter is not None and weights is None):
        sequences = exit_adapter.collect(artifact.out, train_prompts, TRAIN_TOKENS,
                                         cache_dir=cache / "replies", log=log)
        counts = reply_token_counts(sequences, arch.vocab_size)
    sizes = shortlist_sizes(counts)
    vocab = (None if shortlist_size is None else
             shortlist(counts, sizes[-1] if shortlist_size == "auto" else int(shortlist_size)))
    data, speeds = {}, {}
    screen = minutes / 4 if len(candidates) > 1 else minutes  # then the chosen one trains on

    def adapter_for(layer, budget):
        if adapter is None or weights is not None:
            return weights
        if layer not in data:
            data[layer] = sequences if layer == candidates[0] else \
                with_exit_states(artifact.out, sequences)
        trained, report["adapters"][layer] = exit_adapter.train(  # resumes: `budget` is the total
            data[layer], arch, exit_adapter.layer_weights(source.weights, layer),
            *exit_adapter.head_weights(source.weights, arch), minutes=budget,
            cache_dir=cache / "adapters", log=log)
        return trained

    for layer in candidates:
        artifact.write(layer, fixed)
        artifact.write(layer, fixed, adapter_for(layer, screen), vocab, with_draft=True)
        if calibrate:
            log(f"exit layer {layer}: early-exit drafting, fixed k, on {len(prompts)} held-out "
                "calibration prompts")
            speeds[layer] = measure(artifact.out, exit_policies(), prompts, log)
            report["exit_layers"][layer] = speeds[layer]
    layer = max(speeds, key=lambda e: best(speeds[e])["speedup"]) if speeds else candidates[0]
    artifact.write(layer, fixed)
    w = adapter_for(layer, screen if len(candidates) == 1 else minutes * 3 / 4)
    if calibrate and len(candidates) > 1 and w is not weights:
        log(f"exit layer {layer}, adapter trained on:")
        artifact.write(layer, fixed, w, vocab, with_draft=True)
        speeds[layer] = report["exit_layers"][layer] = measure(artifact.out, exit_policies(),
                                                                prompts, log)
    if adapter is not None and weights is None:
        artifact.extra["adapter"] = {"trained_minutes": minutes * 3 / 4 if len(candidates) > 1
                                     else minutes, **report["adapters"][layer]}
    if save and w is not None:
        command = "edgespec export " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["export"] \
            else "export_model(...)"
        save_adapter(save, w, layer, counts, {"source_sha256": source.sha256, "command": command,
                                             **artifact.extra.get("adapter", {})})
        log(f"adapter kept in {save}")
    if not calibrate:
        artifact.write(layer, fixed, w, vocab, with_draft=True)
        return
    k = best(speeds[layer])["policy"]["draft_k"]
    if shortlist_size == "auto":
        by_size = {}
        for size in sizes + [None]:
            vocab = None if size is None else shortlist(counts, size)
            artifact.write(layer, fixed, w, vocab, with_draft=True)
            log(f"shortlist {size or 'off (full vocabulary)'}:")
            by_size[size] = measure(artifact.out, [exit_policies()[k - 1]], prompts, log)[0]
        report["shortlist"] = {str(s): r for s, r in by_size.items()}
        size = max(by_size, key=lambda s: by_size[s]["speedup"])
        vocab = None if size is None else shortlist(counts, size)
    artifact.write(layer, fixed, w, vocab, with_draft=True)
    log(f"exit layer {layer}, k {k}: the adaptive policy")
    report["policies"] = measure(artifact.out, final_policies(k), prompts, log)
    chosen = best(report["policies"])["policy"]
    policy = {"k": chosen["draft_k"], "threshold": chosen.get("draft_threshold", 0.0),
              "lookup_k": chosen["lookup_k"], "adaptive": chosen["adaptive"]}
    log(f"chosen: exit layer {layer}, shortlist {len(vocab) if vocab is not None else 'off'}, "
        f"{_describe(policy)} ({best(report['policies'])['speedup']:.2f}x plain on the "
        "calibration prompts)")
    artifact.write(layer, {**policy, "calibration": report}, w, vocab, with_draft=True)
