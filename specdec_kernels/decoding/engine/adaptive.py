"""Adaptive draft length: choose K (draft tokens per sequence) every step.

A policy is consulted by ``SpeculativeDecoder.generate`` before each step (``choose``) and
told what happened after it (``update``, with the engine's ``StepRecord``):

* ``HeuristicPolicy``: the classic schedule (as in transformers' assisted generation,
  "heuristic" ``num_assistant_tokens``): raise K by ``up`` after a step whose K drafts
  were all accepted, lower it by ``down`` after a rejection, within [k_min, k_max].
* ``CostModelPolicy``: from the running acceptance rate per draft position and the draft
  and verify costs measured online (seconds of a draft step of K tokens, of a target
  verify pass over N nodes), choose the K that maximises the expected tokens per second
  (the speed-up analysis of Leviathan et al. 2023, §3.4, with measured per-position rates
  instead of one i.i.d. acceptance rate, and measured rather than assumed costs).
* ``FixedPolicy``: a constant K (for comparison and statistics).

``default_policy(drafter)`` is the per-drafter default chosen from measurements (see its
docstring), used by the CLI and by ``SpeculativeDecoder(policy="auto")``.

Model of a step (one sequence): with K requested draft tokens the expected emitted tokens
are ``E(K) = 1 + sum_{j<=K} r_j`` where ``r_j`` is the probability that the accepted path
reaches depth j given that depth j was requested (this folds in drafts that come out
shorter than K, e.g. an n-gram lookup without a match), and the step takes
``T(K) = t_draft(K) + t_verify(nodes(K))``.  The policy picks ``argmax_K E(K) / T(K)``.

A cost model's measurements of a run (the rates r_j, the draft and verify costs) live in one
``Calibration`` (``calibration.py``), which ``TreeBudget`` (a tree drafter's node budget, here
too) reads as well: the pass cost by node count, and its own tree calibration kept there.
"""

from __future__ import annotations

import numbers
from typing import Callable, Dict, List, Optional, Sequence

from specdec_kernels.decoding.draft import NoDrafter, SamplingParams
from specdec_kernels.decoding.engine.calibration import (  # noqa: F401 (LinearCost re-exported)
    Calibration,
    LinearCost,
    PathCalibration,
)

MAX_DEFAULT_K = 1024  # the largest draft length a drafter may declare as its default


def drafter_default_k(drafter) -> int:
    """The drafter's own default draft length (``Drafter.default_k``; 4 for an object without
    one, 0 for no drafter): the fixed K of ``default_policy`` and the cap of adaptive policies.

    Raises:
        ValueError: a ``default_k`` that is not an int in 0..MAX_DEFAULT_K (bools, floats and
            strings included), naming the drafter."""
    if drafter is None:
        return 0
    k = getattr(drafter, "default_k", 4)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= k <= MAX_DEFAULT_K:
        name = getattr(drafter, "name", type(drafter).__name__)
        raise ValueError(f"drafter {name!r}: default_k must be an int in 0..{MAX_DEFAULT_K}, got {k!r}")
    return int(k)


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """E(K) = 1 + r_1 + ... + r_K: expected tokens emitted by a step with K draft tokens.

    Args:
        rates: rates[j - 1] = P(the accepted path reaches depth j | K >= j), non-increasing
            in j for a chain; positions past the list count 0.
        k: the draft length K >= 0.
    """
    return 1.0 + float(sum(rates[: max(k, 0)]))


