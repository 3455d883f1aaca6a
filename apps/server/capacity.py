"""How many conversations the server decodes at once, and the memory their caches hold.

Each sequence holds one conversation's KV cache at the context it is served with,
allocated when the server starts, so a server that starts never runs out of cache memory
later. The default `parallel` is chosen from the artifact's measured batch round costs: the
most sequences at which every reply still decodes at least SHARE as fast as it does alone.
"""
import os

from edgespec.artifact import BATCH_SIZES
from edgespec.errors import EdgespecError

SHARE = 1 / 3  # the least part of its solo speed a reply keeps at the default parallel
MIB, GIB = 2 ** 20, 2 ** 30


def available_bytes():
    """Memory the system can give without swapping (None where it cannot say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_parallel(model, available) -> int:
    """The most sequences (1 or a batch size) whose round costs each reply at most 1 / SHARE
    plain steps and whose caches fit in `available` bytes."""
    if model.engine.device != "cpu":  # the batch graphs run on the CPU provider only
        return 1
    costs, best = model.costs.measured["batch_round_costs"], 1
    for parallel in BATCH_SIZES:
        cost = (costs.get(str(parallel)) or {}).get(str(parallel))
        if cost is not None and cost <= 1 / SHARE and fits(parallel, model.engine.sequence_bytes,
                                                            available):
            best = parallel
    return best


def fits(parallel: int, sequence_bytes: int, available) -> bool:
    return available is None or parallel * sequence_bytes <= available


def check_parallel(parallel: int, engine, available):
    """Refuse (one line) `parallel` sequences whose caches at the engine's context do not fit in
    `available` bytes, naming what would fit."""
    engine.check_batch(parallel)
    if fits(parallel, engine.sequence_bytes, available):
        return
    context, each = engine.max_context, engine.sequence_bytes
    most = available // each
    per_position = engine.bytes_for_context(context + 1) - each
    shorter = next((c for c in range(context, 1, -max(1, context // 64))
                    if parallel * engine.bytes_for_context(c) <= available), None)
    options = []
    if most >= 1:
        options.append(f"--parallel {most} fits at that context")
    if shorter:
        options.append(f"--max-context {shorter} fits {parallel} sequences")
    raise EdgespecError(
        f"--parallel {parallel} at --max-context {context} needs "
        f"{parallel * each / GIB:.2f} GiB of KV cache ({each / MIB:.0f} MiB a conversation, "
        f"{per_position / 1024:.0f} KiB a token), but {available / GIB:.2f} GiB of memory is "
        f"available: {' or '.join(options) or 'free some memory first'}")


def statement(parallel: int, engine) -> str:
    """What the sequences hold, for the server's first lines."""
    each = engine.sequence_bytes
    return (f"{parallel} conversation{'s' if parallel > 1 else ''} at once, each up to "
            f"{engine.max_context} tokens: {each / MIB:.0f} MiB of KV cache each, "
            f"{parallel * each / MIB:.0f} MiB in all")
