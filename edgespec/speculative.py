"""Self-speculative decoding: draft with the early exit, verify with the full model, accept.

One round, starting with the last committed token t (not yet in any cache):
1. draft:    lower(t), then up to k times: head(exit state) -> draft token d, lower(d).
             Each lower call is one token, exactly as in plain decoding.
2. verify:   upper on the exit states of t, d_1..d_n (one call), head on its rows: the
             verifier's distribution after t and after every draft, the last one the bonus.
3. accept:   greedy, the longest prefix where the verifier chooses the draft; sampling, the
             speculative-sampling rule (keeps the verifier's distribution exactly). Then the
             verifier's own token: the correction at the first rejection, or the bonus.
4. roll back: both caches keep t and the accepted drafts. Nothing is copied.
"""
import time
from dataclasses import asdict, dataclass

import numpy as np

from .engine import Engine
from .errors import EdgespecError
from .sampling import SamplingParams, distribution, penalize


@dataclass(frozen=True)
class DraftPolicy:
    """k: the most drafts a round; threshold: stop drafting when the draft's top
    probability falls below it (0: always draft k)."""
    k: int = 4
    threshold: float = 0.0

    def __post_init__(self):
        if not isinstance(self.k, int) or not 1 <= self.k <= 16:
            raise EdgespecError(f"invalid draft-k {self.k}: it must be an integer in 1..16")
        if not 0 <= self.threshold < 1:
            raise EdgespecError(f"invalid draft-threshold {self.threshold}: it must be in [0, 1)")


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0     # lower runs
    verify_s: float = 0.0    # upper runs
    head_s: float = 0.0      # head runs, draft and verify
    sampling_s: float = 0.0  # choosing, accepting (host side)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_per_round(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Committed tokens per verify round: accepted drafts plus the verifier's token."""
        return self.accepted_per_round + 1 if self.rounds else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "acceptance": self.acceptance,
                "accepted_per_round": self.accepted_per_round,
                "tokens_per_round": self.tokens_per_round}

    @classmethod
    def from_dict(cls, values: dict) -> "SpecStats":
        return cls(**{name: values[name] for name in cls.__dataclass_fields__})

    def line(self) -> str:
        total = self.draft_s + self.verify_s + self.head_s + self.sampling_s or 1.0
        share = " ".join(f"{name} {100 * getattr(self, name + '_s') / total:.0f}%"
                         for name in ("draft", "verify", "head", "sampling"))
        return (f"accepted {self.accepted}/{self.drafted} ({100 * self.acceptance:.1f}%), "
                f"{self.tokens_per_round:.1f} tokens/round, {share}")


class _Timer:
    """Charges the time since the last charge to one of the stats' fields."""

    def __init__(self, stats):
        self.stats = stats
        self.restart()

    def restart(self):
        """Start counting afresh (after the consumer of a round had its turn)."""
        self.last = time.perf_counter()

    def charge(self, field):
        now = time.perf_counter()
        setattr(self.stats, field, getattr(self.stats, field) + now - self.last)
        self.last = now


class SpeculativeDecoder:
    def __init__(self, engine: Engine, params: SamplingParams, policy: DraftPolicy,
                 stats: SpecStats):
        self.engine, self.params, self.policy, self.stats = engine, params, policy, stats
        self.rng = np.random.default_rng(params.seed)

    def choose(self, logits, history, pending=()):
        """(token, its distribution or None when greedy) from logits at one position whose
        history is history + pending (joined only when a penalty or sampling reads it)."""
        if self.params.greedy and self.params.repetition_penalty == 1.0:
            return int(np.argmax(logits)), None
        seen = history + list(pending) if pending else history
        if self.params.greedy:
            return int(np.argmax(penalize(logits, seen, self.params.repetition_penalty))), None
        p = distribution(logits, seen, self.params)
        return int(self.rng.choice(p.size, p=p)), p

    def draft(self, token, history, budget, timer):
        """Feed `token`, then propose up to `budget` drafts; (drafts, their distributions)."""
        engine, drafts, dists = self.engine, [], []
        engine.lower([token])
        timer.charge("draft_s")
        while len(drafts) < budget:
            logits = engine.head(engine.exit_states, [engine.lower_len - 1])[0]
            timer.charge("head_s")
            if self.policy.threshold and _top_probability(logits) < self.policy.threshold:
                break
            d, q = self.choose(logits, history, drafts)
            drafts.append(d)
            dists.append(q)
            timer.charge("sampling_s")
            engine.lower([d])
            timer.charge("draft_s")
        return drafts, dists

    def verify(self, n_drafts, timer):
        """Verifier logits after the round's first token and after each draft (n + 1 rows)."""
        first = self.engine.upper(n_drafts + 1)
        timer.charge("verify_s")
        logits = self.engine.head(self.engine.final_states, range(first, first + n_drafts + 1))
        timer.charge("head_s")
        return logits

    def accept(self, drafts, dists, logits, history):
        """The committed tokens of the round: accepted drafts, then the verifier's token."""
        for i, d in enumerate(drafts):
            if self.params.greedy:
                target, _ = self.choose(logits[i], history, drafts[:i])
                if target != d:
                    return drafts[:i] + [target]
                continue
            p, q = distribution(logits[i], history + drafts[:i], self.params), dists[i]
            if self.rng.random() * q[d] >= p[d]:  # reject with probability 1 - min(1, p/q)
                residual = np.maximum(p - q, 0.0)
                return drafts[:i] + [int(self.rng.choice(p.size, p=residual / residual.sum()))]
        return drafts + [self.choose(logits[len(drafts)], history, drafts)[0]]

    def rounds(self, first_logits, history: list, max_new_tokens: int):
        """Yield lists of committed tokens, one list per round (the first from prefill)."""
        engine, stats = self.engine, self.stats
        timer = _Timer(stats)
        first, _ = self.choose(first_logits, history)
        timer.charge("sampling_s")
        history.append(first)
        yield [first]
        timer.restart()
        produced = 1
        while produced < max_new_tokens:
            room = engine.max_context - len(history)  # positions left after the token fed
            budget = max(0, min(self.policy.k, max_new_tokens - produced - 1, room))
            base = engine.lower_len
            drafts, dists = self.draft(history[-1], history, budget, timer)
            logits = self.verify(len(drafts), timer)
            committed = self.accept(drafts, dists, logits, history)
            timer.charge("sampling_s")
            engine.rollback(base + len(committed))
            stats.rounds += 1
            stats.drafted += len(drafts)
            stats.accepted += len(committed) - 1
            history.extend(committed)
            produced += len(committed)
            yield committed
            timer.restart()


def _top_probability(logits) -> float:
    z = logits - logits.max()
    return float(1.0 / np.exp(z, dtype=np.float64).sum())
