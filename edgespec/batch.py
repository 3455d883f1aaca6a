"""Many replies decoded together, each bit for bit the reply it gets alone.

Each round runs the rows of every running sequence in one call of the batch graphs
(Engine.forward): a sequence's last token and the drafts planned for it, or a chunk of its
prompt. The batch graphs give every row the bits it gets when its sequence runs alone, and
each reply draws from its own sampler, so a reply never depends on what runs beside it.

One round of several sequences:
1. plan:    each decoding sequence's drafts (from a drafter that drafts without the engine:
            lookup) and the chance each is accepted; plan_drafts keeps those that give
            the batch the most expected tokens per unit of the round's measured cost.
2. forward: every sequence's rows in one call of lower and upper; head on the rows whose
            logits are needed.
3. accept:  per sequence, as alone (decoder.accept); its cache rolls back to what it kept.
A sequence running alone runs as it does alone: its prompt in one prefill, then the solo
decode loop's rounds (decoder.py), early exit too.
"""
import time
from collections import deque

from .artifact import BATCH_SLOTS
from .decoder import accept
from .drafter import costs_by_rows
from .engine import CHUNK, ContextFull
from .errors import EdgespecError

PROMPT_ROWS = 64  # prompt rows a sequence adds to a round while others decode
MOST_PARALLEL = max(BATCH_SLOTS)


def plan_drafts(chances: list, cost, base_rows: int) -> list:
    """How many drafts each sequence verifies this round: the choice with the most expected
    committed tokens per unit of round cost. chances[i][j]: the chance that sequence i's
    drafts 0..j are all accepted (falling with j); cost(rows): a round's cost; base_rows:
    the round's rows without drafts (a token for each of the len(chances) sequences, and
    prompt chunks). Drafts are taken best first, so more rows only ever add the next best."""
    ranked = sorted(((chance, -j, i) for i, row in enumerate(chances)
                     for j, chance in enumerate(row)), reverse=True)
    expected, rows = float(len(chances)), base_rows
    best, taken = expected / cost(rows), 0
    for n, (chance, _, _) in enumerate(ranked, 1):
        expected, rows = expected + chance, rows + 1
        if expected / cost(rows) > best:
            best, taken = expected / cost(rows), n
    counts = [0] * len(chances)
    for _, _, i in ranked[:taken]:
        counts[i] += 1
    return counts


class Member:
    """One reply of a batch: its prompt, decode loop, text, and (once it ends) its result."""

    def __init__(self, index, prompt_ids, settings, decoder, reply, owner=None):
        self.index, self.prompt, self.settings = index, list(prompt_ids), settings
        self.decoder, self.reply, self.owner = decoder, reply, owner
        self.history = list(prompt_ids)
        self.seq = None  # its sequence in the engine while it runs
        self.prefilled = 0  # prompt tokens in its cache
        self.reused = 0  # of them, those its place's cache held already
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


