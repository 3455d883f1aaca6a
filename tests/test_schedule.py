"""Prompt lookup matches, lookup's draft-length plan and the never-slower scheduler, as pure logic."""
import pytest

from edgespec.lookup import Match, PromptLookup
from edgespec.schedule import (FIRST_PAUSE, LOOKUP_PRIOR, PROBE_STEPS, START_K, TRIAL_ROUNDS,
                               Scheduler, _costs_by_rows)


def proposal(history, k, lookup=None):
    """What a lookup round would draft: up to k tokens of the match's continuation."""
    match = (lookup or PromptLookup()).match(history)
    return match.continuation(history, k) if match else []


def test_lookup_proposes_what_followed_the_longest_match():
    history = [1, 2, 3, 4, 5, 9, 2, 3]
    assert proposal(history, k=2) == [4, 5]
    history = [7, 3, 4, 1, 8, 3, 4, 2, 5, 7, 3, 4]
    assert PromptLookup().match(history) == Match(3, 3, "single")  # "7 3 4" beats "3 4"
    assert proposal(history, k=3) == [1, 8, 3]


def test_lookup_takes_the_most_frequent_continuation_then_the_latest():
    history = [3, 1, 8, 3, 1, 9, 7, 3, 1, 8, 6, 3, 1]
    assert PromptLookup().match(history) == Match(2, 9, "split")  # "3 1" -> 8 twice, 9 once
    assert proposal([3, 4, 1, 3, 4, 2, 3, 4], k=1) == [2]  # a tie: the latest


def test_lookup_says_whether_earlier_occurrences_agreed():
    assert PromptLookup().match([1, 5, 6, 7, 2, 5, 6, 7, 3, 5, 6]) == Match(2, 7, "agreed")
    assert PromptLookup().match([5, 6, 7, 8, 5, 6]).kind == "single"
    assert PromptLookup().match([9, 1, 9]) == Match(1, 1, "single")  # a lone repeated token


def test_lookup_proposes_nothing_without_a_match_and_grows_with_the_history():
    lookup, history = PromptLookup(), [1, 2, 3, 4]
    assert lookup.match(history) is None and proposal(history, 4, lookup) == []
    history += [5, 1, 2]
    assert proposal(history, 4, lookup) == [3, 4, 5, 1]


def test_round_costs_are_interpolated_and_extended_past_the_measured_rows():
    costs = _costs_by_rows({"1": 10.0, "2": 12.0, "4": 16.0}, 6)
    assert costs[1:] == pytest.approx([1.0, 1.2, 1.4, 1.6, 1.8, 2.0])


def plan(costs, k_max=8, adaptive=True):
    scheduler = Scheduler({"exit": 0, "lookup": k_max}, adaptive, round_costs=costs)
    scheduler.new_text()
    return scheduler


FREE_ROWS = {"1": 1.0, "16": 1.0}
DEAR_ROWS = {"1": 1.0, "2": 2.0}  # every row costs a plain step: no draft can pay


def test_lookup_drafts_as_far_as_free_rows_allow_and_not_when_rows_cost_a_step():
    long_match = Match(6, 0, "agreed")
    assert plan(FREE_ROWS).lookup_k(long_match, budget=5) == 5
    assert plan(FREE_ROWS).lookup_k(long_match, budget=50) == 8  # the policy's most
    assert plan(DEAR_ROWS).lookup_k(long_match, budget=5) == 0
    assert plan(DEAR_ROWS).lookup_k(None, budget=5) == 0


CPU_ROWS = {"1": 1.0, "2": 1.25, "3": 1.45, "4": 1.65, "6": 2.05, "8": 2.45}


def test_longer_and_agreed_matches_earn_longer_drafts():
    ks = [plan(CPU_ROWS).lookup_k(Match(n, 0, kind), budget=8)
          for n, kind in ((1, "split"), (2, "single"), (6, "single"), (6, "agreed"))]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] > ks[1]
    assert LOOKUP_PRIOR["agreed"][0] > LOOKUP_PRIOR["single"][0] > LOOKUP_PRIOR["split"][0]


def test_lookup_learns_from_the_texts_rounds_and_forgets_with_a_new_prompt():
    scheduler, match = plan(CPU_ROWS), Match(3, 0, "single")
    first = scheduler.lookup_k(match, budget=8)
    assert first > 0
    for _ in range(20):  # every draft of such matches is rejected
        k = scheduler.lookup_k(match, budget=8)
        scheduler.record("lookup" if k else None, k, 1, 1.0)
    assert scheduler.lookup_k(match, budget=8) == 0
    scheduler.new_text()
    assert scheduler.lookup_k(match, budget=8) == first


