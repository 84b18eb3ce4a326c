"""One calibration of pass cost and acceptance per ``generate`` call: what the draft-length
policy and a tree drafter's node budget both read.

``Calibration`` holds, for one run of a batch, the measurements that ``CostModelPolicy`` (K per
sequence, ``adaptive.py``) and ``TreeBudget`` (nodes per tree, ``adaptive.py``) weigh:

* the target pass's cost by nodes per sequence (``verify_cost``, a ``LinearCost`` of seconds):
  the decoder's curve of its earlier requests of the same kind (numerics, threads, batch size;
  ``SpeculativeDecoder.pass_costs``), the same object, so that this run's passes are added to
  it and later runs start from it;
* the draft cost by K (``draft_cost``, and per draft source ``draft_costs``), the verify time
  per K requested (``verify_by_k``, per source ``verify_by_ks``) and the mean nodes a K yields
  (``nodes``): the step times by K (``step_times``) and by node count
  (``step_times_by_nodes``);
* the acceptance counts per sequence, draft source and depth (``requested``, ``reached``) and
  the rates estimated from them (``batch_rates``, ``sequence_rates``);
* per tree drafter, its tree calibration (``PathCalibration``: accepted drafts against the path
  probabilities of the nodes its drafts kept, per sequence; ``paths``).

The costs and counts are fed once per step, in one place: the policy's ``update`` hands the
engine's ``StepRecord`` to ``update(record, sources)``.  A tree calibration is fed by its
budget (the drafter alone knows which nodes it kept and, inside a composite drafter, which of
the accepted drafts were its own).  The engine makes the calibration (``CostModelPolicy.calibrate``)
before the drafter starts and hands it over in ``DraftRun.calibration``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple


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


class PathCalibration:
    """One tree drafter's calibration in one run, per sequence: its accepted drafts against the
    summed path probabilities of the nodes its drafts kept (EAGLE-2's node values, measured).

    The factor of sequence b is ``(accepted + prior) / (predicted + prior)`` over its steps so
    far: a head that is over-confident gets a factor below 1, so smaller trees
    (``TreeBudget``).

    Args:
        batch: the run's sequences.
        prior: pseudo-count of the prior factor of 1 (>= 0; 0: the factor is 1).
    """

    def __init__(self, batch: int, prior: float):
        self.prior = float(prior)
        self.predicted = [0.0] * batch  # summed path probabilities of the kept nodes
        self.accepted = [0.0] * batch  # accepted drafts
        self.last_predicted = [0.0] * batch  # the latest draft's, until its step is observed

    def factor(self, b: int) -> float:
        """Measured accepted drafts per unit of predicted path probability of sequence b."""
        return (self.accepted[b] + self.prior) / (self.predicted[b] + self.prior) if self.prior else 1.0

    def calibrated(self, b: int, values: Sequence[float]) -> List[float]:
        """Path probabilities (descending) times sequence b's factor, capped at 1 and kept
        non-increasing: the values a budget weighs."""
        c = self.factor(b)
        scaled = [min(1.0, c * float(v)) for v in values]
        for i in range(1, len(scaled)):
            scaled[i] = min(scaled[i], scaled[i - 1])
        return scaled

    def kept(self, b: int, values: Sequence[float]) -> None:
        """The path probabilities of the nodes sequence b's draft keeps (its prediction)."""
        self.last_predicted[b] = float(sum(values))

    def observe(self, num_accepted, active) -> None:
        """A step's accepted drafts per sequence (``num_accepted`` (B,) int64 on the host,
        ``active`` (B,) bools): ``update`` for each active sequence."""
        for b, (n, a) in enumerate(zip(num_accepted.tolist(), active)):
            if a:
                self.update(b, int(n))

    def update(self, b: int, num_accepted: int) -> None:
        """Sequence b accepted ``num_accepted`` drafts of the tree it was last given."""
        self.predicted[b] += self.last_predicted[b]
        self.accepted[b] += float(num_accepted)
        self.last_predicted[b] = 0.0


class Calibration:
    """Pass cost and acceptance of one ``generate`` call, measured as it runs (the module
    docstring lists what; ``CostModelPolicy``'s docstring how each estimate is made).

    Times are seconds; nodes count the root; K is the draft length a step requested for a
    sequence; a draft source is the drafter's source that drafted for a sequence
    (``Drafter.draft_sources``, 0 when the drafter names none).

    Args:
        batch_size: B, the run's sequences.
        settings: how to estimate, a ``CostModelPolicy`` (any object with its attributes):
            ``k_max`` (the deepest draft position counted), ``warmup`` (steps recorded before
            the cost estimates are used, ``ready``), ``prior_ratio``, ``prior_strength`` and
            ``seq_prior`` (the rates' pseudo-counts, ``batch_rates``, ``sequence_rates``),
            ``draft_cost`` and ``verify_cost`` (fixed (a, b) cost lines in seconds, or None:
            measured).  Read once, here.
        pass_costs: the decoder's measured pass-cost curve of earlier requests of this kind (a
            ``LinearCost`` by nodes per sequence): the verify cost is that object, and this
            run's passes are added to it; None: a new curve.  Not used with a fixed
            ``verify_cost``.
    """

    def __init__(self, batch_size: int, settings, pass_costs: Optional[LinearCost] = None):
        self.batch_size, self.k_max, self.warmup = batch_size, settings.k_max, settings.warmup
        self.prior_ratio, self.prior_strength = settings.prior_ratio, settings.prior_strength
        self.seq_prior = settings.seq_prior
        self._fixed_draft_cost, verify_cost = settings.draft_cost, settings.verify_cost
        self.steps = 0  # steps recorded (``update``)
        # per sequence and draft source: [j] steps with K >= j, and steps whose accepted path reached j
        self.requested: List[Dict[int, List[int]]] = [{} for _ in range(batch_size)]
        self.reached: List[Dict[int, List[int]]] = [{} for _ in range(batch_size)]
        # draft seconds against K: every step (draft_cost), and per source the steps whose
        # drafting sequences all drew from it (draft_costs), each source's first drafting step
        # left out (it includes a model drafter's catch-up on the prompt)
        self.draft_cost = self._new_draft_line()
        self.draft_costs: Dict[int, LinearCost] = {}
        # the target pass by nodes per sequence, one for all sources: the decoder's curve
        # (``pass_costs``), measured from scratch without one, or fixed
        if verify_cost is not None:
            self.verify_cost = LinearCost(*verify_cost)
        else:
            self.verify_cost = pass_costs if pass_costs is not None else LinearCost()
        self.verify_by_k = LinearCost()  # verify seconds per K requested (a K seen often enough)
        self.verify_by_ks: Dict[int, LinearCost] = {}  # the same per source (its steps alone)
        self.sourced = False  # the drafter named sources at some step (``step_sources``)
        self.drafted_sources: set = set()  # sources that drafted (K > 0) at some step
        self.nodes: Dict[Tuple[int, int], List[float]] = {}  # (source, K) -> [count, mean nodes per sequence]
        # the largest K of the step being drafted (set by the policy as it chooses; k_max until
        # then): the draft time that ``step_times_by_nodes`` adds
        self.draft_k = self.k_max
        self.paths: Dict[object, PathCalibration] = {}  # a tree drafter's budget -> its tree calibration

    def _new_draft_line(self) -> LinearCost:
        """A draft-cost line: the fixed ``draft_cost`` given, else one fitted, proportional to K."""
        return LinearCost(*(self._fixed_draft_cost or (None, None)), proportional=True)

    def _counts(self, table: List[Dict[int, List[int]]], b: int, source: int) -> List[int]:
        if source not in table[b]:
            table[b][source] = [0] * (self.k_max + 1)
        return table[b][source]

    def new_paths(self, owner, batch: int, prior: float) -> PathCalibration:
        """A fresh tree calibration of ``batch`` sequences for ``owner`` (a tree drafter's
        ``TreeBudget``), kept in ``paths[owner]`` (replacing any): each tree drafter of a
        composite keeps its own."""
        self.paths[owner] = PathCalibration(batch, prior)
        return self.paths[owner]

    # ------------------------------------------------------------------ estimates
    @property
    def ready(self) -> bool:
        """The warm-up's steps are recorded and a verify time is known: the cost estimates
        are used (before, the policy follows its heuristic and a budget its growth limit)."""
        return self.steps >= self.warmup and self.verify_cost.known

    def step_sources(self, sources: Optional[Sequence[int]]) -> List[int]:
        """The draft source per sequence of the step being chosen: ``sources`` (the drafter's
        ``draft_sources``; from then on each source's own lines are used), else all 0."""
        self.sourced = self.sourced or sources is not None
        return list(sources) if sources is not None else [0] * self.batch_size

    def batch_rates(self, source: int = 0) -> List[float]:
        """r_1..r_kmax of one draft source, estimated over the whole batch: r_j the rate at
        which the accepted path reaches depth j where j was requested, with the pseudo-counts
        ``prior_ratio * r_{j-1}`` (strength ``prior_strength``; r_0 = 1), non-increasing."""
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
        """r_1..r_kmax of sequence b's drafts from one source, shrunk towards the batch's
        (``batch``, default ``batch_rates(source)``; strength ``seq_prior``)."""
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

    def draft_cost_of(self, source: int) -> LinearCost:
        """The draft-cost line of a source: its own once measured, else the line of all steps
        (always that one while the drafter names no sources)."""
        own = self.draft_costs.get(source)
        return own if self.sourced and own is not None and own.known else self.draft_cost

    def step_times(self, source: int = 0) -> List[float]:
        """Estimated seconds of a step for K = 0..k_max of one source (a floor of 1e-9): its
        draft line at K plus the verify time at K (the mean of the source's steps at K where
        seen at least 3 times, else the verify line at the nodes K yields)."""
        out = []
        by_k = self.verify_by_ks.get(source) if self.sourced else self.verify_by_k
        for k in range(self.k_max + 1):
            seen = by_k.points.get(k) if by_k is not None else None
            if self.verify_cost.fixed is None and seen is not None and seen[0] >= self.verify_by_k.min_count:
                verify = seen[1]
            else:
                verify = self.verify_cost(self.nodes_for(k, source))
            t = (self.draft_cost_of(source)(k) if k > 0 else 0.0) + verify
            out.append(max(t, 1e-9))
        return out

    def largest_verified_nodes(self) -> Optional[int]:
        """The most nodes per sequence of a verify pass measured so far (this run's and the
        earlier ones' of the decoder's curve), 0 before any; None with a fixed verify cost
        (nothing to measure).  ``TreeBudget.growth_limit`` reads it."""
        if self.verify_cost.fixed is not None:
            return None
        return max(self.verify_cost.points, default=0)

    def step_times_by_nodes(self, max_nodes: int) -> Optional[List[float]]:
        """Estimated seconds of a step whose tree has n nodes per sequence, n = 0..max_nodes
        (entry 0 unused; a floor of 1e-9): the draft time at ``draft_k`` (the line of all
        steps, whichever source drafts) plus the verify line at n nodes.  None until ``ready``
        (``TreeBudget`` then keeps its largest tree within its growth limit, which also
        measures larger passes)."""
        if not self.ready:
            return None
        draft = self.draft_cost(self.draft_k) if self.draft_k > 0 else 0.0
        return [max(draft + self.verify_cost(n), 1e-9) for n in range(max_nodes + 1)]

    # ------------------------------------------------------------------ measurements
    def update(self, record, sources: Sequence[int]) -> None:
        """Add one step: the engine's ``StepRecord`` (K, nodes and accepted drafts per
        sequence, draft and verify seconds) under the draft sources its K were chosen for
        (``step_sources``).  Counts depths up to k_max per active sequence; the draft time
        goes to the line of all steps against the step's largest K (not the first step's: it
        includes a model drafter's prefill of the prompt) and to a source's own line where
        every drafting sequence drew from that source (not its first drafting step); the
        verify time to the pass curve by the block's width and to the lines by K."""
        self.steps += 1
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
        if not any(record.active):
            return
        k_step = max(k for k, a in zip(record.ks, record.active) if a)
        if k_step > 0 and self.steps > 1:
            self.draft_cost.add(k_step, record.draft_time)
        self.verify_cost.add(record.block_width, record.verify_time)
        self.verify_by_k.add(k_step, record.verify_time)
        drew = {sources[b] for b, a in enumerate(record.active) if a and record.ks[b] > 0}
        first = drew - self.drafted_sources
        self.drafted_sources |= drew
        if self.sourced and len(drew) == 1 and not first:
            (s,) = drew
            self.draft_costs.setdefault(s, self._new_draft_line()).add(k_step, record.draft_time)
            self.verify_by_ks.setdefault(s, LinearCost()).add(k_step, record.verify_time)
