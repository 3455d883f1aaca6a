"""The quality gate: how closely a quantized artifact follows the full-precision model.

Both models score every next token of a fixed English passage (data/quality.txt, written for
the project, so no model was tuned on it). Two numbers: top-1 agreement (the artifact's most
likely token equals the reference's) and the perplexity of the passage under each model.
Export prints them and stores them in the manifest; README compares them with peers.
"""
from pathlib import Path

import numpy as np

QUALITY_TEXT = Path(__file__).parent / "data" / "quality.txt"
ROWS = 64  # logits rows scored at a time


def passage_ids(tokenizer) -> list:
    """The passage as token ids (no chat template: plain text), after the BOS token for
    models whose tokenizer adds one (Gemma is lost without it)."""
    ids = tokenizer.encode(QUALITY_TEXT.read_text(), add_special_tokens=False)
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
    return ids if bos is None else [bos] + ids


def reference_logits(torch_model, ids) -> np.ndarray:
    """[len(ids), vocab] next-token logits of the full-precision model (transformers)."""
    import torch
    with torch.no_grad():
        return torch_model(torch.tensor([ids])).logits[0].float().numpy()


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
    """scores() of an exported artifact, prefill in chunks: a chunk's logits at a time, never
    the passage's (with a large vocabulary those take gigabytes)."""
    from edgespec.engine import CHUNK
    from edgespec.model import load
    engine = load(path, verify=False).engine
    top1, nll = [], []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start:start + CHUNK]
        engine.lower(np.asarray(chunk, np.int64))
        engine.upper(len(chunk))
        logits = engine.head(engine.final_states, range(len(chunk)))
        chunk_top1, chunk_nll = scores(logits, ids[start:start + CHUNK + 1])
        top1.append(chunk_top1)
        nll.append(chunk_nll)
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
    the passage is cut to the artifact's context. The reference's logits are dropped once
    scored, before the artifact is loaded."""
    ids = passage_ids(source.tokenizer)[:max_context]
    reference = scores(reference_logits(source.streamed_reference(), ids), ids)
    return compare(reference, artifact_scores(path, ids), ids)
