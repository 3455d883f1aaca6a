"""The quality gate: how closely a quantized artifact follows the full-precision model.

Both models score every next token of a fixed English passage (data/quality.txt, written for
the project, so no model was tuned on it). Two numbers: top-1 agreement (the artifact's most
likely token equals the reference's) and the perplexity of the passage under each model.
Export prints them and stores them in the manifest; README compares them with peers.
"""
from pathlib import Path

import numpy as np

QUALITY_TEXT = Path(__file__).parent / "data" / "quality.txt"
ROWS = 16  # logits rows scored at a time (float64 copies of them: 20 MB for Qwen2.5's)


def passage_ids(tokenizer) -> list:
    """The passage as token ids (no chat template: plain text), after the BOS token for
    models whose tokenizer adds one (Gemma is lost without it)."""
    ids = tokenizer.encode(QUALITY_TEXT.read_text(), add_special_tokens=False)
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
    return ids if bos is None else [bos] + ids


def reference_scores(reference, ids) -> tuple:
    """scores() of the full-precision model (export/reference.py's Reference), made a slice
    of the vocabulary at a time: no [len(ids), vocab] logits."""
    top1, log_p = reference.scores(reference.hidden([ids])[0], ids[1:])
    return top1, -log_p


def scores(logits, ids) -> tuple:
    """(top-1 token, negative log-likelihood of the next id) of every row of `logits`, the
    rows after ids[0:len(logits)]; the last row of the passage has no next id to score."""
    top1, nll = [], []
    for start in range(0, len(logits), ROWS):  # float64 copies of a few rows, not all
        rows = logits[start:start + ROWS].astype(np.float64)
        top1.append(rows.argmax(-1))
        nexts = np.asarray(ids[start + 1:start + 1 + len(rows)])
        rows = rows[:len(nexts)]
        top = rows.max(-1, keepdims=True)
        log_z = (top + np.log(np.exp(rows - top).sum(-1, keepdims=True)))[:, 0]
        nll.append(log_z - rows[np.arange(len(rows)), nexts])
    return np.concatenate(top1), np.concatenate(nll)


def artifact_scores(path, ids) -> tuple:
    """scores() of an exported artifact, prefill in chunks and the head on ROWS rows at a
    time: never a chunk's logits, let alone the passage's (with a large vocabulary those
    take gigabytes)."""
    from edgespec.artifact import open_artifact
    from edgespec.engine import CHUNK, Engine
    # the engine alone (no tokenizer), its buffers no longer than the passage
    engine = Engine(open_artifact(path, verify=False), max_context=max(2, len(ids)))
    seq = engine.new_sequence()
    top1, nll = [], []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start:start + CHUNK]
        engine.lower(seq, start, np.asarray(chunk, np.int64))
        engine.upper(seq, start, len(chunk))
        for first in range(0, len(chunk), ROWS):  # a few rows' logits at a time, not a chunk's
            rows = range(first, min(first + ROWS, len(chunk)))
            logits = engine.head(rows)
            row_top1, row_nll = scores(logits, ids[start + first:start + rows.stop + 1])
            top1.append(row_top1)
            nll.append(row_nll)
    return np.concatenate(top1), np.concatenate(nll)


def compare(reference, scored, ids) -> dict:
    """The gate's numbers from the scores() of the reference and of the model judged."""
    perplexity = lambda nll: round(float(np.exp(np.mean(nll))), 3)  # noqa: E731
    return {"tokens": int(len(ids)),
            "top1_agreement": round(float(np.mean(reference[0] == scored[0])), 4),
            "perplexity": perplexity(scored[1]),
            "reference_perplexity": perplexity(reference[1])}


def measure(source, path, max_context) -> dict:
    """The gate's numbers for the artifact at `path`, made from `source` (export's model);
    the passage is cut to the artifact's context."""
    from .reference import Reference
    ids = passage_ids(source.tokenizer)[:max_context]
    reference = reference_scores(Reference(source.arch, source.weights), ids)
    return compare(reference, artifact_scores(path, ids), ids)
