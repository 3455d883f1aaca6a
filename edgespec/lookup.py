"""Lookup drafting: propose the tokens that followed the longest earlier occurrence of the
text's end, in this text (prompt and reply so far) or in replies the process made before.

Outputs often copy their input (code and text edits, answers quoting a document, extraction,
rewrites) or an earlier output (an agent calling one tool with one schema turn after turn).
Every n-gram of 1..MAX_NGRAM tokens is indexed with the tokens that followed it, so a round
costs a few dictionary lookups, not a scan; the occurrence found is then compared backwards
token by token, so a match knows its true length up to MAX_MATCH. A long match is a copy
under way and earns a long draft; a short one, or one whose earlier occurrences were
followed by different tokens, a short draft or none.

Adaptive, lookup is planned rather than timed: its offer carries the chance that each draft
is accepted (the rate at which matches of a length and kind were accepted: measured priors,
refined by the text's own rounds), and the round's planner weighs them against the
artifact's round cost by rows (rounds.py). Its drafts depend on the texts alone, not on
clock noise. The rates start afresh with each text; the replies are remembered (the latest
MEMORY_TOKENS tokens of them) for the texts after, and a batch keeps the replies of each
owner (a server's client) apart: one client's text is never drafted into another's.
"""
import copy
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass

from .drafter import Drafter, Offer

MAX_NGRAM = 8          # the longest n-gram indexed
MAX_MATCH = 64         # how far back a match is measured
MEMORY_TOKENS = 16384  # earlier replies remembered, the oldest forgotten first
MEMORY_NGRAM = 4       # the one n-gram size they are indexed by (a match there is no shorter)
MEMORY_OWNERS = 32     # owners whose replies are remembered apart, the least recent forgotten

# Match lengths by bucket (a bucket holds lengths from its bound to the next one's).
LENGTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)
# How often a match's next token was the verifier's, by length bucket and kind, on the
# development prompts' greedy replies (benchmarks/lookup_priors.py; DESIGN.md). A draft's
# later tokens count as a "single" match grown by the tokens before them.
PRIOR = {"agreed": (.52, .74, .75, .88, .89, .89, .99, .99, .99, .99, .99),
         "single": (.29, .48, .57, .68, .78, .78, .83, .89, .92, .94, .96),
         "split": (.19, .25, .25, .25, .25, .27, .33, .33, .33, .33, .33)}
# The same when the verifier samples with the default settings (a draft is accepted when
# the verifier draws it).
PRIOR_SAMPLED = {"agreed": (.50, .63, .63, .63, .63, .63, .63, .63, .63, .63, .63),
                 "single": (.13, .24, .35, .49, .49, .65, .80, .80, .80, .80, .80),
                 "split": (.07, .10, .23, .23, .23, .23, .23, .23, .23, .23, .23)}
PRIOR_ROUNDS = 8     # drafts' worth of evidence each prior counts for


def bucket(length: int) -> int:
    """The index of the length bucket that holds `length` (>= 1)."""
    return sum(length >= bound for bound in LENGTHS) - 1


BUCKET = tuple(bucket(length) if length else 0 for length in range(MAX_MATCH + 1))  # by length


@dataclass(frozen=True)
class Match:
    length: int    # tokens at the history's end that occurred before (at most MAX_MATCH)
    text: list     # the text of that occurrence: this one, or a remembered reply
    position: int  # where the chosen continuation starts in it
    kind: str      # "agreed": its last MAX_NGRAM tokens (or fewer) were seen several times,
    #                always followed by the same token; "single": seen once; "split":
    #                followed by different tokens

    def continuation(self, k: int) -> list:
        """Up to k tokens of the text from the chosen continuation on: the drafts."""
        return self.text[self.position:self.position + k]

    def keys(self, k: int) -> list:
        """The (length bucket, kind) whose acceptance rate each of k drafts takes: a draft's
        later tokens count as a "single" match grown by the tokens before them."""
        return [(BUCKET[min(self.length + i, MAX_MATCH)], self.kind if i == 0 else "single")
                for i in range(k)]


class NgramIndex:
    """Where each n-gram of some texts occurred (n in `sizes`), and which tokens followed it."""

    def __init__(self, sizes=range(1, MAX_NGRAM + 1)):
        self.sizes = sorted(sizes, reverse=True)
        self.index = {}  # n-gram -> {next token: [times seen, when last seen, text, position]}
        self.clock = itertools.count()

    def add(self, text: list, start: int, end: int):
        """Index the n-grams of `text` that end at start..end-1 and have a token after them."""
        for last in range(start, min(end, len(text) - 1)):
            after, stamp = text[last + 1], next(self.clock)
            for n in (n for n in self.sizes if n <= last + 1):
                follow = self.index.setdefault(tuple(text[last + 1 - n:last + 1]), {})
                seen = follow.get(after)
                if seen is None:
                    follow[after] = [1, stamp, text, last + 1]
                else:
                    seen[0] += 1
                    seen[1:] = stamp, text, last + 1

    def match(self, history: list):
        """The longest occurrence of the history's end (None if none), with its n-gram's
        most frequent continuation (the latest, among equally frequent ones)."""
        for n in (n for n in self.sizes if n <= len(history)):
            follow = self.index.get(tuple(history[-n:]))
            if follow:
                count, _, text, position = max(follow.values(), key=lambda s: s[:2])
                kind = "split" if len(follow) > 1 else "agreed" if count > 1 else "single"
                return Match(n + _agree_back(history, text, position, n), text, position, kind)
        return None


