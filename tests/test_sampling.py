"""Logits to tokens: parameter checks, filters, penalties, seeds, and the sampled frequencies."""
import numpy as np
import pytest

from edgespec.errors import EdgespecError
from edgespec.sampling import Sampler, SamplingParams, distribution, penalize

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
    np.testing.assert_allclose(penalize(logits, [0, 1], 2.0), [1.0, -2.0, 0.5])
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