def best_draft_length(rates: Sequence[float], step_time: Sequence[float], k_min: int = 0) -> int:
    """The K in [k_min, len(step_time) - 1] that maximises E(K) / step_time[K].

    Args:
        rates: per-position rates (see ``expected_tokens``).
        step_time: step_time[K] > 0, the time of a step drafting K tokens (any unit), e.g.
            ``1 + c * K`` for a draft/verify cost ratio c and a verify cost flat in K.
        k_min: the smallest K allowed.

    Returns:
        The best K; ties go to the smaller K.

    Raises:
        ValueError: k_min outside the range of step_time, or a step time <= 0.

    Example: rates (0.8, 0.6, 0.4, 0.2) and c = 0.1 give E = 1, 1.8, 2.4, 2.8, 3.0 and
    T = 1, 1.1, 1.2, 1.3, 1.4, so E/T = 1, 1.64, 2.0, 2.15, 2.14: K = 3.
    """
    if not 0 <= k_min < len(step_time):
        raise ValueError(f"k_min must lie in 0..{len(step_time) - 1}, got {k_min}")
    if min(step_time) <= 0:
        raise ValueError(f"step_time must be > 0, got {list(step_time)}")
    best, best_rate = k_min, -1.0
    for k in range(k_min, len(step_time)):
        rate = expected_tokens(rates, k) / step_time[k]
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


def best_tree_size(values: Sequence[float], step_time: Sequence[float], n_min: int = 1) -> int:
    """The node count n (root included) of a dynamic draft tree that maximises expected
    tokens per second, EAGLE-2's expected-accepted-length rule with a measured cost.

    Keeping the n - 1 best candidate nodes (values in descending order) emits, in
    expectation, ``E(n) = 1 + values[0] + ... + values[n - 2]`` tokens: a node's value is the
    probability that the accepted path passes through it (EAGLE-2, Li et al. 2024: the
    drafter's path probability, here times a measured calibration), and the emitted tokens
    are the bonus token plus the accepted nodes.  The step costs ``step_time[n]``.

    Args:
        values: the candidates' values, non-increasing, each in [0, 1].
        step_time: step_time[n] > 0 for n = 0 .. N (entry 0 unused), e.g. the draft time plus
            the measured target pass over n tokens; N = len(step_time) - 1 caps n, and so does
            len(values) + 1.
        n_min: the smallest n allowed (>= 1).

    Returns:
        The best n in [n_min, min(N, len(values) + 1)]; ties go to the smaller n.

    Raises:
        ValueError: n_min < 1 or above N, a step time <= 0, values not non-increasing.

    Example: values (0.6, 0.3, 0.25, 0.15, 0.1) and a pass whose 8 tokens cost 1.8 times one
    (``T(n) = 1 + (n - 1) * 0.8 / 7``) give E = 1, 1.6, 1.9, 2.15, 2.3, 2.4 and E / T = 1,
    1.436, 1.546, 1.601, 1.578, 1.527 for n = 1..6: n = 4.  A flat cost (a GPU below its
    compute bound) keeps every node.
    """
    N = min(len(step_time) - 1, len(values) + 1)
    if not 1 <= n_min <= max(N, 1):
        raise ValueError(f"n_min must lie in 1..{max(N, 1)}, got {n_min}")
    if min(step_time[1:], default=1.0) <= 0:
        raise ValueError(f"step_time must be > 0, got {list(step_time)}")
    if any(values[i] < values[i + 1] for i in range(len(values) - 1)):
        raise ValueError("values must be non-increasing (the candidates' order)")
    best, best_rate, expected = n_min, -1.0, 1.0 + float(sum(values[: n_min - 1]))
    for n in range(n_min, N + 1):
        if n > n_min:
            expected += float(values[n - 2])
        rate = expected / step_time[n]
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = n, rate
    return best


