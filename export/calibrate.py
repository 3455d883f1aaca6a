"""Calibration: the exit layer, exit adapter, shortlist and draft policy, chosen by measured speed.

Everything is measured on the exported artifact itself, on the project's own calibration
instructions (data/calibration.jsonl; never benchmark prompts). Every eighth instruction is
held out: those measure speed (plain vs speculative, same artifact, same process) and
agreement; the rest are the adapter's training data (the model's own greedy replies).
"""
import json
import sys
import time
from pathlib import Path

import numpy as np

from edgespec.settings import DraftPolicy

from . import adapter as exit_adapter
from . import budget
from .progress import progress

CALIBRATION = Path(__file__).parent / "data" / "calibration.jsonl"
HELD_OUT_EVERY = 8
TRAIN_PROMPTS = None   # all but the held-out ones
MEASURE_PROMPTS = 12   # held-out instructions timed per policy
MEASURE_TOKENS = 96
TRAIN_TOKENS = 128
EXIT_FRACTIONS = (0.25, 0.5, 0.75)  # exit layer candidates, as fractions of the depth
K_CANDIDATES = (1, 2, 3, 4)
LOOKUP_K = 32  # the most; each round's k comes from the plan (edgespec/lookup.py)
THRESHOLDS = (0.0, 0.3, 0.6)
SHORTLIST_COVERAGE = (0.95, 0.99)  # of the calibration replies' tokens
MIN_COUNT_REPLIES = 48  # replies collected only to count tokens, for a given shortlist size
COSTS_SECONDS = 120  # about the most export spends measuring round costs
SHORT_CONTEXT = 512  # positions of the engines that measure round costs and plain speed
PROBE_TOKENS = 32  # plain decoding's speed here, measured first, sizes the plan
DEFAULT_K = 4  # early-exit drafts per round while nothing is measured
FIXED = {"k": DEFAULT_K, "threshold": 0.0, "lookup_k": 0, "adaptive": False}  # while measuring
# shipped when nothing is measured: the scheduler pauses a drafter that does not pay
ADAPTIVE = {"k": DEFAULT_K, "threshold": 0.0, "lookup_k": LOOKUP_K, "adaptive": True}


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
    """The prompts that leave room for `new_tokens` in the context calibration runs at."""
    from edgespec.artifact import open_artifact
    from edgespec.tokenizer import TextCodec

    codec, context = TextCodec.for_artifact(open_artifact(artifact_dir, verify=False)), \
        short_context(artifact_dir)
    return [p for p in prompts if len(codec.encode_chat([{"role": "user", "content": p}]))
            + new_tokens < context]


def with_exit_states(artifact_dir, sequences) -> list:
    """The same sequences with the exit states of another artifact (another exit layer)."""
    from edgespec.artifact import open_artifact
    from edgespec.engine import Engine

    engine = Engine(open_artifact(artifact_dir, verify=False),
                    max_context=short_context(artifact_dir))
    moved, seq = [], engine.new_sequence()
    for s in sequences:
        engine.lower(seq, 0, s.tokens)
        states = seq.exit_states.numpy()[0, :len(s.tokens)].astype(np.float32)
        moved.append(exit_adapter.Sequence(states, s.start, s.top_ids, s.top_probs, s.tokens))
    return moved


