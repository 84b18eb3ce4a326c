"""Thread safety with forced interleavings (barriers and events, so the tests are
deterministic): a RuntimeChoice's concurrent first calls, one decoder refused at a second
entry, and two decoders sharing one model from two threads."""

from __future__ import annotations

import threading

import pytest

from specdec_kernels.autotune import RuntimeChoice
from specdec_kernels.decoding import NgramDrafter, SamplingParams, SpeculativeDecoder
from tests.engine.tiny import PROMPTS, tiny  # noqa: F401 (fixture)


def run_side_by_side(work, n: int, timeout: float) -> None:
    """Run ``work(0)`` .. ``work(n - 1)`` each in its own thread, all started before any is
    awaited; wait up to ``timeout`` seconds for each."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)


def test_runtime_choice_concurrent_first_calls():
    """Four threads enter a fresh choice's first calls together (all four inside ``run`` at
    once, and ``choices()`` read while they record): every call returns its own result, each
    candidate is timed at least ``trials`` times, and the choice is made once."""
    choice = RuntimeChoice("test", ("a", "b"), trials=2)
    inside = threading.Barrier(4)
    errors, results = [], []

    def work(i):
        try:
            for call in range(6):

                def run(c, call=call):
                    if call == 0:
                        inside.wait(timeout=30)  # all four first calls run side by side
                    return (i, call, c)

                results.append(choice("shape", run))
                choice.choices()
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    run_side_by_side(work, 4, timeout=60)
    assert not errors, errors
    assert sorted((i, call) for i, call, _ in results) == [(i, c) for i in range(4) for c in range(6)]
    rows = choice.choices()
    assert len(rows) == 1 and rows[0]["choice"] in ("a", "b")
    assert choice.chosen("shape") == rows[0]["choice"]
    timed = choice._times[("shape", ("a", "b"))]
    assert min(len(v) for v in timed.values()) >= 2


def test_a_decoder_refuses_a_second_entry_and_recovers(tiny):
    """Thread A is held inside ``generate`` (its on_step waits); a second ``generate`` on the
    same decoder, from this thread, is refused naming the decoder; A then finishes with the
    tokens it gives alone, and the decoder takes the next call."""
    _, model = tiny
    decoder = SpeculativeDecoder(model, NgramDrafter())
    alone = decoder.generate([PROMPTS[0]], 10, 3).tokens
    entered, release = threading.Event(), threading.Event()
    out = {}

    def on_step(state):
        entered.set()
        release.wait(timeout=60)

    def a():
        out["a"] = decoder.generate([PROMPTS[0]], 10, 3, on_step=on_step).tokens

    t = threading.Thread(target=a)
    t.start()
    try:
        assert entered.wait(timeout=60)
        with pytest.raises(RuntimeError, match="'ngram'.*is decoding already"):
            decoder.generate([PROMPTS[1]], 4, 3)
    finally:
        release.set()
        t.join(timeout=60)
    assert out["a"] == alone
    assert decoder.generate([PROMPTS[0]], 10, 3).tokens == alone


def test_two_decoders_share_one_model_across_threads(tiny):
    """Two decoders on one model, stepping in lockstep from two threads (a barrier in each
    on_step), give the tokens each gives alone, greedy and seeded sampling."""
    _, model = tiny
    sp = SamplingParams(temperature=0.8)
    runs = [(PROMPTS[0], None), (PROMPTS[2], sp)]
    alone = [
        SpeculativeDecoder(model, NgramDrafter()).generate([p], 12, 3, sampling=s, seeds=[5]).tokens for p, s in runs
    ]
    lockstep = threading.Barrier(2)
    out, errors = {}, []

    def on_step(state):
        try:
            lockstep.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass  # the other run finished first

    def work(i):
        try:
            p, s = runs[i]
            out[i] = (
                SpeculativeDecoder(model, NgramDrafter())
                .generate([p], 12, 3, sampling=s, seeds=[5], on_step=on_step)
                .tokens
            )
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            lockstep.abort()

    run_side_by_side(work, 2, timeout=120)
    assert not errors, errors
    assert [out[0], out[1]] == alone
