"""Logits to tokens: penalties, temperature, top-k, top-p, min-p, seeded draws.

`Sampler.candidates` is the single definition of "the model's distribution at a position
given its history"; greedy decoding takes the argmax of the penalized logits, sampling
draws from the candidates.

Cost: the chain touches the whole vocabulary only in a few float32 vector passes (with
top-k a max and a comparison; without top-k a copy for the penalties and an exponential)
and sorts and normalizes just the tokens a filter keeps, top-k's few in plain Python lists:
between two ONNX Runtime runs a numpy call's fixed cost outweighs the work on so few
(DESIGN.md). Penalties read token counts kept up to date as the history grows, not the
history itself.

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
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from .options import DEFAULT, SAMPLING

# Without a top-k or top-p or min-p filter every token keeps some probability: tokens whose
# weight is below this fraction of the likeliest's are drawn, in id order, only when the
# uniform falls past all the others (rarely), so most draws sort a few hundred tokens.
TAIL = 2.0 ** -12
SMALLEST = 5e-324  # the smallest positive float64: a weight below it is 0


@dataclass(frozen=True)
class SamplingParams:
    """The sampling options (options.SAMPLING: their defaults, ranges and help)."""
    temperature: float = DEFAULT["temperature"]
    top_k: int = DEFAULT["top_k"]
    top_p: float = DEFAULT["top_p"]
    min_p: float = DEFAULT["min_p"]
    # repetition divides seen tokens' positive logits (CTRL's); presence is subtracted from
    # every seen token's logit, frequency once per occurrence (OpenAI's)
    repetition_penalty: float = DEFAULT["repetition_penalty"]
    presence_penalty: float = DEFAULT["presence_penalty"]
    frequency_penalty: float = DEFAULT["frequency_penalty"]
    seed: int = DEFAULT["seed"]

    def __post_init__(self):
        for option in SAMPLING:
            option.check(getattr(self, option.name))

    def with_options(self, **given) -> "SamplingParams":
        """These settings with the given fields replaced (None: not given, keep ours). A
        temperature of 0 given over them is plain greedy decoding: our filters and
        penalties are for sampling, so only the penalties given alongside apply."""
        given = {k: v for k, v in given.items() if v is not None}
        base = SamplingParams(seed=self.seed) if given.get("temperature") == 0 else self
        return dataclasses.replace(base, **given)

    def describe(self) -> str:
        """The settings that are on, in words: "greedy" or "temperature 0.8, top-k 40, ...",
        with the seed when one is set and the reply samples."""
        if self.greedy and not self.penalized:
            return "greedy"
        neutral = SamplingParams()
        parts = ["greedy" if self.greedy else f"temperature {self.temperature:g}"] + [
            f"{name.replace('_', ' ').replace('top ', 'top-').replace('min ', 'min-')} "
            f"{getattr(self, name):g}" for name in SAMPLING_FIELDS[1:]
            if getattr(self, name) != getattr(neutral, name)]
        if not self.greedy and self.seed is not None:
            parts.append(f"seed {self.seed}")
        return ", ".join(parts)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def raises(self) -> bool:
        """Whether a penalty may raise a seen token's logit (a negative one, or below 1)."""
        return (self.repetition_penalty < 1.0 or self.presence_penalty < 0.0
                or self.frequency_penalty < 0.0)