def measure(artifact_dir, policies: list, prompts: list, log=print) -> list:
    """For each policy (keyword overrides of the draft policy): the median over prompts of
    speculative / plain tokens per second, tokens per round, and whether output matched."""
    import edgespec

    model = edgespec.load(artifact_dir, verify=False, max_context=short_context(artifact_dir))
    ratios = [[] for _ in policies]
    rounds = [[0, 0] for _ in policies]
    identical = [True] * len(policies)
    with progress(len(prompts), f"plain and {len(policies)} draft "
                  f"polic{'y' if len(policies) == 1 else 'ies'}", unit="prompt") as bar:
        for prompt in prompts:
            ids = model.encode(prompt)
            plain = model.generate_ids(ids, MEASURE_TOKENS, mode="plain", temperature=0)
            for i, policy in enumerate(policies):
                model.forget()  # no policy copies the reply an earlier one made
                spec = model.generate_ids(ids, MEASURE_TOKENS, temperature=0, **policy)
                ratios[i].append(spec.decode_tokens_per_s / plain.decode_tokens_per_s)
                rounds[i][0] += spec.stats.rounds
                rounds[i][1] += spec.stats.rounds + spec.stats.accepted
                identical[i] &= spec.tokens == plain.tokens
            bar.update(1)
    results = [{"policy": policy, "speedup": round(float(np.median(r)), 3),
                "tokens_per_round": round(n_tokens / max(1, n_rounds), 2),
                "identical": same}
               for policy, r, (n_rounds, n_tokens), same in zip(policies, ratios, rounds, identical)]
    for r in results:
        log(f"  {_describe(r['policy'])}: {r['speedup']:.2f}x plain, "
            f"{r['tokens_per_round']:.2f} tokens/round")
    return results


def round_costs(artifact_dir) -> dict:
    """The manifest's round costs, measured here at the process's thread count."""
    from edgespec.artifact import open_artifact
    from edgespec.engine import Engine, measured_costs

    engine = Engine(open_artifact(artifact_dir, verify=False),
                    max_context=short_context(artifact_dir))
    return measured_costs(engine, unload_single=True, seconds=COSTS_SECONDS)


def short_context(artifact_dir) -> int:
    """The context calibration and the gates run at (their prompts and replies are short):
    a sequence's buffers are sized by its context (an 8B model's take a gigabyte at 4096
    positions)."""
    from edgespec.artifact import open_artifact
    return min(SHORT_CONTEXT, open_artifact(artifact_dir, verify=False).max_context)


def plain_token_seconds(artifact_dir, prompt) -> float:
    """Seconds per token of plain greedy decoding here: a short generation after a warm-up."""
    import edgespec

    model = edgespec.load(artifact_dir, verify=False, max_context=short_context(artifact_dir))
    ids = model.encode(prompt)
    model.generate_ids(ids, 4, mode="plain", ignore_eos=True, temperature=0)
    return 1 / model.generate_ids(ids, PROBE_TOKENS, mode="plain", ignore_eos=True,
                                  temperature=0).decode_tokens_per_s


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

READY = Path(__file__).parent / "data" / "adapters"  # shipped in the package


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
                    budget_minutes, save=None, log=print):
    """Write the artifact with its draft graph, choosing what `auto`/`calibrate` leave open,
    within `budget_minutes` of calibration (export/budget.py sizes the work to it).

    Plain decoding's speed here -> the plan -> the calibration replies (adapter training
    data, the shortlist's token counts) -> per candidate exit layer: an adapter (shipped,
    given or trained briefly) and the measured speed of early-exit drafting -> the best
    layer's adapter trained on -> the shortlist size -> the shipped (adaptive) policy.
    Without `calibrate` nothing is measured and an adapter is trained only if asked."""
    start = time.perf_counter()
    run = Calibration(artifact, adapter, log)
    first = run.ready_layer if run.ready_layer is not None else exit_layer
    candidates = [first] + [e for e in candidate_exit_layers(artifact.source.arch.num_layers)
                            if e != first and auto and run.ready_layer is None]
    run.prepare(first)
    plan = run.plan(candidates, shortlist_size == "auto", calibrate, minutes, budget_minutes)
    run.collect(plan.replies or (MIN_COUNT_REPLIES if shortlist_size not in (None, "auto")
                                 and run.counts is None else 0))
    vocab = (None if shortlist_size is None or run.counts is None else shortlist(
        run.counts, shortlist_sizes(run.counts)[-1] if shortlist_size == "auto" else shortlist_size))
    layer, k, weights = run.choose_exit_layer(plan, vocab)
    if save and weights is not None:
        run.save(save, weights, layer)
    if plan.shortlist:
        vocab = run.choose_shortlist(layer, k, weights, plan.screen_prompts)
    # a raw exit over the whole vocabulary needs no graph of its own: the head serves it
    # (a second copy of the lm_head in memory otherwise)
    with_draft = weights is not None or vocab is not None
    if not plan.prompts:
        artifact.write(layer, ADAPTIVE, weights, vocab, with_draft=with_draft)
        return
    log(f"exit layer {layer}, k {k}: the adaptive policies")
    run.report["policies"] = measure(artifact.out, final_policies(k), run.prompts[:plan.prompts],
                                     log)
    chosen = best(run.report["policies"])
    policy = DraftPolicy(**chosen["policy"]).to_manifest()
    run.report["minutes"] = round((time.perf_counter() - start) / 60, 1)
    log(f"chosen: exit layer {layer}, shortlist {len(vocab) if vocab is not None else 'off'}, "
        f"{_describe(policy)} ({chosen['speedup']:.2f}x plain on the calibration prompts); "
        f"calibration took {run.report['minutes']} min (budget {budget_minutes:g}, "
        f"estimated {plan.seconds / 60:.1f})")
    artifact.write(layer, {**policy, "calibration": run.report}, weights, vocab,
                   with_draft=with_draft)


