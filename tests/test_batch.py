"""Many replies in one engine: every reply of a batch equals its solo run, token for token,
however the batch is mixed (prompt lengths, drafts, sampling settings, sequences joining,
leaving and cancelled); and the batch graphs give each row the logits it gets alone."""
import json
import random

import numpy as np
import pytest
from helpers import make_checkpoint, quiet, run_cli

import edgespec
from edgespec.rounds import plan_drafts
from edgespec.engine import CHUNK
from edgespec.errors import EdgespecError
from edgespec.export.pipeline import export_model

SAMPLINGS = [dict(temperature=0), dict(temperature=0.8, top_k=20, seed=1),
             dict(temperature=1.2, top_p=0.9, seed=7), dict(temperature=0.6, min_p=0.1, seed=3),
             dict(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, seed=11),
             dict(temperature=0, frequency_penalty=0.4)]
FORCED_EXIT = dict(draft_k=3, lookup_k=0, adaptive=False)  # the early exit drafts every round


def prompts_for(model, count, seed):
    """Random prompts of mixed lengths, some repeating themselves (lookup drafts from them)."""
    rng, vocab = random.Random(seed), model.engine.vocab_size
    prompts = []
    for _ in range(count):
        base = [rng.randrange(vocab) for _ in range(rng.randrange(2, 12))]
        prompts.append((base * rng.randrange(1, 6))[:rng.randrange(3, 90)])
    return prompts


def solo(model, prompt, settings):
    return solo_run(model, prompt, settings)[0]


def solo_run(model, prompt, settings):
    """The reply alone: its tokens and its streamed text."""
    model.forget()
    pieces = []
    return model.generate_ids(prompt, settings=settings, on_text=pieces.append).tokens, \
        "".join(pieces)


def test_plan_takes_the_best_drafts_first_and_only_while_they_pay():
    cost = {rows: 1 + 0.25 * (rows - 1) for rows in range(1, 64)}.get  # a row: 1/4 step
    # sequence 0's drafts are likely, sequence 1's not: only 0 drafts, and only while the
    # next draft's chance beats what the round already makes per unit of cost
    assert plan_drafts([[0.9, 0.8, 0.7, 0.1], [0.05, 0.01]], cost, 2) == [3, 0]
    assert plan_drafts([[0.1], [0.2]], cost, 2) == [0, 0]
    # every draft pays when rows are nearly free
    assert plan_drafts([[0.5, 0.4], [0.3]], lambda rows: 1 + 0.01 * rows, 2) == [2, 1]
    assert plan_drafts([[], []], cost, 2) == [0, 0]


def test_a_plan_is_never_worse_than_no_drafts():
    rng = random.Random(0)
    for _ in range(200):
        chances = [sorted((rng.random() for _ in range(rng.randrange(0, 6))), reverse=True)
                   for _ in range(rng.randrange(1, 8))]
        per_row = rng.uniform(0.05, 1.5)
        cost = lambda rows: 1 + per_row * rows  # noqa: E731
        counts = plan_drafts(chances, cost, len(chances))
        rows = len(chances) + sum(counts)
        expected = len(chances) + sum(sum(c[:k]) for c, k in zip(chances, counts))
        assert expected / cost(rows) >= len(chances) / cost(len(chances)) - 1e-12
        assert all(k <= len(c) for c, k in zip(chances, counts))


def test_batch_graphs_give_every_row_its_solo_logits(tiny_int4):
    """Sequences at different positions, with rows of different lengths in one call, get
    bit for bit the logits of the same rows run alone."""
    model = edgespec.load(tiny_int4)
    engine = model.engine
    prompts = prompts_for(model, 8, seed=1)
    rng = random.Random(2)
    for count in (2, 3, 5, 8):
        sequences = [engine.new_sequence() for _ in range(count)]
        parts = [(seq, 0, p) for seq, p in zip(sequences, prompts)]
        engine.forward(parts)
        for _ in range(3):
            rows = [[rng.randrange(engine.vocab_size) for _ in range(rng.randrange(1, 5))]
                    for _ in range(count)]
            parts = [(seq, seq.upper_len - rng.randrange(0, 2), ids)
                     for seq, ids in zip(sequences, rows)]
            engine.forward(parts)
            batched = engine.head(range(sum(map(len, rows)))).copy()
            start = 0
            for seq, first, ids in parts:
                own = engine.new_sequence()
                alone = engine.prefill(own, 0, seq.tokens[:first]) if first else None
                for i in range(len(ids)):  # one plain step per row, as a solo run makes them
                    alone = engine.prefill(own, first + i, [ids[i]])
                    assert np.array_equal(alone, batched[start + i])
                start += len(ids)


