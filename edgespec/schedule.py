"""Never slower: each round's drafter and k come from measured speed.

Every round is timed. Plain steps give the baseline (seconds per token); per drafter the
scheduler keeps moving averages of a round's seconds and committed tokens. A drafter whose
tokens per second fall below plain decoding's is paused for a while (twice as long each
time it loses again), then tried afresh: acceptance changes with the text. Within a
drafter, k starts at 2, doubles after a round that accepted every draft (up to the
policy's k) and drops to one more than the drafts accepted after a round that did not: a
missed verify of many rows costs up to two plain steps, a copied run regrows in a few
rounds (measured on the dev prompts against +1/-1 from the policy's k: mean speedup over
plain 1.32x vs 1.28x on SmolLM2, 1.23x vs 1.21x on Qwen2.5-Coder-0.5B). Scheduling
changes the speed, never the output.

A model keeps its scheduler from one generation to the next, so a drafter that keeps losing
stays paused instead of paying its trial rounds in every reply. Only prompt lookup, whose
worth depends on the text, starts afresh with each prompt; the early exit's depends on the
model.
"""
DRAFTERS = ("exit", "lookup")
TEXT_DRAFTERS = ("lookup",)  # judged afresh for each prompt
SMOOTHING = 0.25     # weight of the newest round in the moving averages
PROBE_STEPS = 2      # plain steps that measure the baseline before any drafting
TRIAL_ROUNDS = 4     # rounds a drafter gets before it is judged
FIRST_PAUSE = 16     # tokens decoded without a drafter after it first loses
MAX_PAUSE = 256
START_K = 2          # drafts a round before a drafter has shown it earns more


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


class Scheduler:
    def __init__(self, k_max: dict, adaptive: bool):
        """k_max: drafter name -> the most drafts a round (0: never use it)."""
        self.drafters = {name: _Drafter(k) for name, k in k_max.items()}
        self.adaptive = adaptive
        self.plain_s, self.plain_steps = None, 0  # seconds per plain step, steps measured
        self.produced = 0

    def new_text(self):
        """A new prompt: forget what the text-dependent drafters measured."""
        for name in TEXT_DRAFTERS:
            self.drafters[name].forget()

    def k(self, name: str, budget: int) -> int:
        """How many drafts `name` may propose this round (0: do not use it)."""
        d = self.drafters[name]
        if not self.adaptive:
            return min(d.k_max, budget)
        if self.plain_steps < PROBE_STEPS or self.produced < d.paused_until:
            return 0
        return min(d.k, budget)

    def record(self, drafter, drafted: int, committed: int, seconds: float):
        """Account one round: `drafter` None for a plain step; a drafter's round may have
        drafted nothing (its cost still counts against it)."""
        self.produced += committed
        if not self.adaptive:
            return
        if drafter is None:
            self.plain_s = _average(self.plain_s, seconds)
            self.plain_steps += 1
            return
        d = self.drafters[drafter]
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
