"""The drafter interface: what the decode loop asks of a way to guess the next tokens.

A round starts from the last committed token t. Each round the loop asks every drafter for
an offer for this position within a budget (how many drafts at most, and the committed
tokens it expects per unit of cost, a plain step being 1 token for 1); it takes the best
offer, has that drafter feed t and its drafts through the lower layers, verifies them with
the full model, and tells the drafter what was accepted and what the round took. Without
an offer the round is a plain step. Plain decoding is the loop with no drafters.

Costs are in plain steps, from `Pace`: the artifact's measured cost of a round by rows
(for drafters that plan) and plain decoding's measured seconds a token (for drafters that
time themselves). A drafter changes the speed, never the output: the verifier decides.
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
    value: float = 0.0  # expected committed tokens per plain step of cost (0: not known)
    plan: object = None  # the drafter's own notes for the round it offers


class Drafter:
    """Subclasses set `name` and implement the four methods; `from_policy` makes one for a
    draft policy (None when the policy turns it off)."""
    name = ""

    @classmethod
    def from_policy(cls, policy, engine, pace) -> "Drafter":
        raise NotImplementedError

    def new_text(self, sampled: bool):
        """A new generation begins (sampled: the verifier samples rather than argmaxes)."""

    def for_text(self, owner=None) -> "Drafter":
        """The drafter for one more text decoded beside the others (a batch): itself when
        what it keeps is the model's, a twin with the text's own state otherwise. What it
        keeps of earlier texts is shared only between texts of one `owner` (None: the
        model's own)."""
        return self

    def end_text(self):
        """A text decoded beside others (see for_text) has ended."""

    def offer(self, history: list, budget: int) -> Offer:
        """What it would draft after `history` (at most `budget` tokens), or None."""
        raise NotImplementedError

    def candidates(self, history: list, budget: int):
        """For a batch round, which plans the drafts of many sequences at once and runs
        them in one call: (drafts, chances, offer_for) for up to `budget` drafts made
        without the engine. chances[j]: the chance that drafts 0..j are all accepted (the
        tokens draft j adds, expected); offer_for(k): the offer of the first k, for
        `observe`. ([], [], None) when it has none or cannot draft in a batch."""
        return [], [], None

    def draft(self, offer: Offer, history: list, sampler, timer) -> list:
        """Feed history[-1] and the drafts through the engine's lower layers; the drafts.
        timer.charge(part) books the time since the last charge to a part of the step."""
        raise NotImplementedError

    def observe(self, offer: Offer, drafted: int, accepted: int, seconds: float):
        """What the verifier accepted of the round's drafts, and the round's seconds."""

    def forget(self):
        """Drop what it keeps of earlier texts (their replies); what it measured of the
        model (such as the early exit's timings) stays."""


def average(mean, value):
    return value if mean is None else mean + SMOOTHING * (value - mean)


class Pace:
    """The yardsticks drafters are judged by (one per loaded model and draft policy)."""

    def __init__(self, round_costs: dict = None):
        self.measured = round_costs or ROUND_COSTS
        self.plain_s, self.plain_steps = None, 0  # seconds a plain step, steps measured
        self.produced = 0  # tokens committed, all generations

    def costs(self, most: int) -> list:
        """A round's cost in plain steps for 0..most rows (index: rows)."""
        return costs_by_rows(self.measured, most)

    def record(self, committed: int, seconds: float, plain: bool):
        self.produced += committed
        if plain:
            self.plain_s = average(self.plain_s, seconds)
            self.plain_steps += 1

    @property
    def probed(self) -> bool:
        return self.plain_steps >= PROBE_STEPS


def costs_by_rows(measured: dict, most: int) -> list:
    """Round cost in plain steps for 0..most rows (index = rows): interpolated between the
    measured row counts (which include 1), extended beyond them with the last slope."""
    measured = {int(rows): float(cost) for rows, cost in measured.items()}
    rows = sorted(measured)
    costs = [measured[r] / measured[1] for r in rows]
    slope = (costs[-1] - costs[-2]) / (rows[-1] - rows[-2]) if len(rows) > 1 else 0.0
    return [0.0] + [float(np.interp(r, rows, costs)) if r <= rows[-1]
                    else costs[-1] + slope * (r - rows[-1]) for r in range(1, most + 1)]