@pytest.mark.parametrize("parallel", [2, 3, 4, 8])
def test_every_reply_equals_its_solo_run(tiny_int4, parallel):
    """More prompts than sequences: sequences join as others end (different lengths and
    limits), greedy and sampled with settings of their own, with and without drafts."""
    model = edgespec.load(tiny_int4)
    prompts = prompts_for(model, 10, seed=parallel)
    settings = [model.settings(max_new_tokens=12 + 7 * (i % 4), ignore_eos=True,
                               mode="plain" if i % 5 == 4 else "speculative",
                               **SAMPLINGS[i % len(SAMPLINGS)],
                               **(FORCED_EXIT if i % 3 == 1 else {}))
                for i in range(len(prompts))]
    model.forget()
    batch = model.batch(parallel)
    # rows nearly free, so that the planner drafts whatever lookup finds (whatever this
    # machine measured at export)
    batch.costs.batch = {slots: [1 + 0.001 * rows for rows in range(CHUNK + 1)]
                         for slots in batch.costs.batch}
    requests = [batch.add(p, s) for p, s in zip(prompts, settings)]
    texts = {r.index: "" for r in requests}
    for request, piece in batch.run():
        texts[request.index] += piece.text
    for request, prompt, s in zip(requests, prompts, settings):
        assert (request.result.tokens, texts[request.index]) == solo_run(model, prompt, s)
        assert request.result.finish_reason == "length"
    drafted = {name: sum(r.result.stats.drafters[name].drafted for r in requests
                         if name in r.result.stats.drafters) for name in ("lookup", "exit")}
    assert drafted["lookup"] > 0 and drafted["exit"] > 0  # the batch rounds drafted both ways


def test_wide_heads_cross_the_gemm_cuts_as_alone(tmp_path):
    """head_dim 256 (Gemma 3): rows given to a batch call in the pieces call_rows allows
    never span a position where attention's scores GEMM changes its K slices
    (engine.gemm_cuts), so they get their solo bits across position 63."""
    checkpoint = make_checkpoint(tmp_path / "checkpoint", layers=2, head_dim=256)
    export_model(str(checkpoint), tmp_path / "artifact", precision="fp32", exit_layer=1,
                 log=quiet)
    model = edgespec.load(tmp_path / "artifact")
    engine = model.engine
    prompts = prompts_for(model, 3, seed=12)
    ids = [(p * 40)[:70] for p in prompts]
    sequences = [engine.new_sequence() for _ in ids]
    batched = [[] for _ in ids]
    positions = [0] * len(ids)
    while min(positions) < 70:  # each sequence in pieces of up to 12 rows
        parts = []
        for i, seq in enumerate(sequences):
            count = engine.call_rows(positions[i], min(12, 70 - positions[i]))
            parts.append((seq, positions[i], ids[i][positions[i]:positions[i] + count]))
        engine.forward([p for p in parts if p[2]])
        logits = iter(engine.head(range(sum(len(p[2]) for p in parts))).copy())
        for i, (_, first, rows) in enumerate(parts):
            batched[i] += [next(logits) for _ in rows]
            positions[i] += len(rows)
    for i in range(len(ids)):
        seq = engine.new_sequence()
        for position, token in enumerate(ids[i]):
            np.testing.assert_array_equal(engine.prefill(seq, position, [token]),
                                          batched[i][position],
                                          err_msg=f"sequence {i}, position {position}")


