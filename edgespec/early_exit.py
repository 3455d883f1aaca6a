"""The early exit: the model's own lower layers and a draft head guess the next tokens.

Its round (rounds.py) feeds the last token through lower, then up to k times: the draft
head on the newest exit state gives logits, from which `next_draft` draws a draft d with
the generation's sampler, and lower runs on d. A confidence threshold ends the drafts
early when the draft head's top probability falls below it.

Adaptive, it is timed: plain steps give the baseline (PlainSpeed), and moving averages of its
rounds' seconds and committed tokens its speed. When that falls below plain decoding's it
is paused for a while (twice as long each time it loses again), then tried afresh:
acceptance changes with the text. Its k starts at 2, doubles after a round that accepted
every draft (up to the policy's k) and drops to one more than the drafts accepted after a
round that did not. Its record lives with the loaded model, so an exit that keeps losing
stays paused across replies (its worth is the model's, not the text's).
"""
from .drafter import Drafter, Offer, average

TRIAL_ROUNDS = 4     # rounds it gets before it is judged
FIRST_PAUSE = 16     # tokens decoded without it after it first loses
MAX_PAUSE = 256
START_K = 2          # drafts a round before it has shown it earns more


class EarlyExit(Drafter):
    name = "exit"

    def __init__(self, pace, k_max: int, threshold: float = 0.0, adaptive: bool = False):
        self.pace = pace
        self.k_max, self.threshold, self.adaptive = k_max, threshold, adaptive
        self.k = min(START_K, k_max)
        self.pause, self.paused_until = FIRST_PAUSE, 0
        self._restart()

    @classmethod
    def from_policy(cls, policy, pace):
        if not policy.draft_k:
            return None
        return cls(pace, policy.draft_k, policy.draft_threshold, policy.adaptive)

    def _restart(self):
        self.seconds = self.tokens = None  # moving averages of its rounds
        self.rounds = 0

    def offer(self, history, budget):
        k = self._k(budget)
        return Offer(self, k, self._value()) if k else None

    def _k(self, budget: int) -> int:
        if not self.adaptive:
            return min(self.k_max, budget)
        if not self.pace.probed or self.pace.produced < self.paused_until:
            return 0
        return min(self.k, budget)

    def _value(self) -> float:
        """Its measured speed in plain decoding's (0 before it is measured)."""
        if not self.adaptive or self.seconds is None:
            return 0.0
        return self.tokens / self.seconds * self.pace.plain_s

    def next_draft(self, logits, probability, sampler, history, drafts):
        """The next draft from the draft head's logits (or its ranked top candidates) and
        its top probability (read only with a threshold): None when below the threshold."""
        if self.threshold and probability < self.threshold:
            return None
        return sampler(logits, history, drafts)

    def observe(self, offer, drafted, accepted, seconds):
        """A round the threshold cut to no draft still paid for the draft head: it counts
        against the exit, but says nothing of k. Only its own rounds time it."""
        if not self.adaptive:
            return
        committed = accepted + 1
        if drafted:
            self.k = min(self.k_max, 2 * self.k) if accepted == drafted else committed
        if seconds is None:
            return
        self.seconds, self.tokens = average(self.seconds, seconds), average(self.tokens, committed)
        self.rounds += 1
        if self.rounds < TRIAL_ROUNDS:
            return
        if self.tokens / self.seconds < 1.0 / self.pace.plain_s:
            self.paused_until = self.pace.produced + self.pause  # the round is counted in
            self.pause = min(MAX_PAUSE, 2 * self.pause)
            self._restart()
        else:
            self.pause = FIRST_PAUSE
