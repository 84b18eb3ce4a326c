"""Run-time choice between implementations whose speed depends on the machine (public: the
ops use it; the engine's step thread count has its own rule, ``decoding/engine/threads.py``).

Which of two correct CPU paths is faster depends on the CPU, its vector units, its caches
and its load (a matmul path tuned on one x86 machine ran 3x slower than ``F.linear`` on
another), so the product never hard-codes such a choice: the first real calls of a shape
class time each candidate in turn, ``trials`` times (alternating, so that a change of load
hits both alike), and the faster median wins for the rest of the process, as an autotuner
would.  The calls being measured do the real work (their results are used), so measuring
costs only the slower candidate's extra time on a few calls.

Thread safety: a choice's bookkeeping is guarded by a lock (the calls themselves run outside
it), so concurrent first calls from several threads each time a candidate and the choice is
made once; a candidate timed while another thread's call runs beside it is slower for both
alike.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import weakref
from typing import Callable, Dict, Hashable, List, Optional, Sequence, TypeVar

import torch

T = TypeVar("T")

# every RuntimeChoice, so that ``read_environment_again`` reaches them all
_CHOICES: "weakref.WeakSet[RuntimeChoice]" = weakref.WeakSet()


_MEASURED_CALLS = [0]  # calls run under measurement so far, by every RuntimeChoice of the process


def measured_calls() -> int:
    """How many calls every ``RuntimeChoice`` of the process has run while measuring (a count
    that only grows): a caller timing work of its own (the engine's step thread count) compares
    it before and after, and does not take a time that includes a candidate under trial."""
    return _MEASURED_CALLS[0]


def read_environment_again() -> None:
    """Every RuntimeChoice reads its environment variable again (``reset_backends`` calls this)."""
    for choice in list(_CHOICES):
        choice.read_environment()


class RuntimeChoice:
    """The faster of ``candidates`` per shape class, measured on real calls.

    Args:
        name: what is chosen (reports).
        candidates: implementation names; the first is the default where nothing can be
            measured (under torch.compile, a dispatch mode such as FakeTensorMode).
        trials: timed calls of each candidate before the choice.
        env: an environment variable that forces a candidate ("auto" or unset: measure).
        forceable: names the environment variable may force besides the candidates (paths too
            slow to time, such as a portable fallback, but runnable).

    Raises:
        ValueError: the environment variable names no candidate.
    """

    def __init__(
        self,
        name: str,
        candidates: Sequence[str],
        trials: int = 3,
        env: Optional[str] = None,
        forceable: Sequence[str] = (),
    ):
        if len(candidates) < 1 or trials < 1:
            raise ValueError("RuntimeChoice needs at least one candidate and one trial")
        self.name = name
        self.candidates = tuple(candidates)
        self.forceable = tuple(f for f in forceable if f not in self.candidates)
        self.trials = trials
        self.env = env
        self._chosen: Dict[Hashable, str] = {}
        self._times: Dict[Hashable, Dict[str, List[float]]] = {}
        self._lock = threading.Lock()  # guards _chosen and _times (never held while a candidate runs)
        self.read_environment()
        _CHOICES.add(self)

    def read_environment(self) -> None:
        """Read the environment variable (at construction, and again here: ``reset_backends``
        calls this for every choice)."""
        self._env_value = os.environ.get(self.env, "auto") if self.env else "auto"

    def forced(self) -> Optional[str]:
        """The candidate forced by the environment variable (as read at construction or by the
        last ``read_environment``), or None.

        Raises:
            ValueError: the variable names no candidate.
        """
        value = self._env_value
        if value in ("", "auto"):
            return None
        if value not in self.candidates + self.forceable:
            raise ValueError(f"{self.env} must be 'auto' or one of {self.candidates + self.forceable}, got {value!r}")
        return value

    def __call__(self, key: Hashable, run: Callable[[str], T], available: Optional[Sequence[str]] = None) -> T:
        """``run(candidate)`` with the candidate chosen for ``key`` (measuring while undecided).

        ``available``: the candidates usable for this call (default all), in preference order.
        """
        names = tuple(c for c in self.candidates if available is None or c in available)
        forced = self.forced()
        if forced is not None and (forced in names or forced in self.forceable):
            return run(forced)
        if len(names) == 1 or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
            return run(names[0])
        key = (key, names)
        chosen = self._chosen.get(key)
        if chosen is not None:
            return run(chosen)
        with self._lock:
            times = self._times.setdefault(key, {c: [] for c in names})
            candidate = min(names, key=lambda c: len(times[c]))  # alternate: the least timed next
            _MEASURED_CALLS[0] += 1
        t = time.perf_counter()
        out = run(candidate)
        elapsed = time.perf_counter() - t
        with self._lock:
            times[candidate].append(elapsed)
            if key not in self._chosen and all(len(v) >= self.trials for v in times.values()):
                # the first call of each may include one-time costs (page faults, lazy loading)
                medians = {c: statistics.median(v[1:] if len(v) > 1 else v) for c, v in times.items()}
                self._chosen[key] = min(names, key=lambda c: medians[c])
        return out

    def chosen(self, key: Hashable) -> Optional[str]:
        """The candidate chosen for ``key`` (with every candidate available), or None while undecided."""
        return self._chosen.get((key, self.candidates))

    def choices(self) -> List[Dict]:
        """What was chosen so far: one dict per shape class (key, choice, median ms per candidate)."""
        rows = []
        with self._lock:
            snapshot = [(key, {c: list(v) for c, v in times.items()}) for key, times in self._times.items()]
        for key, times in snapshot:
            rows.append(
                {
                    "what": self.name,
                    "key": repr(key[0]),
                    "choice": self._chosen.get(key),
                    **{f"{c}_ms": statistics.median(v) * 1e3 if v else None for c, v in times.items()},
                }
            )
        return rows

    def reset(self) -> None:
        """Forget every measurement and choice (tests)."""
        with self._lock:
            self._chosen.clear()
            self._times.clear()