def _agree_back(history, text, position, n) -> int:
    """How many tokens before the matched n-gram also agree (the match's true length - n)."""
    more, most = 0, min(MAX_MATCH, len(history), position) - n
    while more < most and history[-n - 1 - more] == text[position - n - 1 - more]:
        more += 1
    return more


class Memory:
    """Earlier replies, indexed by one n-gram size (a few bytes a token, not the text's
    every size); the oldest are forgotten beyond MEMORY_TOKENS."""

    def __init__(self):
        self.replies, self.tokens, self.index = deque(), 0, NgramIndex((MEMORY_NGRAM,))

    def remember(self, reply: list):
        if len(reply) < 2:
            return
        self.replies.append(reply)
        self.tokens += len(reply)
        self.index.add(reply, 0, len(reply))
        if self.tokens > MEMORY_TOKENS:  # forget the older half at once: one re-index
            while self.tokens > MEMORY_TOKENS // 2:
                self.tokens -= len(self.replies.popleft())
            self.index = NgramIndex((MEMORY_NGRAM,))
            for kept in self.replies:
                self.index.add(kept, 0, len(kept))


class PromptLookup(Drafter):
    name = "lookup"

    def __init__(self, k_max: int, adaptive: bool = False):
        self.k_max, self.adaptive = k_max, adaptive
        self.forget()
        self.new_text()

    @classmethod
    def from_policy(cls, policy, pace):
        return cls(policy.lookup_k, policy.adaptive) if policy.lookup_k else None

    def forget(self):
        self.memory = Memory()
        self.owners = OrderedDict()  # owner -> the Memory of the replies made for it
        self.text, self.prompt_len = [], None

    def for_text(self, owner=None):
        twin = copy.copy(self)  # a text and rates of its own
        twin.memory = self.memory if owner is None else self._memory_of(owner)
        twin.text, twin.prompt_len = [], None
        twin.new_text()
        return twin

    def _memory_of(self, owner) -> Memory:
        memory = self.owners.pop(owner, None) or Memory()
        self.owners[owner] = memory  # the most recent last
        if len(self.owners) > MEMORY_OWNERS:
            self.owners.popitem(last=False)
        return memory

    def end_text(self):
        self.new_text()  # remembers the reply

    def new_text(self, sampled: bool = False):
        if self.prompt_len is not None:
            self.memory.remember(self.text[self.prompt_len:])
        self.text, self.prompt_len = [], None  # our own copy: the caller's list may change
        self.index = NgramIndex()
        self.hits, self.tries = {}, {}
        self.prior = PRIOR_SAMPLED if sampled else PRIOR

    def offer(self, history, budget):
        """The continuation of the longest match, up to `budget` drafts, with each draft's
        chance when adaptive (the planner then chooses how many); None without a match."""
        match, budget = self.match(history, budget)
        if not budget:
            return None
        keys = match.keys(budget)
        chances = tuple(self.chances(keys)) if self.adaptive else ()
        return Offer(self, budget, tokens=tuple(match.continuation(budget)), chances=chances,
                     plan=(match, keys))

    def match(self, history, budget):
        """The longest match of the history's end (None if none) and the most drafts it can
        give within `budget`."""
        if self.prompt_len is None:
            self.prompt_len = len(history) - 1  # the first offer follows the first token
        indexed = len(self.text)
        self.text.extend(history[indexed:])
        self.index.add(self.text, max(0, indexed - 1), len(self.text))
        match = max((m for m in (self.index.match(self.text), self.memory.index.match(self.text))
                     if m), key=lambda m: m.length, default=None)  # ties: this text's
        if match is None:
            return None, 0
        return match, min(budget, self.k_max, len(match.text) - match.position)

    def chances(self, keys) -> list:
        """For each draft, the chance that it and every draft before it are accepted."""
        return list(itertools.accumulate((self.rate(key) for key in keys),
                                         lambda chain, rate: chain * rate))

    def rate(self, key) -> float:
        """How often such a draft token was accepted: the prior, then this text's rounds."""
        length_bucket, kind = key
        prior = self.prior[kind][length_bucket]
        return (self.hits.get(key, 0) + PRIOR_ROUNDS * prior) / \
            (self.tries.get(key, 0) + PRIOR_ROUNDS)

    def observe(self, offer, drafted, accepted, seconds):
        _, keys = offer.plan
        for i, key in enumerate(keys[:min(accepted + 1, drafted)]):  # up to the first miss
            self.tries[key] = self.tries.get(key, 0) + 1
            self.hits[key] = self.hits.get(key, 0) + (i < accepted)