# What a reply samples with when the model recommends nothing (a GGUF carries no sampling
# settings): the usual settings of local chat tools. Greedy is --temperature 0.
CHAT_DEFAULTS = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1)
SAMPLING_FIELDS = tuple(option.name for option in SAMPLING if option.name != "seed")


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
        if len(history) > self.length:  # verify rows of a round share one history
            self.extend(history[self.length:])
            self.length = len(history)

    def extend(self, tokens):
        for token in tokens:
            self.add(token)

    def retract(self, tokens):
        """Undo extend(tokens)."""
        for token in reversed(tokens):
            self.remove(token)

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
    """The tokens a position may draw, the likeliest first, and their weights
    (probabilities relative to the likeliest's) with their running sum; `tail`: the rest of
    the vocabulary's weights when no filter cut it (drawn from in id order), else None.
    Arrays, or lists where they are few."""
    ids: np.ndarray
    weights: np.ndarray
    cumulative: np.ndarray
    tail: np.ndarray = None

    def draw(self, u: float) -> int:
        """The token at u in [0, 1) of the cumulative weights: the likeliest first, then
        the tail in id order."""
        head = float(self.cumulative[-1])
        target = u * (head + (float(self.tail.sum()) if self.tail is not None else 0.0))
        if target < head or self.tail is None:
            return int(self.ids[min(bisect_right(self.cumulative, target), len(self.ids) - 1)])
        rest = np.flatnonzero(self.tail)
        cumulative = np.cumsum(self.tail[rest], dtype=np.float64)
        i = np.searchsorted(cumulative, target - head, "right")
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
        self.counts = None  # TokenCounts of the history, when a penalty reads them
        self.spread = 8.0  # how far below the max near_top looks first (adapts; never
        # changes the result, only how many tokens the exact selection reads)

    @property
    def top_needed(self):
        """How many of a position's largest logits (with the ties of the last) decide its
        token: 1 when greedy, top-k when sampling with it; None when a penalty or a filter
        reads the whole row."""
        params = self.params
        if params.penalized:
            return None
        return 1 if params.greedy else params.top_k or None

    def __call__(self, logits, history, pending=()) -> int:
        """logits: a position's, or (when top_needed) its ranked() top of that many, as the
        head computes them on a GPU. pending: tokens after `history` not committed yet (a
        round's drafts)."""
        params = self.params
        if isinstance(logits, list):
            if params.greedy:
                return logits[0][1]
            return self._top_k_candidates(logits).draw(
                uniform(self.seed, len(history) + len(pending)))
        z = logits if logits.dtype == np.float32 else logits.astype(np.float32)
        if not params.penalized and params.greedy:
            return int(np.argmax(z))
        counts = self._count(z.size, history, pending)
        try:
            if params.greedy:  # the argmax of the penalized logits (ties: the lower id)
                return self.ranked_top(z, 1)[0][1]
            return self.candidates(z).draw(uniform(self.seed, len(history) + len(pending)))
        finally:
            if counts is not None:
                counts.retract(pending)

    def _count(self, vocab, history, pending):
        """Bring the token counts up to history + pending (None when no penalty is on)."""
        if not self.params.penalized:
            return None
        if self.counts is None:
            self.counts = TokenCounts(vocab)
        self.counts.follow(history)
        self.counts.extend(pending)
        return self.counts

    def penalized(self, logits: np.ndarray, history, pending=()) -> np.ndarray:
        """float32 logits of the whole vocabulary with the penalties for the tokens of
        history + pending applied (the input itself when no penalty is on)."""
        z = logits if logits.dtype == np.float32 else logits.astype(np.float32)
        counts = self._count(z.size, history, pending)
        try:
            return self._penalize_all(z)
        finally:
            if counts is not None:
                counts.retract(pending)

    def _penalize_all(self, z: np.ndarray) -> np.ndarray:
        """A copy of `z` with the penalties for the counted tokens (`z` when none is on)."""
        if self.counts is None:
            return z
        z = z.copy()
        seen = self.counts.seen[:self.counts.n_seen]
        z[seen] = self._penalize(z[seen], self.counts.count[seen])
        return z

    def _penalize(self, values: np.ndarray, count: np.ndarray) -> np.ndarray:
        """Penalized logits of tokens seen count (> 0) times."""
        params = self.params
        if params.repetition_penalty != 1.0:
            values = np.where(values > 0, values / np.float32(params.repetition_penalty),
                              values * np.float32(params.repetition_penalty))
        if params.presence_penalty or params.frequency_penalty:
            values = values - (np.float32(params.presence_penalty)
                               + np.float32(params.frequency_penalty) * count)
        return values.astype(np.float32, copy=False)

    def near_top(self, z: np.ndarray, k: int):
        """(ids ascending, their penalized logits) of a few tokens that include the k with
        the largest penalized logits, read with numpy passes over the vocabulary:
        the tokens within `spread` of the raw max, once they hold k unseen ones (a penalty
        that only lowers cannot lift a token from below them), and when a penalty may raise
        a logit every seen token too."""
        params, counts = self.params, self.counts
        top = float(z.max())
        while True:
            ids = np.flatnonzero(z >= top - self.spread)
            seen = counts.count[ids] if counts is not None else None
            unseen = ids.size - (np.count_nonzero(seen) if seen is not None else 0)
            if unseen >= k or not math.isfinite(self.spread):
                break
            self.spread *= 2  # too few: look further down (logits at -inf: all of them)
            if self.spread > 1e4:
                self.spread = math.inf
        if ids.size > 2 * k + 8 and math.isfinite(self.spread):
            self.spread *= 0.8  # more than needed: look less far next time
        values = z[ids]
        keep = ids.size - unseen + k  # the largest `keep` raw logits hold k unseen tokens
        if ids.size > 4 * keep + 64 and not params.raises:
            # far too many (a flat distribution after a peaked one): keep the `keep` largest
            # and their ties. A penalty only lowers, so no token below them can reach the
            # k-th of the unseen among them.
            hit = values >= np.partition(values, ids.size - keep)[ids.size - keep]
            ids, values = ids[hit], values[hit]
            seen = seen[hit] if seen is not None else None
        if counts is None:
            return ids, values
        if params.raises:
            ids = np.union1d(ids, counts.seen[:counts.n_seen])
            seen = counts.count[ids]
            values = z[ids]
        hit = seen > 0
        values[hit] = self._penalize(values[hit], seen[hit])
        return ids, values

    def ranked_top(self, z: np.ndarray, k: int) -> list:
        """[(-penalized logit, id)] of the k tokens with the largest penalized logits and
        every token tied with the k-th, the largest first, ties by id."""
        ids, values = self.near_top(z, k)
        order = np.argsort(-values, kind="stable")  # ids ascend: ties stay in id order
        values = values[order]
        n = np.searchsorted(-values, -values[k - 1], "right") \
            if ids.size > k else ids.size  # ties with the k-th stay
        return list(zip((-values[:n]).tolist(), ids[order[:n]].tolist()))

    def candidates(self, z: np.ndarray) -> Candidates:
        """Temperature, then top-k, top-p and min-p, over raw logits `z` (the token counts
        up to date when a penalty is on)."""
        params, t = self.params, self.params.temperature
        if params.top_k and params.top_k < z.size:
            return self._top_k_candidates(self.ranked_top(z, params.top_k))
        tail = None
        z = self._penalize_all(z)
        top = float(z.max())
        if params.top_p < 1.0 or not params.min_p:  # every token's weight counts
            every = np.exp((z - top) / np.float32(t))
            ids = np.flatnonzero(every >= TAIL)
            weights = every[ids].astype(np.float64)
            every[ids] = 0.0
            tail = every
        else:  # min-p alone bounds the logits kept (the exact cut is on the weights)
            ids = np.flatnonzero(z >= top + t * math.log(params.min_p) - 1e-3)
            weights = np.exp((z[ids] - top).astype(np.float64) / t)
        order = np.argsort(-weights, kind="stable")
        ids, weights = ids[order], weights[order]
        if params.top_p < 1.0:
            ids, weights = _nucleus(ids, weights, tail, params.top_p)
            tail = None
        n = _min_p_size(weights, len(weights), params.min_p)
        ids, weights = ids[:n], weights[:n]
        return Candidates(ids, weights, np.cumsum(weights), tail)

    def _top_k_candidates(self, ranked: list) -> Candidates:
        """candidates' chain after top-k on its few tokens (ranked_top's), in Python lists."""
        params = self.params
        first = ranked[0][0]
        weights = [math.exp((first - v) / params.temperature) for v, _ in ranked]
        cumulative = list(accumulate(weights))
        n = _nucleus_size(cumulative, cumulative[-1], params.top_p) \
            if params.top_p < 1.0 else len(weights)
        n = _min_p_size(weights, n, params.min_p)
        return Candidates([i for _, i in ranked[:n]], weights[:n], cumulative[:n])


