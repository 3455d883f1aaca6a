"""Logits to tokens: parameter checks, filters, penalties, seeds, and the sampled frequencies."""
import numpy as np
import pytest

from edgespec.errors import EdgespecError
from edgespec.sampling import Sampler, SamplingParams, distribution, penalize, row_top

LOGITS = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], dtype=np.float32))


@pytest.mark.parametrize("field, value, name", [
    ("temperature", -0.5, "temperature"), ("top_p", 0.0, "top-p"), ("top_p", 1.5, "top-p"),
    ("top_k", -1, "top-k"), ("min_p", 1.0, "min-p"), ("repetition_penalty", 0.0,
                                                      "repetition-penalty"),
    ("temperature", float("nan"), "temperature"), ("seed", -1, "seed"), ("seed", 2**63, "seed"),
    ("seed", 1.5, "seed"),
])
def test_invalid_parameters_are_refused_by_name(field, value, name):
    with pytest.raises(EdgespecError, match=f"invalid {name}"):
        SamplingParams(**{field: value})


def test_greedy_takes_the_argmax():
    assert Sampler(SamplingParams())(LOGITS, []) == 0


def test_temperature_one_keeps_the_model_distribution():
    p = distribution(LOGITS, [], SamplingParams(temperature=1.0))
    np.testing.assert_allclose(p, [0.4, 0.3, 0.15, 0.1, 0.05], rtol=1e-5)


def test_top_k_top_p_and_min_p_cut_the_tail():
    assert np.count_nonzero(distribution(LOGITS, [], SamplingParams(1.0, top_k=2))) == 2
    # 0.4 + 0.3 = 0.7 reaches top_p = 0.7: two tokens stay
    assert np.count_nonzero(distribution(LOGITS, [], SamplingParams(1.0, top_p=0.7))) == 2
    # min_p 0.3: tokens below 0.3 * 0.4 = 0.12 go
    assert np.count_nonzero(distribution(LOGITS, [], SamplingParams(1.0, min_p=0.3))) == 3


def test_repetition_penalty_lowers_tokens_already_seen():
    logits = np.array([2.0, -1.0, 0.5], dtype=np.float32)
    np.testing.assert_allclose(penalize(logits, [0, 1], SamplingParams(repetition_penalty=2.0)),
                               [1.0, -2.0, 0.5])
    assert Sampler(SamplingParams(repetition_penalty=10.0))(LOGITS, [0]) == 1


def test_a_draw_depends_on_the_seed_and_the_position_only():
    first, second = Sampler(SamplingParams(1.0, seed=7)), Sampler(SamplingParams(1.0, seed=7))
    draws = [first(LOGITS, [0] * position) for position in range(50)]
    # the second sampler asks in another order, and twice: the same token at each position
    assert [second(LOGITS, [0] * position) for position in reversed(range(50))][::-1] == draws
    assert [second(LOGITS, [0] * position) for position in range(50)] == draws
    assert len(set(draws)) > 1
    other = Sampler(SamplingParams(1.0, seed=8))
    assert [other(LOGITS, [0] * position) for position in range(50)] != draws


def test_without_a_seed_each_sampler_draws_afresh():
    draws = {Sampler(SamplingParams(1.0))(LOGITS, []) for _ in range(50)}
    assert len(draws) > 1


@pytest.mark.parametrize("over", ["seeds", "positions"])
def test_sampled_frequencies_match_the_distribution(over):
    n = 20000
    if over == "seeds":
        draws = [Sampler(SamplingParams(temperature=1.0, seed=s))(LOGITS, []) for s in range(n)]
    else:
        sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
        draws = [sampler(LOGITS, range(position)) for position in range(n)]
    counts = np.bincount(draws, minlength=5)
    expected = n * np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 18.47  # chi-square, 4 degrees of freedom, p = 0.001


@pytest.mark.parametrize("spread", [0.1, 3.0])  # flat: the fallback to a full sort; peaked
def test_top_p_on_a_large_vocabulary_keeps_the_smallest_set_reaching_p(spread):
    logits = (np.random.default_rng(4).normal(size=49152) * spread).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    p = distribution(logits, [], params)
    full = distribution(logits, [], SamplingParams(temperature=1.0))
    order = np.argsort(-full)
    needed = np.searchsorted(np.cumsum(full[order]), 0.9) + 1
    assert np.count_nonzero(p) == needed
    assert set(np.flatnonzero(p)) == set(order[:needed])


def reference_distribution(logits, history, params):
    """The chain written plainly in float64 over the whole vocabulary: penalties,
    temperature, top-k, softmax, top-p, min-p."""
    z = logits.astype(np.float64)
    if len(history):
        seen, counts = np.unique(np.asarray(history), return_counts=True)
        r = params.repetition_penalty
        z[seen] = np.where(z[seen] > 0, z[seen] / r, z[seen] * r)
        z[seen] -= params.presence_penalty + params.frequency_penalty * counts
    z = z / params.temperature
    if 0 < params.top_k < z.size:
        z[z < np.sort(z)[-params.top_k]] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1:
        order = np.argsort(-p, kind="stable")
        kept = order[:np.searchsorted(np.cumsum(p[order]), params.top_p) + 1]
        p = np.where(np.isin(np.arange(p.size), kept), p, 0.0)
    p[p < params.min_p * p.max()] = 0.0
    return p / p.sum()