class Batch:
    """Replies decoded together, at most `parallel` at a time; the rest wait in arrival
    order and take a place as soon as one is free. Each place's KV cache is allocated when
    the batch is made (engine.sequence_bytes each), the first being the model's own.

    A place keeps its cache after a reply: the next reply of the same owner that starts
    with the same tokens (the next turn of a chat) runs only what follows them. Replies of
    different owners share no cache and no memory of earlier replies."""

    def __init__(self, model, parallel: int):
        if not (isinstance(parallel, int) and 1 <= parallel <= MOST_PARALLEL):
            raise EdgespecError(f"parallel must be an integer from 1 to {MOST_PARALLEL}, "
                                f"not {parallel!r}")
        self.model, self.engine, self.parallel = model, model.engine, parallel
        # the model's own sequence is the first place: its memory is not held twice
        self.free = [model.sequence] + [self.engine.new_sequence() for _ in range(parallel - 1)]
        self.owners = {}  # place -> the owner whose tokens its cache holds
        self.waiting, self.running = deque(), []
        self._count = 0
        self.prompt_seconds = 0.0  # time in rounds that ran only prompt rows
        self.rounds = self.rows = 0  # decoding rounds, and the rows they verified
        self.committed = 0  # tokens committed, all replies
        measured = model.costs["batch_round_costs"]
        self.costs = {int(slots): costs_by_rows({1: 1.0, **{int(r): c for r, c in by_rows.items()}},
                                                CHUNK)
                      for slots, by_rows in measured.items()}

    def add(self, prompt_ids: list, settings, owner=None) -> Member:
        """Queue a reply to token ids: its Member, whose `result` is set when it ends. Only
        replies of the same `owner` share cached prompts and remembered replies."""
        self.model._check_prompt(prompt_ids)
        member = Member(self._count, prompt_ids, settings,
                        self.model._decoder(settings, own_text=True, owner=owner),
                        self.model._reply(settings), owner)
        self._count += 1
        self.waiting.append(member)
        return member

    def cancel(self, member: Member):
        """End a reply at the next round's start (finish "cancelled"), or drop it if it has
        not started; the others go on unchanged."""
        member.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def run(self):
        """Rounds until every reply has ended: yields (member, Piece) as text arrives."""
        while self.busy:
            yield from self.step()

    def step(self) -> list:
        """One round: the (member, Piece) pairs of the text it produced. A member that
        ended has its `result`."""
        events = []
        for member in [m for m in list(self.waiting) + self.running if m.cancelled]:
            events += self._finish(member, "cancelled")
        while self.waiting and self.free:
            self._place(self.waiting.popleft())
        if len(self.running) == 1:
            return events + self._solo_round(self.running[0])
        if self.running:
            events += self._batch_round()
        return events

    def _place(self, member):
        """Give a member the free place whose cache holds the longest start of its prompt
        among its owner's, else the least recently used one."""
        def shared(seq):
            return seq.shared_prefix(member.prompt) if self.owners.get(seq) == member.owner \
                else -1
        seq = max(self.free, key=shared)
        member.prefilled = member.reused = max(0, shared(seq))  # before the place changes hands
        self.free.remove(seq)
        self.owners[seq] = member.owner
        seq.rollback(member.reused)
        member.seq, member.started_at = seq, time.perf_counter()
        self.running.append(member)

    def clear(self) -> list:
        """End every reply at once, without results (a round failed: the caches may be half
        written); the members it ended. Every place starts empty again."""
        ended = self.running + list(self.waiting)
        self.free += [m.seq for m in self.running]
        self.running, self.waiting = [], deque()
        for seq in self.free:
            seq.rollback(0)
        self.owners.clear()
        return ended

    def _solo_round(self, member) -> list:
        """A round of the one running member, as when it decodes alone: its whole prompt
        (nothing else waits on it), or a round of the solo decode loop."""
        self.engine.use(member.seq)
        if member.prefilling:
            logits = self.engine.prefill(member.prompt[member.prefilled:])
            member.prefilled, member.first_token_at = len(member.prompt), time.perf_counter()
            return self._commit(member, member.decoder.start(logits, member.history))
        drafted = member.decoder.stats.drafted
        try:
            committed = member.decoder.round(member.history, member.wanted)
        except ContextFull:
            return self._finish(member, "context_full")
        self.rounds += 1
        self.rows += 1 + member.decoder.stats.drafted - drafted
        return self._commit(member, committed)

    def _batch_round(self) -> list:
        """Prompt chunks in one call (a member whose prompt is in gets its first token),
        then a decoding round in another: decode time stays apart from prompt time."""
        events, limit = [], self.engine.max_context
        decoding = [m for m in self.running if not m.prefilling]
        for m in [m for m in decoding if len(m.history) > limit]:
            events += self._finish(m, "context_full")  # no room for the token it would feed
            decoding.remove(m)
        prefilling = [m for m in self.running if m.prefilling]
        if prefilling:
            began = time.perf_counter()
            share = CHUNK // len(prefilling)  # all chunks fit one call
            events += self._prompt_chunks(prefilling, min(share, PROMPT_ROWS) if decoding
                                          else share)
            self.prompt_seconds += time.perf_counter() - began
        if decoding:
            events += self._decode(decoding)
        return events

    def _prompt_chunks(self, members, share) -> list:
        """The next `share` prompt rows of each member in one call."""
        engine, parts, last_rows, offset = self.engine, [], {}, 0
        for m in members:
            n = engine.call_rows(m.prefilled, min(len(m.prompt) - m.prefilled, share))
            parts.append((m.seq, m.prefilled, m.prompt[m.prefilled:m.prefilled + n]))
            m.prefilled += n
            offset += n
            if not m.prefilling:
                last_rows[m] = offset - 1
        engine.forward(parts)
        logits = engine.head_rows(list(last_rows.values()))
        events = []
        for m, row in zip(last_rows, logits):
            m.first_token_at = time.perf_counter()
            events += self._commit(m, m.decoder.start(row, m.history))
        return events

    def _decode(self, members) -> list:
        """One round of every decoding member: its last token and its planned drafts."""
        engine, timer = self.engine, time.perf_counter()
        drafts, offers = self._plan(members)
        parts = [(m.seq, len(m.history) - 1, [m.history[-1]] + drafts[m]) for m in members]
        engine.forward(parts)
        rows = sum(len(ids) for _, _, ids in parts)
        logits = iter(engine.head_rows(range(rows)))
        seconds = time.perf_counter() - timer
        self.rounds, self.rows = self.rounds + 1, self.rows + rows
        events = []
        for m in members:
            rows = [next(logits) for _ in range(1 + len(drafts[m]))]
            committed = accept(m.decoder.sampler, drafts[m], rows, m.history)
            m.seq.rollback(len(m.history) - 1 + len(committed))
            offer = offers.get(m)
            if offer is not None:
                offer.drafter.observe(offer, len(drafts[m]), len(committed) - 1, seconds)
            m.decoder.stats.record(offer and offer.drafter.name, len(drafts[m]),
                                   len(committed) - 1)
            m.decoder.stats.seconds["verify"] += seconds / len(members)
            m.history.extend(committed)
            events += self._commit(m, committed)
        return events

    def _plan(self, decoding):
        """The drafts of each decoding member this round, and the offers they came from."""
        found = {}
        share = CHUNK // len(decoding)  # every decoding member's rows fit one call
        for m in decoding:
            first = len(m.history) - 1
            budget = min(m.decoder.budget(m.history, m.wanted),
                         self.engine.call_rows(first, share) - 1)
            best = ([], [], None)
            for drafter in m.decoder.drafters if budget else ():
                tokens, chances, offer_for = drafter.candidates(m.history, budget)
                if tokens:
                    best = (tokens, chances, offer_for)
                    break
            found[m] = best
        cost = self.costs.get(next(s for s in BATCH_SLOTS if s >= max(2, len(decoding))))
        counts = [0] * len(decoding) if cost is None else plan_drafts(
            [found[m][1] for m in decoding], lambda rows: cost[min(rows, CHUNK)],
            len(decoding))
        drafts, offers = {}, {}
        for m, k in zip(decoding, counts):
            tokens, _, offer_for = found[m]
            drafts[m] = list(tokens[:k])
            if k:
                offers[m] = offer_for(k)
        return drafts, offers

    def _commit(self, member, committed) -> list:
        self.committed += len(committed)
        events = [(member, piece) for piece in member.reply.add(committed)]
        if member.reply.finish or member.wanted <= 0:
            events += self._finish(member, member.reply.finish or "length")
        return events

    def _finish(self, member, finish) -> list:
        """End a member's reply: its result, its place to the next in line."""
        events = [(member, piece) for piece in member.reply.close(finish)]
        if member in self.waiting:
            self.waiting.remove(member)
        if member in self.running:
            self.running.remove(member)
            self.free.append(member.seq)
        for drafter in member.decoder.drafters:
            drafter.end_text()
        member.result = self.model._generation(member, finish)
        return events
