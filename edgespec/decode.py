"""Plain decoding: every token through lower, upper and head. The baseline and the reference."""
from .engine import Engine
from .sampling import Sampler


def plain_rounds(engine: Engine, sampler: Sampler, first_logits, history: list,
                 max_new_tokens: int):
    """Yield [token] per step, starting from the prompt's last logits.

    `history` (prompt + generated ids) is extended in place; the engine's caches hold all of
    it but the last token. Same protocol as SpeculativeDecoder.rounds."""
    logits = first_logits
    for produced in range(1, max_new_tokens + 1):
        token = sampler(logits, history)
        history.append(token)
        yield [token]
        if produced < max_new_tokens:
            logits = engine.step(token)
