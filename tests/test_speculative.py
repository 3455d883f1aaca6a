"""The speculative loop is lossless: greedy output equals plain greedy output token for token,
sampled output equals plain sampled output with the same seed, and has exactly the verifier's
distribution."""
import itertools
from dataclasses import replace

import numpy as np
import pytest
from helpers import make_checkpoint, quiet

import edgespec
from edgespec import rounds
from edgespec.early_exit import EarlyExit
from edgespec.errors import EdgespecError
from edgespec.rounds import Drafting, accept
from edgespec.sampling import SAMPLING_FIELDS, Sampler, SamplingParams, distribution
from edgespec.export.pipeline import export_model


@pytest.fixture(scope="module", params=[1, 3])
def tiny_model(request, tiny_checkpoint, tmp_path_factory):
    """The tiny model with a poor draft (exit after layer 1 of 4) and a better one (3)."""
    out = tmp_path_factory.mktemp("artifacts") / f"exit{request.param}"
    export_model(str(tiny_checkpoint), out, exit_layer=request.param, log=quiet)
    model = edgespec.load(out)
    model.stop_ids = set()  # random models end turns at random: compare whole lengths
    return model


def prompt(seed, n=12):
    return [int(t) for t in np.random.default_rng(seed).integers(5, 300, n)]


def repetitive_prompt(seed):
    """A prompt that repeats itself, so prompt lookup finds matches."""
    return prompt(seed, 6) * 3


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_speculative_equals_plain_over_seeds(tiny_model, k):
    for seed in range(8):
        ids = prompt(seed)
        plain = tiny_model.generate_ids(ids, max_new_tokens=40, mode="plain").tokens
        spec = tiny_model.generate_ids(ids, max_new_tokens=40, draft_k=k, adaptive=False)
        assert spec.tokens == plain, f"seed {seed}, k {k}"
        assert spec.stats.rounds > 0 and spec.stats.drafted > 0


def test_greedy_equality_holds_with_repetition_penalty_and_adaptive_drafts(tiny_model):
    options = dict(repetition_penalty=1.3, draft_k=5, draft_threshold=0.02)
    drafted = 0
    for seed in range(4):
        ids = prompt(100 + seed)
        plain = tiny_model.generate_ids(ids, 40, mode="plain", repetition_penalty=1.3)
        spec = tiny_model.generate_ids(ids, 40, **options)
        assert spec.tokens == plain.tokens
        drafted += spec.stats.drafted
    assert drafted > 0  # else plain was compared with plain


@pytest.mark.parametrize("draft_k, lookup_k", [(0, 4), (3, 2)])
def test_greedy_equality_holds_with_prompt_lookup_drafts(tiny_model, draft_k, lookup_k):
    looked_up = 0
    for seed in range(6):
        ids = repetitive_prompt(seed)
        plain = tiny_model.generate_ids(ids, 40, mode="plain").tokens
        # fixed k: lookup drafts wherever it matches (an adaptive early exit, timed, may
        # win every round on one machine and none on another)
        spec = tiny_model.generate_ids(ids, 40, draft_k=draft_k, lookup_k=lookup_k,
                                       adaptive=False)
        assert spec.tokens == plain, f"seed {seed}"
        by = spec.stats.drafters
        looked_up += by["lookup"].drafted
        assert spec.stats.drafted == sum(d.drafted for d in by.values())
    assert looked_up > 0


def test_lookup_copies_an_earlier_reply_until_the_model_forgets_it(tiny_model):
    # the same prompt again: lookup drafts the reply it remembers, and the verifier takes it
    ids, options = prompt(7), dict(draft_k=0, lookup_k=16, adaptive=True)
    plain = tiny_model.generate_ids(ids, 60, mode="plain").tokens
    tiny_model.forget()
    first = tiny_model.generate_ids(ids, 60, **options)
    again = tiny_model.generate_ids(ids, 60, **options)
    tiny_model.forget()
    forgotten = tiny_model.generate_ids(ids, 60, **options)
    assert first.tokens == again.tokens == forgotten.tokens == plain
    lookup = [g.stats.drafters["lookup"] for g in (first, again, forgotten)]
    # without the memory a run repeats the first's rounds exactly (lookup is planned, not
    # timed); with it, the remembered reply is drafted and taken in fewer, longer rounds
    assert (lookup[2].drafted, lookup[2].accepted) == (lookup[0].drafted, lookup[0].accepted)
    assert lookup[1].accepted > lookup[0].accepted and again.stats.rounds < first.stats.rounds


def test_greedy_equality_holds_under_the_adaptive_scheduler(tiny_model):
    plain_steps, drafted = [], 0
    for seed in range(4):  # the same drafters for all four: their records carry over
        ids = repetitive_prompt(50 + seed)
        plain = tiny_model.generate_ids(ids, 60, mode="plain").tokens
        spec = tiny_model.generate_ids(ids, 60, draft_k=3, lookup_k=4, adaptive=True)
        assert spec.tokens == plain, f"seed {seed}"
        plain_steps.append(spec.stats.plain_steps)
        drafted += spec.stats.drafted
    assert sum(plain_steps) >= 2  # the early exit waits for plain decoding to be measured
    assert drafted > 0  # else plain was compared with plain


