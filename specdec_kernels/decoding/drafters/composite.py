"""The base of the drafters made of several drafters (``MergeDrafter``, ``FallbackDrafter``,
``EnsembleDrafter``; ``MultiDrafter`` builds one of them): it holds and checks the
sub-drafters, keeps their per-drafter statistics and hands each one its own view of the run
and of every step.

What the three share, and what this module does for them:

- the sub-drafters, their statistics names and optional per-drafter caps on K;
- the start of a run (``observe`` of ``result.started``): each sub-drafter gets a
  ``DraftRun`` of its own (``_runs``): generators of its own, derived per sequence, and the
  target's KV cache only if no earlier sub-drafter took it (``shares_target_cache``, e.g. a
  ``ModelDrafter`` running the target's own layers), so no two drafters write draft nodes into
  the same slots; the per-drafter counters go to the run's ``DecodeStats.drafters``;
- each sub-drafter's ``StepResult`` (``_observe_one``): its own run, the target's hidden
  states with the columns of its own ``feature_layers`` (EAGLE-3's multi-layer features, Li
  et al. 2025) out of the union the engine hands over, where it wants them, and the target's
  argmax tokens at its own nodes (``_own_argmax``, which a drafter that renumbers nodes
  overrides; lookahead decoding's Jacobi iterations), where it wants them;
- the cost counters (``model_tokens``, ``kv_cache_bytes``).

A subclass implements ``propose`` (asking each sub-drafter with ``_request``) and
``observe`` (after ``super().observe(result)``, which begins a run).
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from specdec_kernels.decoding.draft import Drafter, DraftRequest, DraftRun, StepResult, TargetFeatures

#: counters kept per sub-drafter in ``DecodeStats.drafters[name]``
DRAFTER_COUNTERS = (
    "steps",  # sequence steps in which the drafter proposed at least one draft token
    "proposed",  # its draft tokens that made it into the merged tree (shared ones counted)
    "accepted",  # accepted nodes of the merged tree that it had proposed
    "only_accepted",  # accepted nodes that it alone had proposed
    "propose_time",  # seconds in its propose
    "observe_time",  # seconds in its observe (the start of a run included)
    "weight",  # ensemble only: the sum over sequence steps of its mixture weight at depth 1
)


class CompositeDrafter(Drafter):
    """A drafter made of sub-drafters: their checks, statistics, and each one's view of the
    run and of the steps.

    Args:
        drafters: the sub-drafters, in priority order.
        max_depths: optional per-sub-drafter caps on K (None entries: no cap), e.g.
            ``(None, 3)`` to give a costly model drafter at most 3 draft tokens while the
            free n-gram lookup gets the full K.
        names: statistics keys per sub-drafter (default: each drafter's ``name``, made unique
            with a suffix).

    Attributes:
        drafters, max_depths, names: as given (``names`` filled in).
        vocab_size: the sub-drafters' common ``vocab_size``, or None when none has one.
        counters: per name, the ``DRAFTER_COUNTERS`` of the current run
            (``DecodeStats.drafters``).
        shares_target_cache: a sub-drafter took the target's KV cache in the current run.
        ensemble, fallback: which of the combinations it is (class constants; what
            ``MultiDrafter``'s flags of the same names chose).

    Raises:
        ValueError: no drafters, a max_depths / names list of the wrong length or a negative
            cap, duplicate names, sub-drafters with different vocabularies.
        TypeError: a sub-drafter that is not a ``Drafter``; drafters or names not a list or
            tuple (one drafter, a string); a max_depths entry not an int (bools, floats).
    """

    name = "multi"
    default_k = 6
    ensemble = False
    fallback = False

    def __init__(
        self,
        drafters: Sequence[Drafter],
        *,
        max_depths: Optional[Sequence[Optional[int]]] = None,
        names: Optional[Sequence[str]] = None,
    ):
        if isinstance(drafters, Drafter) or not isinstance(drafters, (list, tuple)):
            raise TypeError(f"drafters must be a list or tuple of Drafters, got {type(drafters).__name__}")
        drafters = list(drafters)
        if not drafters:
            raise ValueError("drafters must hold at least one Drafter")
        for i, d in enumerate(drafters):
            if not isinstance(d, Drafter):
                raise TypeError(f"drafters[{i}] must be a Drafter, got {type(d).__name__}")
        if max_depths is not None:
            max_depths = list(max_depths)
            if len(max_depths) != len(drafters):
                raise ValueError(f"max_depths must hold one cap per drafter ({len(drafters)}), got {len(max_depths)}")
            for i, c in enumerate(max_depths):
                if c is not None and (isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0):
                    raise ValueError(f"max_depths[{i}] must be an int >= 0 or None, got {c!r}")
            max_depths = [None if c is None else int(c) for c in max_depths]
        if names is None:
            names, seen = [], {}
            for d in drafters:
                base = getattr(d, "name", type(d).__name__)
                seen[base] = seen.get(base, 0) + 1
                names.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise TypeError(f"names must be a list or tuple of strings, got {type(names).__name__} {names!r}")
        names = [str(n) for n in names]
        if len(names) != len(drafters) or len(set(names)) != len(names):
            raise ValueError(f"names must be one distinct name per drafter, got {names}")
        vocabs = {getattr(d, "vocab_size", None) for d in drafters} - {None}
        if len(vocabs) > 1:
            raise ValueError(f"the drafters' vocabularies differ: {sorted(vocabs)}")
        self.drafters = drafters
        self.max_depths = max_depths
        self.names = names
        self.vocab_size = vocabs.pop() if vocabs else None
        self.counters: Dict[str, Dict[str, float]] = {}
        self._runs: List[DraftRun] = []  # per sub-drafter, its view of the current run

    # ------------------------------------------------------------------ statistics
    def _new_counters(self) -> None:
        # a new dict every run: an earlier run's statistics keep their own (DecodeStats.drafters)
        self.counters = {n: {c: (0.0 if c.endswith("_time") else 0) for c in DRAFTER_COUNTERS} for n in self.names}

    @contextmanager
    def _timed(self, name: str, counter: str) -> Iterator[None]:
        """Add the seconds the block takes to sub-drafter ``name``'s ``counter``."""
        t = time.perf_counter()
        yield
        self.counters[name][counter] += time.perf_counter() - t

    def _capped(self, i: int, num_draft_tokens: Sequence[int]) -> List[int]:
        """``num_draft_tokens`` cut at sub-drafter ``i``'s ``max_depths`` cap."""
        cap = self.max_depths[i] if self.max_depths is not None else None
        return [min(k, cap) if cap is not None else k for k in num_draft_tokens]

    # ------------------------------------------------------------------ hidden states
    @property
    def wants_hidden(self) -> bool:
        """True when a sub-drafter (e.g. ``MedusaDrafter``) wants the target's hidden state."""
        return any(getattr(d, "wants_hidden", False) for d in self.drafters)

    @property
    def context_window(self) -> int:
        """The longest ``context_window`` of the sub-drafters that want hidden states."""
        return max(
            [int(getattr(d, "context_window", 0) or 0) for d in self.drafters if getattr(d, "wants_hidden", False)]
            or [0]
        )

    @property
    def feature_layers(self) -> Tuple[int, ...]:
        """The target layers any sub-drafter that wants hidden states asks for, ascending."""
        return tuple(
            sorted(
                {
                    i
                    for d in self.drafters
                    if getattr(d, "wants_hidden", False)
                    for i in getattr(d, "feature_layers", ())
                }
            )
        )

    def _columns(self, d: Drafter, width: int) -> Optional[torch.Tensor]:
        """The columns of a hidden-state row ``width`` wide (the final hidden state, then the
        layers of ``feature_layers``) that sub-drafter ``d`` gets (its own layers, in its
        order); None when it gets them all."""
        mine, ours = tuple(getattr(d, "feature_layers", ())), self.feature_layers
        if mine == ours:
            return None
        H = width // (1 + len(ours))
        blocks = [0] + [1 + ours.index(i) for i in mine]
        return torch.cat([torch.arange(j * H, (j + 1) * H) for j in blocks])

    def _own_features(self, d: Drafter, features: Optional[TargetFeatures]) -> Optional[TargetFeatures]:
        """Sub-drafter ``d``'s share of the target's hidden states: None unless it wants
        hidden states; else the final hidden state of each sequence's last accepted node (the
        same for every sub-drafter: it does not depend on who proposed the node) and, for a
        sub-drafter with a context window, the committed positions' (each keeps as many as it
        needs), each with the columns of its own ``feature_layers``."""
        if features is None or not getattr(d, "wants_hidden", False):
            return None
        cols = self._columns(d, features.last.shape[-1])

        def pick(h: torch.Tensor) -> torch.Tensor:
            return h if cols is None else h[:, cols.to(h.device)]

        context = positions = None
        if features.context is not None and getattr(d, "context_window", 0):
            context = [None if h is None else pick(h) for h in features.context]
            positions = features.context_positions
        return TargetFeatures(pick(features.last), features.valid, context, positions)

    @property
    def wants_target_argmax(self) -> bool:
        """True when a sub-drafter (e.g. ``LookaheadDrafter``) wants the target's argmax tokens."""
        return any(getattr(d, "wants_target_argmax", False) for d in self.drafters)

    def _own_argmax(self, i: int, argmax: torch.Tensor, num_nodes: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The target's argmax tokens and node counts in sub-drafter ``i``'s node indices: as
        they are, where the draft verified is the sub-drafter's own (a shared chain)."""
        return argmax, self._own_num_nodes(i, num_nodes)

    def _own_num_nodes(self, i: int, num_nodes: torch.Tensor) -> torch.Tensor:
        """The nodes (B,) int64 of sub-drafter ``i``'s own draft verified this step: the
        draft's, where it is the sub-drafter's own."""
        return num_nodes

    # ------------------------------------------------------------------ caches
    @property
    def shares_target_cache(self) -> bool:
        """True when a sub-drafter took the target's KV cache at the start of the current run."""
        return any(bool(getattr(d, "shares_target_cache", False)) for d in self.drafters)

    @property
    def model_tokens(self) -> int:
        """Tokens fed through the sub-drafters' models (see ``DecodeStats.draft_model_tokens``)."""
        return sum(int(getattr(d, "model_tokens", 0)) for d in self.drafters)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the sub-drafters' own KV caches."""
        return sum(int(getattr(d, "kv_cache_bytes", 0)) for d in self.drafters)

    # ------------------------------------------------------------------ interface
    def observe(self, result: StepResult) -> None:
        """Begin a run (``result.started``; a subclass's override calls this first and handles
        the steps): fresh counters, recorded in ``result.run.stats.drafters``; each
        sub-drafter observes the start with a ``DraftRun`` of its own (``_runs``): generators
        derived per sequence from ``result.run.generators``, and the target's KV cache only
        where no earlier sub-drafter took it (``shares_target_cache``); then the
        subclass's per-batch state is reset (``_reset``).

        Args:
            result: the run's start (``StepResult`` of the prefill: the prompts, the run, the
                prompts' hidden states where wanted).
        """
        super().observe(result)
        if not result.started:
            return
        run = result.run
        self._new_counters()
        if run.stats is not None:
            run.stats.drafters = self.counters
        self._runs = []
        taken = False
        for i, d in enumerate(self.drafters):
            # each sub-drafter draws from generators of its own, derived per sequence; the
            # run's statistics stay the composite's (a nested composite records none there)
            own = None
            if run.generators is not None:
                own = [
                    torch.Generator().manual_seed((g.initial_seed() + 7919 * (i + 1)) % 2**63) for g in run.generators
                ]
            self._runs.append(
                dataclasses.replace(
                    run, generators=own, target_kv_cache=None if taken else run.target_kv_cache, stats=None
                )
            )
            self._observe_one(i, result)
            taken = taken or bool(getattr(d, "shares_target_cache", False))
        self._reset(result.batch_size)

    def _reset(self, batch: int) -> None:
        """A subclass's own per-batch state, reset at the start of a run (batch sequences)."""

    def _run_of(self, i: int, run: DraftRun) -> DraftRun:
        """Sub-drafter ``i``'s ``DraftRun`` (``run`` itself before the first run began)."""
        return self._runs[i] if i < len(self._runs) else run

    def _request(self, i: int, request: DraftRequest, num_draft_tokens: Sequence[int], active: Sequence[bool]):
        """Sub-drafter ``i``'s ``DraftRequest``: ``request`` with its own run, depths and
        active flags."""
        return dataclasses.replace(
            request, run=self._run_of(i, request.run), num_draft_tokens=num_draft_tokens, active=active
        )

    def _observe_one(
        self,
        i: int,
        result: StepResult,
        accepted_nodes: Optional[torch.Tensor] = None,
        num_accepted: Optional[torch.Tensor] = None,
        active: Optional[Sequence[bool]] = None,
    ) -> None:
        """Sub-drafter ``i`` observes ``result`` in its own terms (timed as its
        ``observe_time``): its own run, accepted path (``accepted_nodes`` (B, N') int64,
        ``num_accepted`` (B,) int64; None: the result's) and active flags (None: the
        result's), node counts, the target's argmax at its own nodes where it wants them
        (``_own_argmax``) and its columns of the hidden states where it wants them
        (``_own_features``).  In the engine's old order of effects: the argmax, the
        accepted path, the committed positions' hidden states, the last one."""
        d, name = self.drafters[i], self.names[i]
        changes = dict(run=self._run_of(i, result.run), target_argmax=None)
        changes["features"] = self._own_features(d, result.features)
        if not result.started:
            changes["accepted_nodes"] = result.accepted_nodes if accepted_nodes is None else accepted_nodes
            changes["num_accepted"] = result.num_accepted if num_accepted is None else num_accepted
            if result.num_nodes is not None:
                changes["num_nodes"] = self._own_num_nodes(i, result.num_nodes)
            if result.target_argmax is not None and getattr(d, "wants_target_argmax", False):
                changes["target_argmax"], changes["num_nodes"] = self._own_argmax(
                    i, result.target_argmax, result.num_nodes
                )
        if active is not None:
            changes["active"] = active
        own = dataclasses.replace(result, **changes)
        with self._timed(name, "observe_time"):
            d.observe(own)

    def _observe_all(self, result: StepResult) -> None:
        """Every sub-drafter observes the accepted path as it is (its nodes are the draft's)."""
        for i in range(len(self.drafters)):
            self._observe_one(i, result)