class Calibration:
    """One export's calibration: its prompts, replies, adapters and measurements."""

    def __init__(self, artifact, adapter, log):
        self.artifact, self.source, self.adapter, self.log = artifact, artifact.source, adapter, log
        self.cache = cache_dir(self.source)
        (self.cache / "adapters").mkdir(parents=True, exist_ok=True)
        self.report = {"exit_layers": {}, "adapters": {}}
        self.weights = self.counts = self.ready_layer = None
        self.exit_states = {}  # exit layer -> the replies with that layer's exit states
        ready = ready_adapter(self.source) if adapter == "auto" else \
            None if adapter in (None, "train") else Path(adapter)
        if ready:
            self.weights, self.ready_layer, self.counts, meta = load_adapter(ready)
            log(f"adapter: {ready} (exit layer {self.ready_layer}; made by: "
                f"{meta.get('command', '?')})")

    @property
    def training(self) -> bool:
        return self.adapter is not None and self.weights is None

    def prepare(self, layer):
        """Write the plain artifact at `layer` (timing the build); the prompts that fit."""
        train_prompts, held = instructions()
        start = time.perf_counter()
        self.artifact.write(layer, FIXED)
        self.build_s = time.perf_counter() - start
        self.prompts = fitting(self.artifact.out, held[:MEASURE_PROMPTS], MEASURE_TOKENS)
        self.train_prompts = fitting(self.artifact.out, train_prompts, TRAIN_TOKENS)

    def plan(self, candidates, shortlist_auto, calibrate, minutes, budget_minutes):
        """What this calibration does (budget.plan, priced at plain decoding's speed here);
        an "auto" adapter the budget cannot afford is dropped for the raw exit."""
        if not calibrate:  # measure nothing; train only when asked to
            if self.adapter == "auto":
                self.adapter = None if self.weights is None else self.adapter
            return budget.Plan(None, 0.0, exit_layers=candidates[:1], adapter_minutes=minutes,
                               replies=len(self.train_prompts) if self.training else 0)
        sizes = budget.Sizes(len(self.prompts), MEASURE_TOKENS, len(self.train_prompts),
                             TRAIN_TOKENS, len(K_CANDIDATES), len(SHORTLIST_COVERAGE) + 1,
                             len(final_policies(DEFAULT_K)))
        token_s = plain_token_seconds(self.artifact.out, self.prompts[0])
        train = None if not self.training else "train" if self.adapter == "train" else "auto"
        plan = budget.plan(budget_minutes * 60, token_s, self.build_s, sizes, candidates, train,
                           self.counts is not None, shortlist_auto, minutes)
        drafter = "raw exit" if self.weights is None else \
            "the shipped adapter" if self.adapter == "auto" else "the adapter given"
        if train and not plan.replies:
            self.adapter = None
            drafter += (f" (an adapter's {budget.MIN_REPLIES} replies and training do not "
                        "fit; a larger --calibration-minutes would train one)")
        self.log(plan.describe(budget_minutes * 60, drafter))
        return plan

    def collect(self, replies):
        """The model's greedy replies to the first `replies` training prompts: the adapter's
        data and the shortlist's token counts."""
        if not replies:
            return
        sequences = exit_adapter.collect(self.artifact.out, self.train_prompts[:replies],
                                         TRAIN_TOKENS, cache_dir=self.cache / "replies",
                                         log=self.log)
        self.exit_states[self.artifact.exit_layer] = sequences
        if self.counts is None or self.training:
            self.counts = reply_token_counts(sequences, self.source.arch.vocab_size)

    def adapter_for(self, layer, minutes):
        """The adapter for `layer`: the given one, or trained up to `minutes` in all (a
        later call with more minutes resumes from the checkpoint)."""
        if not self.training:
            return self.weights
        if layer not in self.exit_states:
            first = next(iter(self.exit_states.values()))
            self.exit_states[layer] = with_exit_states(self.artifact.out, first)
        weights, self.report["adapters"][layer] = exit_adapter.train(
            self.exit_states[layer], self.source.arch,
            exit_adapter.layer_weights(self.source.weights, layer),
            *exit_adapter.head_weights(self.source.weights, self.source.arch), minutes=minutes,
            cache_dir=self.cache / "adapters", log=self.log)
        return weights

    def choose_exit_layer(self, plan, vocab):
        """(exit layer, k, adapter weights): the fastest early-exit drafting measured. With
        several candidates, half the training screens them, the chosen one gets the rest."""
        layers, minutes = plan.exit_layers, plan.adapter_minutes
        screen = minutes / (2 * len(layers)) if len(layers) > 1 else minutes
        speeds = self.report["exit_layers"]
        for layer in layers:
            self.artifact.write(layer, FIXED)
            weights = self.adapter_for(layer, screen)
            if plan.screen_k:
                speeds[layer] = self._measure_exit(layer, weights, vocab, plan.screen_prompts)
        layer = max(speeds, key=lambda e: best(speeds[e])["speedup"]) if speeds else layers[0]
        self.artifact.write(layer, FIXED)
        if len(layers) > 1 and self.training:  # the chosen layer's adapter trains on
            weights = self.adapter_for(layer, screen + minutes / 2)
            if plan.screen_k:
                speeds[layer] = self._measure_exit(layer, weights, vocab, plan.screen_prompts)
        if self.training:
            self.artifact.extra["adapter"] = self.report["adapters"][layer]
        k = best(speeds[layer])["policy"]["draft_k"] if speeds else DEFAULT_K
        return layer, k, weights

    def _measure_exit(self, layer, weights, vocab, prompts):
        self.artifact.write(layer, FIXED, weights, vocab, with_draft=True)
        self.log(f"exit layer {layer}: early-exit drafting, fixed k, on {prompts} "
                 "held-out calibration prompts")
        return measure(self.artifact.out, exit_policies(), self.prompts[:prompts], self.log)

    def choose_shortlist(self, layer, k, weights, prompts):
        """The draft head's vocabulary (None: all) that drafts fastest at k."""
        by_size = {}
        for size in shortlist_sizes(self.counts) + [None]:
            vocab = None if size is None else shortlist(self.counts, size)
            self.artifact.write(layer, FIXED, weights, vocab, with_draft=True)
            self.log(f"shortlist {size or 'off (full vocabulary)'}:")
            by_size[size] = measure(self.artifact.out, [exit_policies()[k - 1]],
                                    self.prompts[:prompts], self.log)[0]
        self.report["shortlist"] = {str(s): r for s, r in by_size.items()}
        size = max(by_size, key=lambda s: by_size[s]["speedup"])
        return None if size is None else shortlist(self.counts, size)

    def save(self, path, weights, layer):
        command = "edgespec export " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["export"] \
            else "export_model(...)"
        save_adapter(path, weights, layer, self.counts, {
            "source_sha256": self.source.sha256, "command": command,
            **self.report["adapters"].get(layer, {})})
        self.log(f"adapter kept in {path}")
