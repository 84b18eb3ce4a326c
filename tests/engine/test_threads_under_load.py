"""threads="auto" on a loaded machine: the choice rule (fewest threads unless more were
clearly faster on every trial), its budget for trials and its reaction to load that starts
after the choice, with injected step times; and the engine under a synthetic load of busy
processes, checked on the choice's logic and the tokens (no timing assertions)."""

from __future__ import annotations

import multiprocessing
import os
import statistics

import pytest
import torch

from specdec_kernels.decoding import SpeculativeDecoder
from specdec_kernels.decoding.engine import threads
from specdec_kernels.decoding.engine.threads import MARGIN, ThreadChoice, TrialBudget, fewest_clearly_faster
from tests.engine.tiny import tiny  # noqa: F401 (fixture)


def test_rule_keeps_the_fewest_unless_more_are_clearly_faster_every_time():
    ms = 1e-3
    assert fewest_clearly_faster({1: [10 * ms] * 3, 2: [5 * ms] * 3}) == 2
    assert fewest_clearly_faster({1: [10 * ms] * 3, 2: [10 * ms] * 3}) == 1  # a tie keeps one thread
    assert fewest_clearly_faster({1: [10 * ms] * 3, 2: [9.5 * ms] * 3}) == 1  # within the margin
    # a lower median is not enough: one trial of two threads was slow (a noisy, loaded machine)
    times = {1: [10 * ms, 10 * ms, 10 * ms], 2: [3 * ms, 3 * ms, 40 * ms]}
    assert statistics.median(times[2]) < statistics.median(times[1]) and fewest_clearly_faster(times) == 1
    assert fewest_clearly_faster({1: [10 * ms] * 3, 2: [4 * ms] * 2}) == 1  # too few trials
    # a chain: 8 beats 1, 16 beats 8; 16 must beat 8 (not only 1)
    assert fewest_clearly_faster({1: [10 * ms] * 3, 8: [4 * ms] * 3, 16: [2 * ms] * 3}) == 16
    assert fewest_clearly_faster({1: [10 * ms] * 3, 8: [4 * ms] * 3, 16: [3.9 * ms] * 3}) == 8
    # a count that is not clearly faster ends the comparison
    assert fewest_clearly_faster({1: [10 * ms] * 3, 8: [10 * ms] * 3, 16: [1 * ms] * 3}) == 1
    assert fewest_clearly_faster({1: [10 * ms] * 3, 2: [8 * ms] * 3}, margin=0.3) == 1
    for bad in ({}, {0: [1.0]}, {1: []}, {1: [-1.0]}):
        with pytest.raises(ValueError, match="times"):
            fewest_clearly_faster(bad)
    with pytest.raises(ValueError, match="margin"):
        fewest_clearly_faster({1: [1.0]}, margin=-0.1)


def drive(choice, key, step_time, steps):
    """Run ``steps`` steps of ``key`` whose time is ``step_time(count)``; the counts used."""
    used = []
    for _ in range(steps):
        n = choice.count(key)
        used.append(n)
        choice.record(key, n, step_time(n))
    return used


def test_loaded_machine_pays_one_slow_trial_then_the_budget_holds_it_off():
    budget = TrialBudget()
    choice = ThreadChoice([1, 2], budget=budget)
    loaded = {1: 0.04, 2: 2.0}.__getitem__  # two threads 50x slower, as measured under load
    used = drive(choice, "tokens<=1", loaded, 2400)
    # three reference steps at one thread, one trial with two threads (not clearly faster:
    # the round ends at once), then one thread until what the trial lost against one thread's
    # median (2 s - 40 ms) is within 5% of the time
    trials = [i for i, n in enumerate(used) if n == 2]
    assert trials[0] == 3 and used[:3] == [1, 1, 1] and len(trials) == 2
    first, second = choice.rounds
    assert first["times"] == {1: [0.04] * 3, 2: [2.0]} and first["choice"] == 1
    loss = 2.0 - 0.04
    assert second["choice"] == 1 and second["trial_time"] == pytest.approx(loss, abs=1e-12)
    # the second trial started as soon as the budget allowed it (past losses plus one more
    # like the last within 5% of all step time), and not before
    assert second["next_cost"] == pytest.approx(loss, abs=1e-12)
    assert second["total_time"] * budget.share >= 2 * loss > (second["total_time"] - 0.04) * budget.share
    assert 1880 < trials[1] < 1960  # about 2 * 1.96 s / 5% / 40 ms steps later
    assert budget.trial_time <= budget.share * budget.total_time
    # a new decoder's choice (a new call of a one-shot API) on the same process budget: its
    # reference steps, then no trial, as one like the process's last would break the budget
    fresh = ThreadChoice([1, 2], budget=budget)
    before = budget.trial_time
    assert drive(fresh, "tokens<=1", loaded, 50) == [1] * 50 and budget.trial_time == before
    assert drive(ThreadChoice([1, 2], budget=TrialBudget()), "tokens<=1", loaded, 5) == [1, 1, 1, 2, 1]


