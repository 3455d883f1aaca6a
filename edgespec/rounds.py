"""The decode round: every decoding sequence's next tokens, for one sequence or several.
Plain decoding is this round with no drafters.

One round, each sequence starting from its last committed token t (not yet in any cache):
1. plan:    every drafter of a sequence offers drafts after its history (drafter.py); the
            planner keeps the offer with the most expected tokens per unit of the round's
            measured cost, and cuts planned drafts (lookup's, which come with chances) to
            those that pay for their rows, weighing all sequences' drafts together.
2. draft:   a sequence whose offer is the early exit's draws its drafts now: lower on t,
            then the draft head and lower on each draft, up to its k.
3. forward: lower and upper on each sequence's t and drafts, at their positions: one
            sequence on the single-sequence graphs (where the exit's drafts are in lower
            already), several in one call of the batch graphs (engine.py), bit for bit
            alike.
4. head:    the verifier's logits after t and after every draft, the last one the bonus (or
            the few largest that decide the token, where the head computes them).
5. accept:  per sequence, the longest prefix where the verifier chooses the draft, then the
            verifier's own token: the correction at the first mismatch, or the bonus. Greedy
            chooses the argmax, sampling draws with the position's own uniform (sampling.py),
            so the committed tokens are exactly those plain decoding commits.
6. commit:  each cache rolls back to t and the accepted drafts (nothing is copied); the
            drafters hear what was accepted, the history grows.
"""
import time
from dataclasses import dataclass

from .drafter import PlainSpeed
from .early_exit import EarlyExit
from .lookup import PromptLookup
from .sampling import top_probability

# Every drafter, in the order that breaks ties between equal offers (the cheaper first: a
# lookup round runs no draft head). A new drafter is a module and a line here.
DRAFTERS = (PromptLookup, EarlyExit)


class Drafting:
    """The drafters of each draft policy used so far, with the PlainSpeed they are judged by:
    what they learn (the early exit's timing, the replies lookup remembers) carries over
    from one reply to the next."""

    def __init__(self):
        self.by_policy = {}  # policy -> (its PlainSpeed, its drafters)

    def for_reply(self, settings, owner=None) -> tuple:
        """(pace, drafters) for a reply with these settings: none for plain decoding; each
        drafter's twin for this reply, sharing what it remembers of earlier replies only
        with the same `owner`'s."""
        policy = settings.draft
        if policy not in self.by_policy:
            pace = PlainSpeed()
            made = (cls.from_policy(policy, pace) for cls in DRAFTERS)
            self.by_policy[policy] = pace, [d for d in made if d is not None]
        pace, drafters = self.by_policy[policy]
        if settings.mode != "speculative":
            return pace, []
        return pace, [d.for_text(owner) for d in drafters]

    def forget(self):
        """Forget the earlier replies the drafters copy from."""
        for _, drafters in self.by_policy.values():
            for drafter in drafters:
                drafter.forget()


class Timer:
    """Charges the time since the last charge to one part of the sequences' stats, shared
    equally between the sequences of the round."""

    def __init__(self, stats: list):
        self.stats, self.began = stats, time.perf_counter()
        self.last = self.began

    def charge(self, part: str):
        now = time.perf_counter()
        for stats in self.stats:
            stats.seconds[part] += (now - self.last) / len(self.stats)
        self.last = now


@dataclass
class Planned:
    """What one sequence verifies this round: the offer it came from (None: a plain step)
    and the drafts (the early exit's are drawn in the round, up to `count`)."""
    offer: object = None
    count: int = 0
    drafts: list = None


# -- plan ----------------------------------------------------------------------------------

def plan_drafts(chances: list, cost, base_rows: int, base_expected: float = None) -> list:
    """How many drafts each planned offer verifies: the choice with the most expected
    committed tokens per unit of round cost. chances[i][j]: the chance that offer i's
    drafts 0..j are all accepted (falling with j); cost(rows): a round's cost; base_rows and
    base_expected: the round's rows and expected tokens without them (default: a token for
    each offer). Drafts are taken best first, so more rows only ever add the next best."""
    ranked = sorted(((chance, -j, i) for i, row in enumerate(chances)
                     for j, chance in enumerate(row)), reverse=True)
    expected = float(len(chances)) if base_expected is None else base_expected
    rows = base_rows
    best, taken = expected / cost(rows), 0
    for n, (chance, _, _) in enumerate(ranked, 1):
        expected, rows = expected + chance, rows + 1
        if expected / cost(rows) > best:
            best, taken = expected / cost(rows), n
    counts = [0] * len(chances)
    for _, _, i in ranked[:taken]:
        counts[i] += 1
    return counts


def worth(offer, cost) -> tuple:
    """(how many drafts, expected tokens per plain step) of one sequence's offer alone: a
    planned offer's best count, else its k and the drafter's own measure."""
    if not offer.chances:
        return offer.k, offer.value
    k = plan_drafts([offer.chances], cost, 1, 1.0)[0]
    return k, (1.0 + sum(offer.chances[:k])) / cost(k + 1) if k else 0.0


def best_offer(offers: list, cost, keep_planned: bool = False) -> tuple:
    """(the offer with the most expected tokens per plain step alone, its drafts alone);
    ties: the earlier drafter. (None, 0) when none is made or, unless keep_planned, a
    planned one cannot beat a plain step alone (among several sequences its rows may still
    pay: the cut decides)."""
    scored = [(value, -i, o, k) for i, o in enumerate(offers)
              for k, value in [worth(o, cost)] if k or (keep_planned and o.chances)]
    best = max(scored, key=lambda s: s[:2], default=None)
    return (best[2], best[3]) if best else (None, 0)