def test_a_full_context_stops_both_modes_at_the_same_token(tiny_checkpoint, tmp_path):
    export_model(str(tiny_checkpoint), tmp_path / "small", max_context=40, log=quiet)
    model = edgespec.load(tmp_path / "small")
    model.stop_ids = set()
    plain = model.generate_ids(prompt(1, 30), max_new_tokens=30, mode="plain")
    spec = model.generate_ids(prompt(1, 30), max_new_tokens=30, draft_k=4)
    assert spec.finish_reason == plain.finish_reason == "context_full"
    assert spec.tokens == plain.tokens


def exact_joint(model, ids, params, length):
    """The verifier's probability of every continuation of `length` tokens (plain steps)."""
    table = {}
    engine, seq = model.engine, model.engine.new_sequence()

    def walk(prefix, prob, logits):
        p = distribution(logits, ids + list(prefix), params)
        for token in np.flatnonzero(p):
            path, mass = prefix + (int(token),), prob * p[token]
            if len(path) == length:
                table[path] = mass
                continue
            walk(path, mass, engine.prefill(seq, len(ids) + len(prefix), [int(token)]).copy())

    walk((), 1.0, engine.prefill(seq, 0, ids).copy())
    return table


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.9, top_k=4, top_p=0.95, min_p=0.02, repetition_penalty=1.2),
    SamplingParams(temperature=0.5, top_p=0.6, presence_penalty=0.8, frequency_penalty=0.5),
    SamplingParams(temperature=1.0, min_p=0.2, repetition_penalty=1.5),
])
def test_speculative_sampling_has_the_verifiers_joint_distribution(tiny_model, params):
    ids, length, n = prompt(7), 3, 3000
    expected = exact_joint(tiny_model, ids, params, length)
    options = {f: getattr(params, f) for f in SAMPLING_FIELDS}
    counts = {}
    for seed in range(n):
        path = tuple(tiny_model.generate_ids(ids, length, seed=seed, draft_k=3, **options).tokens)
        counts[path] = counts.get(path, 0) + 1
    assert_same_distribution(counts, expected, n)


@pytest.mark.parametrize("params", [
    dict(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1),
    dict(temperature=0.7),  # every token may be drawn: the tail of the vocabulary too
    dict(temperature=1.2, top_p=0.8, frequency_penalty=0.6),
    dict(temperature=0.8, min_p=0.05, presence_penalty=-0.5, repetition_penalty=0.9),
])
@pytest.mark.parametrize("options", [dict(draft_k=3), dict(draft_k=2, lookup_k=4),
                                     dict(draft_k=4, lookup_k=6, adaptive=True)])
def test_sampled_speculative_equals_plain_with_the_same_seed(tiny_model, options, params):
    drafted = 0
    for seed in range(6):
        ids = repetitive_prompt(200 + seed)
        plain = tiny_model.generate_ids(ids, 40, mode="plain", seed=seed, **params).tokens
        spec = tiny_model.generate_ids(ids, 40, seed=seed, **params, **options)
        assert spec.tokens == plain, f"seed {seed}"
        drafted += spec.stats.drafted
    assert drafted > 0


def assert_same_distribution(counts, expected, n):
    assert set(counts) <= set(expected), "sampled a continuation the verifier cannot produce"
    # chi-square over cells with enough expected mass, the rest pooled
    cells = sorted(expected, key=expected.get, reverse=True)
    big = [c for c in cells if expected[c] * n >= 5]
    observed = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    wanted = [expected[c] * n for c in big] + [n - sum(expected[c] * n for c in big)]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, wanted) if e > 0)
    dof = len(big)
    # p = 0.001 critical value by the Wilson-Hilferty approximation
    critical = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < critical, f"chi2 {chi2:.1f} over {dof} dof (critical {critical:.1f})"


def test_lookup_drafts_accepted_as_point_masses_keep_the_verifiers_distribution(tiny_model):
    # a lookup draft d is accepted when the verifier's draw at its position is d: with
    # p(d). Then the first committed token has distribution p, the bonus after d p'.
    params, ids, engine = SamplingParams(temperature=1.0, top_k=5), prompt(11), tiny_model.engine
    seq = engine.new_sequence()
    first_logits = engine.prefill(seq, 0, ids).copy()
    p = distribution(first_logits, ids, params)
    draft = int(np.argsort(p)[-2])  # likely, but not the likeliest token
    logits = np.stack([first_logits, engine.prefill(seq, len(ids), [draft])])
    after = distribution(logits[1], ids + [draft], params)
    expected = {(int(t),): p[t] for t in np.flatnonzero(p) if t != draft}
    expected.update({(draft, int(t)): p[draft] * after[t] for t in np.flatnonzero(after)})
    n, counts = 20000, {}
    for seed in range(n):
        path = tuple(accept(Sampler(replace(params, seed=seed)), [draft], logits, ids))
        counts[path] = counts.get(path, 0) + 1
    assert_same_distribution(counts, expected, n)


