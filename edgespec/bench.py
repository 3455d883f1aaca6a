"""`edgespec bench`: plain vs speculative decoding, same artifact, same prompts, one process.

Per prompt (first turn, chat template, the given sampling settings, seeded by the prompt's id
unless a seed is given): plain and speculative, `repeat` times interleaved, the one that goes
first alternating. Speedup is the ratio of their median decode tokens/s; identical says
whether every run produced the same tokens (seeded sampling, like greedy decoding, gives
speculative the same tokens as plain).
"""
import json
import statistics
import sys
import time
import zlib
from collections import defaultdict
from importlib import resources
from pathlib import Path

from .errors import EdgespecError


def default_prompts() -> Path:
    return Path(str(resources.files("edgespec") / "data" / "prompts.jsonl"))


def load_prompts(path=None, limit=None, per_category=None, categories=None) -> list:
    """Rows of a Spec-Bench style JSONL file (question_id, category, and turns, whose first
    is the user's message, or messages, a conversation to answer)."""
    path = Path(path) if path else default_prompts()
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise EdgespecError(f"prompts file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise EdgespecError(f"{path} is not JSON lines ({e})") from e
    if not all({"question_id", "category"} <= row.keys() and ("turns" in row or "messages" in row)
               for row in rows):
        raise EdgespecError(f"{path}: every line needs question_id, category and turns or "
                            "messages")
    rows.sort(key=lambda row: row["question_id"])
    if categories:
        unknown = set(categories) - {row["category"] for row in rows}
        if unknown:
            raise EdgespecError(f"no prompts of category {', '.join(sorted(unknown))} in {path}")
        rows = [row for row in rows if row["category"] in categories]
    if per_category:
        kept, seen = [], defaultdict(int)
        for row in rows:
            seen[row["category"]] += 1
            if seen[row["category"]] <= per_category:
                kept.append(row)
        rows = kept
    return rows[:limit] if limit else rows


def prompt_ids(model, row) -> list:
    """A prompt row's token ids through the chat template."""
    return (model.codec.encode_chat(row["messages"]) if "messages" in row
            else model.encode(row["turns"][0]))


def bench_prompt(model, row, settings, repeat=1) -> dict:
    """Plain and speculative decoding of one prompt with `settings` (Model.settings),
    interleaved `repeat` times, each speculative run without earlier replies to copy; the
    speeds are medians over the runs and `identical` holds only if every run matched plain."""
    ids = prompt_ids(model, row)
    settings = _seeded(settings, row)
    if len(ids) + settings.max_new_tokens >= model.engine.max_context:
        raise EdgespecError(f"prompt {row['question_id']} has {len(ids)} tokens: too long for "
                            f"the context of {model.engine.max_context} with "
                            f"{settings.max_new_tokens} new tokens")
    runs = {"plain": [], "speculative": []}
    for i in range(repeat):
        # which mode goes first alternates: the second run of a pair is not always the same
        for mode in ("plain", "speculative")[::1 if i % 2 == 0 else -1]:
            model.forget()  # a repeat must not copy its own earlier reply
            runs[mode].append(model.generate_ids(ids, settings=settings.with_options(mode=mode)))
    plains, specs = runs["plain"], runs["speculative"]
    plain_speed = statistics.median(g.decode_tokens_per_s for g in plains)
    spec_speed = statistics.median(g.decode_tokens_per_s for g in specs)
    stats = specs[-1].stats  # they stand for the runs (same tokens each time)
    return {"question_id": row["question_id"], "category": row["category"],
            "n_prompt": len(ids), "n_generated": specs[-1].n_generated, "runs": repeat,
            "plain_tokens_per_s": plain_speed, "spec_tokens_per_s": spec_speed,
            "speedup": spec_speed / plain_speed if plain_speed else 0.0,
            "identical": all(g.tokens == plains[0].tokens for g in plains + specs),
            "acceptance": stats.acceptance, "tokens_per_round": stats.tokens_per_round,
            "drafters": stats.to_dict()["drafters"], "time_shares": stats.time_shares()}


def drafter_line(results) -> str:
    """What each drafter did over all prompts: rounds, accepted drafts a round, acceptance."""
    totals = defaultdict(lambda: defaultdict(int))
    for r in results:
        for name, counts in r["drafters"].items():
            for key, value in counts.items():
                totals[name][key] += value
    parts = [f"{name} {t['rounds']} rounds, "
             f"{t['accepted'] / t['rounds'] if t['rounds'] else 0:.2f} accepted/round "
             f"({t['accepted']}/{t['drafted']} drafts)" for name, t in totals.items()]
    return "per drafter, all prompts: " + ("; ".join(parts) or "none drafted")


def summarize(results) -> dict:
    """Per category and overall: medians and the fraction of identical outputs."""
    groups = defaultdict(list)
    for r in results:
        groups[r["category"]].append(r)
    groups["overall"] = list(results)

    def summary(rows):
        return {"prompts": len(rows),
                "median_speedup": statistics.median(r["speedup"] for r in rows),
                "identical": sum(r["identical"] for r in rows) / len(rows),
                "median_plain_tokens_per_s": statistics.median(r["plain_tokens_per_s"] for r in rows),
                "median_spec_tokens_per_s": statistics.median(r["spec_tokens_per_s"] for r in rows),
                "median_acceptance": statistics.median(r["acceptance"] for r in rows),
                "median_tokens_per_round": statistics.median(r["tokens_per_round"] for r in rows)}
    return {name: summary(rows) for name, rows in groups.items()}


def table(summaries) -> str:
    head = (f"{'category':16} {'n':>3} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} "
            f"{'identical':>9} {'accept':>7} {'tok/round':>9}")
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        if name == "overall":
            lines.append("-" * len(head))
        lines.append(f"{name:16} {s['prompts']:>3} {s['median_plain_tokens_per_s']:>11.1f} "
                     f"{s['median_spec_tokens_per_s']:>10.1f} {s['median_speedup']:>7.2f}x "
                     f"{100 * s['identical']:>8.0f}% {100 * s['median_acceptance']:>6.1f}% "
                     f"{s['median_tokens_per_round']:>9.2f}")
    return "\n".join(lines)


def plot(summaries, out, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EdgespecError("--plot needs matplotlib: pip install matplotlib") from None
    names = list(summaries)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.7 * len(names)), 6), sharex=True)
    top.bar(names, [summaries[n]["median_speedup"] for n in names], color="tab:blue")
    top.axhline(1.0, color="gray", linewidth=1)
    top.set_ylabel("median speedup (x)")
    top.set_title(title)
    bottom.bar(names, [100 * summaries[n]["median_acceptance"] for n in names], color="tab:green")
    bottom.set_ylabel("median acceptance (%)")
    bottom.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def run_parallel(model, rows, settings, parallels, repeat=1, progress=sys.stderr) -> dict:
    """Every prompt decoded `parallel` at a time, for each count in `parallels`, plain and
    speculative, the whole set `repeat` times interleaved. Parallel 1 is the single-reply
    path (Model.generate_ids); its replies are the solo runs every batch's replies are
    compared with. {(parallel, mode): run summary}, speeds the medians over the repeats."""
    model.engine.check_batch(max(parallels))
    model.generate("Hello", max_new_tokens=8)  # warm up sessions and allocators
    prompts = [(prompt_ids(model, row), _seeded(settings, row)) for row in rows]
    parallels = sorted(set(parallels) | {1})
    runs, solo = defaultdict(list), {}
    todo = [(p, mode) for _ in range(repeat) for p in parallels for mode in ("plain", "speculative")]
    for i, (parallel, mode) in enumerate(todo, 1):
        print(f"\r[{'#' * (20 * i // len(todo)):20}] {i}/{len(todo)}  parallel {parallel}, "
              f"{mode}   ", end="", file=progress, flush=True)
        run = _run_batch(model, prompts, mode, parallel)
        solo.setdefault(mode, run["replies"])
        run["identical"] = sum(a == b for a, b in zip(run.pop("replies"), solo[mode]))
        runs[(parallel, mode)].append(run)
    print(file=progress)
    summary = {}
    for (parallel, mode), done in runs.items():
        speed = statistics.median(r["aggregate_decode_tok_s"] for r in done)
        base = statistics.median(r["aggregate_decode_tok_s"] for r in runs[(1, mode)])
        plain = statistics.median(r["aggregate_decode_tok_s"] for r in runs[(parallel, "plain")])
        summary[(parallel, mode)] = {
            "parallel": parallel, "mode": mode, "runs": len(done), "prompts": len(prompts),
            "aggregate_decode_tok_s": speed, "vs_parallel_1": speed / base,
            "vs_plain": speed / plain,
            "per_sequence_tok_s": statistics.median(r["per_sequence_tok_s"] for r in done),
            "tokens_per_round": statistics.median(r["tokens_per_round"] for r in done),
            "accepted": done[-1]["accepted"],
            "identical_to_solo": f"{min(r['identical'] for r in done)}/{len(prompts)}"}
    return summary


