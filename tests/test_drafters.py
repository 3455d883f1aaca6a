"""The drafters' own logic, without a model: prompt lookup's matches and draft-length plan,
the early exit's timing, and how the loop picks between their offers."""
import pytest

from edgespec.drafter import PROBE_STEPS, Offer, PlainSpeed, costs_by_rows
from edgespec.early_exit import FIRST_PAUSE, START_K, TRIAL_ROUNDS, EarlyExit
from edgespec.lookup import (MAX_MATCH, MAX_NGRAM, MEMORY_TOKENS, PRIOR, Match, NgramIndex,
                             PromptLookup)
from edgespec.rounds import best_offer, worth


def indexed(history):
    index = NgramIndex()
    index.add(history, 0, len(history))
    return index


def found(history):
    return indexed(history).match(history)


def proposal(history, k):
    """What a lookup round would draft: up to k tokens of the match's continuation."""
    match = found(history)
    return match.continuation(k) if match else []


def match(length, kind):
    return Match(length, [], 0, kind)


def test_lookup_proposes_what_followed_the_longest_match():
    history = [1, 2, 3, 4, 5, 9, 2, 3]
    assert proposal(history, k=2) == [4, 5]
    history = [7, 3, 4, 1, 8, 3, 4, 2, 5, 7, 3, 4]
    assert found(history) == Match(3, history, 3, "single")  # "7 3 4" beats "3 4"
    assert proposal(history, k=3) == [1, 8, 3]


def test_lookup_takes_the_most_frequent_continuation_then_the_latest():
    history = [3, 1, 8, 3, 1, 9, 7, 3, 1, 8, 6, 3, 1]
    assert found(history) == Match(2, history, 9, "split")  # "3 1" -> 8 twice, 9 once
    assert proposal([3, 4, 1, 3, 4, 2, 3, 4], k=1) == [2]  # a tie: the latest


def test_lookup_says_whether_earlier_occurrences_agreed():
    history = [1, 5, 6, 7, 2, 5, 6, 7, 3, 5, 6]
    assert found(history) == Match(2, history, 7, "agreed")
    assert found([5, 6, 7, 8, 5, 6]).kind == "single"
    assert found([9, 1, 9]) == Match(1, [9, 1, 9], 1, "single")  # a lone repeated token


def test_a_match_knows_its_true_length_past_the_indexed_ngrams():
    copied = list(range(100, 100 + MAX_NGRAM + 5))
    history = copied + [1, 2, 3] + copied
    assert found(history[:-2]).length == MAX_NGRAM + 3  # "... 1 2 3" differs before that
    long_copy = list(range(200, 200 + MAX_MATCH + 20)) + [7]
    history = long_copy + long_copy[:-1]
    assert found(history) == Match(MAX_MATCH, history, len(long_copy) - 1, "single")


def test_lookup_proposes_nothing_without_a_match_and_grows_with_the_history():
    index, history = NgramIndex(), [1, 2, 3, 4]
    index.add(history, 0, 4)
    assert index.match(history) is None
    history += [5, 1, 2]
    index.add(history, 3, len(history))
    assert index.match(history).continuation(4) == [3, 4, 5, 1]


def test_lookup_drafts_from_replies_of_earlier_texts_and_forgets_the_oldest():
    drafter = lookup(FREE_ROWS, k_max=8)
    reply = [50, 51, 52, 53, 54, 55, 56, 57, 58]
    prompt = [1, 2, 3]
    for n in range(1, len(reply) + 1):  # the decode loop offers after each committed token
        drafter.offer(prompt + reply[:n], budget=8)
    drafter.new_text()
    offer = drafter.offer([4, 5, 50, 51, 52, 53], budget=8)  # a new prompt, the reply's start
    assert offer.plan[0].continuation(offer.k) == [54, 55, 56, 57, 58]
    filler = list(range(1000, 1000 + MEMORY_TOKENS))  # a reply as long as the memory
    for n in (1, len(filler)):
        drafter.offer([9] + filler[:n], budget=8)
    drafter.new_text()
    assert drafter.offer([4, 5, 50, 51, 52, 53], budget=8) is None  # the oldest forgotten


def test_round_costs_are_interpolated_and_extended_past_the_measured_rows():
    costs = costs_by_rows({"1": 10.0, "2": 12.0, "4": 16.0}, 6)
    assert costs[1:] == pytest.approx([1.0, 1.2, 1.4, 1.6, 1.8, 2.0])


def cost(costs):
    """A round's cost by rows, as the planner reads it."""
    return costs_by_rows(costs, 64).__getitem__


