"""Replies decoded together, each bit for bit the reply it gets alone; a single reply is a
batch of one.

The batch keeps the requests: waiting in arrival order, or running on one of its
sequences (each a KV cache, allocated when the batch is made). Each step runs the
running ones' prompts (a lone prompt whole, several in chunks in one call of the batch
graphs) and one decode round of the decoding ones (rounds.py). The batch graphs give
every row the bits it gets when its sequence runs alone, and each reply draws from its
own sampler, so a reply never depends on what runs beside it.
"""
import time
from collections import deque
from dataclasses import asdict

from .artifact import BATCH_SIZES
from .engine import CHUNK
from .errors import EdgespecError
from .reply import Generation
from .rounds import decode_round
from .sampling import Sampler
from .stats import DecodeStats, DrafterStats

PROMPT_ROWS = 64  # prompt rows a sequence adds to a round while others decode
MOST_PARALLEL = max(BATCH_SIZES)


class Request:
    """One reply being made: its prompt and settings, its sequence while it runs, what
    decodes it (sampler, drafters, their pace, stats), its text, and once it ended its
    Generation (`result`)."""

    def __init__(self, index, prompt_ids, settings, owner, drafting, text):
        self.index, self.prompt, self.settings, self.owner = index, list(prompt_ids), \
            settings, owner
        self.sampler = Sampler(settings.sampling)
        self.pace, self.drafters = drafting.for_reply(settings, owner)
        self.stats = DecodeStats(drafters={d.name: DrafterStats() for d in self.drafters})
        for d in self.drafters:
            d.new_text(sampled=not self.sampler.params.greedy)
        self.text = text  # its ReplyText
        self.history = list(prompt_ids)
        self.seq = None  # its sequence while it runs
        self.prefilled = 0  # prompt tokens in its cache
        self.reused = 0  # of them, those its sequence held already
        self.cancelled = False
        self.result = None  # its Generation, once it ended
        self.queued_at = time.perf_counter()
        self.started_at = self.first_token_at = None

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def wanted(self) -> int:
        """Tokens it may still commit."""
        return self.settings.max_new_tokens - (len(self.history) - len(self.prompt))

    def budget(self, max_context: int) -> int:
        """The most drafts its next round may verify."""
        room = max_context - len(self.history)  # positions left after the token fed
        return max(0, min(self.wanted - 1, room))

    def start(self, logits) -> list:
        """Its first token, from the prompt's last logits."""
        self.first_token_at = time.perf_counter()
        first = self.sampler(logits, self.history)
        self.history.append(first)
        return [first]

    def generation(self, finish: str) -> Generation:
        """Its Generation: prefill is its time from taking a sequence to its first token,
        decode the rest."""
        now, began = time.perf_counter(), self.started_at or self.queued_at
        first = self.first_token_at or now
        return Generation(self.text.text, self.text.tokens, len(self.prompt), first - began,
                          now - first, self.settings.mode, finish, self.stats,
                          n_prefilled=len(self.prompt) - self.reused,
                          sampling={**asdict(self.settings.sampling), "seed": self.sampler.seed})


def check_prompt(engine, prompt_ids):
    """Refuse, in one line, a prompt the engine cannot run."""
    limit, vocab = engine.max_context, engine.vocab_size
    if not prompt_ids:
        raise EdgespecError("the prompt is empty")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)  # the embedding lookup
    if bad is not None:  # does not check its ids
        raise EdgespecError(f"the prompt holds token id {bad}; this model's ids are "
                            f"0..{vocab - 1}")
    if len(prompt_ids) >= limit:
        raise EdgespecError(f"the prompt has {len(prompt_ids)} tokens but the artifact's "
                            f"context is {limit}; shorten the prompt or export with a "
                            "larger --max-context")


