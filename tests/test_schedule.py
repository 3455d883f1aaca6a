"""Prompt lookup proposals and the never-slower scheduler, as pure logic."""
from edgespec.lookup import PromptLookup
from edgespec.schedule import FIRST_PAUSE, PROBE_STEPS, START_K, TRIAL_ROUNDS, Scheduler


def test_lookup_proposes_what_followed_the_newest_ngram_last_time():
    history = [1, 2, 3, 4, 5, 9, 2, 3]
    assert PromptLookup().propose(history, k=2) == [4, 5]


def test_lookup_prefers_the_longest_ngram_and_the_latest_occurrence():
    history = [7, 3, 4, 1, 8, 3, 4, 2, 5, 7, 3, 4]
    assert PromptLookup().propose(history, k=3) == [1, 8, 3]  # "7 3 4" beats "3 4" -> 2
    assert PromptLookup().propose([3, 4, 1, 3, 4, 2, 3, 4], k=1) == [2]


def test_lookup_proposes_nothing_without_a_match_and_grows_with_the_history():
    lookup, history = PromptLookup(), [1, 2, 3, 4]
    assert lookup.propose(history, 4) == []
    history += [5, 1, 2]
    assert lookup.propose(history, 4) == [3, 4, 5, 1]


def run_rounds(scheduler, plain_s, round_s, tokens, rounds):
    """Feed rounds: plain steps while the scheduler allows no drafts, else drafting rounds."""
    used = []
    for _ in range(rounds):
        k = scheduler.k("exit", budget=8)
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


def test_k_starts_small_doubles_while_all_is_accepted_and_drops_to_what_was():
    scheduler = Scheduler({"exit": 0, "lookup": 6}, adaptive=True)
    run_rounds(scheduler, 1.0, 1.0, 1, PROBE_STEPS)  # "exit" is off: plain steps
    ks = []
    for accepted in (2, 4, 6, 1, 2, 0, 1):  # what each round accepts of its k drafts
        k = scheduler.k("lookup", budget=8)
        ks.append(k)
        scheduler.record("lookup", k, min(accepted, k) + 1, 0.5)
    assert ks == [START_K, 4, 6, 6, 2, 4, 1]


def test_a_fixed_policy_always_drafts_k():
    scheduler = Scheduler({"exit": 3, "lookup": 2}, adaptive=False)
    assert run_rounds(scheduler, 1.0, 9.0, 1, 10) == [3] * 10
    assert scheduler.k("lookup", budget=1) == 1


def test_rounds_the_confidence_gate_stopped_count_against_their_drafter():
    scheduler = Scheduler({"exit": 4, "lookup": 0}, adaptive=True)
    run_rounds(scheduler, 1.0, 1.0, 1, PROBE_STEPS)
    for _ in range(TRIAL_ROUNDS):  # the draft head ran, then no draft was confident enough
        assert scheduler.k("exit", budget=8) == START_K  # untouched: nothing was drafted
        scheduler.record("exit", 0, 1, 1.2)
    assert scheduler.k("exit", budget=8) == 0  # paused: slower than plain


def test_a_new_prompt_retries_lookup_but_keeps_a_losing_exit_paused():
    scheduler = Scheduler({"exit": 4, "lookup": 4}, adaptive=True)
    run_rounds(scheduler, plain_s=1.0, round_s=3.0, tokens=1, rounds=PROBE_STEPS + TRIAL_ROUNDS)
    for _ in range(TRIAL_ROUNDS):
        scheduler.record("lookup", scheduler.k("lookup", budget=8), 1, 3.0)
    assert scheduler.k("exit", budget=8) == 0 and scheduler.k("lookup", budget=8) == 0
    scheduler.new_text()
    assert scheduler.k("exit", budget=8) == 0  # the model's early exit is still slow
    assert scheduler.k("lookup", budget=8) > 0  # a new text may copy its prompt
