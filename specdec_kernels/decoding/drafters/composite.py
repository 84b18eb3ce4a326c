"""The base of the drafters made of several drafters (``MergeDrafter``, ``FallbackDrafter``,
``EnsembleDrafter``; ``MultiDrafter`` builds one of them): it holds and checks the
sub-drafters, keeps their per-drafter statistics and forwards every engine hook to them.

What the three share, and what this module does for them:

- the sub-drafters, their statistics names and optional per-drafter caps on K;
- ``start``: each sub-drafter starts with generators of its own, derived per sequence;
- the hidden-state hooks (``observe_context`` / ``observe_hidden``): each sub-drafter that
  wants hidden states gets the columns of its own ``feature_layers`` (EAGLE-3's multi-layer
  features, Li et al. 2025) out of the union the engine hands over;
- ``observe_target_argmax`` (lookahead decoding's Jacobi iterations): each sub-drafter that
  wants them gets the target's argmax tokens at its own nodes (``_own_argmax``, which a
  drafter that renumbers nodes overrides);
- the cache hooks (``set_cache_layout``, ``bind_target_cache``: the target's KV cache goes to
  the first sub-drafter that can share it) and the cost counters (``model_tokens``,
  ``kv_cache_bytes``).

A subclass implements ``propose`` and ``observe``.
"""

from __future__ import annotations

import numbers
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from specdec_kernels.decoding.draft import Drafter, SamplingParams

if TYPE_CHECKING:
    from specdec_kernels.decoding.engine.stats import DecodeStats
    from specdec_kernels.decoding.model import Transformer
    from specdec_kernels.decoding.paged import CacheLayout

#: counters kept per sub-drafter in ``DecodeStats.drafters[name]``
DRAFTER_COUNTERS = (
    "steps",  # sequence steps in which the drafter proposed at least one draft token
    "proposed",  # its draft tokens that made it into the merged tree (shared ones counted)
    "accepted",  # accepted nodes of the merged tree that it had proposed
    "only_accepted",  # accepted nodes that it alone had proposed
    "propose_time",  # seconds in its propose
    "observe_time",  # seconds in its observe
    "weight",  # ensemble only: the sum over sequence steps of its mixture weight at depth 1
)


class CompositeDrafter(Drafter):
    """A drafter made of sub-drafters: their checks, statistics and hook forwarding.

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

    # ------------------------------------------------------------------ statistics
    def bind_stats(self, stats: DecodeStats) -> None:
        """Record per-drafter counters into ``stats.drafters`` (the engine calls this in
        ``start`` with the run's ``DecodeStats``)."""
        stats.drafters = self.counters

    def _new_counters(self) -> None:
        # a new dict every run: an earlier run's statistics keep their own (bind_stats)
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

    def observe_context(
        self, hidden: Sequence[Optional[torch.Tensor]], first_positions: Sequence[int], active: Sequence[bool]
    ) -> None:
        """Forward the committed positions' hidden states to the sub-drafters with a context
        window (each keeps as many as it needs, with the columns of its own ``feature_layers``)."""
        width = next((h.shape[-1] for h in hidden if h is not None), 0)
        for d, name in zip(self.drafters, self.names):
            if getattr(d, "wants_hidden", False) and getattr(d, "context_window", 0):
                with self._timed(name, "observe_time"):
                    cols = self._columns(d, width)
                    mine = hidden if cols is None else [None if h is None else h[:, cols.to(h.device)] for h in hidden]
                    d.observe_context(mine, first_positions, active)

    def observe_hidden(self, hidden: torch.Tensor, active: Sequence[bool]) -> None:
        """Forward the target's hidden state of each sequence's last accepted node (the same
        for every sub-drafter: it does not depend on who proposed the node), with the columns
        of its own ``feature_layers``."""
        for d, name in zip(self.drafters, self.names):
            if getattr(d, "wants_hidden", False):
                with self._timed(name, "observe_time"):
                    cols = self._columns(d, hidden.shape[-1])
                    d.observe_hidden(hidden if cols is None else hidden[:, cols.to(hidden.device)], active)

    @property
    def wants_target_argmax(self) -> bool:
        """True when a sub-drafter (e.g. ``LookaheadDrafter``) wants the target's argmax tokens."""
        return any(getattr(d, "wants_target_argmax", False) for d in self.drafters)

    def observe_target_argmax(self, argmax: torch.Tensor, num_nodes: torch.Tensor, active: Sequence[bool]) -> None:
        """Hand each sub-drafter that wants them the target's argmax tokens (B, N) int64 at its
        own nodes (``_own_argmax``)."""
        for i, (d, name) in enumerate(zip(self.drafters, self.names)):
            if not getattr(d, "wants_target_argmax", False):
                continue
            own, own_n = self._own_argmax(i, argmax, num_nodes)
            with self._timed(name, "observe_time"):
                d.observe_target_argmax(own, own_n, active)

    def _own_argmax(self, i: int, argmax: torch.Tensor, num_nodes: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The target's argmax tokens and node counts in sub-drafter ``i``'s node indices: as
        they are, where the draft verified is the sub-drafter's own (a shared chain)."""
        return argmax, num_nodes

    # ------------------------------------------------------------------ caches
    def set_cache_layout(self, layout: CacheLayout) -> None:
        """Hand the engine's ``paged.CacheLayout`` to every sub-drafter that takes one."""
        super().set_cache_layout(layout)
        for d in self.drafters:
            if hasattr(d, "set_cache_layout"):
                d.set_cache_layout(layout)

    def bind_target_cache(self, target: Transformer, kv_cache: object) -> bool:
        """The target's KV cache goes to the first sub-drafter that can share it
        (``ModelDrafter.bind_target_cache``); the others keep caches of their own, so no two
        drafters write draft nodes into the same slots.  Returns whether one shares."""
        shared = False
        for d in self.drafters:
            if hasattr(d, "bind_target_cache"):
                shared = bool(d.bind_target_cache(target, None if shared else kv_cache)) or shared
        return shared

    @property
    def model_tokens(self) -> int:
        """Tokens fed through the sub-drafters' models (see ``DecodeStats.draft_model_tokens``)."""
        return sum(int(getattr(d, "model_tokens", 0)) for d in self.drafters)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the sub-drafters' own KV caches."""
        return sum(int(getattr(d, "kv_cache_bytes", 0)) for d in self.drafters)

    # ------------------------------------------------------------------ interface
    def start(
        self,
        histories: Sequence[Sequence[int]],
        capacity: int,
        sampling: SamplingParams,
        generators: Sequence[torch.Generator],
    ) -> None:
        """Fresh counters; every sub-drafter starts, drawing from generators of its own,
        derived per sequence from ``generators``."""
        super().start(histories, capacity, sampling, generators)
        self._new_counters()
        for i, (d, name) in enumerate(zip(self.drafters, self.names)):
            # each sub-drafter draws from generators of its own, derived per sequence
            own = [torch.Generator().manual_seed((g.initial_seed() + 7919 * (i + 1)) % 2**63) for g in generators]
            with self._timed(name, "propose_time"):
                d.coupling = self.coupling
                d.start(histories, capacity, sampling, own)
        self._reset(len(histories))

    def _reset(self, batch: int) -> None:
        """A subclass's own per-batch state, reset at the end of ``start`` (batch sequences)."""

    def _observe_all(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, active: Sequence[bool]) -> None:
        """Every sub-drafter observes the accepted path as it is (its nodes are the draft's)."""
        for d, name in zip(self.drafters, self.names):
            with self._timed(name, "observe_time"):
                d.observe(accepted_nodes, num_accepted, active)
