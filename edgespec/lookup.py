"""Prompt lookup: propose the tokens that followed the longest earlier match of the history's end.

Outputs often copy their input (extraction, translation, summaries, code edits) or repeat
themselves: when the last few tokens appeared before, in the prompt or the reply, the
tokens after them are a free draft. Every n-gram of 1..MAX_NGRAM tokens is indexed with
the tokens that followed it, so a round costs a few dictionary lookups, not a scan. A match
says how far to trust it: its length, and whether its earlier occurrences agreed on what
came next.

Adaptive, lookup is planned rather than timed: the rate at which such matches' tokens were
accepted (measured priors, refined by the text's own rounds) and the artifact's round cost
by rows give each k's expected committed tokens per unit of cost; a round offers the best
k, none when no k beats a plain step. Its drafts then depend on the text alone, not on
clock noise. The index and the rates start afresh with each generation: lookup's worth is
the text's.
"""
from dataclasses import dataclass

from .drafter import Drafter, Offer

MAX_NGRAM = 8

# How often a match's next token was the verifier's, by match length (1..6 or more) and
# kind, on the development prompts' greedy replies (see DESIGN.md). A draft's later tokens
# count as a "single" match grown by the tokens before them.
PRIOR = {"agreed": (.50, .78, .88, .90, .90, .97),
         "single": (.29, .52, .61, .70, .73, .84),
         "split": (.19, .28, .33, .33, .33, .50)}
# The same when the verifier samples (a draft is accepted when the verifier draws it), made
# monotone in the length where few matches were seen.
PRIOR_SAMPLED = {"agreed": (.56, .72, .80, .80, .80, .80),
                 "single": (.17, .31, .45, .50, .50, .72),
                 "split": (.08, .10, .20, .20, .20, .20)}
LONG_MATCH = 6       # matches this long or longer share one rate
PRIOR_ROUNDS = 8     # drafts' worth of evidence each prior counts for


@dataclass(frozen=True)
class Match:
    length: int    # tokens at the history's end that occurred before
    position: int  # where the chosen continuation starts in the history
    kind: str      # "agreed": seen several times, always followed by the same token;
    #                "single": seen once; "split": followed by different tokens

    def continuation(self, history: list, k: int) -> list:
        """Up to k tokens of the history from the chosen continuation on: the drafts."""
        return history[self.position:self.position + k]


class NgramIndex:
    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self.index = {}  # n-gram -> {next token: [times seen, position of the latest]}
        self.indexed = 0  # n-grams ending before this position are in the index

    def match(self, history: list):
        """The longest n-gram ending the history that occurred before (None if none), with
        its most frequent continuation (the latest, among equally frequent ones)."""
        last = len(history) - 1  # the newest n-grams end here: nothing follows them yet
        for end in range(self.indexed, last):
            after = history[end + 1]
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                follow = self.index.setdefault(tuple(history[end + 1 - n:end + 1]), {})
                seen = follow.setdefault(after, [0, 0])
                seen[0] += 1
                seen[1] = end + 1
        self.indexed = max(self.indexed, last)
        for n in range(min(self.max_ngram, len(history)), 0, -1):
            follow = self.index.get(tuple(history[-n:]))
            if follow:
                count, position = max(follow.values())
                kind = "split" if len(follow) > 1 else "agreed" if count > 1 else "single"
                return Match(n, position, kind)
        return None


class PromptLookup(Drafter):
    name = "lookup"

    def __init__(self, engine, pace, k_max: int, adaptive: bool = False):
        self.engine, self.k_max, self.adaptive = engine, k_max, adaptive
        self.cost = pace.costs(k_max + 1)
        self.new_text()

    @classmethod
    def from_policy(cls, policy, engine, pace):
        return cls(engine, pace, policy.lookup_k, policy.adaptive) if policy.lookup_k else None

    def new_text(self, sampled: bool = False):
        self.index = NgramIndex()
        self.hits, self.tries = {}, {}
        self.prior = PRIOR_SAMPLED if sampled else PRIOR

    def offer(self, history, budget):
        match = self.index.match(history)
        if match is None:
            return None
        budget = min(budget, self.k_max, len(history) - match.position)
        if not self.adaptive:
            return Offer(self, budget, plan=(match, [])) if budget else None
        return self.plan(match, budget)

    def rate(self, key) -> float:
        """How often such a draft token was accepted: the prior, then this text's rounds."""
        length, kind = key
        prior = self.prior[kind][length - 1]
        return (self.hits.get(key, 0) + PRIOR_ROUNDS * prior) / \
            (self.tries.get(key, 0) + PRIOR_ROUNDS)

    def plan(self, match: Match, budget: int):
        """The offer of the k with the most expected committed tokens per unit of cost,
        None when none earns more than a plain step (1 token a step)."""
        keys = [(min(match.length + i, LONG_MATCH), match.kind if i == 0 else "single")
                for i in range(budget)]
        best_k, best, expected, chain = 0, 1.0, 1.0, 1.0
        for k, key in enumerate(keys, 1):
            chain *= self.rate(key)  # the chance that the first k drafts are all accepted
            expected += chain
            if expected / self.cost[k + 1] > best:
                best_k, best = k, expected / self.cost[k + 1]
        return Offer(self, best_k, best, (match, keys[:best_k])) if best_k else None

    def draft(self, offer, history, sampler, timer):
        match, _ = offer.plan
        drafts = match.continuation(history, offer.k)
        self.engine.lower([history[-1]] + drafts)  # one run for the token and its drafts
        timer.charge("draft")
        return drafts

    def observe(self, offer, drafted, accepted, seconds):
        _, keys = offer.plan
        for i, key in enumerate(keys[:accepted + 1]):  # drafts up to the first miss
            self.tries[key] = self.tries.get(key, 0) + 1
            self.hits[key] = self.hits.get(key, 0) + (i < accepted)