def _seeded(settings, row):
    if settings.sampling.seed is not None:
        return settings
    return settings.with_options(seed=zlib.crc32(str(row["question_id"]).encode()))


def _run_batch(model, prompts, mode, parallel) -> dict:
    """One pass over the prompts: tokens, aggregate and per-reply decode speeds. Decode time
    is the wall time less the rounds that ran prompt rows only (parallel 1: the replies'
    own decode times, prefill apart)."""
    model.forget()  # nothing copied from an earlier pass
    if parallel == 1:
        results = [model.generate_ids(ids, settings=settings.with_options(mode=mode))
                   for ids, settings in prompts]
        decode_s = sum(g.decode_s for g in results)
    else:
        batch = model.batch(parallel)
        requests = [batch.add(ids, settings.with_options(mode=mode)) for ids, settings in prompts]
        began = time.perf_counter()
        for _ in batch.run():
            pass
        decode_s = time.perf_counter() - began - batch.prompt_seconds
        results = [m.result for m in requests]
    accepted = {}  # drafter -> [accepted, drafted], all replies
    for g in results:
        for name, s in g.stats.drafters.items():
            counts = accepted.setdefault(name, [0, 0])
            counts[0], counts[1] = counts[0] + s.accepted, counts[1] + s.drafted
    return {"replies": [g.tokens for g in results],
            "accepted": {name: f"{a}/{d}" for name, (a, d) in accepted.items() if d},
            "aggregate_decode_tok_s": sum(g.n_generated - 1 for g in results) / decode_s,
            "per_sequence_tok_s": statistics.median(g.decode_tokens_per_s for g in results),
            "tokens_per_round": statistics.mean(g.stats.tokens_per_round for g in results)}


