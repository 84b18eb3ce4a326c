"""Multi-draft speculation: several drafters' chains and trees merged into one token tree
(``MergeDrafter``), and the node remapping between the merged tree and each draft.

Each step every sub-drafter (n-gram lookup, layer-skip, a draft model, Medusa heads, any
``Drafter``) proposes its own chain or tree below the same root; the drafts are merged per
sequence into one trie with ``specdec_kernels.tree.merge_trees`` (a prefix that several
drafters proposed is fed once), and the target model verifies the whole trie in one pass
(the tree verification of SpecInfer, Miao et al. 2024; the "multiple drafters, one tree"
idea of e.g. Lookahead decoding's n-gram pool merged with a draft model's chain).

Each sub-drafter then observes the accepted path *in its own node indices*: the merged
tree's accepted nodes are mapped back to the deepest node of the sub-drafter's draft that
lies on the accepted path (and its ancestors; ``map_to_merged`` / ``own_accepted_path``), so
a model drafter compacts its own KV cache exactly as if it had been verified alone (with
fewer accepted drafts when another drafter went further; the committed tokens it did not
propose are fed at its next ``propose``).

The merged draft carries no distribution (``Draft.probs`` is None, q one-hot): at
temperature > 0, recursive rejection sampling with one-hot q keeps the target distribution
exactly for any drafts chosen independently of the verification coins, whatever the
sub-drafters sampled from (a sampling sub-drafter's own q is dropped, which can lower its
acceptance; ``deterministic=True`` on model drafters drafts their top tokens instead).

Per-drafter statistics (``DecodeStats.drafters``) record which sources proposed the
accepted nodes.
"""

from __future__ import annotations

import numbers
from typing import List, Optional, Sequence, Tuple

import torch

from specdec_kernels.decoding.draft import Draft, Drafter, DraftRequest, StepResult
from specdec_kernels.decoding.drafters.composite import CompositeDrafter
from specdec_kernels.tree import merge_trees


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


