"""GET /metrics: what the server has done, in Prometheus' text format (version 0.0.4).

Handlers count every answer by status and time the generation requests; the server counts
connections it closed on its own, by why; the worker counts every generation by how it
finished, with its tokens and what speculation did, and every round of the batch. The
gauges are read when the page is asked for.
"""
import threading
import time
from collections import Counter, deque

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKENS_PER_S_BUCKETS = (5, 10, 25, 50, 100, 150, 200, 300, 500, 1000)
WINDOW_S = 10.0  # the recent past the batch's rates are taken over

# name (without edgespec_ and _total): help, summed from each generation's numbers
TOTALS = {
    "prompt_tokens": "prompt tokens of the generations",
    "prompt_tokens_cached": "prompt tokens found in the KV cache (not prefilled again)",
    "generated_tokens": "tokens generated, cancelled replies included",
    "decode_tokens": "tokens generated after each reply's first (the tokens/s numerator)",
    "decode_seconds": "seconds spent decoding after each reply's first token",
    "drafted_tokens": "draft tokens proposed to the verifier",
    "accepted_tokens": "draft tokens the verifier accepted",
    "speculative_rounds": "verify rounds (plain steps of speculative replies included)",
}


class Histogram:
    """Cumulative buckets, their sum and count, as Prometheus reads them."""

    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float):
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def samples(self, name):
        for bound, count in zip(self.buckets, self.counts):
            yield f'{name}_bucket{{le="{bound}"}}', count
        yield f'{name}_bucket{{le="+Inf"}}', self.count
        yield f"{name}_sum", self.sum
        yield f"{name}_count", self.count


