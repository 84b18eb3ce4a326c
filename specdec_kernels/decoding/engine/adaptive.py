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
"""

from __future__ import annotations

import numbers
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from specdec_kernels.decoding.draft import NoDrafter, SamplingParams

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
    drafter's path probabilities times a calibration measured as it runs, against the step
    cost by node count of a ``CostModelPolicy`` (the decoder's measured pass-cost curve).

    The calibration of sequence b is ``(accepted + prior) / (predicted + prior)``: accepted
    drafts over the sum of the kept nodes' path probabilities, over its steps so far (a head
    that is over-confident gets smaller trees).  Without a cost (no cost-model policy) the budget
    is ``max_nodes``; with one, trees grow from 2 nodes to at most twice the largest pass it has
    measured (``growth_limit``), so a size is chosen only once the cost of about that size is
    known.

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
        self.cost = None  # a CostModelPolicy (set by the engine each run) or None
        self.start(0)

    def start(self, batch: int) -> None:
        """Forget the calibration: a new batch of ``batch`` sequences."""
        self.predicted = [0.0] * batch
        self.accepted = [0.0] * batch
        self.last_predicted = [0.0] * batch
        self.last_nodes: List[Optional[int]] = [None] * batch  # the latest choice per sequence

    def calibration(self, b: int) -> float:
        """Measured accepted drafts per unit of predicted path probability of sequence b."""
        return (self.accepted[b] + self.prior) / (self.predicted[b] + self.prior) if self.prior else 1.0

    def calibrated(self, b: int, values: Sequence[float]) -> List[float]:
        """Path probabilities (descending) times sequence b's calibration, capped at 1 and
        kept non-increasing: the values the rule weighs."""
        c = self.calibration(b)
        scaled = [min(1.0, c * float(v)) for v in values]
        for i in range(1, len(scaled)):
            scaled[i] = min(scaled[i], scaled[i - 1])
        return scaled

    def growth_limit(self) -> Optional[int]:
        """The most nodes a tree may have before larger passes are measured: twice the largest
        pass the cost has measured (2 before any), so that trees grow 2, 4, 8, ... while each
        size is measured, and a pass-cost line known only at small sizes (or at one size, where
        it is flat) never sends a step to ``max_nodes`` untried (on a CPU a 64-node pass costs
        about ten one-token passes).  None without a cost, or with a cost that keeps no such
        record (fixed costs)."""
        largest = getattr(self.cost, "largest_verified_nodes", None) if self.cost is not None else None
        seen = largest() if callable(largest) else None
        return None if seen is None else max(2, 2 * seen)

    def choose(self, b: int, values: Sequence[float]) -> int:
        """The node count for sequence b from its candidates' path probabilities (descending):
        ``best_tree_size`` against the cost's step times, within ``growth_limit``; without a
        cost, the largest tree the candidates allow; while the cost is warming up, the growth
        limit's size."""
        cap = min(self.max_nodes, len(values) + 1)
        times = self.cost.step_times_by_nodes(cap) if self.cost is not None else None
        limit = self.growth_limit()
        if times is None:
            if limit is None:
                return cap
            n = max(min(cap, limit), min(self.min_nodes, cap))
        else:
            n = best_tree_size(self.calibrated(b, values[: cap - 1]), times, min(self.min_nodes, cap))
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
        times = self.cost.step_times_by_nodes(cap) if self.cost is not None else None
        if times is None:
            return True
        scaled = self.calibrated(b, values)
        bound = scaled + [scaled[-1] if scaled else 1.0] * (cap - 1 - len(scaled))
        return best_tree_size(bound, times, min(self.min_nodes, cap)) > len(values) + 1

    def width(self, rows: Sequence[int], top_k: int) -> int:
        """How many nodes a tree drafter need expand per depth for the sequences ``rows``:
        the best n - 1 nodes by path probability lie among the n - 1 best of each depth, each
        with at most n - 1 kept children, so expanding ``min(top_k, n)`` (one spare, so that
        a budget can grow) loses nothing; n is each sequence's latest choice (``top_k``
        while any has none)."""
        last = [self.last_nodes[b] for b in rows] if self.cost is not None else [None]
        if not last or any(n is None for n in last):
            return top_k
        return max(1, min(top_k, max(last)))

    def kept(self, b: int, values: Sequence[float]) -> None:
        """The path probabilities of the nodes sequence b's draft keeps (its prediction)."""
        self.last_predicted[b] = float(sum(values))

    def observe(self, num_accepted, active) -> None:
        """A step's accepted drafts per sequence (``num_accepted`` (B,), ``active`` (B,) bools):
        ``update`` for each active sequence (what a drafter's ``observe`` hands on)."""
        for b, (n, a) in enumerate(zip(num_accepted.tolist(), active)):
            if a:
                self.update(b, int(n))

    def update(self, b: int, num_accepted: int) -> None:
        """Sequence b accepted ``num_accepted`` drafts of the tree it was last given."""
        self.predicted[b] += self.last_predicted[b]
        self.accepted[b] += float(num_accepted)
        self.last_predicted[b] = 0.0


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