class RecordingExit(EarlyExit):
    """Keeps each round's drafts, so that the statistics can be checked against counts made
    from what the rounds did rather than by the loop's own bookkeeping."""
    drafts = []

    def offer(self, history, budget):
        offer = super().offer(history, budget)
        if offer:  # the only drafter: its offer is the round's
            self.drafts.append([])
        return offer

    def next_draft(self, *args):
        draft = super().next_draft(*args)
        self.drafts[-1].append(draft)
        return draft


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_statistics_count_rounds_drafts_and_acceptance(tiny_model, monkeypatch):
    monkeypatch.setattr(rounds, "DRAFTERS", (RecordingExit,))
    monkeypatch.setattr(tiny_model, "drafting", Drafting())
    monkeypatch.setattr(RecordingExit, "drafts", [])
    ids = prompt(3)
    batch = tiny_model.batch(1)
    request = batch.add(ids, tiny_model.settings(max_new_tokens=30, draft_k=3, lookup_k=0,
                                                 adaptive=False, temperature=0))
    committed, before = [], len(ids)
    while batch.busy:  # a step: the prompt and the first token, then a round each
        batch.step()
        committed.append(request.history[before:])
        before = len(request.history)
    first, rounds_, drafts = committed[0], committed[1:], RecordingExit.drafts
    assert len(first) == 1 and sum(map(len, committed)) == 30
    plain = len(rounds_) - len(drafts)  # a round with no room for a draft: the last
    assert len(drafts) > 1 and plain in (0, 1)
    drafts = drafts + [[]] * plain
    # greedy: a round commits the drafts the verifier agreed with, then its own token
    accepted = [common_prefix(c, d) for c, d in zip(rounds_, drafts)]
    assert [len(c) for c in rounds_] == [a + 1 for a in accepted]
    drafted, stats = sum(map(len, drafts)), request.result.stats
    assert (stats.rounds, stats.drafted, stats.accepted) == (len(rounds_), drafted, sum(accepted))
    assert list(stats.drafters) == ["exit"]
    exit_ = stats.drafters["exit"]
    assert (exit_.rounds, exit_.drafted, exit_.accepted) == \
        (len(drafts) - plain, drafted, sum(accepted))
    assert stats.plain_steps == plain
    assert stats.acceptance == pytest.approx(sum(accepted) / drafted)
    assert stats.tokens_per_round == pytest.approx((30 - len(first)) / len(rounds_))


@pytest.mark.parametrize("options, message", [
    (dict(draft_k=-1), "invalid draft-k"), (dict(draft_k=99), "invalid draft-k"),
    (dict(lookup_k=33), "invalid lookup-k"),
    (dict(draft_threshold=1.5), "invalid draft-threshold"),
])
def test_invalid_draft_options_are_refused(tiny_model, options, message):
    with pytest.raises(EdgespecError, match=message):
        tiny_model.generate_ids(prompt(0), 5, **options)


def test_rollback_forgets_rejected_drafts_in_place(tiny_model):
    """After rounds with rejected drafts the cache holds exactly the committed tokens, and
    its keys and values are those a fresh prefill of them gives; the buffers never move."""
    engine, seq = tiny_model.engine, tiny_model.sequence
    pointers = {name: value.data_ptr() for name, value in seq.kv.items()}
    exit_states = seq.exit_states.data_ptr()
    for k, seed in itertools.product((2, 5), range(2)):
        ids = prompt(seed)
        result = tiny_model.generate_ids(ids, 30, draft_k=k, adaptive=False)
        assert result.stats.drafted > result.stats.accepted  # some drafts were rolled back
        committed = ids + result.tokens[:-1]  # the last token is not fed yet
        assert seq.cached_tokens() == committed
        after = engine.prefill(seq, len(committed), result.tokens[-1:]).copy()
        fresh = engine.prefill(seq, 0, committed + result.tokens[-1:]).copy()
        np.testing.assert_allclose(after, fresh, rtol=0, atol=1e-5)
    assert {n: v.data_ptr() for n, v in seq.kv.items()} == pointers
    assert seq.exit_states.data_ptr() == exit_states


@pytest.mark.parametrize("arch, residual", [("llama", np.float16), ("gemma3", np.float32)])
def test_fp16_graphs_built_for_cuda_run_lossless_on_the_cpu(arch, residual, tmp_path):
    # the CUDA export (fp16 activations; Gemma 3's residual stream in fp32) is checked here
    # on the CPU EP, which runs it too
    checkpoint = make_checkpoint(tmp_path / "ckpt", arch=arch)
    export_model(str(checkpoint), tmp_path / "cuda", device="cuda", log=quiet)
    model = edgespec.load(tmp_path / "cuda", device="cpu")
    assert model.engine.dtype == np.float16
    assert model.engine.state_dtype == residual
    model.stop_ids = set()
    for seed in range(3):
        plain = model.generate_ids(prompt(seed), 30, mode="plain")
        assert model.generate_ids(prompt(seed), 30, draft_k=3).tokens == plain.tokens