def test_the_fast_chain_equals_the_plain_one_for_every_filter_and_penalty():
    rng = np.random.default_rng(5)
    for trial in range(200):
        vocab = int(rng.choice([7, 300, 49152]))
        logits = (rng.normal(size=vocab) * rng.choice([0.3, 2, 5])).astype(np.float32)
        history = list(rng.integers(0, vocab, rng.integers(0, 40)))
        params = SamplingParams(
            temperature=float(rng.choice([0.3, 0.8, 1.5])), top_k=int(rng.choice([0, 1, 5, 40])),
            top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0, 0.05])),
            repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])),
            presence_penalty=float(rng.choice([0, 0.5, -1])),
            frequency_penalty=float(rng.choice([0, 0.4, -0.3])))
        fast, plain = distribution(logits, history, params), reference_distribution(
            logits, history, params)
        # the same tokens kept (a float32 weight below 1e-38 of the likeliest rounds to 0)
        assert set(np.flatnonzero(fast)) <= set(np.flatnonzero(plain)), (trial, params)
        assert set(np.flatnonzero(fast > 1e-30)) == set(np.flatnonzero(plain > 1e-30))
        np.testing.assert_allclose(fast, plain, atol=1e-6, err_msg=str(params))


def test_presence_and_frequency_penalties_subtract_per_seen_token_and_per_occurrence():
    logits = np.array([2.0, 1.0, 0.5, 0.0], dtype=np.float32)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    np.testing.assert_allclose(penalize(logits, [0, 0, 0, 2], params), [0.75, 1.0, -0.25, 0.0])


def test_pending_drafts_count_for_the_penalty_then_leave_no_trace():
    logits = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(repetition_penalty=1.5))
    assert sampler(logits, [2], pending=[0]) == 1  # 0 is pending: penalized
    assert sampler(logits, [2]) == 0  # and forgotten once the round is over


def test_draws_from_the_tail_of_an_unfiltered_vocabulary_keep_its_distribution():
    # a few likely tokens and thousands of unlikely ones: about a fifth of the mass lies in
    # the tail that the sampler orders by id instead of sorting
    logits = np.full(5000, -9.0, dtype=np.float32)
    logits[:4] = [0.0, -0.5, -1.0, -1.5]
    p = distribution(logits, [], SamplingParams(temperature=1.0))
    n = 20000
    draws = np.array([Sampler(SamplingParams(temperature=1.0, seed=s))(logits, [])
                      for s in range(n)])
    observed = [np.sum(draws == t) for t in range(4)] + [np.sum(draws >= 4)]
    expected = n * np.append(p[:4], p[4:].sum())
    assert expected[-1] > 0.1 * n
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    assert chi2 < 18.47  # 4 degrees of freedom, p = 0.001
    # the tail's draws spread over its tokens, not piled on a few
    assert len(set(draws[draws >= 4])) > 0.5 * min(4996, np.sum(draws >= 4))


def test_settings_describe_what_is_on_and_the_seed_of_a_sampled_reply():
    assert SamplingParams().describe() == "greedy"
    assert SamplingParams(repetition_penalty=1.2).describe() == "greedy, repetition penalty 1.2"
    assert SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=3).describe() == \
        "temperature 0.8, top-k 40, top-p 0.9, seed 3"


def test_a_sampler_kept_across_peaked_and_flat_positions_keeps_the_exact_top_k():
    """Its look-ahead spread, learnt on earlier positions, may select far too few or far too
    many tokens at the next: the kept set is the same as the plain chain's either way."""
    rng = np.random.default_rng(9)
    vocab, history = 49152, []
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1)
    sampler = Sampler(params)
    for step in range(60):
        scale = [0.2, 8.0][step % 2]  # flat, then peaked: the spread lags behind
        logits = (rng.normal(size=vocab) * scale).astype(np.float32)
        logits[history[-20:]] += 3.0  # seen tokens among the likeliest
        sampler._count(vocab, history, ())
        fast = sampler.candidates(logits).probabilities(vocab)
        np.testing.assert_allclose(fast, reference_distribution(logits, history, params),
                                   atol=1e-6, err_msg=f"step {step}")
        history.append(int(rng.integers(0, vocab)))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_k=3, top_p=0.8, min_p=0.05)],
                         ids=["greedy", "top-k", "top-k, top-p, min-p"])
def test_a_rows_ranked_top_draws_what_the_whole_row_draws(params):
    # what a GPU head hands over (Engine.head_top): the k largest logits and the ties of the
    # k-th, ranked; rows with ties at the cut and among the top included
    rng, k = np.random.default_rng(0), Sampler(params).top_needed
    for trial in range(200):
        z = rng.normal(size=64).astype(np.float32)
        if trial % 3 == 0:
            z[rng.choice(64, 4, replace=False)] = np.sort(z)[-k]  # ties with the k-th
        if trial % 5 == 0:
            z[rng.choice(64, 2, replace=False)] = z.max()  # ties at the top
        full, top = Sampler(params), Sampler(params)
        top.seed = full.seed = trial
        assert row_top(z, k) == full.ranked_top(z, k)
        history = list(range(trial % 7))
        assert top(row_top(z, k), history) == full(z, history)
