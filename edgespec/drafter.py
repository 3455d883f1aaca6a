"""The drafter interface: what the decode round (rounds.py) asks of a way to guess the next
tokens. A drafter only proposes; the round runs the engine.

Each round the round asks every drafter of a sequence for an offer after its history
within a budget (how many drafts at most): lookup offers the drafts it copied and the
chance that each is accepted, for the planner to weigh against the round's measured cost;
the early exit offers how many it would draw (its k, from its timing) and draws them in the
round from the draft head's logits (EarlyExit.next_draft). After the verifier decided, the
drafter hears what was accepted and what the round took. Without an offer the round is a
plain step. A drafter changes the speed, never the output: the verifier decides.
"""
from dataclasses import dataclass

import numpy as np

SMOOTHING = 0.25    # weight of the newest round in the moving averages
PROBE_STEPS = 2     # plain steps that measure the baseline before a timed drafter drafts
# A round's cost by rows, in plain steps, for an artifact that measured none of its own
ROUND_COSTS = {1: 1.0, 2: 1.14, 3: 1.41, 4: 1.61, 5: 1.84, 6: 2.02, 8: 2.38}


@dataclass(frozen=True)
class Offer:
    drafter: "Drafter"
    k: int              # the most drafts it would make this round (>= 1)
    value: float = 0.0  # a timed drafter's measured tokens per plain step (0: not known)
    tokens: tuple = ()  # the drafts, when known before the round (lookup's copies)
    chances: tuple = ()  # chances[j]: that drafts 0..j are all accepted; given, the planner
    #                      chooses how many of the k to verify, else all k are
    plan: object = None  # the drafter's own notes for `observe`


class Drafter:
    """Subclasses set `name` and implement `offer`; `from_policy` makes one for a draft
    policy (None when the policy turns it off)."""
    name = ""

    @classmethod
    def from_policy(cls, policy, pace) -> "Drafter":
        raise NotImplementedError

    def new_text(self, sampled: bool):
        """A new generation begins (sampled: the verifier samples rather than argmaxes)."""

    def for_text(self, owner=None) -> "Drafter":
        """The drafter for one more text decoded beside others: itself when what it keeps
        is the model's, a twin with the text's own state otherwise. What it keeps of earlier
        texts is shared only between texts of one `owner` (None: the model's own)."""
        return self

    def end_text(self):
        """A text (see for_text) has ended."""

    def offer(self, history: list, budget: int) -> Offer:
        """What it would draft after `history` (at most `budget` tokens), or None."""
        raise NotImplementedError

    def observe(self, offer: Offer, drafted: int, accepted: int, seconds):
        """What the verifier accepted of the round's drafts, and the round's seconds (None
        when the round decoded other sequences too: its time is not this text's)."""

    def forget(self):
        """Drop what it keeps of earlier texts (their replies); what it measured of the
        model (such as the early exit's timings) stays."""


def average(mean, value):
    return value if mean is None else mean + SMOOTHING * (value - mean)


class PlainSpeed:
    """Plain decoding's measured speed, the yardstick a timed drafter is judged by (one per
    loaded model and draft policy)."""

    def __init__(self):
        self.plain_s, self.plain_steps = None, 0  # seconds a plain step, steps measured
        self.produced = 0  # tokens committed, all generations

    def record(self, committed: int, seconds: float, plain: bool):
        self.produced += committed
        if plain:
            self.plain_s = average(self.plain_s, seconds)
            self.plain_steps += 1

    @property
    def probed(self) -> bool:
        return self.plain_steps >= PROBE_STEPS


class RoundCosts:
    """What a round costs by rows, in plain steps, as the artifact measured it: for one
    sequence on the single-sequence graphs, and for 2 to 8 on the batch graphs."""

    def __init__(self, measured: dict, most: int):
        self.measured = measured  # the manifest's round_costs and batch_round_costs
        self.single = costs_by_rows(measured.get("round_costs") or ROUND_COSTS, most)
        self.batch = {int(slots): costs_by_rows({1: 1.0, **by_rows}, most)
                      for slots, by_rows in (measured.get("batch_round_costs") or {}).items()}

    def for_sequences(self, n: int) -> list:
        """The cost by rows of a round of n sequences (index: rows), None when not measured."""
        if n == 1:
            return self.single
        return next((self.batch[s] for s in sorted(self.batch) if s >= n), None)


def costs_by_rows(measured: dict, most: int) -> list:
    """Round cost in plain steps for 0..most rows (index = rows): interpolated between the
    measured row counts (which include 1), extended beyond them with the last slope."""
    measured = {int(rows): float(cost) for rows, cost in measured.items()}
    rows = sorted(measured)
    costs = [measured[r] / measured[1] for r in rows]
    slope = (costs[-1] - costs[-2]) / (rows[-1] - rows[-2]) if len(rows) > 1 else 0.0
    return [0.0] + [float(np.interp(r, rows, costs)) if r <= rows[-1]
                    else costs[-1] + slope * (r - rows[-1]) for r in range(1, most + 1)]
