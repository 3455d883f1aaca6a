"""Prompt lookup: propose the tokens that followed the longest earlier match of the history's end.

Outputs often copy their input (extraction, translation, summaries, code edits) or repeat
themselves: when the last few tokens appeared before, in the prompt or the reply, the
tokens after them are a free draft. Every n-gram of 1..MAX_NGRAM tokens is indexed with
the tokens that followed it, so a round costs a few dictionary lookups, not a scan. The
match says how far to trust it: its length, and whether its earlier occurrences agreed on
what came next (schedule.py turns that into how many of its tokens to verify).
"""
from dataclasses import dataclass

MAX_NGRAM = 8


@dataclass(frozen=True)
class Match:
    length: int    # tokens at the history's end that occurred before
    position: int  # where the chosen continuation starts in the history
    kind: str      # "agreed": seen several times, always followed by the same token;
    #                "single": seen once; "split": followed by different tokens

    def continuation(self, history: list, k: int) -> list:
        """Up to k tokens of the history from the chosen continuation on: the drafts."""
        return history[self.position:self.position + k]


class PromptLookup:
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
