"""Several drafters as one: ``MultiDrafter`` builds the drafter that combines them.

Three combinations, one module each, on one base (``composite.CompositeDrafter``: the
sub-drafters, their statistics, each one's own view of the run and of every step's result):

=============  =============================================================================
``merge``      ``MergeDrafter``: every sub-drafter's chain or tree merged into one token tree
               (a trie), verified in one pass; each sub-drafter observes the accepted path in
               its own node indices (``map_to_merged`` / ``own_accepted_path``)
``fallback``   ``FallbackDrafter``: each sequence takes the draft of the first sub-drafter, in
               order, that drafts anything for it; later ones are not asked for it
``ensemble``   ``EnsembleDrafter``: the sub-drafters' distributions averaged (weights given or
               learnt per sequence), one chain drawn from the mixture
=============  =============================================================================

``MultiDrafter(drafters, ensemble=..., fallback=...)`` returns one of the three (the CLI's
``--drafter multi [--ensemble | --fallback]`` and the benchmarks build them so); every one
is an instance of ``MultiDrafter`` (``isinstance``), with ``.ensemble`` and ``.fallback``
telling which.  Per-drafter statistics go to ``DecodeStats.drafters``.
"""

from __future__ import annotations

import abc
from typing import Optional, Sequence

from specdec_kernels.decoding.draft import Drafter
from specdec_kernels.decoding.drafters.composite import DRAFTER_COUNTERS, CompositeDrafter
from specdec_kernels.decoding.drafters.ensemble import LOG_FLOOR, WEIGHT_SHARE, EnsembleDrafter
from specdec_kernels.decoding.drafters.fallback import FallbackDrafter
from specdec_kernels.decoding.drafters.merge import MergeDrafter, map_to_merged, own_accepted_path

__all__ = [
    "DRAFTER_COUNTERS",
    "LOG_FLOOR",
    "WEIGHT_SHARE",
    "CompositeDrafter",
    "EnsembleDrafter",
    "FallbackDrafter",
    "MergeDrafter",
    "MultiDrafter",
    "map_to_merged",
    "own_accepted_path",
]


class MultiDrafter(CompositeDrafter, metaclass=abc.ABCMeta):
    """Combine several drafters into one: merge their drafts into one token tree (default),
    take the first one's that drafts (``fallback``), or average their distributions
    (``ensemble``).  Constructing it returns a ``MergeDrafter``, ``FallbackDrafter`` or
    ``EnsembleDrafter``, each of which counts as a ``MultiDrafter`` (``isinstance``; they are
    registered as its virtual subclasses, the class itself is never instantiated).

    Args:
        drafters: the sub-drafters, in priority order (earlier drafts keep their nodes when
            ``max_nodes`` cuts the merged tree).
        max_nodes: merge / fallback: the most nodes (root included) of a draft; None for no
            limit (the engine still cuts at its ``max_draft_nodes``).  Ensemble: unused.
        max_depths: optional per-sub-drafter caps on K (None entries: no cap).
        names: statistics keys per sub-drafter (default: each drafter's ``name``, made unique
            with a suffix).
        ensemble: average the sub-drafters' distributions into one chain draft
            (``EnsembleDrafter``); every sub-drafter must hand over chain distributions.
        weights: ensemble only: the mixture weights (one per sub-drafter, >= 0, not all 0),
            the initial ones when learnt; None: equal.
        learn_weights: ensemble only: update the weights per sequence from the committed
            tokens (None: when ``weights`` is None).
        fallback: each sequence's draft is the first sub-drafter's, in order, that drafts at
            least one token for it (``FallbackDrafter``).

    Returns:
        The ``CompositeDrafter`` that combines them.

    Raises:
        ValueError: ensemble and fallback together, weights without ensemble, and as the
            drafter built (no drafters, max_nodes < 1, bad max_depths / names / weights,
            sub-drafters with different vocabularies).
        TypeError: ensemble or fallback not a bool, and as the drafter built (a sub-drafter
            that is not a ``Drafter``; ensemble: one without chain distributions).

    Example::

        drafter = MultiDrafter([NgramDrafter(), LayerSkipDrafter(model, 24)], max_nodes=32)
        result = SpeculativeDecoder(model, drafter).generate([ids], 128, num_draft_tokens=4)
        print(result.stats.drafters)   # {'ngram': {...}, 'layerskip': {...}}
    """

    def __new__(
        cls,
        drafters: Sequence[Drafter],
        *,
        max_nodes: Optional[int] = 64,
        max_depths: Optional[Sequence[Optional[int]]] = None,
        names: Optional[Sequence[str]] = None,
        ensemble: bool = False,
        weights: Optional[Sequence[float]] = None,
        learn_weights: Optional[bool] = None,
        fallback: bool = False,
    ) -> CompositeDrafter:
        for flag, value in (("ensemble", ensemble), ("fallback", fallback)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be True or False, got {value!r}")
        if ensemble and fallback:
            raise ValueError("ensemble and fallback exclude each other: one averages the drafters, one picks one")
        if ensemble:
            return EnsembleDrafter(
                drafters, max_depths=max_depths, names=names, weights=weights, learn_weights=learn_weights
            )
        if weights is not None:
            raise ValueError("weights apply to ensemble averaging only (ensemble=True)")
        kind = FallbackDrafter if fallback else MergeDrafter
        return kind(drafters, max_nodes=max_nodes, max_depths=max_depths, names=names)


for _kind in (MergeDrafter, FallbackDrafter, EnsembleDrafter):
    MultiDrafter.register(_kind)