def test_a_cancelled_reply_changes_no_other(tiny_int4):
    model = edgespec.load(tiny_int4)
    prompts = prompts_for(model, 5, seed=5)
    settings = model.settings(max_new_tokens=30, ignore_eos=True, temperature=0.7, seed=4)
    batch = model.batch(4)
    requests = [batch.add(p, settings) for p in prompts]
    for _ in range(4):
        batch.step()
    batch.cancel(requests[1])
    batch.cancel(requests[4])  # still waiting for a place
    for _ in batch.run():
        pass
    cancelled = requests[1].result
    assert cancelled.finish_reason == "cancelled" and 0 < cancelled.n_generated < 30
    assert cancelled.tokens == solo(model, prompts[1], settings)[:cancelled.n_generated]
    assert requests[4].result.finish_reason == "cancelled" and requests[4].result.tokens == []
    for i in (0, 2, 3):
        assert requests[i].result.tokens == solo(model, prompts[i], settings)


def test_replies_end_as_alone_at_the_context_and_at_stops(tiny_int4):
    model = edgespec.load(tiny_int4)
    limit = model.engine.max_context
    prompts = prompts_for(model, 3, seed=9) + [[5] * (limit - 6)]
    settings = model.settings(max_new_tokens=40, temperature=0)
    batch = model.batch(4)
    requests = [batch.add(p, settings) for p in prompts]
    for _ in batch.run():
        pass
    for request, prompt in zip(requests, prompts):
        model.forget()
        alone = model.generate_ids(prompt, settings=settings)
        assert (request.result.tokens, request.result.finish_reason) == \
            (alone.tokens, alone.finish_reason)
    assert requests[-1].result.finish_reason == "context_full"


def test_generate_many_streams_each_reply(tiny_int4):
    model = edgespec.load(tiny_int4)
    pieces = {}
    results = model.generate_many(["hello there", "a b c a b c", "x"], parallel=2,
                                  max_new_tokens=10, temperature=0,
                                  on_text=lambda i, t: pieces.setdefault(i, []).append(t))
    for i, prompt in enumerate(("hello there", "a b c a b c", "x")):
        streamed = []
        alone = model.generate(prompt, max_new_tokens=10, temperature=0, on_text=streamed.append)
        assert (results[i].tokens, results[i].text) == (alone.tokens, alone.text)
        assert pieces.get(i, []) == streamed


def test_bad_batch_input_gets_a_clear_error(tiny_int4):
    model = edgespec.load(tiny_int4)
    for parallel in (0, 9, 2.5):
        with pytest.raises(EdgespecError, match="parallel must be an integer from 1 to 8"):
            model.batch(parallel)
    batch = model.batch(2)
    with pytest.raises(EdgespecError, match="context"):
        batch.add([1] * model.engine.max_context, model.settings())
    assert not batch.busy


def test_bench_parallel_reports_aggregate_speed_and_identity(tiny_int4, tmp_path):
    out = tmp_path / "bench.json"
    result = run_cli("bench", str(tiny_int4), "--parallel", "3", "--repeat", "1",
                     "--max-new-tokens", "12", "--temperature", "0", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "aggregate tok/s" in result.stdout and "identical to solo" in result.stdout
    runs = json.loads(out.read_text())["runs"]
    assert {(r["parallel"], r["mode"]) for r in runs} == \
        {(p, m) for p in (1, 3) for m in ("plain", "speculative")}
    for r in runs:
        n = r["prompts"]
        assert r["identical_to_solo"] == f"{n}/{n}" and r["aggregate_decode_tok_s"] > 0


@pytest.mark.smollm2
def test_smollm2_batch_replies_equal_their_solo_runs(smollm2_int4):
    """Chat prompts of different lengths, four at a time, greedy and seeded sampling with
    the artifact's defaults: each reply is its solo reply."""
    model = edgespec.load(smollm2_int4)
    questions = ["Name three planets.", "Write a haiku about rain.",
                 "Rewrite this sentence in the past tense: I walk to the shop and buy bread.",
                 "What is 12 times 7? Explain.", "List the days of the week.",
                 "Repeat after me: the quick brown fox jumps over the lazy dog."]
    for options in (dict(temperature=0), dict(seed=5)):
        settings = model.settings(max_new_tokens=48, **options)
        batch = model.batch(4)
        requests = [batch.add(model.encode(q), settings) for q in questions]
        for _ in batch.run():
            pass
        for request, q in zip(requests, questions):
            assert request.result.tokens == solo(model, model.encode(q), settings), q
