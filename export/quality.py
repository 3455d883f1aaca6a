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


def artifact_logits(path, ids) -> np.ndarray:
    """[len(ids), vocab] next-token logits of an exported artifact, prefill in chunks."""
    from edgespec.engine import CHUNK
    from edgespec.model import load
    engine = load(path, verify=False).engine
    rows = []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start:start + CHUNK]
        engine.lower(np.asarray(chunk, np.int64))
        engine.upper(len(chunk))
        rows.append(engine.head(engine.final_states, range(len(chunk))).astype(np.float32))
    return np.concatenate(rows)


def perplexity(logits, ids) -> float:
    """exp of the mean negative log-likelihood of ids[1:] given the logits before them."""
    nll = []
    for start in range(0, len(ids) - 1, ROWS):  # float64 copies of a few rows, not all
        rows = logits[start:min(start + ROWS, len(ids) - 1)].astype(np.float64)
        top = rows.max(-1, keepdims=True)
        log_z = (top + np.log(np.exp(rows - top).sum(-1, keepdims=True)))[:, 0]
        nll.append(log_z - rows[np.arange(len(rows)), ids[start + 1:start + 1 + len(rows)]])
    return float(np.exp(np.mean(np.concatenate(nll))))


def compare(reference, logits, ids) -> dict:
    ids = np.asarray(ids)
    return {"tokens": int(len(ids)),
            "top1_agreement": round(float(np.mean(reference.argmax(-1) == logits.argmax(-1))), 4),
            "perplexity": round(perplexity(logits, ids), 3),
            "reference_perplexity": round(perplexity(reference, ids), 3)}


def measure(source, path, max_context) -> dict:
    """The gate's numbers for the artifact at `path`, made from `source` (export's model);
    the passage is cut to the artifact's context."""
    ids = passage_ids(source.tokenizer)[:max_context]
    reference = reference_logits(source.streamed_reference(), ids)
    return compare(reference, artifact_logits(path, ids), ids)
