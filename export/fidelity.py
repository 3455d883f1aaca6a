"""The fidelity gate: do the artifact's greedy answers follow the model the user brought?

For each short chat question of data/fidelity.jsonl (the question and words of a right
answer), the source model in float32 answers greedily, up to REPLY_TOKENS tokens; then the
artifact answers the same token ids with plain greedy decoding:
- first16_equal: its first FIRST tokens equal the reference's (all when shorter);
- right: a word of the answer is in its reply (reference_right: the reference's count);
- top1_agreement: teacher-forced along the reference's replies, how often the artifact's
  likeliest next token is the reference's.
The reference's replies are decoded speculatively, the artifact drafting and the float32
model (export/reference.py, one layer in memory at a time) verifying: a pass per round
over all questions, not a pass of the whole model per token.
Export prints them and stores them in the manifest; benchmarks/fidelity.py judges peers
(llama.cpp on the same GGUF) the same way.
"""
import json
import time
from pathlib import Path

import numpy as np

QUESTIONS = Path(__file__).parent / "data" / "fidelity.jsonl"
# a question's whole cost in the gate, in times its artifact reply's (the reply, the
# teacher-forced pass, its share of the reference's rounds), for choosing how many fit
QUESTION_COST = 4
MIN_QUESTIONS = 4  # fewer measure noise
REPLY_TOKENS, FIRST = 48, 16


def questions(path=QUESTIONS) -> list:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def reference_replies(reference, prompts, stop_ids, draft, seconds=None) -> tuple:
    """The float32 model's greedy replies (token ids, end of turn excluded), by speculative
    decoding: `draft` proposes, `reference` (export/reference.py's Reference) verifies.

    draft(ids, n): up to n proposed tokens after `ids` (the artifact's greedy continuation).
    A round drafts every unfinished reply from its confirmed tokens, verifies all the drafts
    in one teacher-forced pass and accepts the longest agreeing prefix plus the reference's
    own next token (the bonus): each reply is the reference's greedy one whatever the draft,
    and grows by a token at least, so REPLY_TOKENS rounds finish them all (and are the
    most run). seconds: no round starts after this many; the replies then unfinished are
    left out. Returns ({prompt index: reply} of the finished replies, rounds run)."""
    confirmed = [[] for _ in prompts]
    unfinished, rounds, start = list(range(len(prompts))), 0, time.monotonic()
    while unfinished and rounds < REPLY_TOKENS and (
            seconds is None or time.monotonic() - start < seconds):
        contexts = [prompts[i] + confirmed[i] for i in unfinished]
        rooms = [REPLY_TOKENS - len(confirmed[i]) for i in unfinished]
        drafts = [list(draft(c, room))[:room] for c, room in zip(contexts, rooms)]
        for i, drafted, greedy, room in zip(unfinished, drafts,
                                            verify(reference, contexts, drafts), rooms):
            confirmed[i] += accept(drafted, greedy, stop_ids, room)
        unfinished = [i for i in unfinished if len(confirmed[i]) < REPLY_TOKENS
                      and confirmed[i][-1] not in stop_ids]
        rounds += 1
    return ({i: [t for t in reply if t not in stop_ids] for i, reply in enumerate(confirmed)
             if i not in unfinished}, rounds)


def verify(reference, contexts, drafts) -> list:
    """For each context and its draft: the reference's greedy token after the context and
    after each drafted token (len(draft) + 1 of them), from one pass over all."""
    states = reference.hidden([c + d for c, d in zip(contexts, drafts)])
    rows = [s[len(c) - 1:] for s, c in zip(states, contexts)]
    top1 = reference.scores(np.concatenate(rows))[0].tolist()
    ends = np.cumsum([len(r) for r in rows]).tolist()
    return [top1[end - len(r):end] for r, end in zip(rows, ends)]


def accept(drafted, greedy, stop_ids, room) -> list:
    """The drafted tokens up to the first the reference disagrees with, then its own token
    there; cut after a stop id and at `room` tokens."""
    n = 0
    while n < len(drafted) and drafted[n] == greedy[n]:
        n += 1
    tokens = list(drafted[:n]) + [greedy[n]]
    stops = [k + 1 for k, t in enumerate(tokens) if t in stop_ids]
    return tokens[:min([room, *stops])]


