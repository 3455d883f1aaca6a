"""Plain decoding: every token through lower, upper and head. The baseline and the reference."""
from .engine import Engine


def plain_decode(engine: Engine, first_logits, history: list, max_new_tokens: int, sampler,
                 stop_ids):
    """Yield up to max_new_tokens tokens, starting from the prompt's last logits.

    `history` (prompt + generated ids) is extended in place; the engine's caches hold it.
    """
    logits = first_logits
    for produced in range(1, max_new_tokens + 1):
        token = sampler(logits, history)
        history.append(token)
        yield token
        if token in stop_ids or produced == max_new_tokens:
            return
        logits = engine.step(token)