def parallel_table(summary) -> str:
    head = (f"{'parallel':>8} {'mode':12} {'aggregate tok/s':>15} {'x parallel 1':>12} "
            f"{'x plain':>8} {'per-seq tok/s':>13} {'tok/round':>9} {'identical to solo':>17}  "
            "drafts accepted")
    lines = [head, "-" * len(head)]
    for s in summary.values():
        lines.append(f"{s['parallel']:>8} {s['mode']:12} {s['aggregate_decode_tok_s']:>15.1f} "
                     f"{s['vs_parallel_1']:>11.2f}x {s['vs_plain']:>7.2f}x "
                     f"{s['per_sequence_tok_s']:>13.1f} {s['tokens_per_round']:>9.2f} "
                     f"{s['identical_to_solo']:>17}  "
                     + (", ".join(f"{n} {c}" for n, c in s["accepted"].items()) or "-"))
    return "\n".join(lines)


def cost_line(costs) -> str:
    plain = costs[1]
    return "round cost by rows (ms; x a plain step): " + ", ".join(
        f"{rows}: {ms:.1f} ({ms / plain:.2f}x)" for rows, ms in costs.items())


def run(model, rows, settings, repeat=1, progress=sys.stderr) -> list:
    """Bench every row with `settings` (Model.settings), printing a progress line per prompt."""
    model.generate("Hello", max_new_tokens=8)  # warm up sessions and allocators
    results = []
    for i, row in enumerate(rows, 1):
        results.append(bench_prompt(model, row, settings, repeat))
        r = results[-1]
        bar = "#" * (20 * i // len(rows))
        print(f"\r[{bar:20}] {i}/{len(rows)}  {r['category']:14} {r['question_id']:>4}: "
              f"{r['speedup']:.2f}x, {'identical' if r['identical'] else 'DIFFERENT'}   ",
              end="", file=progress, flush=True)
    print(file=progress)
    return results