class ArtifactAnswers:
    """An artifact's greedy continuations (the reference's drafts), replies and
    teacher-forced top-1 tokens."""

    def __init__(self, model):
        self.model, self.generations = model, {}

    def continuation(self, ids, n) -> list:
        """Plain greedy tokens after `ids`, at most n, the stop token last when it stops."""
        return self._generate(ids, n).tokens

    def reply(self, ids) -> tuple:
        """(greedy reply without end of turn, decode tokens/s)."""
        g = self._generate(ids, REPLY_TOKENS)
        return [t for t in g.tokens if t not in self.model.stop_ids], g.decode_tokens_per_s

    def _generate(self, ids, n):
        # kept: the reference's first drafts are the replies judge() asks for
        key = (tuple(ids), n)
        if key not in self.generations:
            self.generations[key] = self.model.generate_ids(list(ids), n, mode="plain",
                                                            temperature=0)
        return self.generations[key]

    def top1(self, ids) -> list:
        """The likeliest next token after every prefix of `ids` (one prefill, all rows)."""
        engine, seq = self.model.engine, self.model.sequence
        engine.lower(seq, 0, np.asarray(ids, np.int64))
        engine.upper(seq, 0, len(ids))
        return engine.head(range(len(ids))).argmax(-1).tolist()


def is_right(text, answers) -> bool:
    return any(a.lower() in text.lower() for a in answers)


def judge(answers, rows, prompts, references, decode) -> dict:
    """The gate's numbers for one engine (ArtifactAnswers, or a peer with the same two
    methods) against the reference replies."""
    first, right, agree, total, speeds = 0, 0, 0, 0, []
    for row, ids, want in zip(rows, prompts, references):
        got, speed = answers.reply(ids)
        speeds.append(speed)
        first += got[:FIRST] == want[:FIRST]
        right += is_right(decode(got), row["answer"])
        predicted = answers.top1(ids + want)[len(ids) - 1:len(ids) + len(want) - 1]
        agree += sum(p == w for p, w in zip(predicted, want))
        total += len(want)
    return {"questions": len(rows), "first16_equal": first, "right": right,
            "top1_agreement": round(agree / max(total, 1), 4),
            "decode_tokens_per_s": round(float(np.median(speeds)), 1)}


def measure(source, path, max_context, seconds=None) -> dict:
    """The gate's numbers for the artifact at `path`, made from `source` (export's model),
    on the questions whose reply fits the artifact's context; None when none does.
    seconds: about the most the gate may take. The questions it affords are chosen up
    front, in order, from the time of the artifact's first reply; "questions" counts those
    measured (0: no reference reply finished in time), "left_out" the rest (and any whose
    reference reply the budget cut)."""
    from edgespec.model import load
    from .calibrate import short_context
    from .reference import Reference
    start = time.monotonic()
    model = load(path, verify=False, max_context=short_context(path))
    rows, prompts = [], []
    for row in questions():
        ids = model.encode(row["question"])
        if len(ids) + REPLY_TOKENS < min(max_context, model.engine.max_context):
            rows.append(row)
            prompts.append(ids)
    if not rows:
        return None
    answers, fitting = ArtifactAnswers(model), len(rows)
    if seconds is not None:
        first = time.monotonic()
        answers.continuation(prompts[0], REPLY_TOKENS)
        per_question = QUESTION_COST * (time.monotonic() - first)
        keep = max(MIN_QUESTIONS, int(seconds / per_question))
        rows, prompts = rows[:keep], prompts[:keep]
    left = None if seconds is None else seconds - (time.monotonic() - start)
    replies, rounds = reference_replies(Reference(source.arch, source.weights), prompts,
                                        set(model.stop_ids), answers.continuation, left)
    if not replies:  # the drafts agreed too little for any reply to finish in time
        return {"questions": 0, "left_out": fitting, "reference_rounds": rounds}
    rows, prompts = [rows[i] for i in sorted(replies)], [prompts[i] for i in sorted(replies)]
    references = [replies[i] for i in sorted(replies)]
    decode = model.codec.decode
    result = judge(answers, rows, prompts, references, decode)
    result.pop("decode_tokens_per_s")  # export's machine is busy; bench measures speed
    left_out = fitting - len(rows)
    return {**result, "reference_right": sum(is_right(decode(r), row["answer"])
                                             for r, row in zip(references, rows)),
            "reference_rounds": rounds, **({"left_out": left_out} if left_out else {})}