class MergeDrafter(CompositeDrafter):
    """Merge several drafters' chains / trees into one token tree verified in one pass.

    Args:
        drafters: the sub-drafters, in priority order (earlier drafts keep their nodes when
            ``max_nodes`` cuts the merged tree).
        max_nodes: the most nodes (root included) of a merged tree; None for no limit (the
            engine still cuts at its ``max_draft_nodes``).
        max_depths, names: as ``CompositeDrafter``.

    Raises:
        ValueError: max_nodes < 1, and as ``CompositeDrafter``.
        TypeError: as ``CompositeDrafter``.

    Example::

        drafter = MergeDrafter([NgramDrafter(), LayerSkipDrafter(model, 24)], max_nodes=32)
        result = SpeculativeDecoder(model, drafter).generate([ids], 128, num_draft_tokens=4)
        print(result.stats.drafters)   # {'ngram': {...}, 'layerskip': {...}}
    """

    def __init__(
        self,
        drafters: Sequence[Drafter],
        *,
        max_nodes: Optional[int] = 64,
        max_depths: Optional[Sequence[Optional[int]]] = None,
        names: Optional[Sequence[str]] = None,
    ):
        super().__init__(drafters, max_depths=max_depths, names=names)
        if max_nodes is not None and (
            isinstance(max_nodes, bool) or not isinstance(max_nodes, numbers.Integral) or max_nodes < 1
        ):
            raise ValueError(f"max_nodes must be an int >= 1 or None, got {max_nodes!r}")
        self.max_nodes = max_nodes
        self._last = None

    def _reset(self, batch: int) -> None:
        """Forget the last step's merged trees (a new batch)."""
        self._last = None

    def _ask(self, request: DraftRequest) -> Tuple[List[Draft], List[List[bool]]]:
        """The sub-drafters' drafts, in order (K cut at each one's cap, each with its own
        run), and per sub-drafter the sequences it was asked to draft for: the active ones
        ``_still_waiting`` leaves."""
        drafts: List[Draft] = []
        asked: List[List[bool]] = []
        waiting = list(request.active)
        for i, name in enumerate(self.names):
            asked.append(list(waiting))
            own = self._request(i, request, self._capped(i, request.num_draft_tokens), asked[i])
            with self._timed(name, "propose_time"):
                drafts.append(self.drafters[i].propose(own))
            waiting = self._still_waiting(waiting, drafts[-1])
        return drafts, asked

    def _still_waiting(self, waiting: List[bool], draft: Draft) -> List[bool]:
        """The sequences the sub-drafters after the one that drafted ``draft`` are asked for:
        here all of ``waiting`` (every sub-drafter drafts for every active sequence)."""
        return waiting

    def propose(self, request: DraftRequest) -> Draft:
        """The sub-drafters' drafts (``_ask``) merged per sequence into one trie of at most
        ``max_nodes`` nodes (``merge_trees``).

        Args:
            request: the batch's histories, draft depths (each sub-drafter's cut at its cap)
                and active flags.

        Returns:
            A ``Draft`` (tokens, parents (B, N) int64 on the first draft's device; ``probs``
            None: q one-hot).
        """
        histories, active = request.histories, request.active
        B = len(histories)
        drafts, asked = self._ask(request)
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

    def observe(self, result: StepResult) -> None:
        """Begin a run (``result.started``, ``CompositeDrafter.observe``), or credit the
        sources of the accepted nodes; each sub-drafter then observes the accepted path in its
        own node indices (``own_accepted_path``), for the sequences it drafted for, and the
        target's argmax at its own nodes (``_own_argmax``) where it wants them.

        Args:
            result: the step's ``StepResult``: ``accepted_nodes`` (B, N) int64, the merged
                tree's accepted path (root first, then -1); ``num_accepted`` (B,) int64,
                accepted drafts (root not counted); ``active``, per sequence, whether it took
                part in the step.
        """
        super().observe(result)
        if result.started:
            return
        if self._last is None:
            self._observe_all(result)
            return
        try:
            self._observe_merged(result)
        finally:
            self._last = None

    def _observe_merged(self, result: StepResult) -> None:
        """``observe`` after a merged draft (``_last``)."""
        accepted_nodes, num_accepted, active = result.accepted_nodes, result.num_accepted, result.active
        proposed_active, per_seq, widths, asked = self._last
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
            # a sub-drafter observes only the sequences it was asked to draft for (fallback:
            # one that was not keeps its state, e.g. a model drafter's cache, as if the step
            # had not happened, and catches up on the committed tokens when next asked)
            seen = [bool(a) and bool(q) for a, q in zip(active, asked[i])]
            self._observe_one(i, result, own_nodes.to(accepted_nodes.device), own_count.to(num_accepted.device), seen)

    def _own_argmax(self, i: int, argmax: torch.Tensor, num_nodes: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The merged tree's argmax entries mapped back to sub-drafter ``i``'s nodes (-1 at a
        node cut from the merged tree)."""
        if self._last is None:
            return argmax, num_nodes
        per_seq, widths = self._last[1], self._last[2]
        own = torch.full((argmax.shape[0], max(widths[i], 1)), -1, dtype=argmax.dtype)  # -1: cut from the merged tree
        own_n = self._own_num_nodes(i, num_nodes)
        for b, (_, maps, _) in enumerate(per_seq):
            ids = maps[i]
            for j, m in enumerate(ids):
                if 0 <= m < int(num_nodes[b]):  # in the merged tree and not cut by the engine
                    own[b, j] = argmax[b, m]
        return own, own_n

    def _own_num_nodes(self, i: int, num_nodes: torch.Tensor) -> torch.Tensor:
        """The nodes (B,) int64 of sub-drafter ``i``'s own draft (the root alone where it was
        not asked), however many of them the merged tree kept."""
        if self._last is None:
            return num_nodes
        return torch.tensor([len(maps[i]) for _, maps, _ in self._last[1]], dtype=torch.int64)
