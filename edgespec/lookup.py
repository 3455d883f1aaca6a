"""Prompt lookup: propose the tokens that followed the newest n-gram's last earlier occurrence.

Outputs often copy their input (extraction, translation, summaries, code edits): when the
last few tokens appeared before, in the prompt or the reply, the tokens after them are a
free draft. Longer n-grams are tried first; the index grows with the history, so a round
costs a dictionary lookup, not a scan.
"""


class PromptLookup:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.index = {n: {} for n in self.sizes}  # n-gram -> position of the token after it
        self.indexed = 0  # n-grams ending before this position are in the index

    def propose(self, history: list, k: int) -> list:
        """Up to k tokens that followed the newest n-gram of `history` when it last appeared."""
        last = len(history) - 1  # the newest n-gram itself ends here: not indexed yet
        for end in range(self.indexed, last):
            for n in self.sizes:
                if end + 1 >= n:
                    self.index[n][tuple(history[end + 1 - n:end + 1])] = end + 1
        self.indexed = max(self.indexed, last)
        for n in self.sizes:
            follow = self.index[n].get(tuple(history[-n:]))
            if follow is not None:
                return history[follow:follow + k]
        return []
