"""The calibration budget: what calibration does is sized to the time it is given."""
import pytest
from helpers import quiet

from edgespec.export import budget, calibrate
from edgespec.export.pipeline import export_model

SIZES = budget.Sizes(held_out=12, measure_tokens=96, train_prompts=200, train_tokens=128,
                     k_candidates=4, shortlist_sizes=3, final_policies=5)
QWEN_05B = dict(token_s=1 / 65, build_s=60)   # plain decoding and a graph build, typical
SMOLLM2 = dict(token_s=1 / 150, build_s=15)


def plan(minutes, machine, train="auto", counts=False, candidates=(18, 6, 12)):
    return budget.plan(minutes * 60, sizes=SIZES, candidates=list(candidates), train=train,
                       counts=counts, shortlist_auto=True, adapter_minutes=8.0, **machine)


def test_a_budget_that_cannot_afford_an_adapter_keeps_the_raw_exit_and_measures_the_choice():
    p = plan(5, QWEN_05B)
    assert (p.replies, p.exit_layers) == (0, [18])
    assert p.prompts >= 10 and p.seconds <= 5 * 60


def test_a_budget_that_affords_an_adapter_trains_it_and_screens_every_exit_layer():
    p = plan(60, QWEN_05B)
    assert p.replies >= budget.MIN_REPLIES and p.adapter_minutes > budget.MIN_ADAPTER_MINUTES
    assert p.screen_k and p.shortlist and p.exit_layers == [6, 12, 18]
    assert p.seconds <= 60 * 60


def test_a_shipped_adapter_gets_the_k_and_shortlist_screens_in_the_default_budget():
    p = plan(5, SMOLLM2, train=None, counts=True, candidates=(8,))
    assert (p.prompts, p.screen_k, p.shortlist, p.replies) == (12, True, True, 0)


def test_without_token_counts_no_shortlist_is_measured():
    assert not plan(60, SMOLLM2, train=None, counts=False).shortlist


def test_a_slow_model_measures_the_final_choice_on_fewer_prompts():
    p = plan(5, dict(token_s=1 / 20, build_s=250))
    assert budget.MIN_PROMPTS <= p.prompts < SIZES.held_out
    assert not (p.replies or p.screen_k)


def test_a_budget_too_small_to_measure_measures_nothing():
    assert plan(0.1, QWEN_05B).prompts == 0


def test_an_adapter_asked_for_is_trained_whatever_the_budget():
    assert plan(0.1, QWEN_05B, train="train").replies == budget.MIN_REPLIES


@pytest.mark.parametrize("minutes", [0.001, 1])
def test_a_tiny_budget_ships_the_raw_exit_with_an_adaptive_policy_and_lookup(
        tiny_checkpoint, tmp_path, monkeypatch, minutes):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lines = []
    manifest = export_model(str(tiny_checkpoint), tmp_path / "m", exit_layer="auto",
                            adapter="auto", shortlist="auto", calibrate=True,
                            calibration_minutes=minutes, log=lines.append)
    draft = manifest["draft"]
    graph = manifest.get("draft_graph")  # none for a raw exit over the whole vocabulary
    assert (graph is None or not graph["adapter"]) and manifest["exit_layer"] == 3
    assert any(line.startswith(f"calibration budget {minutes:g} min") and "raw exit" in line
               for line in lines), lines
    # a minute affords the final choice on the tiny model, never an adapter's minute of training
    if minutes == 1:
        assert draft["adaptive"] and draft["calibration"]["policies"]
    else:
        assert {k: draft[k] for k in calibrate.ADAPTIVE} == calibrate.ADAPTIVE
        assert calibrate.ADAPTIVE["adaptive"] and calibrate.ADAPTIVE["lookup_k"] > 0
