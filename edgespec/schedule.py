"""Never slower: each round's drafter and k come from measured speed.

The early exit is timed. Plain steps give the baseline (seconds per token); for the exit the
scheduler keeps moving averages of a round's seconds and committed tokens. When its
tokens per second fall below plain decoding's it is paused for a while (twice as long each
time it loses again), then tried afresh: acceptance changes with the text. Its k starts
at 2, doubles after a round that accepted every draft (up to the policy's k) and drops to
one more than the drafts accepted after a round that did not: a missed verify of many
rows costs up to two plain steps (measured on the dev prompts against +1/-1 from the
policy's k, when lookup was scheduled the same way: mean speedup over plain 1.32x vs 1.28x
on SmolLM2). Scheduling changes the speed, never the output.

A model keeps its scheduler from one generation to the next, so an early exit that keeps
losing stays paused instead of paying its trial rounds in every reply.

Prompt lookup is planned instead of timed: a match (lookup.py) comes with how long it is and
whether its earlier occurrences agreed, and the rate at which such matches' tokens were
accepted (measured priors, refined by the prompt's own rounds). With the artifact's round
cost by rows, each round verifies the k tokens that maximize expected committed tokens per
unit of cost, none when no k beats a plain step. Its drafts then depend on the text alone,
not on clock noise, and a round never costs more than its expected tokens pay for. The
rates start afresh with each prompt: lookup's worth is the text's. A round whose match is
expected to earn less than the early exit measures goes to the exit.
"""
import numpy as np

DRAFTERS = ("exit", "lookup")
SMOOTHING = 0.25     # weight of the newest round in the moving averages
PROBE_STEPS = 2      # plain steps that measure the baseline before any drafting
TRIAL_ROUNDS = 4     # rounds a drafter gets before it is judged
FIRST_PAUSE = 16     # tokens decoded without a drafter after it first loses
MAX_PAUSE = 256
START_K = 2          # drafts a round before a drafter has shown it earns more

# How often a lookup match's next token was the verifier's, by match length (1..6 or more)
# and kind: SmolLM2-135M's greedy replies to 65 dev prompts (5 a category), 128 tokens each.
# A draft's later tokens count as a "single" match grown by the tokens before them.
LOOKUP_PRIOR = {"agreed": (.50, .78, .88, .90, .90, .97),
                "single": (.29, .52, .61, .70, .73, .84),
                "split": (.19, .28, .33, .33, .33, .50)}
# The same rates when the verifier samples (a draft is accepted when the verifier draws it):
# the same replies sampled with the chat defaults, every match along them counted, made
# monotone in the length where few matches were seen.
LOOKUP_PRIOR_SAMPLED = {"agreed": (.56, .72, .80, .80, .80, .80),
                        "single": (.17, .31, .45, .50, .50, .72),
                        "split": (.08, .10, .20, .20, .20, .20)}
LONG_MATCH = 6       # matches this long or longer share one rate
PRIOR_ROUNDS = 8     # drafts' worth of evidence each prior counts for
# A round through lower, upper and head by rows, in plain steps: SmolLM2 int4, 2 threads,
# 200 cached positions (the default when the manifest has no measurement of its own)
ROUND_COSTS = {1: 1.0, 2: 1.14, 3: 1.41, 4: 1.61, 5: 1.84, 6: 2.02, 8: 2.38}


def _average(mean, value):
    return value if mean is None else mean + SMOOTHING * (value - mean)


class _Drafter:
    def __init__(self, k_max):
        self.k_max, self.k = k_max, min(START_K, k_max)
        self.forget()

    def forget(self):
        """Start with no record: no pause, no measurements (k stays)."""
        self.pause, self.paused_until = FIRST_PAUSE, 0
        self.restart()

    def restart(self):
        self.seconds = self.tokens = None
        self.rounds = 0


