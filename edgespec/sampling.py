"""Logits to tokens: penalties, temperature, top-k, top-p, min-p, seeded draws.

`Sampler.candidates` is the single definition of "the model's distribution at a position
given its history"; greedy decoding takes the argmax of the penalized logits, sampling
draws from the candidates.

Cost: the chain touches the whole vocabulary only in a few float32 vector passes (a copy
for the penalties, a max, a comparison; an exponential only when no top-k bounds the
candidates) and sorts and normalizes just the tokens a filter keeps. Penalties read token
counts kept up to date as the history grows, not the history itself.

A draw is one uniform per position, u = hash(seed, position), through the inverse CDF of
the kept tokens in order of falling probability (ties by id); a fixed order that depends
on the probabilities alone, so the draw samples exactly from them. Because the uniform
belongs to the position and not to the order of calls, a draft sampled from the draft's
distribution and checked against the verifier's choice at the same position is accepted
exactly when the verifier would have drawn it: speculative sampling then emits token for
token what plain sampling with the same seed emits, whatever was drafted, and the
scheduler's timing-driven choices cannot change a seeded reply. Ordering by probability
makes a draft and a verifier that agree on the likeliest tokens draw the same one.
"""
import dataclasses
import hashlib
import math
from dataclasses import dataclass

import numpy as np

from .errors import EdgespecError

# Without a top-k or top-p or min-p filter every token keeps some probability: tokens whose
# weight is below this fraction of the likeliest's are drawn, in id order, only when the
# uniform falls past all the others (rarely), so most draws sort a few hundred tokens.
TAIL = 2.0 ** -12


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0       # 0: greedy
    top_k: int = 0                 # 0: off
    top_p: float = 1.0             # 1: off
    min_p: float = 0.0             # 0: off
    repetition_penalty: float = 1.0  # 1: off; divides seen tokens' positive logits (CTRL)
    presence_penalty: float = 0.0   # 0: off; subtracted from every seen token's logit
    frequency_penalty: float = 0.0  # 0: off; subtracted once per occurrence (OpenAI's)
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
            ("presence-penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2,
             "in [-2, 2] (0 is off)"),
            ("frequency-penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2,
             "in [-2, 2] (0 is off)"),
            ("seed", self.seed, self.seed is None or (
                isinstance(self.seed, int) and not isinstance(self.seed, bool)
                and 0 <= self.seed < 2**63), "an integer in [0, 2**63)"),
        ]
        for name, value, ok, expected in checks:
            if not ok or (isinstance(value, float) and not np.isfinite(value)):
                raise EdgespecError(f"invalid {name} {value}: it must be {expected}")

    def with_options(self, **given) -> "SamplingParams":
        """These settings with the given fields replaced (None: not given, keep ours)."""
        return dataclasses.replace(self, **{k: v for k, v in given.items() if v is not None})

    def describe(self) -> str:
        """The settings that are on, in words: "greedy" or "temperature 0.8, top-k 40, ..."."""
        if self.greedy and not self.penalized:
            return "greedy"
        neutral = SamplingParams()
        parts = ["greedy" if self.greedy else f"temperature {self.temperature:g}"] + [
            f"{name.replace('_', ' ').replace('top ', 'top-').replace('min ', 'min-')} "
            f"{getattr(self, name):g}" for name in SAMPLING_FIELDS[1:]
            if getattr(self, name) != getattr(neutral, name)]
        return ", ".join(parts)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


# What a reply samples with when the model recommends nothing (a GGUF carries no sampling
# settings): the usual settings of local chat, under which small models do not loop the way
# they do greedily. Greedy is --temperature 0.
CHAT_DEFAULTS = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1)
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty")


class TokenCounts:
    """How often each token occurs in a history that only grows, kept as it grows; a
    round's pending drafts are counted in for one call and out again."""

    def __init__(self, vocab: int):
        self.count = np.zeros(vocab, np.int32)
        self.seen = np.empty(vocab, np.int64)  # ids in order of first occurrence
        self.n_seen = 0
        self.length = 0  # history tokens counted

    def follow(self, history):
        if len(history) < self.length:  # another history: count afresh
            self.count[self.seen[:self.n_seen]] = 0
            self.n_seen = self.length = 0
        for token in history[self.length:]:
            self.add(token)
        self.length = len(history)

    def add(self, token):
        if self.count[token] == 0:
            self.seen[self.n_seen] = token
            self.n_seen += 1
        self.count[token] += 1

    def remove(self, token):
        """Undo the latest add of `token` (pending drafts leave in reverse order)."""
        self.count[token] -= 1
        if self.count[token] == 0:
            self.n_seen -= 1


@dataclass
class Candidates:
    """The tokens a position may draw and their weights (unnormalized probabilities), the
    likeliest first; `tail`: the rest of the vocabulary's weights when no filter cut it
    (drawn from in id order), else None."""
    ids: np.ndarray
    weights: np.ndarray
    tail: np.ndarray = None

    @property
    def total(self) -> float:
        return float(self.weights.sum()) + (float(self.tail.sum()) if self.tail is not None
                                            else 0.0)

    def draw(self, u: float) -> int:
        """The token at u in [0, 1) of the cumulative weights: the likeliest first, then
        the tail in id order."""
        target = u * self.total
        cumulative = np.cumsum(self.weights)
        if target < cumulative[-1] or self.tail is None:
            return int(self.ids[min(np.searchsorted(cumulative, target, "right"),
                                    self.ids.size - 1)])
        rest = np.flatnonzero(self.tail)
        cumulative = np.cumsum(self.tail[rest], dtype=np.float64)
        i = np.searchsorted(cumulative, target - float(self.weights.sum()), "right")
        return int(rest[min(i, rest.size - 1)])

    def probabilities(self, vocab: int) -> np.ndarray:
        p = np.zeros(vocab)
        if self.tail is not None:
            p[:] = self.tail
        p[self.ids] = self.weights
        return p / p.sum()


def uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that is a function of (seed, position) alone."""
    digest = hashlib.blake2b(seed.to_bytes(8, "little") + position.to_bytes(8, "little"),
                             digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0 ** -53


class Sampler:
    """Chooses the token at position len(history) + len(pending) of one generation (its
    history only grows): the argmax of the penalized logits when greedy, else a seeded draw
    from its candidates."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = params.seed if params.seed is not None else \
            int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> 1)
        self.counts = None
        self.spread = 8.0  # how far below the max top-k looks first (adapts; never changes
        # the result, only how much of the vocabulary the exact selection sorts)

    def __call__(self, logits: np.ndarray, history, pending=()) -> int:
        """pending: tokens after `history` not committed yet (a round's drafts)."""
        z = self.penalized(logits, history, pending)
        if self.params.greedy:
            return int(np.argmax(z))
        position = len(history) + len(pending)
        return self.candidates(z).draw(uniform(self.seed, position))

    def penalized(self, logits: np.ndarray, history, pending=()) -> np.ndarray:
        """float32 logits with the penalties for the tokens of history + pending applied
        (the input itself when no penalty is on)."""
        params = self.params
        if not params.penalized:
            return logits if logits.dtype == np.float32 else logits.astype(np.float32)
        if self.counts is None:
            self.counts = TokenCounts(logits.size)
        counts = self.counts
        counts.follow(history)
        for token in pending:
            counts.add(token)
        seen = counts.seen[:counts.n_seen]
        z = logits.astype(np.float32, copy=True)
        if params.repetition_penalty != 1.0:
            picked = z[seen]
            z[seen] = np.where(picked > 0, picked / params.repetition_penalty,
                               picked * params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            z[seen] -= np.float32(params.presence_penalty) + \
                np.float32(params.frequency_penalty) * counts.count[seen]
        for token in reversed(pending):
            counts.remove(token)
        return z

    def candidates(self, z: np.ndarray) -> Candidates:
        """Temperature, then top-k, top-p and min-p, over penalized logits `z`."""
        params, t = self.params, self.params.temperature
        top = float(z.max())
        tail = None
        if params.top_k and params.top_k < z.size:
            ids = np.flatnonzero(z >= self._kth(z, top, params.top_k))
            weights = np.exp((z[ids] - top).astype(np.float64) / t)
        elif params.top_p < 1.0 or not params.min_p:  # every token's weight counts
            every = np.exp((z - top) / np.float32(t))
            ids = np.flatnonzero(every >= TAIL)
            weights = every[ids].astype(np.float64)
            every[ids] = 0.0
            tail = every
        else:  # min-p alone bounds the logits kept
            ids = np.flatnonzero(z >= top + t * math.log(params.min_p) - 1e-3)  # the exact
            # cut is on the weights below
            weights = np.exp((z[ids] - top).astype(np.float64) / t)
        order = np.argsort(-weights, kind="stable")
        ids, weights = ids[order], weights[order]
        if params.top_p < 1.0:
            ids, weights = _nucleus(ids, weights, tail, params.top_p)
            tail = None
        if params.min_p:  # the likeliest token's weight is 1
            n = np.searchsorted(-weights, -params.min_p, "right")
            ids, weights = ids[:n], weights[:n]
        kept = weights > 0  # tokens at -inf (outside a draft's shortlist) never draw
        if not kept.all():
            ids, weights = ids[kept], weights[kept]
        return Candidates(ids, weights, tail)

    def _kth(self, z, top, k) -> float:
        """The k-th largest logit: selected among those within `spread` of the max when
        there are enough of them (one vector comparison), else over the whole vocabulary."""
        near = z[z >= top - self.spread]
        if near.size < k or near.size > 64 * k:
            kth = float(np.partition(z, -k)[-k])
            self.spread = max(1.0, 2 * (top - kth))
            return kth
        return float(np.partition(near, -k)[-k])


def _nucleus(ids, weights, tail, top_p):
    """The smallest prefix of the likeliest-first candidates whose mass reaches top_p of
    the whole (candidates and tail): when the candidates do not reach it, the tail is
    sorted in too (a flat distribution)."""
    total = float(weights.sum()) + (float(tail.sum()) if tail is not None else 0.0)
    cumulative = np.cumsum(weights)
    if cumulative[-1] < top_p * total and tail is not None:
        rest = np.flatnonzero(tail)
        ids = np.concatenate([ids, rest])
        weights = np.concatenate([weights, tail[rest].astype(np.float64)])
        order = np.argsort(-weights, kind="stable")
        ids, weights = ids[order], weights[order]
        cumulative = np.cumsum(weights)
    n = min(np.searchsorted(cumulative, top_p * total) + 1, ids.size)
    return ids[:n], weights[:n]


def distribution(logits: np.ndarray, history, params: SamplingParams) -> np.ndarray:
    """The probabilities a sampler draws the token after `history` from (vocabulary-sized)."""
    sampler = Sampler(params)
    if params.greedy:
        return np.eye(logits.size)[int(np.argmax(sampler.penalized(logits, history)))]
    return sampler.candidates(sampler.penalized(logits, history)).probabilities(logits.size)


def penalize(logits: np.ndarray, history, params: SamplingParams) -> np.ndarray:
    """The logits with the penalties of `params` for the tokens of `history`."""
    return Sampler(params).penalized(logits, history)