def test_idle_machine_gets_more_threads_and_load_after_the_choice_drops_them():
    budget = TrialBudget()
    choice = ThreadChoice([1, 4, 8], budget=budget)
    idle = {1: 0.04, 4: 0.012, 8: 0.008}.__getitem__
    used = drive(choice, "k", idle, 20)
    assert used[:9] == [1, 1, 1, 4, 4, 4, 8, 8, 8] and set(used[9:]) == {8}
    assert choice.chosen("k") == 8 and choice.rounds[0]["choice"] == 8
    assert budget.charged_time == 0  # the chosen count's steps so far beat one thread's median
    # load starts: eight threads become slower than one thread was; two such steps drop them
    loaded = {1: 0.06, 4: 0.5, 8: 1.0}.__getitem__
    before = budget.trial_time
    used = drive(choice, "k", loaded, 6)
    assert used[:2] == [8, 8] and used[2:] == [1, 1, 1, 1]
    assert choice.chosen("k") == 1
    # what the two slow steps lost against one thread's median is charged as trial loss,
    # outside the budget's gate
    loss = 2 * (1.0 - 0.04)
    assert budget.charged_time == pytest.approx(loss, abs=1e-12)
    assert budget.trial_time == pytest.approx(before + loss, abs=1e-12)
    # one noisy slow step of the chosen count alone does not drop it, and is charged its loss
    budget = TrialBudget()
    choice = ThreadChoice([1, 2], budget=budget)
    drive(choice, "k", {1: 0.04, 2: 0.02}.__getitem__, 12)
    assert budget.trial_time == 0  # trials faster than one thread lose nothing
    times = iter([0.02, 0.09, 0.02, 0.02])
    drive(choice, "k", lambda n: next(times), 4)
    assert choice.chosen("k") == 2
    assert budget.charged_time == pytest.approx(0.09 - 0.04, abs=1e-12)


def test_a_burst_of_noise_drops_more_threads_only_for_a_few_steps():
    """On a free machine two noisy steps in a row drop a chosen count; its trials lost nothing,
    so it is measured again as soon as the class has its three one-thread reference steps, and
    chosen again, instead of waiting for the budget."""
    budget = TrialBudget()
    choice = ThreadChoice([1, 2], budget=budget)
    free = {1: 0.015, 2: 0.01}.__getitem__
    assert drive(choice, "k", free, 8) == [1, 1, 1, 2, 2, 2, 2, 2]
    burst = iter([0.017, 0.017])  # two steps slower than one thread's 15 ms: a burst of noise
    assert drive(choice, "k", lambda n: next(burst), 2) == [2, 2] and choice.chosen("k") == 1
    assert budget.charged_time == pytest.approx(0.004, abs=1e-12)
    # the charge (4 ms) plus the next trial's expected loss (0) is within 5% of the 0.174 s of
    # steps by the third reference step
    assert drive(choice, "k", free, 8) == [1, 1, 1, 2, 2, 2, 2, 2]
    assert choice.chosen("k") == 2 and len(choice.rounds) == 2


def test_a_noisy_trial_ends_the_round_with_fewer_threads():
    choice = ThreadChoice([1, 2], budget=TrialBudget())
    times = iter([0.04, 0.04, 0.04, 0.01, 0.045])  # second trial of two threads: not clearly faster
    used = drive(choice, "k", lambda n: next(times), 5)
    assert used == [1, 1, 1, 2, 2]
    assert choice.rounds[-1]["choice"] == 1 and choice.chosen("k") == 1
    with pytest.raises(ValueError, match="count"):
        choice.record("k", 2, 0.01)  # the class runs with one thread now
    with pytest.raises(ValueError, match="counts"):
        ThreadChoice([0, 2])


def _spin(stop):
    while not stop.is_set():
        for _ in range(100_000):
            pass