class TreeBudget:
    """Node budgets of a dynamic draft tree, per sequence and step: ``best_tree_size`` of the
    drafter's path probabilities times their measured calibration, against the step cost by
    node count, both read from the run's ``Calibration`` (``calibration.py``: the one the
    cost-model policy measures, handed to the drafter as ``DraftRun.calibration``).

    A drafter binds its budget to each run as the run starts (``start(batch,
    result.run.calibration)``); the budget keeps that run's calibration until the next run's
    ``start`` binds that run's, a fresh one or None, so no measured cost or calibration
    carries over from one run to the next.  The calibration of sequence b is
    ``(accepted + prior) / (predicted + prior)``: accepted drafts over the sum of the kept
    nodes' path probabilities, over its steps so far (a head that is over-confident gets
    smaller trees), kept in the run's ``Calibration`` as this budget's ``PathCalibration``
    (``paths``).  Without a calibration (no cost-model policy) the budget is ``max_nodes``;
    with one, trees grow from 2 nodes to at most twice the largest pass it has measured
    (``growth_limit``), so a size is chosen only once the cost of about that size is known.

    Args:
        max_nodes: the most nodes, root included (>= 1).
        min_nodes: the fewest (1 <= min_nodes <= max_nodes).
        prior: pseudo-count of the calibration's prior of 1 (>= 0).

    Raises:
        ValueError: bounds out of range, a negative prior.
    """

    def __init__(self, max_nodes: int, min_nodes: int = 1, prior: float = 4.0):
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {min_nodes}, {max_nodes}")
        if prior < 0:
            raise ValueError(f"prior must be >= 0, got {prior}")
        self.max_nodes, self.min_nodes, self.prior = int(max_nodes), int(min_nodes), float(prior)
        self.start(0)

    def start(self, batch: int, calibration: Optional[Calibration] = None) -> None:
        """A new run of ``batch`` sequences: bind its ``Calibration`` (``DraftRun.calibration``;
        None without a cost-model policy) and start this budget's calibration in it (``paths``,
        None without one)."""
        self.calibration = calibration
        self.paths: Optional[PathCalibration] = (
            calibration.new_paths(self, batch, self.prior) if calibration is not None else None
        )
        self.last_nodes: List[Optional[int]] = [None] * batch  # the latest choice per sequence

    def growth_limit(self) -> Optional[int]:
        """The most nodes a tree may have before larger passes are measured: twice the largest
        pass the calibration has measured (2 before any), so that trees grow 2, 4, 8, ... while
        each size is measured, and a pass-cost line known only at small sizes (or at one size,
        where it is flat) never sends a step to ``max_nodes`` untried (on a CPU a 64-node pass
        costs about ten one-token passes).  None without a calibration, or with fixed costs
        (nothing measured)."""
        seen = self.calibration.largest_verified_nodes() if self.calibration is not None else None
        return None if seen is None else max(2, 2 * seen)

    def choose(self, b: int, values: Sequence[float]) -> int:
        """The node count for sequence b from its candidates' path probabilities (descending):
        ``best_tree_size`` against the calibration's step times, within ``growth_limit``;
        without a calibration, the largest tree the candidates allow; while its costs are
        warming up, the growth limit's size."""
        cap = min(self.max_nodes, len(values) + 1)
        times = self.calibration.step_times_by_nodes(cap) if self.calibration is not None else None
        limit = self.growth_limit()
        if times is None:
            if limit is None:
                return cap
            n = max(min(cap, limit), min(self.min_nodes, cap))
        else:
            n = best_tree_size(self.paths.calibrated(b, values[: cap - 1]), times, min(self.min_nodes, cap))
            if limit is not None:
                n = max(min(n, limit), min(self.min_nodes, cap))
        self.last_nodes[b] = n
        return n

    def wants_more(self, b: int, values: Sequence[float], depth: int) -> bool:
        """Whether a chain of sequence b whose nodes so far have the path probabilities
        ``values`` (non-increasing) is worth drafting deeper, up to ``depth`` drafts: True
        where ``choose`` could keep a deeper node, i.e. keeps one when every deeper node is
        valued as the last (an upper bound: path probabilities only fall along a chain, and
        lower values deeper down leave the smaller trees' rates as they are and lower the
        larger ones'), so that stopping never cuts a node ``choose`` would keep, whatever the
        shape of the cost curve; True without a cost to weigh them against; False where a
        deeper node would exceed ``depth`` or ``max_nodes``."""
        cap = min(self.max_nodes, int(depth) + 1)
        limit = self.growth_limit()
        if limit is not None:
            cap = min(cap, limit)
        if len(values) + 1 >= cap:  # a deeper node would not fit (or its size is not yet measured)
            return False
        times = self.calibration.step_times_by_nodes(cap) if self.calibration is not None else None
        if times is None:
            return True
        scaled = self.paths.calibrated(b, values)
        bound = scaled + [scaled[-1] if scaled else 1.0] * (cap - 1 - len(scaled))
        return best_tree_size(bound, times, min(self.min_nodes, cap)) > len(values) + 1

    def width(self, rows: Sequence[int], top_k: int) -> int:
        """How many nodes a tree drafter need expand per depth for the sequences ``rows``:
        the best n - 1 nodes by path probability lie among the n - 1 best of each depth, each
        with at most n - 1 kept children, so expanding ``min(top_k, n)`` (one spare, so that
        a budget can grow) loses nothing; n is each sequence's latest choice (``top_k``
        while any has none, or without a calibration)."""
        last = [self.last_nodes[b] for b in rows] if self.calibration is not None else [None]
        if not last or any(n is None for n in last):
            return top_k
        return max(1, min(top_k, max(last)))

    def kept(self, b: int, values: Sequence[float]) -> None:
        """The path probabilities of the nodes sequence b's draft keeps (its prediction)."""
        if self.paths is not None:
            self.paths.kept(b, values)

    def observe(self, num_accepted, active) -> None:
        """A step's accepted drafts per sequence (``num_accepted`` (B,), ``active`` (B,) bools),
        what a drafter's ``observe`` hands on: the calibration of each active sequence."""
        if self.paths is not None:
            self.paths.observe(num_accepted, active)