def test_a_sampled_text_plans_lookup_with_the_lower_rates_of_sampled_acceptance():
    scheduler = plan(CPU_ROWS)
    matches = [Match(n, 0, kind) for n in (1, 2, 4, 6) for kind in ("agreed", "single", "split")]
    scheduler.new_text(sampled=False)
    greedy = [scheduler.lookup_k(m, budget=8) for m in matches]
    scheduler.new_text(sampled=True)
    sampled = [scheduler.lookup_k(m, budget=8) for m in matches]
    assert all(s <= g for s, g in zip(sampled, greedy)) and sum(sampled) < sum(greedy)
    assert any(sampled)  # long agreed matches still pay while sampling


def test_a_fixed_policy_drafts_what_lookup_found_up_to_k():
    scheduler = plan(DEAR_ROWS, k_max=2, adaptive=False)
    assert scheduler.lookup_k(Match(1, 0, "split"), budget=8) == 2
    assert scheduler.lookup_k(Match(1, 0, "split"), budget=1) == 1


def run_rounds(scheduler, plain_s, round_s, tokens, rounds):
    """Feed rounds: plain steps while the scheduler allows no drafts, else drafting rounds."""
    used = []
    for _ in range(rounds):
        k = scheduler.exit_k(budget=8)
        if k == 0:
            scheduler.record(None, 0, 1, plain_s)
        else:
            scheduler.record("exit", k, tokens, round_s)
        used.append(k)
    return used


def test_scheduler_measures_plain_decoding_before_drafting():
    scheduler = Scheduler({"exit": 4, "lookup": 0}, adaptive=True)
    used = run_rounds(scheduler, 1.0, 1.0, 3, PROBE_STEPS + 1)
    assert used[:PROBE_STEPS] == [0] * PROBE_STEPS and used[-1] > 0


def test_scheduler_keeps_a_drafter_that_beats_plain_decoding():
    scheduler = Scheduler({"exit": 4, "lookup": 0}, adaptive=True)
    used = run_rounds(scheduler, plain_s=1.0, round_s=1.5, tokens=3, rounds=40)
    assert all(k > 0 for k in used[PROBE_STEPS:])


def test_scheduler_pauses_a_losing_drafter_and_tries_it_again_later():
    scheduler = Scheduler({"exit": 4, "lookup": 0}, adaptive=True)
    used = run_rounds(scheduler, plain_s=1.0, round_s=3.0, tokens=1, rounds=200)
    trial = used[PROBE_STEPS:PROBE_STEPS + TRIAL_ROUNDS]
    assert all(k > 0 for k in trial)  # tried, with k shrinking as nothing is accepted
    assert trial == sorted(trial, reverse=True)
    pause = used[PROBE_STEPS + TRIAL_ROUNDS:PROBE_STEPS + TRIAL_ROUNDS + FIRST_PAUSE]
    assert pause == [0] * FIRST_PAUSE
    assert sum(k > 0 for k in used) < 0.2 * len(used)  # mostly plain, yet retried
    assert any(k > 0 for k in used[PROBE_STEPS + TRIAL_ROUNDS + FIRST_PAUSE:])


def test_a_fixed_policy_always_drafts_k():
    scheduler = Scheduler({"exit": 3, "lookup": 2}, adaptive=False)
    assert run_rounds(scheduler, 1.0, 9.0, 1, 10) == [3] * 10
    assert scheduler.exit_k(budget=1) == 1


def test_rounds_the_confidence_gate_stopped_count_against_their_drafter():
    scheduler = Scheduler({"exit": 4, "lookup": 0}, adaptive=True)
    run_rounds(scheduler, 1.0, 1.0, 1, PROBE_STEPS)
    for _ in range(TRIAL_ROUNDS):  # the draft head ran, then no draft was confident enough
        assert scheduler.exit_k(budget=8) == START_K  # untouched: nothing was drafted
        scheduler.record("exit", 0, 1, 1.2)
    assert scheduler.exit_k(budget=8) == 0  # paused: slower than plain


def test_a_new_prompt_keeps_a_losing_exit_paused():
    scheduler = Scheduler({"exit": 4, "lookup": 4}, adaptive=True)
    run_rounds(scheduler, plain_s=1.0, round_s=3.0, tokens=1, rounds=PROBE_STEPS + TRIAL_ROUNDS)
    assert scheduler.exit_k(budget=8) == 0
    scheduler.new_text()
    assert scheduler.exit_k(budget=8) == 0  # the model's early exit is still slow


def test_lookup_leaves_a_round_to_an_early_exit_that_earns_more():
    scheduler = Scheduler({"exit": 4, "lookup": 8}, adaptive=True, round_costs=CPU_ROWS)
    weak, sure = Match(2, 0, "single"), Match(6, 0, "agreed")
    assert scheduler.lookup_k(weak, budget=8) > 0  # the exit has not drafted yet
    run_rounds(scheduler, plain_s=1.0, round_s=1.5, tokens=3, rounds=PROBE_STEPS + 2)
    assert scheduler.exit_k(budget=8) > 0  # 2 tokens a plain step's time: it earns 2x
    assert scheduler.lookup_k(weak, budget=8) == 0
    assert scheduler.lookup_k(sure, budget=8) > 0  # a long agreed run earns more still
