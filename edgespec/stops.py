"""Stop strings: a reply ends where one of them first appears, and its text stops before it."""


class StopScanner:
    """Cuts streamed text at the first stop string, holding back what may begin one. Each
    stop has a Knuth-Morris-Pratt matcher, so a character costs amortized constant time
    however long the stops are, and at most the longest stop is ever held back."""

    def __init__(self, stops):
        self.stops, self.pending, self.stopped = stops, "", False
        self.fallback = [_fallback(s) for s in stops]
        self.matched = [0] * len(stops)  # per stop: its longest prefix that ends the text

    def feed(self, text: str) -> str:
        """The text that is safe to send now."""
        if not self.stops:
            return text
        start = len(self.pending)
        self.pending += text
        for i, char in enumerate(text):
            longest = 0  # of the stops that end at this character: cut before the longest
            for j, stop in enumerate(self.stops):
                n = self.matched[j]
                while n and stop[n] != char:
                    n = self.fallback[j][n - 1]
                n = self.matched[j] = n + (stop[n] == char)
                if n == len(stop):
                    longest = max(longest, n)
            if longest:
                self.stopped = True
                out, self.pending = self.pending[:start + i + 1 - longest], ""
                return out
        cut = len(self.pending) - max(self.matched, default=0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _fallback(stop: str) -> list:
    """KMP's failure function: for each prefix of stop, the length of its longest proper
    prefix that is also its suffix."""
    table, n = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while n and stop[i] != stop[n]:
            n = table[n - 1]
        n += stop[i] == stop[n]
        table[i] = n
    return table