class LookupPlan:
    """How many of a lookup match's tokens a round verifies (see the module doc)."""

    def __init__(self, k_max: int, round_costs: dict):
        self.k_max = k_max
        self.cost = _costs_by_rows(round_costs, k_max + 1)
        self.forget()

    def forget(self, sampled: bool = False):
        """A new text: no rates measured yet; the priors of greedy or sampled decoding."""
        self.hits, self.tries = {}, {}
        self.prior = LOOKUP_PRIOR_SAMPLED if sampled else LOOKUP_PRIOR
        self.pending = []  # the keys of the drafts of the round under way

    def rate(self, key) -> float:
        """How often such a draft token was accepted: the prior, then this text's rounds."""
        length, kind = key
        prior = self.prior[kind][length - 1]
        return (self.hits.get(key, 0) + PRIOR_ROUNDS * prior) / \
            (self.tries.get(key, 0) + PRIOR_ROUNDS)

    def k(self, match, budget: int, beat: float = 1.0) -> int:
        """The k with the most expected committed tokens per unit of cost, 0 when none
        earns more than `beat` (a plain step: 1 token a step)."""
        keys = [(min(match.length + i, LONG_MATCH), match.kind if i == 0 else "single")
                for i in range(min(self.k_max, budget))]
        best_k, best, expected, chain = 0, beat, 1.0, 1.0
        for k, key in enumerate(keys, 1):
            chain *= self.rate(key)  # the chance that the first k drafts are all accepted
            expected += chain
            if expected / self.cost[k + 1] > best:
                best_k, best = k, expected / self.cost[k + 1]
        self.pending = keys[:best_k]
        return best_k

    def record(self, accepted: int):
        for i, key in enumerate(self.pending[:accepted + 1]):  # drafts up to the first miss
            self.tries[key] = self.tries.get(key, 0) + 1
            self.hits[key] = self.hits.get(key, 0) + (i < accepted)
        self.pending = []


def _costs_by_rows(measured: dict, most: int) -> list:
    """Round cost in plain steps for 0..most rows (index = rows): interpolated between the
    measured row counts (which include 1), extended beyond them with the last slope."""
    measured = {int(rows): float(cost) for rows, cost in measured.items()}
    rows = sorted(measured)
    costs = [measured[r] / measured[1] for r in rows]
    slope = (costs[-1] - costs[-2]) / (rows[-1] - rows[-2]) if len(rows) > 1 else 0.0
    return [0.0] + [float(np.interp(r, rows, costs)) if r <= rows[-1]
                    else costs[-1] + slope * (r - rows[-1]) for r in range(1, most + 1)]


class Scheduler:
    def __init__(self, k_max: dict, adaptive: bool, round_costs: dict = None):
        """k_max: drafter name -> the most drafts a round (0: never use it); round_costs:
        rows -> a round's cost in plain steps (the artifact's measurement)."""
        self.exit = _Drafter(k_max.get("exit", 0))
        self.lookup = LookupPlan(k_max.get("lookup", 0), round_costs or ROUND_COSTS)
        self.adaptive = adaptive
        self.plain_s, self.plain_steps = None, 0  # seconds per plain step, steps measured
        self.produced = 0

    def new_text(self, sampled: bool = False):
        """A new prompt: forget what lookup learned of the last text. sampled: the verifier
        samples, so fewer of lookup's drafts are accepted."""
        self.lookup.forget(sampled)

    def lookup_k(self, match, budget: int) -> int:
        """How many of the match's tokens to draft this round (0: none)."""
        if match is None or not self.lookup.k_max:
            return 0
        if not self.adaptive:
            return min(self.lookup.k_max, budget)
        # a round whose match earns less than the early exit measures is the exit's
        return self.lookup.k(match, budget, beat=max(1.0, self._exit_value()))

    def _exit_value(self) -> float:
        """The early exit's measured speed in plain decoding's (0 while it is not drafting)."""
        d = self.exit
        if not self.exit_k(1) or d.seconds is None:
            return 0.0
        return d.tokens / d.seconds * self.plain_s

    def exit_k(self, budget: int) -> int:
        """How many early-exit drafts this round may make (0: do not use it)."""
        d = self.exit
        if not self.adaptive:
            return min(d.k_max, budget)
        if self.plain_steps < PROBE_STEPS or self.produced < d.paused_until:
            return 0
        return min(d.k, budget)

    def record(self, drafter, drafted: int, committed: int, seconds: float):
        """Account one round: `drafter` None for a plain step; an early exit's round may
        have drafted nothing (its cost still counts against it)."""
        self.produced += committed
        if not self.adaptive:
            return
        if drafter is None:
            self.plain_s = _average(self.plain_s, seconds)
            self.plain_steps += 1
            return
        if drafter == "lookup":
            self.lookup.record(committed - 1)
            return
        d = self.exit
        if drafted:  # a round without drafts (the confidence gate said no) says nothing of k
            d.k = min(d.k_max, 2 * d.k) if committed > drafted else committed
        d.seconds, d.tokens = _average(d.seconds, seconds), _average(d.tokens, committed)
        d.rounds += 1
        if d.rounds < TRIAL_ROUNDS:
            return
        if d.tokens / d.seconds < 1.0 / self.plain_s:
            d.paused_until = self.produced + d.pause
            d.pause = min(MAX_PAUSE, 2 * d.pause)
            d.restart()
        else:
            d.pause = FIRST_PAUSE