def lookup(costs, k_max=8, adaptive=True, sampled=False):
    drafter = PromptLookup(k_max, adaptive)
    drafter.new_text(sampled)
    drafter.cost = cost(costs)  # the round's, for these tests' plans
    return drafter


def plan(drafter, match, budget):
    """The drafter's offer for this match and the k the planner gives it alone."""
    keys = match.keys(min(budget, drafter.k_max))
    offer = Offer(drafter, len(keys), chances=tuple(drafter.chances(keys)), plan=(match, keys))
    return offer, worth(offer, drafter.cost)[0]


def lookup_k(drafter, match, budget):
    """The k of the drafter's plan for this match (0: no offer)."""
    return plan(drafter, match, budget)[1] if match else 0


def offered(drafters, history, budget, costs=None):
    """The offer a round of one sequence takes, as the planner chooses it."""
    offers = [o for o in (d.offer(history, budget) for d in drafters) if o]
    return best_offer(offers, cost(costs or {"1": 1.0}))[0]


FREE_ROWS = {"1": 1.0, "64": 1.0}
DEAR_ROWS = {"1": 1.0, "2": 2.0}  # every row costs a plain step: no draft can pay


def test_lookup_drafts_as_far_as_free_rows_allow_and_not_when_rows_cost_a_step():
    long_match = match(6, "agreed")
    assert lookup_k(lookup(FREE_ROWS), long_match, budget=5) == 5
    assert lookup_k(lookup(FREE_ROWS), long_match, budget=50) == 8  # the policy's most
    assert lookup_k(lookup(DEAR_ROWS), long_match, budget=5) == 0
    assert offered([lookup(DEAR_ROWS)], [1, 2, 3], budget=5) is None  # no match, no offer


CPU_ROWS = {"1": 1.0, "2": 1.25, "3": 1.45, "4": 1.65, "6": 2.05, "8": 2.45}


def test_longer_and_agreed_matches_earn_longer_drafts():
    ks = [lookup_k(lookup(CPU_ROWS), match(n, kind), budget=8)
          for n, kind in ((1, "split"), (2, "single"), (6, "single"), (6, "agreed"))]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] > ks[1]
    assert PRIOR["agreed"][0] > PRIOR["single"][0] > PRIOR["split"][0]


def test_a_copy_under_way_earns_longer_drafts_and_longer_still_while_accepted():
    drafter, copy = lookup(CPU_ROWS, k_max=32), match(MAX_MATCH, "single")
    assert lookup_k(drafter, match(6, "single"), budget=32) < lookup_k(drafter, copy, budget=32)
    for _ in range(10):  # every draft of the copy is accepted
        offer, k = plan(drafter, copy, 32)
        drafter.observe(offer, k, k, 1.0)
    assert lookup_k(drafter, copy, budget=32) == 32


def test_lookup_learns_from_the_texts_rounds_and_forgets_with_a_new_prompt():
    drafter, short = lookup(CPU_ROWS), match(3, "single")
    first = lookup_k(drafter, short, budget=8)
    assert first > 0
    for _ in range(20):  # every draft of such matches is rejected
        offer, k = plan(drafter, short, 8)
        if k:
            drafter.observe(offer, k, 0, 1.0)
    assert lookup_k(drafter, short, budget=8) == 0
    drafter.new_text()
    assert lookup_k(drafter, short, budget=8) == first


def test_a_sampled_text_plans_lookup_with_the_lower_rates_of_sampled_acceptance():
    matches = [match(n, kind) for n in (1, 2, 4, 6) for kind in ("agreed", "single", "split")]
    greedy = [lookup_k(lookup(CPU_ROWS), m, budget=8) for m in matches]
    sampled = [lookup_k(lookup(CPU_ROWS, sampled=True), m, budget=8) for m in matches]
    assert all(s <= g for s, g in zip(sampled, greedy)) and sum(sampled) < sum(greedy)
    assert any(sampled)  # long agreed matches still pay while sampling


def test_a_fixed_policy_drafts_what_lookup_found_up_to_k():
    drafter = lookup(DEAR_ROWS, k_max=2, adaptive=False)
    history = [3, 1, 4, 1, 5, 9, 3, 1]  # "3 1" was followed by 4, 1, 5, ...
    assert drafter.offer(history, budget=8).k == 2
    assert drafter.offer(history, budget=1).k == 1
    offer = drafter.offer(history, budget=8)
    assert list(offer.tokens) == [4, 1] and not offer.chances  # the planner takes all k