def test_auto_under_synthetic_load_follows_the_rule_and_keeps_the_tokens(tiny, monkeypatch):
    """Busy processes, one per CPU, load the machine while the engine decodes with
    threads="auto" (torch's count 2, so candidates 1 and 2).  In every round, read from its
    recorded times: two threads were chosen only if each of their three trials was clearly
    faster than one thread's median, and one thread kept only if the last trial of two (the
    one that ended the round) was not; trials started within the budget; stats.threads
    reports the choice; the tokens equal one thread's."""
    hf, model = tiny
    prompts = [[5, 17, 33, 2, 9], [64, 3, 12, 99]]
    budget = TrialBudget()  # this test's own, not what earlier tests spent of the process's
    monkeypatch.setattr(threads, "PROCESS_BUDGET", budget)
    saved = torch.get_num_threads()
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    busy = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 2)]
    try:
        torch.set_num_threads(1)
        want = [
            SpeculativeDecoder(model, None, threads=1).generate([p], 40, num_draft_tokens=0).tokens for p in prompts
        ]
        for p in busy:
            p.start()
        torch.set_num_threads(2)
        decoder = SpeculativeDecoder(model, None)
        got = [decoder.generate([p], 40, num_draft_tokens=0) for p in prompts * 2]
    finally:
        stop.set()
        for p in busy:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        torch.set_num_threads(saved)
    assert [r.tokens for r in got] == want * 2
    choice = decoder.thread_choices[2]
    assert choice.budget is budget and choice.counts == (1, 2)
    assert choice.rounds  # the first round ends after at most 4 steps
    for r in choice.rounds:
        times = r["times"]
        assert len(times[1]) == choice.trials
        assert r["trial_time"] + r["next_cost"] <= budget.share * r["total_time"]
        assert len(times.get(2, ())) <= choice.trials
        clear = [t * (1 + MARGIN) < statistics.median(times[1]) for t in times[2]]
        if r["choice"] == 2:
            assert len(clear) == choice.trials and all(clear)
        else:  # one thread kept: the last trial of two was not clearly faster, and ended the round
            assert not clear[-1] and all(clear[:-1])
    for r in got:
        assert set(r.stats.threads) == {"tokens<=1"}
    assert got[-1].stats.threads["tokens<=1"] == choice.chosen("tokens<=1")
    # the budget gates the start of a round, not its steps, and steps of two threads chosen that
    # ran slower than one thread's median are charged as they come: the trial time passes the
    # share by at most the last round's trials of two threads plus those charges, and there
    # are charges only after a round chose two threads
    cls = choice.classes["tokens<=1"]
    last = cls.round if cls.round is not None else choice.rounds[-1]["times"]
    assert budget.trial_time <= budget.share * budget.total_time + sum(last.get(2, ())) + budget.charged_time
    if all(r["choice"] == 1 for r in choice.rounds):
        assert budget.charged_time == 0


def test_a_step_with_a_runtime_choice_under_trial_is_not_a_thread_trial():
    """The int8 products' instruction set is timed anew for each thread count, its slower
    candidates included; a step in which any ``RuntimeChoice`` timed a candidate is not
    recorded (its time is not that of its thread count), so it neither ends a round nor
    enters a reference: the class's next step asks for the same count again."""
    from specdec_kernels.autotune import RuntimeChoice, measured_calls
    from specdec_kernels.decoding.engine.stats import DecodeStats

    class State:  # what StepThreads.run reads of a DecodeState
        batch_size, done = 1, [False]

    choices = {}
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        stats = DecodeStats()
        steps = threads.StepThreads("auto", torch.device("cpu"), stats, choices)
        choice = choices[2]
        isa = RuntimeChoice("a test's choice", ["a", "b"], trials=2)
        calls, total = [], choice.budget.total_time

        def step(measure: bool):
            calls.append(torch.get_num_threads())
            if measure:
                before = measured_calls()
                isa("shape", lambda c: c)
                assert measured_calls() == before + 1

        steps.run(lambda: step(True), 0, State())  # a candidate timed: not recorded
        assert len(choice.classes["tokens<=1"].recent) == 0 and choice.budget.total_time == total
        for _ in range(3):  # measured by the choice till it decides (2 x 2 trials), then plain steps
            steps.run(lambda: step(True), 0, State())
        assert len(choice.classes["tokens<=1"].recent) == 0
        steps.run(lambda: step(False), 0, State())
        assert len(choice.classes["tokens<=1"].recent) == 1  # a plain step is recorded
        assert calls == [1] * 5  # one thread throughout: no trial of two threads yet
        steps.restore()
    finally:
        torch.set_num_threads(saved)