def _nucleus(ids, weights, tail, top_p):
    """The smallest prefix of the likeliest-first candidates whose mass reaches top_p of
    the whole (candidates and tail): when the candidates do not reach it, the tail is
    sorted in too (a flat distribution)."""
    cumulative = np.cumsum(weights)
    total = float(cumulative[-1]) + (float(tail.sum()) if tail is not None else 0.0)
    if cumulative[-1] < top_p * total and tail is not None:
        rest = np.flatnonzero(tail)
        ids = np.concatenate([ids, rest])
        weights = np.concatenate([weights, tail[rest].astype(np.float64)])
        order = np.argsort(-weights, kind="stable")
        ids, weights = ids[order], weights[order]
        cumulative = np.cumsum(weights)
    n = _nucleus_size(cumulative, total, top_p)
    return ids[:n], weights[:n]


def _nucleus_size(cumulative, total: float, top_p: float) -> int:
    """How many of the likeliest-first candidates (their running sum) reach top_p of `total`."""
    return min(bisect_left(cumulative, top_p * total) + 1, len(cumulative))


def _min_p_size(weights, n: int, min_p: float) -> int:
    """How many of the first n falling weights min-p keeps (the likeliest weighs 1); tokens
    at -inf (outside a draft's shortlist) never draw, so one search cuts both."""
    return bisect_right(weights, -max(min_p, SMALLEST), 0, n, key=lambda w: -w)


def ranked(values: np.ndarray, ids: np.ndarray) -> list:
    """[(-logit, id)], the largest first, ties by id: Sampler.ranked_top's order."""
    order = np.lexsort((ids, -values))
    return list(zip((-values[order]).tolist(), ids[order].tolist()))


def row_top(z: np.ndarray, k: int) -> list:
    """ranked() of a row's k largest logits and every tie of the k-th."""
    kth = np.partition(z, z.size - k)[z.size - k]
    ids = np.flatnonzero(z >= kth)
    return ranked(z[ids], ids)


def top_probability(logits) -> float:
    """The probability of the likeliest token (temperature 1, no filter)."""
    z = logits - logits.max()
    return float(1.0 / np.exp(z, dtype=np.float64).sum())


def distribution(logits: np.ndarray, history, params: SamplingParams) -> np.ndarray:
    """The probabilities a sampler draws the token after `history` from (vocabulary-sized)."""
    sampler = Sampler(params)
    if params.greedy:
        return np.eye(logits.size)[sampler(logits, history)]
    sampler._count(logits.size, history, ())
    return sampler.candidates(logits.astype(np.float32)).probabilities(logits.size)


def penalize(logits: np.ndarray, history, params: SamplingParams) -> np.ndarray:
    """The logits with the penalties of `params` for the tokens of `history`."""
    return Sampler(params).penalized(logits, history)