def plan(sequences: list, budgets: list, costs) -> list:
    """Each sequence's Planned: its best offer, the planned drafts of all cut together."""
    cost_by_rows = costs.for_sequences(len(sequences))
    if cost_by_rows is None:  # no measured cost for this many: plain steps
        return [Planned() for _ in sequences]
    several = len(sequences) > 1
    planned = []
    for s, budget in zip(sequences, budgets):
        offers = [o for o in (d.offer(s.history, budget) for d in s.drafters if budget) if o]
        planned.append(Planned(*best_offer(offers, costs.single.__getitem__, several)))
    if several:  # alone, its best count is the cut already
        cut_drafts(planned, cost_by_rows.__getitem__)
    for p in planned:
        if p.offer is not None and p.offer.tokens:
            p.drafts = list(p.offer.tokens[:p.count])
        if not p.count:
            p.offer, p.drafts = None, []
    return planned


def cut_drafts(planned: list, cost):
    """Cut the planned offers' drafts (those with chances) together, by plan_drafts, the
    other offers' rows counted in."""
    cut = [p for p in planned if p.offer is not None and p.offer.chances]
    base_rows = len(planned) + sum(p.count for p in planned) - sum(p.count for p in cut)
    counts = plan_drafts([p.offer.chances for p in cut], cost, base_rows, float(len(planned)))
    for p, count in zip(cut, counts):
        p.count = count


# -- the round ------------------------------------------------------------------------------

def decode_round(engine, sequences: list, budgets: list, costs) -> tuple:
    """One round of the decoding sequences (objects with seq, history, sampler, drafters,
    stats and pace; budgets: the most drafts each may verify): (each one's committed tokens,
    at least one, appended to its history; the rows verified)."""
    timer = Timer([s.stats for s in sequences])
    for s in sequences:
        s.seq.rollback(len(s.history) - 1)  # what the last round drafted past t
    planned = plan(sequences, budgets, costs)
    for s, p in zip(sequences, planned):
        if p.drafts is None:
            p.drafts = exit_drafts(engine, s, p, timer) if p.offer else []
    rows = forward(engine, sequences, planned, timer)
    logits = iter(head(engine, sequences, rows, timer))
    committed = []
    for s, p in zip(sequences, planned):
        verdicts = [next(logits) for _ in range(1 + len(p.drafts))]
        tokens = accept(s.sampler, p.drafts, verdicts, s.history)
        alone = time.perf_counter() - timer.began if len(sequences) == 1 else None
        commit(s, p, tokens, alone)
        committed.append(tokens)
    timer.charge("sampling")
    return committed, rows


def exit_drafts(engine, s, p: Planned, timer) -> list:
    """The early exit's drafts: lower on t, then the draft head and lower on each draft."""
    exit_, sampler, seq = p.offer.drafter, s.sampler, s.seq
    base = len(s.history) - 1
    engine.lower(seq, base, [s.history[-1]])
    timer.charge("draft")
    drafts, k = [], sampler.top_needed
    while len(drafts) < p.count:
        position = base + len(drafts)
        if k and engine.computes_top(k, draft=True):  # the few that decide, from a GPU
            logits, probability = engine.draft_top(seq, position, k, exit_.threshold > 0)
        else:
            logits = engine.draft_head(seq, position)
            probability = exit_.threshold and top_probability(logits)
        d = exit_.next_draft(logits, probability, sampler, s.history, drafts)
        timer.charge("head")
        if d is None:
            break
        drafts.append(d)
        engine.lower(seq, position + 1, [d])
        timer.charge("draft")
    return drafts


def forward(engine, sequences, planned, timer) -> int:
    """Lower and upper on every sequence's t and drafts; the rows the head may read."""
    parts = [(s.seq, len(s.history) - 1, [s.history[-1]] + p.drafts)
             for s, p in zip(sequences, planned)]
    if len(parts) > 1:
        engine.forward(parts)
    else:
        seq, first, ids = parts[0]
        if seq.lower_len < first + len(ids):  # not in lower yet: the exit's drafts are
            engine.lower(seq, first, ids)
            timer.charge("draft")
        engine.upper(seq, first, len(ids))
    timer.charge("verify")
    return sum(len(ids) for _, _, ids in parts)


def head(engine, sequences, rows: int, timer) -> list:
    """The verifier's logits for every row (or the few largest that decide each row's
    token, where the head computes them and the sequences need as many)."""
    needed = {s.sampler.top_needed for s in sequences}
    k = needed.pop() if len(needed) == 1 else 0
    if k and engine.computes_top(k):
        logits = engine.head_top(range(rows), k)
    else:
        logits = engine.head(range(rows))
    timer.charge("head")
    return logits


def accept(sampler, drafts, logits, history) -> list:
    """The committed tokens of a round: accepted drafts, then the verifier's token."""
    for i, d in enumerate(drafts):
        target = sampler(logits[i], history, drafts[:i])
        if target != d:
            return drafts[:i] + [target]
    return drafts + [sampler(logits[len(drafts)], history, drafts)]


def commit(s, p: Planned, tokens: list, seconds):
    """Keep t and the accepted drafts; tell the pace, the drafter and the stats (seconds:
    the round's, when it decoded this sequence alone)."""
    s.seq.rollback(len(s.history) - 1 + len(tokens))
    if seconds is not None:
        s.pace.record(len(tokens), seconds, plain=p.offer is None)
    if p.offer is not None:
        p.offer.drafter.observe(p.offer, len(p.drafts), len(tokens) - 1, seconds)
    s.stats.record(p.offer and p.offer.drafter.name, len(p.drafts), len(tokens) - 1)
    s.history.extend(tokens)
