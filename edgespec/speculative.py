"""Self-speculative decoding: draft cheaply, verify with the full model, accept.

One round, starting with the last committed token t (not yet in any cache):
1. draft:    prompt lookup (the tokens that followed the longest earlier match of the
             history's end) when the scheduler expects its tokens to pay, else the early
             exit: lower(t), then up to k times: draft head on the exit state -> draft
             token d, lower(d). A lookup round runs lower once
             on t and all its drafts. A round may also draft nothing: a plain step.
2. verify:   upper on the exit states of t, d_1..d_n (one call), head on its rows: the
             verifier's distribution after t and after every draft, the last one the bonus.
3. accept:   the longest prefix where the verifier chooses the draft, then the verifier's
             own token: the correction at the first mismatch, or the bonus. Greedy chooses
             the argmax, sampling races with the position's own noise (sampling.py), so the
             committed tokens are exactly those plain decoding commits, greedy or seeded.
4. roll back: both caches keep t and the accepted drafts. Nothing is copied.
The scheduler (never slower) picks the drafter and k each round from measured speed.
"""
import time
from dataclasses import asdict, dataclass

import numpy as np

from .engine import Engine
from .errors import EdgespecError
from .lookup import PromptLookup
from .sampling import Sampler, SamplingParams
from .schedule import DRAFTERS, Scheduler


@dataclass(frozen=True)
class DraftPolicy:
    """k: the most early-exit drafts a round (0: no early-exit drafting); threshold: stop
    drafting when the draft's top probability falls below it (0: always draft k);
    lookup_k: the most prompt-lookup drafts a round (0: no lookup); adaptive: let the
    scheduler choose each round's k (lookup's by expected value, the early exit's by
    timing, paused while slower than plain decoding)."""
    k: int = 4
    threshold: float = 0.0
    lookup_k: int = 0
    adaptive: bool = False

    def __post_init__(self):
        for name in ("k", "lookup_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 16:
                raise EdgespecError(f"invalid {_flag(name)} {value}: it must be an integer "
                                    "in 0..16")
        if not 0 <= self.threshold < 1:
            raise EdgespecError(f"invalid draft-threshold {self.threshold}: it must be in [0, 1)")


def new_scheduler(policy: DraftPolicy, round_costs: dict = None) -> Scheduler:
    """round_costs: rows -> a round's cost in plain steps, as the artifact measured it."""
    return Scheduler({"exit": policy.k, "lookup": policy.lookup_k}, adaptive=policy.adaptive,
                     round_costs=round_costs)


def _flag(name):
    return {"k": "draft-k", "lookup_k": "lookup-k"}[name]


@dataclass
class SpecStats:
    rounds: int = 0          # verify rounds, plain steps included
    drafted: int = 0
    accepted: int = 0
    exit_rounds: int = 0     # by drafter: early exit ...
    exit_drafted: int = 0
    exit_accepted: int = 0
    lookup_rounds: int = 0   # ... and prompt lookup
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    plain_steps: int = 0     # rounds without drafts (nothing to draft, or paused)
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
        by_drafter = ", ".join(
            f"{name} {getattr(self, name + '_accepted')}/{getattr(self, name + '_drafted')}"
            f" in {getattr(self, name + '_rounds')} rounds" for name in DRAFTERS)
        return (f"accepted {self.accepted}/{self.drafted} ({100 * self.acceptance:.1f}%; "
                f"{by_drafter}; {self.plain_steps} plain steps), "
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
                 stats: SpecStats, scheduler: Scheduler = None):
        """scheduler: one kept from earlier generations with the same policy (else new)."""
        self.engine, self.policy, self.stats = engine, policy, stats
        self.sampler = Sampler(params)
        self.lookup = PromptLookup()
        self.scheduler = scheduler or new_scheduler(policy)
        self.scheduler.new_text(sampled=not params.greedy)

    def draft(self, token, history, budget, timer):
        """Feed `token`, then propose up to `budget` drafts; (drafter, drafts)."""
        engine, drafts = self.engine, []
        match = self.lookup.match(history) if self.policy.lookup_k else None
        k = self.scheduler.lookup_k(match, min(budget, len(history) - match.position)) \
            if match else 0
        if k:
            proposal = match.continuation(history, k)
            engine.lower([token] + proposal)
            timer.charge("draft_s")
            return "lookup", proposal
        engine.lower([token])
        timer.charge("draft_s")
        k = self.scheduler.exit_k(budget)
        while len(drafts) < k:
            logits = engine.draft_head()
            timer.charge("head_s")
            if self.policy.threshold and _top_probability(logits) < self.policy.threshold:
                break
            d = self.sampler(logits, history, drafts)
            drafts.append(d)
            timer.charge("sampling_s")
            engine.lower([d])
            timer.charge("draft_s")
        # a round the gate stopped before any draft still paid for the draft head: the
        # early exit's account, not plain decoding's
        return ("exit" if k else None), drafts

    def verify(self, n_drafts, timer):
        """Verifier logits after the round's first token and after each draft (n + 1 rows)."""
        self.engine.upper(n_drafts + 1)
        timer.charge("verify_s")
        logits = self.engine.head(self.engine.final_states, range(n_drafts + 1))
        timer.charge("head_s")
        return logits

    def accept(self, drafts, logits, history):
        """The committed tokens of the round: accepted drafts, then the verifier's token."""
        for i, d in enumerate(drafts):
            target = self.sampler(logits[i], history, drafts[:i])
            if target != d:
                return drafts[:i] + [target]
        return drafts + [self.sampler(logits[len(drafts)], history, drafts)]

    def rounds(self, first_logits, history: list, max_new_tokens: int):
        """Yield lists of committed tokens, one list per round (the first from prefill)."""
        engine, stats = self.engine, self.stats
        timer = _Timer(stats)
        first = self.sampler(first_logits, history)
        timer.charge("sampling_s")
        history.append(first)
        yield [first]
        timer.restart()
        produced = 1
        while produced < max_new_tokens:
            began = timer.last
            room = engine.max_context - len(history)  # positions left after the token fed
            budget = max(0, min(max_new_tokens - produced - 1, room))
            base = engine.lower_len
            drafter, drafts = self.draft(history[-1], history, budget, timer)
            logits = self.verify(len(drafts), timer)
            committed = self.accept(drafts, logits, history)
            timer.charge("sampling_s")
            engine.rollback(base + len(committed))
            self._count(drafter, len(drafts), len(committed) - 1)
            self.scheduler.record(drafter, len(drafts), len(committed), timer.last - began)
            history.extend(committed)
            produced += len(committed)
            yield committed
            timer.restart()

    def _count(self, drafter, drafted, accepted):
        stats = self.stats
        stats.rounds += 1
        stats.drafted += drafted
        stats.accepted += accepted
        if not drafted:
            stats.plain_steps += 1
            return
        for field, value in (("rounds", 1), ("drafted", drafted), ("accepted", accepted)):
            name = f"{drafter}_{field}"
            setattr(stats, name, getattr(stats, name) + value)


def _top_probability(logits) -> float:
    z = logits - logits.max()
    return float(1.0 / np.exp(z, dtype=np.float64).sum())
