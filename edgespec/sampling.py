"""Logits to tokens: repetition penalty, temperature, top-k, top-p, min-p, seeded draws.

`distribution` is the single definition of "the model's distribution at a position given its
history"; greedy decoding takes its argmax, sampling draws from it.

A draw is an exponential race: token = argmax p_i / E_i, with E_i ~ Exp(1) drawn for the
position (seed, position) alone, which samples exactly from p. Because the noise belongs to
the position and not to the order of calls, a draft sampled with the draft's distribution
and checked against the verifier's choice at the same position is accepted exactly when the
verifier would have drawn it: speculative sampling then emits token for token what plain
sampling with the same seed emits, whatever was drafted, and the scheduler's timing-driven
choices cannot change a seeded reply.
"""
from dataclasses import dataclass

import numpy as np

from .errors import EdgespecError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0       # 0: greedy
    top_k: int = 0                 # 0: off
    top_p: float = 1.0             # 1: off
    min_p: float = 0.0             # 0: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int = None

    def __post_init__(self):
        checks = [
            ("temperature", self.temperature, self.temperature >= 0, "a number >= 0 (0 is greedy)"),
            ("top-k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0,
             "an integer >= 0 (0 is off)"),
            ("top-p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("min-p", self.min_p, 0 <= self.min_p < 1, "in [0, 1)"),
            ("repetition-penalty", self.repetition_penalty, self.repetition_penalty > 0,
             "a number > 0 (1 is off)"),
            ("seed", self.seed, self.seed is None or (
                isinstance(self.seed, int) and not isinstance(self.seed, bool)
                and 0 <= self.seed < 2**63), "an integer in [0, 2**63)"),
        ]
        for name, value, ok, expected in checks:
            if not ok or (isinstance(value, float) and not np.isfinite(value)):
                raise EdgespecError(f"invalid {name} {value}: it must be {expected}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def penalize(logits: np.ndarray, history, penalty: float) -> np.ndarray:
    """CTRL-style repetition penalty on every token already in the history."""
    if penalty == 1.0 or len(history) == 0:
        return logits
    seen = np.unique(np.asarray(history, dtype=np.int64))
    logits = logits.astype(np.float32, copy=True)
    picked = logits[seen]
    logits[seen] = np.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def distribution(logits: np.ndarray, history, params: SamplingParams) -> np.ndarray:
    """Probabilities after penalty, temperature and the top-k / top-p / min-p filters."""
    z = penalize(logits, history, params.repetition_penalty).astype(np.float64)
    z = z / params.temperature
    if params.top_k and params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z[z < kth] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        p = _nucleus(p, params.top_p)
    if params.min_p > 0.0:
        p[p < params.min_p * p.max()] = 0.0
    return p / p.sum()


def _nucleus(p: np.ndarray, top_p: float, candidates: int = 2048) -> np.ndarray:
    """Keep the smallest set of likeliest tokens whose mass reaches top_p. Sorting only the
    likeliest `candidates` (enough unless the mass is spread thin) is ~10x faster."""
    pool = np.argpartition(p, -candidates)[-candidates:] if candidates < p.size \
        else np.arange(p.size)
    order = pool[np.argsort(-p[pool], kind="stable")]
    cumulative = np.cumsum(p[order])
    if cumulative[-1] < top_p and pool.size < p.size:
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
    keep = order[:np.searchsorted(cumulative, top_p) + 1]
    kept = np.zeros_like(p)
    kept[keep] = p[keep]
    return kept


class Sampler:
    """Chooses the token at position len(history); greedy is the argmax of the penalized
    logits, sampling an exponential race with the position's own noise."""

    NOISE_KEPT = 32  # positions whose noise is kept (a round's drafts and verify rows)

    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = params.seed if params.seed is not None else \
            int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> 1)
        self.noise_by_position = {}

    def __call__(self, logits: np.ndarray, history, pending=()) -> int:
        """pending: tokens after `history` not committed yet (a round's drafts); the two are
        joined only when a penalty or a draw reads them, not for plain greedy."""
        params = self.params
        if params.greedy and params.repetition_penalty == 1.0:
            return int(np.argmax(logits))
        seen = history + list(pending) if pending else history
        if params.greedy:
            return int(np.argmax(penalize(logits, seen, params.repetition_penalty)))
        p = distribution(logits, seen, params)
        support = np.flatnonzero(p)
        race = p[support] / self.noise(len(seen), p.size)[support]
        return int(support[np.argmax(race)])

    def noise(self, position: int, size: int) -> np.ndarray:
        """Exp(1) per token id, a function of (seed, position) only."""
        noise = self.noise_by_position.get(position)
        if noise is None or noise.size != size:
            if len(self.noise_by_position) >= self.NOISE_KEPT:
                self.noise_by_position.clear()
            noise = np.random.default_rng([self.seed, position]).standard_exponential(size)
            self.noise_by_position[position] = noise
        return noise