class DraftLengthPolicy:
    """Base class: chooses the draft length K per sequence each step.

    ``start(state)`` is called once a batch is prefilled, ``choose(state)`` before every
    step (returns one K >= 0 per sequence), ``update(state, record)`` after it with the
    engine's ``StepRecord`` (K used, draft depth, accepted drafts per sequence, timings).
    """

    name = "policy"

    def start(self, state) -> None:
        self.batch_size = state.batch_size

    def choose(self, state) -> List[int]:
        raise NotImplementedError

    def update(self, state, record) -> None:
        pass

    def describe(self) -> str:
        return self.name


class FixedPolicy(DraftLengthPolicy):
    """A constant K (the engine's plain ``num_draft_tokens=k``, as a policy)."""

    name = "fixed"

    def __init__(self, k: int):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = int(k)

    def choose(self, state) -> List[int]:
        return [self.k] * state.batch_size

    def describe(self) -> str:
        return f"fixed(K={self.k})"


class HeuristicPolicy(DraftLengthPolicy):
    """The classic schedule: K += up after full acceptance, K -= down after a rejection.

    Per sequence: a step that accepted all of its K requested drafts raises K to
    ``min(K + up, k_max)``; a step that rejected a draft token lowers it to
    ``max(K - down, k_min)``; a step whose draft came out shorter than K (an n-gram lookup
    with a short or no match) and was accepted whole leaves K as it is.

    Args:
        k_init: K of the first step (default: k_max // 2, at least k_min).
        k_min, k_max: the range (0 <= k_min <= k_max).
        up, down: steps (>= 0); transformers' assisted generation uses +2 / -1.

    Raises:
        ValueError: a bound or a step out of range.
    """

    name = "heuristic"

    def __init__(self, k_init: Optional[int] = None, k_min: int = 1, k_max: int = 8, up: int = 2, down: int = 1):
        if not 0 <= k_min <= k_max:
            raise ValueError(f"need 0 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
        if up < 0 or down < 0:
            raise ValueError(f"up and down must be >= 0, got up={up}, down={down}")
        k_init = max(k_max // 2, k_min) if k_init is None else k_init
        if not k_min <= k_init <= k_max:
            raise ValueError(f"k_init must lie in [{k_min}, {k_max}], got {k_init}")
        self.k_init, self.k_min, self.k_max, self.up, self.down = k_init, k_min, k_max, up, down

    def start(self, state) -> None:
        super().start(state)
        self.ks = [self.k_init] * state.batch_size

    def choose(self, state) -> List[int]:
        return list(self.ks)

    def next_k(self, k: int, depth: int, accepted: int) -> int:
        """K after a step that requested k, drafted ``depth`` tokens and accepted ``accepted``."""
        if accepted >= k:
            return min(k + self.up, self.k_max)
        if accepted < depth:
            return max(k - self.down, self.k_min)
        return k

    def update(self, state, record) -> None:
        for b in range(len(self.ks)):
            if record.active[b]:
                # from the policy's own K: a K the engine cut (max_new_tokens) and accepted
                # whole is a short draft accepted whole, which leaves K as it is
                self.ks[b] = self.next_k(self.ks[b], record.depths[b], record.num_accepted[b])

    def describe(self) -> str:
        return f"heuristic(K0={self.k_init}, [{self.k_min}, {self.k_max}], +{self.up}/-{self.down})"


EXPLORE_BACKOFF = 8  # CostModelPolicy: the largest gap between probes, in units of explore_every


class CostModelPolicy(DraftLengthPolicy):
    """Choose K maximising expected tokens per second from measured rates and costs.

    Acceptance: for each sequence and position j it counts the steps that requested depth
    j (K >= j) and those whose accepted path reached it; the rate r_j is estimated with
    pseudo-counts: the batch's rate (strength ``seq_prior``) for a sequence, and for the
    batch ``prior_ratio * r_{j-1}`` (strength ``prior_strength``; r_0 = 1), so unseen
    positions are expected to accept geometrically less; rates are made non-increasing.

    Cost: the target pass's cost curve is measured on the machine at hand, never assumed: the
    ``SpeculativeDecoder`` keeps the verify times of earlier requests of the same kind (numerics,
    threads, batch size; ``state.pass_costs``), and a new request starts from that curve and adds
    its own passes to it.  ``t_draft(K)`` (0 for K = 0) is a line fitted to the batch's measured draft time
    (the drafter's propose and observe; the first step's is left out, as it includes a
    model drafter's own prefill of the prompt) against the largest K of the step, proportional
    to K while one K was seen; ``t_verify(n)`` a line fitted to the measured verify time
    (target pass plus verification) against the nodes fed per sequence n, flat while one n
    was seen; the nodes a K yields are the running mean of the nodes the drafter made for
    that K (K + 1 before any), and a K seen at least 3 times costs its own mean verify
    time (a drafter that often drafts less than K, and steps in the cost, are captured
    so).  Costs can be fixed instead of measured (``draft_cost``,
    ``verify_cost`` as (a, b) pairs, seconds), e.g. for a ratio c: draft (0, c), verify (1, 0).
    Every choice is ``best_draft_length(rates, [t_draft(K) + t_verify(nodes(K))])``.

    Exploration: the first ``warmup`` steps follow ``HeuristicPolicy`` (which varies K and
    so the points the costs are fitted to); afterwards a sequence probes one token more
    than its choice (at most k_max), first at step ``explore_every``, so that the rate of the
    next position keeps being measured (a sequence that chose K = 0 would otherwise never
    learn that drafting pays again).  The gap to its next probe is ``explore_every`` while it
    drafts, and doubles (up to ``EXPLORE_BACKOFF`` times ``explore_every``) at each probe
    that finds it still choosing k_min: a probe of a drafter that costs a model pass is paid
    in full when it does not pay, so a sequence that keeps finding so probes ever more
    rarely (bench.defaults, 2026-12-06: layer-skip and the draft model on the demo prompts
    probed 7 times in 64 steps at a fixed gap of 8; with the back-off, 3).

    The costs are per batch step while the rates are per sequence: each sequence's K is
    chosen as if its step cost the whole batch's (exact for batch 1).

    Draft sources: where the drafter says before each step which of its sources will draft
    for a sequence (``Drafter.draft_sources``, handed over as ``state.draft_sources``; a
    fallback ``MultiDrafter`` names its sub-drafter), the acceptance counts and the mean
    nodes per K are kept per source, and so are the draft-cost line and the verify time per
    K, from the steps whose drafting sequences all drew from that source (its first drafting
    step left out; the line of all steps stands in until one is measured); a sequence's K
    is chosen from its source's: prompt lookup, accepted deep where it matches, is not held
    to the depth the EAGLE head's drafts earn, nor the head to lookup's.  The verify line by
    node count stays one for all sources (it is the target pass's cost), and so does the
    draft time ``TreeBudget`` reads.  Without sources, everything is source 0 and the lines
    are those of all steps.

    The counts, lines and rates of a run are kept and estimated by its ``Calibration``
    (``self.calibration``, ``calibration.py``; made by ``calibrate``), fed once per step by
    ``update``; a tree drafter's ``TreeBudget`` reads the same object
    (``DraftRun.calibration``).

    Args:
        k_min, k_max: the range of K (0 <= k_min <= k_max); k_min = 0 lets a sequence stop
            drafting when drafts do not pay.
        k_init: K of the warm-up's first step (default: min(4, k_max)).
        warmup: steps driven by the heuristic before the cost model decides.
        explore_every: the first probe's step, and the gap between probes of a sequence
            that drafts (0: never probe); doubled per probe while it keeps choosing k_min.
        prior_ratio, prior_strength, seq_prior: the pseudo-counts above.
        draft_cost, verify_cost: fixed (a, b) cost lines instead of measured ones.

    Raises:
        ValueError: bounds out of range, a negative warm-up or exploration period,
            prior_ratio outside [0, 1], a negative prior strength, a cost line that is not an
            (a, b) pair of seconds >= 0.
    """

    name = "cost-model"
    per_source = True  # the engine hands over ``state.draft_sources`` before each choice

    def __init__(
        self,
        k_min: int = 0,
        k_max: int = 8,
        *,
        k_init: Optional[int] = None,
        warmup: int = 6,
        explore_every: int = 8,
        prior_ratio: float = 0.5,
        prior_strength: float = 2.0,
        seq_prior: float = 4.0,
        draft_cost=None,
        verify_cost=None,
    ):
        if not 0 <= k_min <= k_max:
            raise ValueError(f"need 0 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
        k_init = min(max(4, k_min), k_max) if k_init is None else k_init
        if not k_min <= k_init <= k_max:
            raise ValueError(f"k_init must lie in [{k_min}, {k_max}], got {k_init}")
        if warmup < 0 or explore_every < 0:
            raise ValueError(f"warmup and explore_every must be >= 0, got {warmup}, {explore_every}")
        if not 0 <= prior_ratio <= 1:
            raise ValueError(f"prior_ratio must lie in [0, 1], got {prior_ratio}")
        if prior_strength < 0 or seq_prior < 0:
            raise ValueError(f"prior strengths must be >= 0, got {prior_strength}, {seq_prior}")
        self.k_min, self.k_max, self.k_init = k_min, k_max, k_init
        self.warmup, self.explore_every = warmup, explore_every
        self.prior_ratio, self.prior_strength, self.seq_prior = prior_ratio, prior_strength, seq_prior
        for name, c in (("draft_cost", draft_cost), ("verify_cost", verify_cost)):
            if c is not None and (len(c) != 2 or min(c) < 0):
                raise ValueError(f"{name} must be an (a, b) pair of seconds >= 0, got {c}")
        self.draft_cost, self.verify_cost = draft_cost, verify_cost  # fixed (a, b) lines, or None

    # ------------------------------------------------------------------ state
    def calibrate(self, state) -> Calibration:
        """A new ``Calibration`` for a run of ``state``'s batch, with this policy's settings
        (k_max, warm-up, pseudo-counts, fixed costs), its verify cost the decoder's pass-cost curve
        ``state.pass_costs`` where there is one.  The engine makes it before the drafter starts
        (it goes into ``DraftRun.calibration``); ``start`` then takes it up."""
        calibration = Calibration(state.batch_size, self, getattr(state, "pass_costs", None))
        calibration.draft_k = self.k_init
        return calibration

    def start(self, state) -> None:
        """A new run: its ``Calibration`` (``self.calibration``) is the run's
        (``state.draft_run.calibration``, made by ``calibrate`` before the drafter started),
        else a new one (``calibrate``: a state of a caller's own loop)."""
        super().start(state)
        B = state.batch_size
        prepared = getattr(getattr(state, "draft_run", None), "calibration", None)
        self.calibration: Calibration = prepared if prepared is not None else self.calibrate(state)
        self.heuristic = HeuristicPolicy(self.k_init, self.k_min, self.k_max)
        self.heuristic.start(state)
        self.last_sources = [0] * B
        # per sequence: the step of its next probe, and the gap after it
        self.next_probe = [self.explore_every] * B
        self.probe_gap = [self.explore_every] * B

    # ------------------------------------------------------------------ interface
    def choose(self, state) -> List[int]:
        calibration = self.calibration
        self.last_sources = calibration.step_sources(getattr(state, "draft_sources", None))
        if not calibration.ready:
            choice = self.heuristic.choose(state)
        else:
            times = {s: calibration.step_times(s) for s in set(self.last_sources)}
            batch = {s: calibration.batch_rates(s) for s in times}
            choice = [
                best_draft_length(calibration.sequence_rates(b, batch[s], s), times[s], self.k_min)
                for b, s in enumerate(self.last_sources)
            ]
            if self.explore_every:
                choice = [self._probe(b, k) for b, k in enumerate(choice)]
        calibration.draft_k = max(choice, default=self.k_max)
        return list(choice)

    def _probe(self, b: int, k: int) -> int:
        """Sequence b's K at this step given the cost model's choice k: one more at its probe
        steps (class docstring), whose gap doubles while k stays k_min."""
        steps = self.calibration.steps
        if steps < self.next_probe[b]:
            return k
        if k > self.k_min:
            self.probe_gap[b] = self.explore_every
        else:
            self.probe_gap[b] = min(2 * self.probe_gap[b], EXPLORE_BACKOFF * self.explore_every)
        self.next_probe[b] = steps + self.probe_gap[b]
        return min(k + 1, self.k_max)

    def update(self, state, record) -> None:
        """The step's measurements go to the calibration (under the sources ``choose`` was
        given), its acceptance to the warm-up's heuristic."""
        self.calibration.update(record, self.last_sources)
        self.heuristic.update(state, record)

    def describe(self) -> str:
        return f"cost-model(K in [{self.k_min}, {self.k_max}])"


def default_policy(drafter, k_max: Optional[int] = None) -> DraftLengthPolicy:
    """The draft-length policy chosen from measurements for a drafter (the CLI's default,
    and ``SpeculativeDecoder(policy="auto")``).

    Args:
        drafter: the engine's drafter: its ``default_k`` and ``drafts_free`` (``Drafter``'s
            class attributes, declared by each drafter) select the default.
        k_max: the largest K (default the drafter's ``default_k``).

    Returns:
        A fresh policy: ``FixedPolicy(0)`` for plain decoding, ``CostModelPolicy(0, k_max)``
        for prompt lookup (free drafts), and for every other drafter ``CostModelPolicy(0,
        k_max, k_init=1, warmup=2)``: its warm-up starts at one draft token and lasts two
        steps, so that drafts that cost a model pass and do not pay on the machine at hand
        cost little before the measured costs decide.

    Raises:
        ValueError: k_max neither None nor an int >= 0; a drafter's bad ``default_k``.

    Measured with ``python -m bench.policies`` (6 Spec-Bench prompts, ids 125 165 245 325
    405 485, 64 new tokens, greedy, CPU, 1 thread, on a machine shared with other jobs, so
    only figures of one run compare).  Run 1: plain 7.79 tokens/s; layer-skip (24 of 30
    layers) 4.09 at K = 4, 6.03 at K = 2, 6.36 heuristic, 7.85 cost model (mean K 0.40);
    n-gram + layer-skip multi-draft 4.53 at K = 4, 6.63 cost model; n-gram 7.57 at K = 8,
    7.63 heuristic.  Run 2 (after the cost model learnt per-K verify costs: on this CPU a
    verify pass of 2..8 nodes costs about the same, one node less): plain 18.23, n-gram
    18.07 at K = 8 and 19.73 cost model (mean K 1.66).
    """
    if k_max is not None and (isinstance(k_max, bool) or not isinstance(k_max, numbers.Integral) or k_max < 0):
        raise ValueError(f"k_max must be None or an int >= 0, got {k_max!r}")
    k = drafter_default_k(drafter) if k_max is None else int(k_max)
    if k == 0:
        return FixedPolicy(k)
    if getattr(drafter, "drafts_free", False):  # no model pass of their own: warm-up from K = 4
        return CostModelPolicy(0, k)
    # drafts that cost model passes (heads, layers, a draft model): a short, cheap warm-up, from
    # K = 1 up, so that a drafter that does not pay on this machine costs little before the cost
    # model stops it (bench.defaults, 2026-12-06: the warm-up of 6 steps from K = 4 held EAGLE's
    # tree, Medusa's tree, layer-skip and the draft model to 0.65-0.86x plain greedy on the demo
    # prompts; from K = 1 over 2 steps, 0.78-0.94x; with layer-skip on the target's cache and
    # probes that back off, 0.93-0.98x, docs/MEASUREMENTS.md)
    return CostModelPolicy(0, k, k_init=1, warmup=2)


def resolve_policy(policy, drafter) -> Optional[DraftLengthPolicy]:
    """A policy from the engine's ``policy=`` argument: None, "auto" (``default_policy``),
    "heuristic", "cost-model", "fixed", or a ``DraftLengthPolicy``.

    Raises:
        ValueError: an unknown name.  TypeError: anything else.
    """
    if policy is None or isinstance(policy, DraftLengthPolicy):
        return policy
    if isinstance(policy, str):
        k = drafter_default_k(drafter)
        makers: Dict[str, Callable[[], DraftLengthPolicy]] = {
            "auto": lambda: default_policy(drafter),
            "heuristic": lambda: HeuristicPolicy(k_max=max(k, 1)),
            "cost-model": lambda: CostModelPolicy(0, k),
            "fixed": lambda: FixedPolicy(k),
        }
        if policy not in makers:
            raise ValueError(f"policy must be None, a DraftLengthPolicy or one of {sorted(makers)}, got {policy!r}")
        return makers[policy]()
    raise TypeError(f"policy must be None, a name or a DraftLengthPolicy, got {type(policy).__name__}")


def draft_schedule(num_draft_tokens, policy, drafter, sampling):
    """A ``generate`` call's draft lengths: ``num_draft_tokens`` as given (an int, a list, a
    schedule or a ``DraftLengthPolicy``), else the decoder's ``policy`` resolved for the drafter
    (``resolve_policy``; K = 4 when it is None).  With ``coupling="rejection"``, whose tokens
    depend on K, ``policy="auto"`` means the drafter's fixed default K.

    Raises:
        ValueError: rejection sampling with an adaptive policy and a drafter (its tokens would
            follow K, so the batch and the machine's timing)."""
    rejection = isinstance(sampling, SamplingParams) and not sampling.greedy and sampling.coupling == "rejection"
    if num_draft_tokens is None:
        if rejection and isinstance(policy, str) and policy == "auto":
            num_draft_tokens = resolve_policy("fixed", drafter)  # K must not follow the timing
        else:
            num_draft_tokens = resolve_policy(policy, drafter) or 4
    chosen = num_draft_tokens if isinstance(num_draft_tokens, DraftLengthPolicy) else None
    if rejection and chosen is not None and not isinstance(chosen, FixedPolicy) and not isinstance(drafter, NoDrafter):
        raise ValueError(
            f"sampling.coupling='rejection' needs a fixed draft length: the {chosen.describe()} policy "
            "chooses K from the batch's acceptance and the measured costs, and rejection sampling's "
            "tokens depend on K; pass num_draft_tokens=<int>, or use coupling='gumbel'"
        )
    return num_draft_tokens
