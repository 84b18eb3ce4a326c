"""Multi-draft speculation: several drafters' chains and trees merged into one token tree,
their distributions averaged into one draft (ensemble), or the first drafter's that drafts
(fallback).

Each step every sub-drafter (n-gram lookup, layer-skip, a draft model, Medusa heads, any
``Drafter``) proposes its own chain or tree below the same root; the drafts are merged per
sequence into one trie with ``specdec_kernels.tree.merge_trees`` (a prefix that several
drafters proposed is fed once), and the target model verifies the whole trie in one pass
(the tree verification of SpecInfer, Miao et al. 2024; the "multiple drafters, one tree"
idea of e.g. Lookahead decoding's n-gram pool merged with a draft model's chain).

Each sub-drafter then observes the accepted path *in its own node indices*: the merged
tree's accepted nodes are mapped back to the deepest node of the sub-drafter's draft that
lies on the accepted path (and its ancestors), so a model drafter compacts its own KV cache
exactly as if it had been verified alone (with fewer accepted drafts when another drafter
went further; the committed tokens it did not propose are fed at its next ``propose``).

The merged draft carries no distribution (``Draft.probs`` is None, q one-hot): at
temperature > 0, recursive rejection sampling with one-hot q keeps the target distribution
exactly for any drafts chosen independently of the verification coins, whatever the
sub-drafters sampled from (a sampling sub-drafter's own q is dropped, which can lower its
acceptance; ``deterministic=True`` on model drafters drafts their top tokens instead).

With ``fallback=True`` each sequence takes the draft of the first sub-drafter, in order,
that drafts anything for it, and later sub-drafters are not asked for that sequence: a
cheap, confident source (prompt lookup with a match of 2 tokens or more) goes first and a
model drafter fills the steps where it has nothing, and the target verifies only the draft
chosen (a merged tree verifies every drafter's nodes, which a CPU pays for per node).

Per-drafter statistics (``DecodeStats.drafters``) record which sources proposed the
accepted nodes.

Ensemble averaging (``ensemble=True``): instead of merging drafts, the sub-drafters' next-
token distributions q_i (``Drafter.chain_begin`` / ``chain_extend``: each drafter's own
distribution under the run's sampling settings, given the chain so far) are averaged,

    q(x) = sum_i w_i q_i(x) / sum_i w_i        (over the drafters with an opinion there),

and each draft token is drawn from that mixture (at temperature 0: its argmax), one depth
at a time, with each sequence's own generator.  The mixture q is handed to the verifier as
``Draft.probs``: it is exactly the distribution the token was drawn from, so rejection
sampling (``rejection_sample`` with ``max(0, p - q)`` residuals) keeps the target's
distribution.  With the engine's Gumbel coupling (the default when sampling) the token is
instead the mixture's Gumbel-max with the target's noise of that token index
(``coupling.py``) and no distribution is handed over.  The weights are given (``weights``) or learnt per sequence from what the
target committed (``learn_weights``): after each step w_i is multiplied by q_i(x) of every
committed token x whose position the chain reached (the accepted drafts and the token the
target chose at the first rejection; Bayes' rule for "which drafter's distribution is the
target's", the exponentially weighted average forecaster with log loss), then mixed with
the uniform weights in proportion ``WEIGHT_SHARE`` (fixed share, Herbster & Warmuth 1998)
so that a drafter that fell behind can come back.
"""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec_kernels.decoding.coupling import gumbel_top_k
from specdec_kernels.decoding.draft import Draft, Drafter, sample_tokens
from specdec_kernels.tree import merge_trees

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
WEIGHT_SHARE = 0.05  # ensemble weights: the uniform share mixed in after each update
LOG_FLOOR = 1e-6  # ensemble weights: q_i(x) below this counts as this (a zero would never recover)


def map_to_merged(
    merged_tokens: Sequence[int], merged_parents: Sequence[int], tokens: Sequence[int], parents: Sequence[int]
) -> List[int]:
    """Merged-tree index of every node of one draft (-1 where ``max_nodes`` cut it).

    The merged tree is a trie (siblings never share a token), so a draft node is the child
    of its parent's merged node that carries its token.

    Args:
        merged_tokens, merged_parents: the trie (``merge_trees``' output), root first.
        tokens, parents: one draft merged into it (root first).

    Returns:
        list of len(tokens) ints; entry 0 is 0 (the roots are identified).
    """
    child = {(p, t): i for i, (t, p) in enumerate(zip(merged_tokens, merged_parents)) if i > 0}
    out = [0] * len(tokens)
    for i in range(1, len(tokens)):
        parent = out[parents[i]]
        out[i] = -1 if parent < 0 else child.get((parent, int(tokens[i])), -1)
    return out


