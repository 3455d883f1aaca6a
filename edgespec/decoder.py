"""The decode loop: draft, verify with the full model, accept. Plain decoding is this loop
with no drafter.

One round, starting with the last committed token t (not yet in any cache):
1. draft:    the drafter with the best offer (drafter.py) feeds t and its drafts d_1..d_n
             through lower; with no offer, lower runs on t alone (a plain step).
2. verify:   upper on the exit states of t, d_1..d_n (one call), head on its rows: the
             verifier's distribution after t and after every draft, the last one the bonus.
3. accept:   the longest prefix where the verifier chooses the draft, then the verifier's
             own token: the correction at the first mismatch, or the bonus. Greedy chooses
             the argmax, sampling draws with the position's own uniform (sampling.py), so
             the committed tokens are exactly those plain decoding commits, greedy or seeded.
4. roll back: both caches keep t and the accepted drafts. Nothing is copied.
"""
import time

from .drafter import Pace
from .early_exit import EarlyExit
from .engine import Engine
from .lookup import PromptLookup
from .sampling import Sampler
from .settings import DraftPolicy
from .stats import DecodeStats, DrafterStats

# Every drafter, in the order that breaks ties between equal offers (the cheaper first: a
# lookup round runs no draft head). A new drafter is a module and a line here.
DRAFTERS = (PromptLookup, EarlyExit)


def drafters_for(policy: DraftPolicy, engine: Engine, pace: Pace) -> list:
    """The drafters a policy turns on, each made for this engine."""
    made = (cls.from_policy(policy, engine, pace) for cls in DRAFTERS)
    return [d for d in made if d is not None]


def best_offer(drafters: list, history: list, budget: int):
    """The offer with the most expected tokens per cost (ties: the earlier drafter), None
    when no drafter offers one."""
    if not (budget and drafters):
        return None
    offers = [o for o in (d.offer(history, budget) for d in drafters) if o]
    return max(offers, key=lambda o: o.value, default=None)


class Timer:
    """Charges the time since the last charge to one part of the stats' seconds."""

    def __init__(self, seconds: dict):
        self.seconds = seconds
        self.restart()

    def restart(self):
        """Start counting afresh (after the consumer of a round had its turn)."""
        self.last = time.perf_counter()

    def charge(self, part: str):
        now = time.perf_counter()
        self.seconds[part] += now - self.last
        self.last = now


class Decoder:
    """The decode loop of one sequence (the engine's current one while it runs)."""

    def __init__(self, engine: Engine, sampler: Sampler, drafters: list, pace: Pace):
        self.engine, self.sampler, self.drafters, self.pace = engine, sampler, drafters, pace
        self.stats = DecodeStats(drafters={d.name: DrafterStats() for d in drafters})
        self.timer = Timer(self.stats.seconds)
        for d in drafters:
            d.new_text(sampled=not sampler.params.greedy)

    def rounds(self, first_logits, history: list, max_new_tokens: int):
        """Yield lists of committed tokens, one list per round (the first from prefill).
        `history` (prompt + generated ids) is extended in place."""
        yield self.start(first_logits, history)
        produced = 1
        while produced < max_new_tokens:
            committed = self.round(history, max_new_tokens - produced)
            produced += len(committed)
            yield committed

    def start(self, first_logits, history: list) -> list:
        """The reply's first token, from the prompt's last logits."""
        self.timer.restart()
        first = self.sampler(first_logits, history)
        self.timer.charge("sampling")
        history.append(first)
        return [first]

    def budget(self, history: list, wanted: int) -> int:
        """The most drafts a round may make when `wanted` tokens are still to come."""
        room = self.engine.max_context - len(history)  # positions left after the token fed
        return max(0, min(wanted - 1, room))

    def round(self, history: list, wanted: int) -> list:
        """One round on the engine's current sequence: the tokens it commits (at least one,
        at most `wanted`), appended to `history`."""
        engine, timer = self.engine, self.timer
        timer.restart()
        began, base = timer.last, len(history) - 1  # the last token's position
        engine.rollback(base)
        offer = best_offer(self.drafters, history, self.budget(history, wanted))
        if offer is None:
            engine.lower([history[-1]])
            timer.charge("draft")
            drafts = []
        else:
            drafts = offer.drafter.draft(offer, history, self.sampler, timer)
        logits = self.verify(len(drafts), timer)
        committed = accept(self.sampler, drafts, logits, history)
        timer.charge("sampling")
        engine.rollback(base + len(committed))
        self.record(offer, len(drafts), committed, timer.last - began)
        history.extend(committed)
        return committed

    def record(self, offer, drafted: int, committed: list, seconds: float):
        """What a round did, for the pace, its drafter and the statistics."""
        self.pace.record(len(committed), seconds, plain=offer is None)
        if offer is not None:
            offer.drafter.observe(offer, drafted, len(committed) - 1, seconds)
        self.stats.record(offer and offer.drafter.name, drafted, len(committed) - 1)

    def verify(self, n_drafts, timer):
        """Verifier logits after the round's first token and after each draft (n + 1 rows),
        or the few largest that decide the token where the head computes them."""
        engine, rows, k = self.engine, range(n_drafts + 1), self.sampler.top_needed
        engine.upper(n_drafts + 1)
        timer.charge("verify")
        if k and engine.computes_top(k):
            logits = engine.head_top(engine.final_states, rows, k)
        else:
            logits = engine.head(engine.final_states, rows)
        timer.charge("head")
        return logits


def accept(sampler, drafts, logits, history) -> list:
    """The committed tokens of a round: accepted drafts, then the verifier's token."""
    for i, d in enumerate(drafts):
        target = sampler(logits[i], history, drafts[:i])
        if target != d:
            return drafts[:i] + [target]
    return drafts + [sampler(logits[len(drafts)], history, drafts)]