class Batch:
    """Requests decoded together, at most `parallel` at a time; the rest wait in arrival
    order and take a sequence as soon as one is free. `sequences` are the first ones (the
    model's own: its memory is not held twice); the rest are allocated now.

    A sequence keeps its cache after a reply: the next reply of the same owner that starts
    with the same tokens (the next turn of a chat) runs only what follows them. Replies of
    different owners share no cache and no memory of earlier replies."""

    def __init__(self, engine, drafting, costs, make_text, parallel: int, sequences=()):
        if not (isinstance(parallel, int) and 1 <= parallel <= MOST_PARALLEL):
            raise EdgespecError(f"parallel must be an integer from 1 to {MOST_PARALLEL}, "
                                f"not {parallel!r}")
        engine.check_batch(parallel)
        self.engine, self.drafting, self.costs = engine, drafting, costs
        self.make_text, self.parallel = make_text, parallel
        self.free = list(sequences)[:parallel]
        self.free += [engine.new_sequence() for _ in range(parallel - len(self.free))]
        self.owners = {}  # sequence -> the owner whose tokens its cache holds
        self.waiting, self.running = deque(), []
        self._count = 0
        self.prompt_seconds = 0.0  # time in steps that ran only prompt rows
        self.rounds = self.rows = 0  # decoding rounds, and the rows they verified
        self.committed = 0  # tokens committed, all replies

    def add(self, prompt_ids: list, settings, owner=None) -> Request:
        """Queue a reply to token ids: its Request, whose `result` is set when it ends. Only
        replies of the same `owner` share cached prompts and remembered replies."""
        check_prompt(self.engine, prompt_ids)
        request = Request(self._count, prompt_ids, settings, owner, self.drafting,
                          self.make_text(settings))
        self._count += 1
        self.waiting.append(request)
        return request

    def cancel(self, request: Request):
        """End a reply at the next step's start (finish "cancelled"), or drop it if it has
        not started; the others go on unchanged."""
        request.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def run(self):
        """Steps until every reply has ended: yields (request, Piece) as text arrives."""
        while self.busy:
            yield from self.step()

    def step(self) -> list:
        """Prompt rows, then one decode round: the (request, Piece) pairs of the text they
        produced. A request that ended has its `result`."""
        events = []
        for r in [r for r in list(self.waiting) + self.running if r.cancelled]:
            events += self._finish(r, "cancelled")
        while self.waiting and self.free:
            self._place(self.waiting.popleft())
        decoding = [r for r in self.running if not r.prefilling]
        for r in [r for r in decoding if len(r.history) > self.engine.max_context]:
            events += self._finish(r, "context_full")  # no room for the token it would feed
            decoding.remove(r)
        prefilling = [r for r in self.running if r.prefilling]
        if prefilling:
            began = time.perf_counter()
            events += self._prompts(prefilling, bool(decoding))
            self.prompt_seconds += time.perf_counter() - began
        if decoding:
            events += self._decode(decoding)
        return events

    def _place(self, request):
        """Give a request the free sequence whose cache holds the longest start of its
        prompt among its owner's, else the least recently used one."""
        def shared(seq):
            return seq.shared_prefix(request.prompt) \
                if self.owners.get(seq) == request.owner else -1
        seq = max(self.free, key=shared)
        request.prefilled = request.reused = max(0, shared(seq))  # before it changes hands
        self.free.remove(seq)
        self.owners[seq] = request.owner
        seq.rollback(request.reused)
        request.seq, request.started_at = seq, time.perf_counter()
        self.running.append(request)

    def clear(self) -> list:
        """End every reply at once, without results (a step failed: the caches may be half
        written); the requests it ended. Every sequence starts empty again."""
        ended = self.running + list(self.waiting)
        self.free += [r.seq for r in self.running]
        self.running, self.waiting = [], deque()
        for seq in self.free:
            seq.rollback(0)
        self.owners.clear()
        return ended

    def _prompts(self, requests, others_decode: bool) -> list:
        """Prompt rows: a lone request's whole prompt in one prefill, else the next rows
        of each in one call (fewer while others decode); each one whose prompt is in gets
        its first token."""
        engine = self.engine
        if len(self.running) == 1:
            r = requests[0]
            logits = engine.prefill(r.seq, r.prefilled, r.prompt[r.prefilled:])
            r.prefilled = len(r.prompt)
            return self._commit(r, r.start(logits))
        share = CHUNK // len(requests)  # all chunks fit one call
        share = min(share, PROMPT_ROWS) if others_decode else share
        parts, last_rows, offset = [], {}, 0
        for r in requests:
            n = engine.call_rows(r.prefilled, min(len(r.prompt) - r.prefilled, share))
            parts.append((r.seq, r.prefilled, r.prompt[r.prefilled:r.prefilled + n]))
            r.prefilled += n
            offset += n
            if not r.prefilling:
                last_rows[r] = offset - 1
        engine.forward(parts)
        logits = engine.head(list(last_rows.values()))
        events = []
        for r, row in zip(last_rows, logits):
            events += self._commit(r, r.start(row))
        return events

    def _decode(self, requests) -> list:
        """One decode round of every decoding request."""
        engine, n = self.engine, len(requests)
        budgets = [r.budget(engine.max_context) for r in requests]
        if n > 1:  # every request's rows fit one call
            budgets = [min(b, engine.call_rows(len(r.history) - 1, CHUNK // n) - 1)
                       for b, r in zip(budgets, requests)]
        committed, rows = decode_round(engine, requests, budgets, self.costs)
        self.rounds, self.rows = self.rounds + 1, self.rows + rows
        events = []
        for r, tokens in zip(requests, committed):
            events += self._commit(r, tokens)
        return events

    def _commit(self, request, tokens) -> list:
        self.committed += len(tokens)
        events = [(request, piece) for piece in request.text.add(tokens)]
        if request.text.finish or request.wanted <= 0:
            events += self._finish(request, request.text.finish or "length")
        return events

    def _finish(self, request, finish) -> list:
        """End a reply: its result, its sequence to the next in line."""
        events = [(request, piece) for piece in request.text.close(finish)]
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
            self.free.append(request.seq)
        for drafter in request.drafters:
            drafter.end_text()
        request.result = request.generation(finish)
        return events