def own_accepted_path(merged_ids: Sequence[int], parents: Sequence[int], accepted: Sequence[int]) -> List[int]:
    """The accepted path in one draft's own node indices.

    Args:
        merged_ids: ``map_to_merged`` of the draft.
        parents: the draft's parent list.
        accepted: the merged tree's accepted path (root first, no padding).

    Returns:
        Node indices of the draft, root first: the path to its deepest node that lies on the
        accepted path (its ancestors lie on it too).  With duplicate siblings in the draft the
        first deepest such node is taken.
    """
    on_path = set(int(a) for a in accepted)
    depth = [0] * len(parents)
    best, best_depth = 0, 0
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
        if merged_ids[i] in on_path and depth[i] > best_depth:
            best, best_depth = i, depth[i]
    path = [best]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    return path[::-1]


class MultiDrafter(Drafter):
    """Merge several drafters' chains / trees into one token tree verified in one pass.

    Args:
        drafters: the sub-drafters, in priority order (earlier drafts keep their nodes when
            ``max_nodes`` cuts the merged tree).
        max_nodes: the most nodes (root included) of a merged tree; None for no limit (the
            engine still cuts at its ``max_draft_nodes``).
        max_depths: optional per-sub-drafter caps on K (None entries: no cap), e.g.
            ``(None, 3)`` to give a costly model drafter at most 3 draft tokens while the
            free n-gram lookup gets the full K.
        names: statistics keys per sub-drafter (default: each drafter's ``name``, made unique
            with a suffix).
        ensemble: average the sub-drafters' distributions into one chain draft instead of
            merging their drafts (see the module docstring); every sub-drafter must hand
            over chain distributions (``Drafter.has_chain_distributions``).
        weights: ensemble only: the mixture weights (one per sub-drafter, >= 0, not all 0),
            the initial ones when learnt; None: equal.
        learn_weights: ensemble only: update the weights per sequence from the committed
            tokens (None: when ``weights`` is None).
        fallback: instead of merging, each sequence's draft is the first sub-drafter's, in
            order, that drafts at least one token for it; a later sub-drafter is asked only
            for the sequences still without a draft (so it costs nothing where an earlier one
            drafted), e.g. prompt lookup with a long match first, else an EAGLE head.  One
            drafter's tree is verified, not the union.

    Raises:
        ValueError: no drafters, max_nodes < 1, a max_depths / names list of the wrong
            length or a negative cap, duplicate names, sub-drafters with different
            vocabularies, ensemble and fallback together.
        TypeError: a sub-drafter that is not a ``Drafter``, (ensemble) one without chain
            distributions, ensemble or fallback not a bool.

    Example::

        drafter = MultiDrafter([NgramDrafter(), LayerSkipDrafter(model, 24)], max_nodes=32)
        result = SpeculativeDecoder(model, drafter).generate([ids], 128, num_draft_tokens=4)
        print(result.stats.drafters)   # {'ngram': {...}, 'layerskip': {...}}
    """

    name = "multi"

    def __init__(
        self,
        drafters: Sequence[Drafter],
        *,
        max_nodes: Optional[int] = 64,
        max_depths: Optional[Sequence[Optional[int]]] = None,
        names: Optional[Sequence[str]] = None,
        ensemble: bool = False,
        weights: Optional[Sequence[float]] = None,
        learn_weights: Optional[bool] = None,
        fallback: bool = False,
    ):
        for flag, value in (("ensemble", ensemble), ("fallback", fallback)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be True or False, got {value!r}")
        if ensemble and fallback:
            raise ValueError("ensemble and fallback exclude each other: one averages the drafters, one picks one")
        drafters = list(drafters)
        if not drafters:
            raise ValueError("drafters must hold at least one Drafter")
        for i, d in enumerate(drafters):
            if not isinstance(d, Drafter):
                raise TypeError(f"drafters[{i}] must be a Drafter, got {type(d).__name__}")
        if max_nodes is not None and max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1 or None, got {max_nodes}")
        if max_depths is not None:
            max_depths = list(max_depths)
            if len(max_depths) != len(drafters):
                raise ValueError(f"max_depths must hold one cap per drafter ({len(drafters)}), got {len(max_depths)}")
            if any(c is not None and c < 0 for c in max_depths):
                raise ValueError(f"max_depths must be >= 0 or None, got {max_depths}")
        if names is None:
            names, seen = [], {}
            for d in drafters:
                base = getattr(d, "name", type(d).__name__)
                seen[base] = seen.get(base, 0) + 1
                names.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
        names = [str(n) for n in names]
        if len(names) != len(drafters) or len(set(names)) != len(names):
            raise ValueError(f"names must be one distinct name per drafter, got {names}")
        vocabs = {getattr(d, "vocab_size", None) for d in drafters} - {None}
        if len(vocabs) > 1:
            raise ValueError(f"the drafters' vocabularies differ: {sorted(vocabs)}")
        if ensemble:
            for i, d in enumerate(drafters):
                if not d.has_chain_distributions:
                    raise TypeError(
                        f"drafters[{i}] ({type(d).__name__}) hands over no chain distributions "
                        "(chain_begin / chain_extend), which ensemble averaging needs"
                    )
            if not vocabs:
                raise ValueError("ensemble averaging needs the vocabulary size: at least one drafter with vocab_size")
        if weights is not None:
            if not ensemble:
                raise ValueError("weights apply to ensemble averaging only (ensemble=True)")
            weights = [float(w) for w in weights]
            if (
                len(weights) != len(drafters)
                or any(not math.isfinite(w) or w < 0 for w in weights)
                or sum(weights) <= 0
            ):
                raise ValueError(
                    f"weights must be one finite weight >= 0 per drafter ({len(drafters)}), not all 0, got {weights}"
                )
        self.ensemble = bool(ensemble)
        self.fallback = bool(fallback)
        self.weights = weights
        self.learn_weights = (weights is None) if learn_weights is None else bool(learn_weights)
        self.drafters = drafters
        self.max_nodes = max_nodes
        self.max_depths = max_depths
        self.names = names
        self.vocab_size = vocabs.pop() if vocabs else None
        self.counters: Dict[str, Dict[str, float]] = {}
        self._last = None

    # ------------------------------------------------------------------ statistics
    def bind_stats(self, stats) -> None:
        """Record per-drafter counters into ``stats.drafters`` (the engine calls this in
        ``start`` with the run's ``DecodeStats``)."""
        stats.drafters = self.counters

    def _new_counters(self) -> None:
        # a new dict every run: an earlier run's statistics keep their own (bind_stats)
        self.counters = {n: {c: (0.0 if c.endswith("_time") else 0) for c in DRAFTER_COUNTERS} for n in self.names}

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

    def observe_context(self, hidden, first_positions, active) -> None:
        """Forward the committed positions' hidden states to the sub-drafters with a context
        window (each keeps as many as it needs, with the columns of its own ``feature_layers``)."""
        width = next((h.shape[-1] for h in hidden if h is not None), 0)
        for d, name in zip(self.drafters, self.names):
            if getattr(d, "wants_hidden", False) and getattr(d, "context_window", 0):
                t = time.perf_counter()
                cols = self._columns(d, width)
                mine = hidden if cols is None else [None if h is None else h[:, cols.to(h.device)] for h in hidden]
                d.observe_context(mine, first_positions, active)
                self.counters[name]["observe_time"] += time.perf_counter() - t

    def observe_hidden(self, hidden: torch.Tensor, active) -> None:
        """Forward the target's hidden state of each sequence's last accepted node (the same
        for every sub-drafter: it does not depend on who proposed the node), with the columns
        of its own ``feature_layers``."""
        for d, name in zip(self.drafters, self.names):
            if getattr(d, "wants_hidden", False):
                t = time.perf_counter()
                cols = self._columns(d, hidden.shape[-1])
                d.observe_hidden(hidden if cols is None else hidden[:, cols.to(hidden.device)], active)
                self.counters[name]["observe_time"] += time.perf_counter() - t

    @property
    def wants_target_argmax(self) -> bool:
        """True when a sub-drafter (e.g. ``LookaheadDrafter``) wants the target's argmax tokens."""
        return any(getattr(d, "wants_target_argmax", False) for d in self.drafters)

    def observe_target_argmax(self, argmax: torch.Tensor, num_nodes: torch.Tensor, active) -> None:
        """Hand each sub-drafter that wants them the target's argmax tokens at its own nodes
        (the merged tree's entries mapped back; the shared chain as it is, ensemble)."""
        for i, (d, name) in enumerate(zip(self.drafters, self.names)):
            if not getattr(d, "wants_target_argmax", False):
                continue
            own, own_n = argmax, num_nodes
            if not self.ensemble and self._last is not None:
                per_seq, widths = self._last[1], self._last[2]
                own = torch.full(
                    (argmax.shape[0], max(widths[i], 1)), -1, dtype=argmax.dtype
                )  # -1: cut from the merged tree
                own_n = torch.ones(argmax.shape[0], dtype=torch.int64)
                for b, (_, maps, _) in enumerate(per_seq):
                    ids = maps[i]
                    own_n[b] = len(ids)
                    for j, m in enumerate(ids):
                        if 0 <= m < int(num_nodes[b]):  # in the merged tree and not cut by the engine
                            own[b, j] = argmax[b, m]
            t = time.perf_counter()
            d.observe_target_argmax(own, own_n, active)
            self.counters[name]["observe_time"] += time.perf_counter() - t

    def set_cache_layout(self, layout) -> None:
        super().set_cache_layout(layout)
        for d in self.drafters:
            if hasattr(d, "set_cache_layout"):
                d.set_cache_layout(layout)

    def bind_target_cache(self, target, kv_cache) -> bool:
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
        return sum(int(getattr(d, "kv_cache_bytes", 0)) for d in self.drafters)

    # ------------------------------------------------------------------ interface
    def start(self, histories, capacity, sampling, generators) -> None:
        super().start(histories, capacity, sampling, generators)
        self._new_counters()
        self._last = None
        M = len(self.drafters)
        w = torch.tensor(self.weights if self.weights is not None else [1.0] * M, dtype=torch.float64)
        self.log_weights = (w / w.sum()).log().expand(len(histories), M).clone()  # (B, M), per sequence
        self._ensemble_last = None
        for i, (d, name) in enumerate(zip(self.drafters, self.names)):
            # each sub-drafter draws from generators of its own, derived per sequence
            own = [torch.Generator().manual_seed((g.initial_seed() + 7919 * (i + 1)) % 2**63) for g in generators]
            t = time.perf_counter()
            d.coupling = self.coupling
            d.start(histories, capacity, sampling, own)
            self.counters[name]["propose_time"] += time.perf_counter() - t

    def draft_sources(self, histories, active) -> Optional[List[int]]:
        """Fallback only: per sequence, the index of the sub-drafter that will draft for it at
        K >= 1: the first whose ``drafts_for(history)`` is true, else the last one (which is
        asked whatever the others do).  None where that cannot be known before drafting (a
        sub-drafter before the last without ``drafts_for``), or without ``fallback``."""
        if not self.fallback:
            return None
        last = len(self.drafters) - 1
        caps = self.max_depths or [None] * len(self.drafters)
        # the sub-drafters before the last; one capped at depth 0 never drafts
        predicates = [
            (lambda h: False) if c == 0 else getattr(d, "drafts_for", None) for d, c in zip(self.drafters[:last], caps)
        ]
        if None in predicates:
            return None
        return [
            next((i for i, p in enumerate(predicates) if p(h)), last) if a else last for h, a in zip(histories, active)
        ]

    def propose(self, histories, num_draft_tokens, active) -> Draft:
        if self.ensemble:
            return self._propose_ensemble(histories, num_draft_tokens, active)
        B = len(histories)
        drafts: List[Draft] = []
        asked = [list(active) for _ in self.drafters]  # per sub-drafter, the sequences it drafts for
        waiting = list(active)  # fallback: the sequences no sub-drafter has drafted for yet
        for i, (d, name) in enumerate(zip(self.drafters, self.names)):
            cap = self.max_depths[i] if self.max_depths is not None else None
            ks = [min(k, cap) if cap is not None else k for k in num_draft_tokens]
            if self.fallback:
                asked[i] = list(waiting)
            t = time.perf_counter()
            drafts.append(d.propose(histories, ks, asked[i]))
            self.counters[name]["propose_time"] += time.perf_counter() - t
            if self.fallback:
                counts = drafts[-1].num_nodes.tolist()
                waiting = [w and int(c) <= 1 for w, c in zip(waiting, counts)]

        trees, per_seq = [], []
        for b in range(B):
            root = histories[b][-1]
            own = []
            for i, draft in enumerate(drafts):
                n = int(draft.num_nodes[b]) if asked[i][b] else 1
                own.append((draft.tokens[b, :n].tolist(), draft.parents[b, :n].tolist()))
            merged = merge_trees(root, own, self.max_nodes)
            maps = [map_to_merged(merged.tokens, merged.parents, t, p) for t, p in own]
            trees.append((merged.tokens, merged.parents))
            per_seq.append((own, maps, merged.sources))
            if active[b]:
                for (t, _), m, name in zip(own, maps, self.names):
                    kept = sum(1 for x in m[1:] if x >= 0)
                    self.counters[name]["proposed"] += kept
                    self.counters[name]["steps"] += int(kept > 0)
        self._last = (list(active), per_seq, [d.tokens.shape[1] for d in drafts], asked)
        return Draft.from_lists(trees, device=drafts[0].tokens.device, is_chain=None)

    def observe(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, active) -> None:
        if self.ensemble:
            self._observe_ensemble(accepted_nodes, num_accepted, active)
            return
        if self._last is None:
            for d, name in zip(self.drafters, self.names):
                t = time.perf_counter()
                d.observe(accepted_nodes, num_accepted, active)
                self.counters[name]["observe_time"] += time.perf_counter() - t
            return
        proposed_active, per_seq, widths, asked = self._last
        self._last = None
        rows = accepted_nodes.tolist()
        counts = num_accepted.tolist()
        paths = [rows[b][: counts[b] + 1] for b in range(len(rows))]
        # which sources proposed the accepted nodes (every sequence that drafted this step,
        # including one that finished in it)
        for b, path in enumerate(paths):
            if not proposed_active[b]:
                continue
            sources = per_seq[b][2]
            for node in path[1:]:
                for s in sources[node]:
                    self.counters[self.names[s]]["accepted"] += 1
                if len(sources[node]) == 1:
                    self.counters[self.names[next(iter(sources[node]))]]["only_accepted"] += 1
        for i, (d, name) in enumerate(zip(self.drafters, self.names)):
            own_nodes = torch.full((len(paths), max(widths[i], 1)), -1, dtype=torch.int64)
            own_count = torch.zeros(len(paths), dtype=torch.int64)
            for b, path in enumerate(paths):
                own, maps, _ = per_seq[b]
                p = own_accepted_path(maps[i], own[i][1], path)
                own_nodes[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
                own_count[b] = len(p) - 1
            t = time.perf_counter()
            # a sub-drafter observes only the sequences it was asked to draft for (fallback:
            # one that was not keeps its state, e.g. a model drafter's cache, as if the step
            # had not happened, and catches up on the committed tokens when next asked)
            seen = [bool(a) and bool(q) for a, q in zip(active, asked[i])]
            d.observe(own_nodes.to(accepted_nodes.device), own_count.to(num_accepted.device), seen)
            self.counters[name]["observe_time"] += time.perf_counter() - t

    # ------------------------------------------------------------------ ensemble averaging
    def mixture_weights(self) -> torch.Tensor:
        """(B, M) float64: each sequence's current mixture weights (summing to 1)."""
        return self.log_weights.exp()

    def _learn(self, histories) -> None:
        """Update each sequence's weights from the tokens committed since the last draft."""
        last, self._ensemble_last = self._ensemble_last, None
        if last is None or not self.learn_weights:
            return
        lengths, member_q, member_has, depths = last
        M = len(self.drafters)
        for b, h in enumerate(histories):
            new = h[lengths[b] :]
            n = min(len(new), depths[b])
            if n == 0:
                continue
            x = torch.tensor(new[:n])
            q = member_q[:, b, torch.arange(n), x]  # (M, n): each drafter's probability of each committed token
            has = member_has[:, b, :n]
            gain = torch.where(has, q.double().clamp(min=LOG_FLOOR).log(), 0.0).sum(1)
            # a drafter without an opinion at a position is scored with the mixture there
            w_has = self.log_weights[b].exp()[:, None] * has
            mix = (q.double() * w_has).sum(0) / w_has.sum(0).clamp(min=1e-300)
            gain = gain + torch.where(~has, mix.clamp(min=LOG_FLOOR).log()[None].expand(M, n), 0.0).sum(1)
            lw = self.log_weights[b] + gain
            w = torch.softmax(lw, 0)
            w = (1 - WEIGHT_SHARE) * w + WEIGHT_SHARE / M
            self.log_weights[b] = w.log()

    def _propose_ensemble(self, histories, num_draft_tokens, active) -> Draft:
        """One chain per sequence drawn from the weighted mixture of the sub-drafters'
        distributions; ``Draft.probs`` holds the mixture at every depth (sampling)."""
        self._learn(histories)
        B, M, V = len(histories), len(self.drafters), int(self.vocab_size)
        ks = [int(k) if a else 0 for k, a in zip(num_draft_tokens, active)]
        D = max(ks) if ks else 0
        roots = [h[-1] for h in histories]
        if D == 0:
            return Draft.from_lists([([r], [-1]) for r in roots], is_chain=True)
        caps = [self.max_depths[i] if self.max_depths is not None else None for i in range(M)]
        member_ks = [[min(k, c) if c is not None else k for k in ks] for c in caps]
        greedy = self.sampling.greedy
        tokens = torch.zeros(B, D + 1, dtype=torch.int64)
        tokens[:, 0] = torch.tensor(roots)
        coupled = not greedy and self.coupling is not None  # Gumbel coupling: no q handed over
        probs = None if greedy or coupled else torch.zeros(B, D + 1, V)
        member_q = torch.zeros(M, B, D, V)
        member_has = torch.zeros(M, B, D, dtype=torch.bool)
        depth = [0] * B  # drafted depth per sequence
        w = self.log_weights.exp().float()  # (B, M)
        for d in range(1, D + 1):
            for i, (drafter, name) in enumerate(zip(self.drafters, self.names)):
                t = time.perf_counter()
                if d == 1:
                    q_i, has_i = drafter.chain_begin(histories, member_ks[i], active, V)
                else:
                    q_i, has_i = drafter.chain_extend(tokens[:, d - 1])
                self.counters[name]["propose_time"] += time.perf_counter() - t
                member_q[i, :, d - 1] = q_i.float()
                member_has[i, :, d - 1] = has_i & torch.tensor([k >= d for k in member_ks[i]])
            has = member_has[:, :, d - 1].T  # (B, M)
            wd = w * has
            total = wd.sum(1)
            go = [(ks[b] >= d) and (depth[b] == d - 1) and bool(total[b] > 0) for b in range(B)]
            q = torch.einsum("bm,mbv->bv", wd / total.clamp(min=1e-30)[:, None], member_q[:, :, d - 1])
            for b in range(B):
                if not go[b]:
                    continue
                if greedy:
                    tokens[b, d] = int(q[b].argmax())
                elif coupled:  # the mixture's Gumbel-max with the target's noise of this index
                    noise = self.coupling.noise(b, len(histories[b]) + d - 1)
                    tokens[b, d] = int(gumbel_top_k(q[b].clamp(min=0).log(), noise, 1)[1][0])
                else:
                    tokens[b, d] = int(sample_tokens(q[b], 1, self.generators[b])[0])
                    probs[b, d - 1] = q[b]
                depth[b] = d
            if d == 1:
                for i, name in enumerate(self.names):
                    for b in range(B):
                        if go[b]:
                            self.counters[name]["weight"] += float(w[b, i])
                            self.counters[name]["steps"] += int(has[b, i])
            if not any(depth[b] == d for b in range(B)):
                break
        for i, name in enumerate(self.names):
            self.counters[name]["proposed"] += int(sum(int(member_has[i, b, : depth[b]].sum()) for b in range(B)))
        self._ensemble_last = ([len(h) for h in histories], member_q, member_has, depth)
        num_nodes = torch.tensor([1 + x for x in depth], dtype=torch.int64)
        parents = torch.arange(-1, D, dtype=torch.int64).expand(B, D + 1).clone()
        return Draft(tokens, parents, num_nodes, probs, is_chain=True)

    def _observe_ensemble(self, accepted_nodes, num_accepted, active) -> None:
        """Every sub-drafter observes the shared chain; counters credit the drafters that had
        an opinion at each accepted depth."""
        last = self._ensemble_last
        if last is not None:
            member_has = last[2]
            for b, m in enumerate(num_accepted.tolist()):
                for i, name in enumerate(self.names):
                    self.counters[name]["accepted"] += int(member_has[i, b, :m].sum())
        for d, name in zip(self.drafters, self.names):
            t = time.perf_counter()
            d.observe(accepted_nodes, num_accepted, active)
            self.counters[name]["observe_time"] += time.perf_counter() - t
