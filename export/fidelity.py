"""The fidelity gate: do the artifact's greedy answers follow the model the user brought?

For each short chat question of data/fidelity.jsonl (the question and words of a right
answer), the source model in float32 (transformers) answers greedily, up to REPLY_TOKENS
tokens; then the artifact answers the same token ids with plain greedy decoding:
- first16_equal: its first FIRST tokens equal the reference's (all when shorter);
- right: a word of the answer is in its reply (reference_right: the reference's count);
- top1_agreement: teacher-forced along the reference's replies, how often the artifact's
  likeliest next token is the reference's.
Export prints them and stores them in the manifest; benchmarks/fidelity.py judges peers
(llama.cpp on the same GGUF) the same way.
"""
import json
from pathlib import Path

import numpy as np

QUESTIONS = Path(__file__).parent / "data" / "fidelity.jsonl"
REPLY_TOKENS, FIRST = 48, 16


def questions(path=QUESTIONS) -> list:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def reference_replies(torch_model, prompts, stop_ids) -> list:
    """The float32 model's greedy replies (token ids, end of turn excluded)."""
    import torch
    replies = []
    for ids in prompts:
        with torch.no_grad():
            out = torch_model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=REPLY_TOKENS, do_sample=False, top_p=None, top_k=None,
                temperature=None, eos_token_id=list(stop_ids), pad_token_id=min(stop_ids))
        replies.append([t for t in out[0, len(ids):].tolist() if t not in stop_ids])
    return replies


class ArtifactAnswers:
    """An artifact's greedy replies and teacher-forced top-1 tokens."""

    def __init__(self, model):
        self.model = model

    def reply(self, ids) -> tuple:
        """(greedy reply without end of turn, decode tokens/s)."""
        g = self.model.generate_ids(ids, REPLY_TOKENS, mode="plain", temperature=0)
        return [t for t in g.tokens if t not in self.model.stop_ids], g.decode_tokens_per_s

    def top1(self, ids) -> list:
        """The likeliest next token after every prefix of `ids` (one prefill, all rows)."""
        engine = self.model.engine
        engine.reset()
        engine.lower(np.asarray(ids, np.int64))
        engine.upper(len(ids))
        return engine.head(engine.final_states, range(len(ids))).argmax(-1).tolist()


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


def measure(source, path, max_context) -> dict:
    """The gate's numbers for the artifact at `path`, made from `source` (export's model),
    on the questions whose reply fits the artifact's context; None when none does."""
    from edgespec.model import load
    model = load(path, verify=False)
    rows, prompts = [], []
    for row in questions():
        ids = model.encode(row["question"])
        if len(ids) + REPLY_TOKENS < max_context:
            rows.append(row)
            prompts.append(ids)
    if not rows:
        return None
    references = reference_replies(source.torch_model, prompts, set(model.stop_ids))
    decode = model.codec.decode
    result = judge(ArtifactAnswers(model), rows, prompts, references, decode)
    result.pop("decode_tokens_per_s")  # export's machine is busy; bench measures speed
    return {**result, "reference_right": sum(is_right(decode(r), row["answer"])
                                             for r, row in zip(references, rows))}