class LinearCost:
    """A cost ``a + b * x`` (seconds) fitted online to (x, seconds) observations.

    Observations are averaged per x with an exponential moving average (weight
    ``1 / count``, at least ``decay``).  An x seen at least ``min_count`` times costs its
    own mean (so steps are captured: on CPU a verify pass of 2..8 nodes costs about the
    same and one node less); any other x the least-squares line through the per-x means
    weighted by their counts (a >= 0, b >= 0).  With one distinct x only, the line is flat
    (``proportional=False``) or proportional to x (``proportional=True``).  Fixed
    coefficients can be given instead (``a``, ``b``).
    """

    def __init__(
        self,
        a: Optional[float] = None,
        b: Optional[float] = None,
        *,
        proportional: bool = False,
        decay: float = 0.1,
        min_count: int = 3,
    ):
        self.fixed = (a, b) if a is not None and b is not None else None
        self.proportional = proportional
        self.decay = decay
        self.min_count = min_count
        self.points: Dict[int, List[float]] = {}  # x -> [count, mean seconds]

    def add(self, x: int, seconds: float) -> None:
        c, m = self.points.get(x, [0, 0.0])
        c += 1
        w = max(1.0 / c, self.decay)
        self.points[x] = [c, m + w * (seconds - m)]

    @property
    def known(self) -> bool:
        return self.fixed is not None or bool(self.points)

    def coefficients(self):
        """(a, b), or None when nothing was observed."""
        if self.fixed is not None:
            return self.fixed
        if not self.points:
            return None
        xs = list(self.points)
        w = [min(self.points[x][0], 20) for x in xs]
        ys = [self.points[x][1] for x in xs]
        sw = sum(w)
        mx = sum(wi * x for wi, x in zip(w, xs)) / sw
        my = sum(wi * y for wi, y in zip(w, ys)) / sw
        sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
        if sxx == 0:
            x = xs[0]
            return (0.0, my / x) if self.proportional and x > 0 else (my, 0.0)
        b = max(sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / sxx, 0.0)
        a = max(my - b * mx, 0.0)
        return a, b

    def __call__(self, x: float) -> float:
        if self.fixed is None and x in self.points and self.points[x][0] >= self.min_count:
            return self.points[x][1]
        coef = self.coefficients()
        if coef is None:
            return 0.0
        return coef[0] + coef[1] * x


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
            prior_ratio outside [0, 1], a negative prior strength.
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
        self._draft_cost_arg, self._verify_cost_arg = draft_cost, verify_cost
        for name, c in (("draft_cost", draft_cost), ("verify_cost", verify_cost)):
            if c is not None and (len(c) != 2 or min(c) < 0):
                raise ValueError(f"{name} must be an (a, b) pair of seconds >= 0, got {c}")

    # ------------------------------------------------------------------ state
    def start(self, state) -> None:
        super().start(state)
        B = state.batch_size
        self.steps = 0
        # per sequence and draft source (``Drafter.draft_sources``; 0 when the drafter names
        # none): [j] steps with K >= j, and steps whose accepted path reached j
        self.requested: List[Dict[int, List[int]]] = [{} for _ in range(B)]
        self.reached: List[Dict[int, List[int]]] = [{} for _ in range(B)]
        v = self._verify_cost_arg
        # draft seconds against K: every step (draft_cost), and per source the steps whose
        # drafting sequences all drew from it (draft_costs), each source's first drafting step
        # left out (it includes a model drafter's catch-up on the prompt)
        self.draft_cost = self._new_draft_line()
        self.draft_costs: Dict[int, LinearCost] = {}
        self.verify_cost = LinearCost(*(v or (None, None)))  # the pass, by nodes: one for all sources
        # the decoder's pass-cost curve of earlier requests of this kind (state.pass_costs): the
        # verify cost starts from it, and this request's passes are added to it
        self.shared_cost = getattr(state, "pass_costs", None) if v is None else None
        if self.shared_cost is not None:
            self.verify_cost.points = {x: list(p) for x, p in self.shared_cost.points.items()}
        self.verify_by_k = LinearCost()  # verify seconds per K requested (a K seen often enough)
        self.verify_by_ks: Dict[int, LinearCost] = {}  # the same per source (its steps alone)
        self.sourced = False  # the drafter named sources (state.draft_sources) at some step
        self.drafted_sources: set = set()  # sources that drafted (K > 0) at some step
        self.nodes: Dict[Tuple[int, int], List[float]] = {}  # (source, K) -> [count, mean nodes per sequence]
        self.heuristic = HeuristicPolicy(self.k_init, self.k_min, self.k_max)
        self.heuristic.start(state)
        self.last_choice = [self.k_init] * B
        self.last_sources = [0] * B
        # per sequence: the step of its next probe, and the gap after it
        self.next_probe = [self.explore_every] * B
        self.probe_gap = [self.explore_every] * B

    def _new_draft_line(self) -> LinearCost:
        """A draft-cost line: the fixed ``draft_cost`` given, else one fitted, proportional to K."""
        return LinearCost(*(self._draft_cost_arg or (None, None)), proportional=True)

    def _draft_cost_of(self, source: int) -> LinearCost:
        """The draft-cost line of a source: its own once measured, else the line of all steps
        (always that one while the drafter names no sources)."""
        own = self.draft_costs.get(source)
        return own if self.sourced and own is not None and own.known else self.draft_cost

    def _counts(self, table: List[Dict[int, List[int]]], b: int, source: int) -> List[int]:
        if source not in table[b]:
            table[b][source] = [0] * (self.k_max + 1)
        return table[b][source]

    # ------------------------------------------------------------------ estimates
    def batch_rates(self, source: int = 0) -> List[float]:
        """r_1..r_kmax of one draft source, estimated over the whole batch."""
        rates, prev = [], 1.0
        empty = [0] * (self.k_max + 1)
        for j in range(1, self.k_max + 1):
            req = sum(r.get(source, empty)[j] for r in self.requested)
            hit = sum(r.get(source, empty)[j] for r in self.reached)
            prior = self.prior_ratio * prev
            r = (
                (hit + self.prior_strength * prior) / (req + self.prior_strength)
                if req + self.prior_strength > 0
                else prior
            )
            prev = min(r, prev)
            rates.append(prev)
        return rates

    def sequence_rates(self, b: int, batch: Optional[List[float]] = None, source: int = 0) -> List[float]:
        """r_1..r_kmax of sequence b's drafts from one source, shrunk towards the batch's."""
        batch = self.batch_rates(source) if batch is None else batch
        requested = self.requested[b].get(source, [0] * (self.k_max + 1))
        reached = self.reached[b].get(source, [0] * (self.k_max + 1))
        rates, prev = [], 1.0
        for j in range(1, self.k_max + 1):
            req, hit = requested[j], reached[j]
            prior = batch[j - 1]
            r = (hit + self.seq_prior * prior) / (req + self.seq_prior) if req + self.seq_prior > 0 else prior
            prev = min(r, prev)
            rates.append(prev)
        return rates

    def nodes_for(self, k: int, source: int = 0) -> float:
        """Mean nodes per sequence (root included) that a step requesting K of a source yielded."""
        if (source, k) in self.nodes:
            return self.nodes[(source, k)][1]
        return k + 1.0

    def step_times(self, source: int = 0) -> List[float]:
        """Estimated seconds of a step for K = 0..k_max of one source (a floor of 1e-9)."""
        out = []
        by_k = self.verify_by_ks.get(source) if self.sourced else self.verify_by_k
        for k in range(self.k_max + 1):
            seen = by_k.points.get(k) if by_k is not None else None
            if self.verify_cost.fixed is None and seen is not None and seen[0] >= self.verify_by_k.min_count:
                verify = seen[1]
            else:
                verify = self.verify_cost(self.nodes_for(k, source))
            t = (self._draft_cost_of(source)(k) if k > 0 else 0.0) + verify
            out.append(max(t, 1e-9))
        return out

    def largest_verified_nodes(self) -> Optional[int]:
        """The most nodes per sequence of a verify pass measured so far (this request's and the
        earlier ones' of ``state.pass_costs``), 0 before any; None with a fixed verify cost
        (nothing to measure).  ``TreeBudget.growth_limit`` reads it."""
        if self._verify_cost_arg is not None:
            return None
        line = getattr(self, "verify_cost", None)  # set by start()
        return max(line.points, default=0) if line is not None else 0

    def step_times_by_nodes(self, max_nodes: int) -> Optional[List[float]]:
        """Estimated seconds of a step whose tree has n nodes per sequence, n = 0..max_nodes
        (entry 0 unused; a floor of 1e-9): the draft time at the last step's largest K (the
        line of all steps, whichever source drafts) plus the verify line at n nodes.  None
        during the warm-up or before a verify time is known (``TreeBudget`` then keeps its
        largest tree, which also measures large passes)."""
        if self.steps < self.warmup or not self.verify_cost.known:
            return None
        k = max(self.last_choice) if self.last_choice else self.k_max
        draft = self.draft_cost(k) if k > 0 else 0.0
        return [max(draft + self.verify_cost(n), 1e-9) for n in range(max_nodes + 1)]

    # ------------------------------------------------------------------ interface
    def choose(self, state) -> List[int]:
        B = state.batch_size
        sources = getattr(state, "draft_sources", None)
        self.sourced = self.sourced or sources is not None
        self.last_sources = list(sources) if sources is not None else [0] * B
        if self.steps < self.warmup or not self.verify_cost.known:
            choice = self.heuristic.choose(state)
        else:
            times = {s: self.step_times(s) for s in set(self.last_sources)}
            batch = {s: self.batch_rates(s) for s in times}
            choice = [
                best_draft_length(self.sequence_rates(b, batch[s], s), times[s], self.k_min)
                for b, s in enumerate(self.last_sources)
            ]
            if self.explore_every:
                choice = [self._probe(b, k) for b, k in enumerate(choice)]
        self.last_choice = choice
        return list(choice)

    def _probe(self, b: int, k: int) -> int:
        """Sequence b's K at this step given the cost model's choice k: one more at its probe
        steps (class docstring), whose gap doubles while k stays k_min."""
        if self.steps < self.next_probe[b]:
            return k
        if k > self.k_min:
            self.probe_gap[b] = self.explore_every
        else:
            self.probe_gap[b] = min(2 * self.probe_gap[b], EXPLORE_BACKOFF * self.explore_every)
        self.next_probe[b] = self.steps + self.probe_gap[b]
        return min(k + 1, self.k_max)

    def update(self, state, record) -> None:
        self.steps += 1
        self.heuristic.update(state, record)
        sources = self.last_sources  # those choose() was given for this step
        for b, a in enumerate(record.active):
            if not a:
                continue
            k, s = min(record.ks[b], self.k_max), sources[b]
            requested, reached = self._counts(self.requested, b, s), self._counts(self.reached, b, s)
            for j in range(1, k + 1):
                requested[j] += 1
                reached[j] += int(record.num_accepted[b] >= j)
            c, m = self.nodes.get((s, k), [0, 0.0])
            c += 1
            self.nodes[(s, k)] = [c, m + max(1.0 / c, 0.1) * (record.num_nodes[b] - m)]
        if any(record.active):
            k_step = max(k for k, a in zip(record.ks, record.active) if a)
            if k_step > 0 and self.steps > 1:  # the first step's includes the drafter's prompt prefill
                self.draft_cost.add(k_step, record.draft_time)
            self.verify_cost.add(record.block_width, record.verify_time)
            self.verify_by_k.add(k_step, record.verify_time)
            # a source's own lines take the steps whose drafting sequences all drew from it,
            # but its first drafting step
            drew = {sources[b] for b, a in enumerate(record.active) if a and record.ks[b] > 0}
            first = drew - self.drafted_sources
            self.drafted_sources |= drew
            if self.sourced and len(drew) == 1 and not first:
                (s,) = drew
                self.draft_costs.setdefault(s, self._new_draft_line()).add(k_step, record.draft_time)
                self.verify_by_ks.setdefault(s, LinearCost()).add(k_step, record.verify_time)
            if self.shared_cost is not None:
                self.shared_cost.add(record.block_width, record.verify_time)

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