class Metrics:
    """Thread-safe counters: handlers and the worker record, /metrics renders."""

    def __init__(self):
        self.lock = threading.Lock()
        self.responses = Counter()    # HTTP status -> answers
        self.closed = Counter()       # why the server closed a connection -> connections
        self.generations = Counter()  # finish reason (or "failed") -> generations
        self.totals = dict.fromkeys(TOTALS, 0)
        self.duration = Histogram(SECONDS_BUCKETS)
        self.first_token = Histogram(SECONDS_BUCKETS)
        self.tokens_per_s = Histogram(TOKENS_PER_S_BUCKETS)
        self.rounds = deque()  # (time, tokens, decoding rounds, their rows): the last WINDOW_S
        self.round_totals = Counter()  # tokens, rounds, rows since the start

    def round_done(self, tokens: int, rounds: int, rows: int):
        """A step of the batch: tokens it committed, decoding rounds it ran and their rows."""
        now = time.monotonic()
        with self.lock:
            self.rounds.append((now, tokens, rounds, rows))
            self.round_totals.update(tokens=tokens, rounds=rounds, rows=rows)
            while self.rounds and self.rounds[0][0] < now - WINDOW_S:
                self.rounds.popleft()

    def _recent(self):
        """Tokens a second and rows a decoding round over the last WINDOW_S (0 when idle)."""
        now = time.monotonic()
        recent = [r for r in self.rounds if r[0] >= now - WINDOW_S]
        tokens, rounds, rows = (sum(r[i] for r in recent) for i in (1, 2, 3))
        return tokens / WINDOW_S, rows / rounds if rounds else 0.0

    def response(self, status: int):
        with self.lock:
            self.responses[int(status)] += 1

    def connection_closed(self, reason: str):
        """The server closed a connection: "timeout" (its request did not arrive whole in
        time), "made_room" (it waited while a new one needed its sequence) or "turned_away"
        (answered 503 at once, every sequence being busy)."""
        with self.lock:
            self.closed[reason] += 1
            if reason == "turned_away":  # its 503 is written by the accept loop, not a handler
                self.responses[503] += 1

    def request_timed(self, seconds: float, first_token_s):
        """A generation request answered: from its arrival to its last byte, and to its
        first text (None when the reply had no text)."""
        with self.lock:
            self.duration.observe(seconds)
            if first_token_s is not None:
                self.first_token.observe(first_token_s)

    def generation(self, finish: str, n_prompt: int = 0, result=None, generated: int = 0):
        """A generation ended: finish is its finish reason or "failed"; result its
        Generation when there is one (else `generated` tokens are all that is known)."""
        with self.lock:
            self.generations[finish] += 1
            t = self.totals
            t["prompt_tokens"] += n_prompt
            if result is None:
                t["generated_tokens"] += generated
                return
            t["prompt_tokens_cached"] += result.n_prompt - result.n_prefilled
            t["generated_tokens"] += result.n_generated
            if result.n_generated > 1 and result.decode_s > 0:
                t["decode_tokens"] += result.n_generated - 1
                t["decode_seconds"] += result.decode_s
                self.tokens_per_s.observe(result.decode_tokens_per_s)
            stats = result.stats
            t["drafted_tokens"] += stats.drafted
            t["accepted_tokens"] += stats.accepted
            t["speculative_rounds"] += stats.rounds if result.mode == "speculative" else 0

    def render(self, queued: int, capacity: int, running: int, parallel: int,
               connections: int) -> str:
        """The text exposition of every metric."""
        out = []

        def family(name, kind, help, samples):
            out.append(f"# HELP edgespec_{name} {help}")
            out.append(f"# TYPE edgespec_{name} {kind}")
            out.extend(f"edgespec_{sample} {_number(value)}" for sample, value in samples)

        with self.lock:
            family("requests_total", "counter", "HTTP requests answered, by status code",
                   [(f'requests_total{{code="{code}"}}', n)
                    for code, n in sorted(self.responses.items())])
            family("connections_closed_total", "counter", "connections the server closed, by "
                   "why: timeout (a request not whole in time), made_room, turned_away (503)",
                   [(f'connections_closed_total{{reason="{reason}"}}', n)
                    for reason, n in sorted(self.closed.items())])
            family("generations_total", "counter", "generations by how they finished "
                   "(stop, length, context_full, cancelled, failed)",
                   [(f'generations_total{{finish="{finish}"}}', n)
                    for finish, n in sorted(self.generations.items())])
            for name, help in TOTALS.items():
                family(f"{name}_total", "counter", help,
                       [(f"{name}_total", self.totals[name])])
            family("decoding_rounds_total", "counter", "decoding rounds of the batch (one "
                   "call of the model for every running reply)",
                   [("decoding_rounds_total", self.round_totals["rounds"])])
            family("round_rows_total", "counter", "rows those rounds verified (a reply's "
                   "last token and its drafts)", [("round_rows_total", self.round_totals["rows"])])
            tokens_per_s, rows_per_round = self._recent()
            for name, histogram, help in (
                    ("request_duration_seconds", self.duration,
                     "generation requests, from arrival to the last byte answered"),
                    ("time_to_first_token_seconds", self.first_token,
                     "generation requests, from arrival to the first text"),
                    ("decode_tokens_per_second", self.tokens_per_s,
                     "decode speed of each reply after its first token")):
                family(name, "histogram", help, histogram.samples(name))
        family("queue_depth", "gauge", "requests waiting for the worker", [("queue_depth", queued)])
        family("queue_capacity", "gauge", "requests that may wait (--queue)",
               [("queue_capacity", capacity)])
        family("busy", "gauge", "1 while the worker generates", [("busy", int(running > 0))])
        family("sequences_running", "gauge", "replies being decoded now",
               [("sequences_running", running)])
        family("parallel", "gauge", "replies decoded at once at most (--parallel)",
               [("parallel", parallel)])
        family("tokens_per_second", "gauge", f"tokens all replies committed a second, over "
               f"the last {WINDOW_S:g} s", [("tokens_per_second", tokens_per_s)])
        family("rows_per_round", "gauge", f"rows a decoding round verified, over the last "
               f"{WINDOW_S:g} s", [("rows_per_round", rows_per_round)])
        family("open_connections", "gauge", "client connections open now",
               [("open_connections", connections)])
        return "\n".join(out) + "\n"


def _number(value) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)
