"""`edgespec bench` end to end on the tiny model, and its prompt selection."""
import json
from pathlib import Path

import pytest
from helpers import one_error_line, run_cli

import edgespec
from edgespec.bench import bench_prompt, load_prompts, prompt_ids
from edgespec.engine import COST_ROWS
from edgespec.errors import EdgespecError

PROMPT_FIELDS = {"question_id", "category", "plain_tokens_per_s", "spec_tokens_per_s",
                 "speedup", "identical", "acceptance", "tokens_per_round", "runs", "drafters"}


def test_bench_writes_table_json_and_plot(tiny_int4, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = run_cli("bench", tiny_int4, "--per-category", "1", "--categories", "qa", "math",
                     "--max-new-tokens", "16", "--json", out, "--plot", png, "--draft-k", "3",
                     "--repeat", "2")
    assert result.returncode == 0, result.stderr
    assert "overall" in result.stdout and "speedup" in result.stdout
    report = json.loads(out.read_text())
    assert [p["category"] for p in report["prompts"]] == ["math", "qa"]
    assert all(PROMPT_FIELDS <= p.keys() and p["runs"] == 2 for p in report["prompts"])
    assert all(p["identical"] for p in report["prompts"])  # greedy: lossless
    assert report["summary"]["overall"]["prompts"] == 2 and report["settings"]["draft_policy"]["draft_k"] == 3
    assert png.read_bytes()[:4] == b"\x89PNG"
    costs = report["round_ms"]  # JSON keys are strings
    assert tuple(sorted(map(int, costs))) == COST_ROWS and all(ms > 0 for ms in costs.values())
    assert "round cost by rows (ms; x a plain step): 1: " in result.stdout
    # the drafter line adds up the prompts' own counts
    exits = [p["drafters"]["exit"] for p in report["prompts"]]
    assert f"exit {sum(e['rounds'] for e in exits)} rounds" in result.stdout
    assert f"({sum(e['accepted'] for e in exits)}/{sum(e['drafted'] for e in exits)} drafts)" \
        in result.stdout


def test_round_costs_leave_the_models_cache_alone_and_the_model_deterministic(tiny_int4):
    model = edgespec.load(tiny_int4)
    before = model.generate_ids([5, 6, 7, 8], max_new_tokens=12).tokens
    held = model.sequence.cached_tokens()
    costs = model.engine.round_costs(repeat=2)
    assert tuple(costs) == COST_ROWS
    assert model.sequence.cached_tokens() == held and held[:4] == [5, 6, 7, 8]
    assert model.generate_ids([5, 6, 7, 8], max_new_tokens=12).tokens == before


def test_per_category_takes_the_lowest_question_ids(tmp_path):
    lines = [{"question_id": i, "category": "ab"[i % 2], "turns": [f"q{i}"]} for i in (9, 4, 7, 2, 5)]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    picked = load_prompts(path, per_category=2)
    assert [(r["category"], r["question_id"]) for r in picked] == [("a", 2), ("a", 4),
                                                                   ("b", 5), ("b", 7)]
    assert len(load_prompts(path, limit=3)) == 3


def test_the_workload_prompts_bench_conversations_through_the_chat_template(tiny_int4):
    path = Path(__file__).parent.parent / "benchmarks" / "data" / "workloads.jsonl"
    rows = load_prompts(path)
    kinds = {"code_edit", "text_edit", "doc_answer", "extraction", "summary", "rewrite",
             "agent_loop"}
    assert {row["category"] for row in rows} == kinds
    model = edgespec.load(tiny_int4)
    agent = next(row for row in rows if "messages" in row)
    assert prompt_ids(model, agent) == model.codec.encode_chat(agent["messages"])
    result = bench_prompt(model, agent, model.settings(max_new_tokens=8, temperature=0))
    assert result["identical"] and result["n_prompt"] == len(prompt_ids(model, agent))


def test_bench_alternates_which_mode_runs_first(tiny_int4):
    model = edgespec.load(tiny_int4)
    modes, generate = [], model.generate_ids

    def recorded(ids, settings, **kwargs):
        modes.append(settings.mode)
        return generate(ids, settings=settings, **kwargs)

    model.generate_ids = recorded  # the real decoding, its order written down
    row = {"question_id": 1, "category": "qa", "turns": ["Name a colour."]}
    result = bench_prompt(model, row, model.settings(max_new_tokens=6, temperature=0), repeat=3)
    assert modes == ["plain", "speculative", "speculative", "plain", "plain", "speculative"]
    assert result["runs"] == 3 and result["identical"]


def test_the_built_in_prompt_set_covers_the_categories():
    categories = {row["category"] for row in load_prompts()}
    assert {"writing", "coding", "math_reasoning", "summarization", "rag", "qa"} <= categories


@pytest.mark.parametrize("content, message", [("{oops", "not JSON lines"),
                                              ('{"question_id": 1}', "needs question_id")])
def test_a_bad_prompts_file_is_named(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(EdgespecError, match=message):
        load_prompts(path)


def test_an_unknown_category_is_a_one_line_error(tiny_int4):
    result = run_cli("bench", tiny_int4, "--categories", "poetry")
    assert result.returncode == 2
    assert "no prompts of category poetry" in one_error_line(result.stderr)