def early_exit(k_max=4, adaptive=True):
    return EarlyExit(PlainSpeed(), k_max, adaptive=adaptive)


def run_rounds(drafter, plain_s, round_s, tokens, rounds):
    """Rounds as the loop runs them: a plain step when the exit offers nothing, else an exit
    round that commits `tokens`; the k of each round (0: plain)."""
    used = []
    for _ in range(rounds):
        offer = offered([drafter], [1, 2, 3], budget=8)
        if offer is None:
            drafter.pace.record(1, plain_s, plain=True)
        else:
            drafter.pace.record(tokens, round_s, plain=False)
            drafter.observe(offer, offer.k, min(tokens - 1, offer.k), round_s)
        used.append(offer.k if offer else 0)
    return used


def test_the_exit_waits_for_plain_decoding_to_be_measured():
    drafter = early_exit()
    used = run_rounds(drafter, 1.0, 1.0, 3, PROBE_STEPS + 1)
    assert used[:PROBE_STEPS] == [0] * PROBE_STEPS and used[-1] > 0


def test_an_exit_that_beats_plain_decoding_keeps_drafting_and_grows_k():
    drafter = early_exit()
    used = run_rounds(drafter, plain_s=1.0, round_s=1.5, tokens=5, rounds=40)
    assert all(k > 0 for k in used[PROBE_STEPS:])
    assert used[PROBE_STEPS] == START_K and used[-1] == 4  # every draft accepted: k doubles


def test_a_losing_exit_is_paused_and_tried_again_later():
    drafter = early_exit()
    used = run_rounds(drafter, plain_s=1.0, round_s=3.0, tokens=1, rounds=200)
    trial = used[PROBE_STEPS:PROBE_STEPS + TRIAL_ROUNDS]
    assert all(k > 0 for k in trial)  # tried, with k shrinking as nothing is accepted
    assert trial == sorted(trial, reverse=True)
    pause = used[PROBE_STEPS + TRIAL_ROUNDS:PROBE_STEPS + TRIAL_ROUNDS + FIRST_PAUSE]
    assert pause == [0] * FIRST_PAUSE
    assert sum(k > 0 for k in used) < 0.2 * len(used)  # mostly plain, yet retried
    assert any(k > 0 for k in used[PROBE_STEPS + TRIAL_ROUNDS + FIRST_PAUSE:])


def test_a_fixed_policy_always_drafts_k():
    drafter = early_exit(k_max=3, adaptive=False)
    assert run_rounds(drafter, 1.0, 9.0, 1, 10) == [3] * 10
    assert drafter.offer([1], budget=1).k == 1


def test_rounds_the_confidence_gate_stopped_count_against_the_exit():
    drafter = early_exit()
    run_rounds(drafter, 1.0, 1.0, 1, PROBE_STEPS)
    for _ in range(TRIAL_ROUNDS):  # the draft head ran, then no draft was confident enough
        offer = drafter.offer([1], budget=8)
        assert offer.k == START_K  # untouched: nothing was drafted
        drafter.pace.record(1, 1.2, plain=False)
        drafter.observe(offer, 0, 0, 1.2)
    assert drafter.offer([1], budget=8) is None  # paused: slower than plain


def test_a_new_prompt_keeps_a_losing_exit_paused():
    drafter = early_exit()
    run_rounds(drafter, plain_s=1.0, round_s=3.0, tokens=1, rounds=PROBE_STEPS + TRIAL_ROUNDS)
    assert drafter.offer([1], budget=8) is None
    drafter.new_text(sampled=False)
    assert drafter.offer([1], budget=8) is None  # the model's early exit is still slow


def test_lookup_leaves_a_round_to_an_early_exit_that_earns_more():
    exit_, look = EarlyExit(PlainSpeed(), 4, adaptive=True), PromptLookup(8, True)
    weak = [5, 7, 1, 2, 9, 1, 2]             # "1 2" seen once before
    sure = [1, 2, 3, 4, 5, 6, 7] * 3 + [1, 2, 3, 4, 5, 6]  # a long run, always followed by 7
    assert offered([look, exit_], weak, 8, CPU_ROWS).drafter is look  # the exit is not measured yet
    run_rounds(exit_, plain_s=1.0, round_s=1.5, tokens=3, rounds=PROBE_STEPS + 2)
    assert exit_.offer(weak, 8) is not None  # 2 tokens a plain step's time: it earns 2x
    assert offered([look, exit_], weak, 8, CPU_ROWS).drafter is exit_
    look.new_text()
    assert offered([look, exit_], sure, 8, CPU_ROWS).drafter is look  # a sure copy earns more still
