"""The intra-op thread count of the decode steps on CPU (``SpeculativeDecoder(threads="auto")``).

More threads are not always faster: on a machine busy with other work an OpenMP thread that
is descheduled makes every parallel region of a step wait for it, and a step with two threads
was measured 50 times slower than with one (bench/threads.py).  So the choice is measured on
the steps themselves, with one thread as the safe default, and built so that measuring
cannot cost more than a bounded share of the time:

* one thread first: a new step shape class runs with one thread, and its steps are the
  reference;
* a count with more threads is then timed on a few steps (``trials``) and wins only if every
  one of its steps, raised by ``margin``, was faster than the median of the current winner;
  the first trial that is not is the end of the round (the remaining trials and counts are
  not run), so a slow count costs one step, not three;
* what trials of counts above one lose against one thread is at most ``BUDGET`` of the
  decoding time of the process (``TrialBudget``, shared by every decoder unless given one):
  a trial step loses the time it took beyond the class's one-thread median (nothing where it
  was faster), and a round starts only if the loss of all past trials plus that of the last
  trial step (what the next may lose) is at most ``BUDGET`` times the time of all steps.  So
  a loaded machine pays for a slow trial once and then waits until the decoding time has
  grown to amortise it and the next, also where every call makes a new decoder (the
  references and choices are the decoder's, kept across its ``generate`` calls); while on a
  free machine, where trials lose nothing, a count dropped by a burst of noise is measured
  again as soon as the class has its one-thread reference steps;
* a chosen count above one is dropped (back to one thread, and measured again under the
  budget) as soon as two steps in a row are slower than the one-thread median it was chosen
  against: load that starts after the choice costs two steps (what its steps lose against
  that median counts as trial loss).

The thread count never changes results (every kernel computes a row on one thread).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Hashable, List, Mapping, Optional, Sequence

import torch

from specdec_kernels.autotune import measured_calls
from specdec_kernels.decoding.engine.stats import DecodeStats

TRIALS = 3  # timed steps of each count with more threads (and the one-thread reference)
MARGIN = 0.1  # more threads must be this much faster, on every trial, than fewer
BUDGET = 0.05  # trials of counts above one: at most this share of the decoding time


class TrialBudget:
    """What trial steps lose against the time of all steps, shared by ``ThreadChoice`` s.

    Args:
        share: the most trial loss, as a share (>= 0) of all step time.

    Attributes:
        trial_time: seconds lost against one thread: what each step run to time a count above
            the fewest took beyond the fewest's median, and what each step of a chosen count
            above the fewest took beyond the median it was chosen against (0 for a step that
            was faster).
        total_time: seconds of all recorded steps.
        charged_time: the part of ``trial_time`` from steps of a chosen count above the
            fewest (charged as they come: the budget gates the start of a round, not these).
        last_trial: seconds the latest trial step lost (what the next may lose, where its
            class has had none).

    Raises:
        ValueError: share < 0.
    """

    def __init__(self, share: float = BUDGET):
        if share < 0:
            raise ValueError(f"share must be >= 0, got {share}")
        self.share = share
        self.trial_time = 0.0
        self.total_time = 0.0
        self.charged_time = 0.0
        self.last_trial = 0.0

    def allows(self, next_cost: float) -> bool:
        """Whether a trial step losing ``next_cost`` seconds keeps trials within the share."""
        return self.trial_time + next_cost <= self.share * self.total_time


PROCESS_BUDGET = TrialBudget()  # the default of every ThreadChoice


def fewest_clearly_faster(times: Mapping[int, Sequence[float]], margin: float = MARGIN, trials: int = TRIALS) -> int:
    """The thread count a round of measurement chooses from the step times it recorded.

    Counts are taken from the fewest up; the fewest is the default.  A count with more
    threads replaces the current choice only if it has at least ``trials`` times and every
    one of them times ``1 + margin`` is below the median of the current choice's times; the
    first count that is not clearly faster ends the comparison (ambiguous or noisy
    measurements keep the fewer threads).

    Args:
        times: thread count (int >= 1) -> step times in seconds; the fewest count must have
            at least one time.
        margin: how much faster (a fraction, >= 0) more threads must be.
        trials: the times a count with more threads needs.

    Returns:
        The chosen thread count (a key of ``times``).

    Raises:
        ValueError: times is empty, a count is below 1, the fewest count has no times, a
            time is negative, margin < 0 or trials < 1.
    """
    if not times:
        raise ValueError("times must map at least one thread count to its step times")
    if margin < 0 or trials < 1:
        raise ValueError(f"margin must be >= 0 and trials >= 1, got margin={margin}, trials={trials}")
    counts = sorted(times)
    if counts[0] < 1:
        raise ValueError(f"times: thread counts must be >= 1, got {counts}")
    if any(t < 0 for c in counts for t in times[c]):
        raise ValueError("times: step times must be >= 0")
    best = counts[0]
    if not times[best]:
        raise ValueError(f"times: the fewest count ({best}) needs at least one time")
    for c in counts[1:]:
        got = times[c]
        if len(got) < trials or max(got) * (1 + margin) >= statistics.median(times[best]):
            break
        best = c
    return best


@dataclass
class _Class:
    """One step shape class: its chosen count, recent step times at it, the round in progress."""

    best: int
    recent: Deque[float]
    reference: Optional[float] = None  # the one-thread median the chosen count (above one) beat
    round: Optional[Dict[int, List[float]]] = None  # count -> times, while measuring
    pending: Optional[int] = None  # the count being timed
    last_trial: Optional[float] = None  # seconds the class's latest trial step lost (what the next may lose)
    started: Dict[str, float] = field(default_factory=dict)  # budget at the round's start (log)


class ThreadChoice:
    """The thread count of the decode steps per step shape class, measured on the steps
    (see the module docstring for the rule; ``fewest_clearly_faster`` decides each round).

    Use: ``n = choice.count(key)``; run the step with n threads, timed; ``choice.record(key,
    n, seconds)``.

    Args:
        counts: the candidate thread counts (>= 1); the fewest is the safe default.
        trials: timed steps per count with more threads, and of the reference.
        margin: how much faster, on every trial, more threads must be.
        budget: the account of trial time (default ``PROCESS_BUDGET``, the process's).

    Attributes:
        rounds: one dict per finished round: key, times (count -> seconds), choice, and the
            budget's trial loss and total time when it started and the loss the next trial
            step was expected to have (next_cost).

    Raises:
        ValueError: no counts, a count below 1, trials < 1 or margin < 0.
    """

    def __init__(
        self,
        counts: Sequence[int],
        trials: int = TRIALS,
        margin: float = MARGIN,
        budget: Optional[TrialBudget] = None,
    ):
        counts = sorted({int(c) for c in counts})
        if not counts or counts[0] < 1:
            raise ValueError(f"counts must be thread counts >= 1, got {counts}")
        if trials < 1 or margin < 0:
            raise ValueError(f"need trials >= 1 and margin >= 0; got {trials}, {margin}")
        self.counts = tuple(counts)
        self.trials, self.margin = trials, margin
        self.budget = budget if budget is not None else PROCESS_BUDGET
        self.classes: Dict[Hashable, _Class] = {}
        self.rounds: List[Dict] = []

    def _class(self, key: Hashable) -> _Class:
        cls = self.classes.get(key)
        if cls is None:
            cls = self.classes[key] = _Class(self.counts[0], deque(maxlen=self.trials))
        return cls

    def _next_cost(self, cls: _Class) -> float:
        # what the next trial step may lose: the class's last, else the process's last
        return cls.last_trial if cls.last_trial is not None else self.budget.last_trial

    def count(self, key: Hashable) -> int:
        """The thread count for the next step of shape class ``key`` (starting a round of
        measurement where one is due and the budget allows)."""
        cls = self._class(key)
        if cls.round is None and cls.best == self.counts[0] and len(self.counts) > 1:
            if len(cls.recent) >= self.trials and self.budget.allows(self._next_cost(cls)):
                cls.round = {cls.best: list(cls.recent)}
                cls.pending = self.counts[1]
                cls.started = {
                    "trial_time": self.budget.trial_time,
                    "total_time": self.budget.total_time,
                    "next_cost": self._next_cost(cls),
                }
        return cls.pending if cls.round is not None else cls.best

    def record(self, key: Hashable, count: int, seconds: float) -> None:
        """Record that a step of ``key`` ran ``seconds`` with ``count`` threads (the count
        ``count(key)`` gave).

        Raises:
            ValueError: count is not what ``count(key)`` gave, or seconds < 0.
        """
        cls = self._class(key)
        expected = cls.pending if cls.round is not None else cls.best
        if count != expected:
            raise ValueError(f"count: the step of {key!r} should have run with {expected} threads, got {count}")
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self.budget.total_time += seconds
        if cls.round is None:
            cls.recent.append(seconds)
            if cls.best == self.counts[0]:
                return
            loss = seconds - cls.reference
            if loss > 0:  # more threads, slower than one thread was: a loss, as a failed trial's
                self.budget.trial_time += loss
                self.budget.charged_time += loss
            last = list(cls.recent)[-2:]
            if len(last) == 2 and min(last) > cls.reference:
                cls.best, cls.reference = self.counts[0], None  # slower than one thread was: load came
                cls.recent.clear()
            return
        loss = max(0.0, seconds - statistics.median(cls.round[self.counts[0]]))
        self.budget.trial_time += loss
        cls.last_trial = self.budget.last_trial = loss
        got = cls.round.setdefault(count, [])
        got.append(seconds)
        ahead = max(c for c in cls.round if c < count)  # the choice so far, which this count must beat
        if max(got) * (1 + self.margin) >= statistics.median(cls.round[ahead]):
            self._finish(key, cls)  # not clearly faster: the round ends (no more trials)
        elif len(got) >= self.trials:
            if count == self.counts[-1]:
                self._finish(key, cls)
            else:
                cls.pending = self.counts[self.counts.index(count) + 1]

    def _finish(self, key: Hashable, cls: _Class) -> None:
        winner = fewest_clearly_faster(cls.round, self.margin, self.trials)
        self.rounds.append({"key": key, "times": cls.round, "choice": winner, **cls.started})
        safe = self.counts[0]
        cls.reference = statistics.median(cls.round[safe]) if winner != safe else None
        cls.best, cls.round, cls.pending = winner, None, None
        cls.recent.clear()

    def chosen(self, key: Hashable) -> int:
        """The count the steps of ``key`` run with outside measurement (the fewest before any)."""
        return self._class(key).best


THREADS_ENV = "SPECDEC_ENGINE_THREADS"  # forces the thread count of threads="auto" (an int), or "auto"


class StepThreads:
    """The intra-op thread count of the decode steps of one ``generate`` call.

    ``"auto"`` on CPU: the candidates are 1, half and all of ``torch.get_num_threads()`` (the
    threads torch would use), chosen per step shape class ("tokens<=N": the verified block's
    size rounded up to a power of two) by the decoder's ``threads.ThreadChoice`` for that
    count, which lives as long as the decoder: a new class runs with one thread (the safe
    default) and is the reference; a count with more threads is timed on a few steps and
    wins only if every one of them was clearly faster (``threads.MARGIN``) than the median
    of fewer threads, the first step that is not ending the trial; what trials lose against
    one thread is at most ``threads.BUDGET`` of the process's decoding time
    (``threads.PROCESS_BUDGET``), so a loaded machine, where OpenMP threads wait on each other
    and two threads were measured 50 times slower than one, pays for one slow trial and then
    amortises it, also where every call makes a new decoder; a chosen count above one that
    becomes slower than one thread was (load that starts after the choice) is dropped after
    two steps, and measured again once the budget allows (at once where its trials lost
    nothing: a burst of noise on a free machine costs a few steps).  Under
    torch.compile or a dispatch mode nothing is measured and torch's count is kept.  An int
    pins the count; None leaves torch's setting alone.  torch's setting is restored when the
    call ends.  $SPECDEC_ENGINE_THREADS forces a count for "auto".  A step in which a run-time
    choice timed a candidate (``autotune.measured_calls``: the int8 products' instruction set is
    measured anew for each thread count, its slower candidates included) is not recorded: its
    time is not that of its thread count.  The count never changes results.
    """

    def __init__(self, threads, device: torch.device, stats: DecodeStats, choices: Dict[int, ThreadChoice]):
        self.saved = torch.get_num_threads()
        self.stats = stats
        self.fixed: Optional[int] = None
        self.choice: Optional[ThreadChoice] = None
        if threads is None or device.type != "cpu":
            return
        if threads != "auto":
            self.fixed = int(threads)
            return
        forced = os.environ.get(THREADS_ENV, "auto")
        if forced not in ("", "auto"):
            if not forced.isdigit() or not 1 <= int(forced) <= 1024:
                raise ValueError(f"${THREADS_ENV} must be 'auto' or an int in 1..1024, got {forced!r}")
            self.fixed = int(forced)
            return
        candidates = sorted({1, max(1, self.saved // 2), self.saved})
        if len(candidates) > 1:
            self.choice = choices.get(self.saved)
            if self.choice is None:
                self.choice = choices[self.saved] = ThreadChoice(candidates)

    def run(self, step: Callable[[], object], k, state) -> None:
        if self.choice is None:
            if self.fixed is not None:
                torch.set_num_threads(self.fixed)
                self.stats.threads.setdefault("all", self.fixed)
            step()
            return
        if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
            self.restore()  # nothing to measure: torch's count
            step()
            return
        ks = k if isinstance(k, (list, tuple)) else [k] * state.batch_size
        tokens = sum(int(x) + 1 for x, done in zip(ks, state.done) if not done)
        key = f"tokens<={1 << max(0, tokens - 1).bit_length()}"
        n = self.choice.count(key)
        torch.set_num_threads(n)
        measured, t = measured_calls(), time.perf_counter()
        step()
        if measured_calls() == measured:  # else a run-time choice timed a candidate in the step
            # (the int8 products' instruction set is measured per thread count): not a time of n threads
            self.choice.record(key, n, time.perf_counter() - t)
        self.stats.threads[key] = self.choice.chosen(key)

    def restore(self) -> None:
        if torch.get_num_threads() != self.saved:
            torch.set_num_threads(self.saved)
