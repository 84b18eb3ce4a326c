"""Drafting with a model: a separate small draft model, or the target's own first layers.

``ModelDrafter`` runs a ``Transformer`` (optionally only its first layers, then its final
norm and head) over its own KV cache, in the position convention of ``model.py``.  Its cache
holds the committed tokens it has seen; at each ``propose`` it first feeds the committed
tokens it has not seen yet (the prompt on the first step, then the bonus token and any
accepted drafts it did not feed) as a chain ending at the root, then drafts:

* a chain: one token per pass, each fed at the next slot;
* a tree of static shape ``tree_widths`` (children per node at each depth, 1 past the
  list's end): each pass re-feeds the tree built so far, below the root, with its ancestor
  mask, and expands the deepest level.

At temperature 0 (or with ``deterministic=True``) the children are the argmax / top-w tokens
(distinct) and no distribution is handed over.  With the engine's Gumbel coupling (the
default when sampling) they are the Gumbel-top-w of the log of ``sampling_probs`` of the
drafter's logits with the target's own noise of that token index (``coupling.py``), and no
distribution is handed over either; otherwise (``coupling="rejection"``) they are sampled
i.i.d. from that distribution with each sequence's own generator, and the distribution is
returned as ``Draft.probs``.

``observe`` compacts the drafter's cache to the accepted path (``compact_kv_cache``), so
the accepted drafts it had fed need not be fed again.

When the layers it runs are the target's own first layers (``LayerSkipDrafter``, or a draft
model made by ``Transformer.truncated``), it takes the target's KV cache the run offers
(``DraftRun.target`` and ``DraftRun.target_kv_cache``, read when ``observe`` sees the run
start; ``shares_target_cache`` then says so): those layers' keys and values of every
committed token are already there (the same layers over the same tokens), so it keeps no
cache of its own, never feeds the prompt, and feeds only the root at each step.  Its draft nodes go to the slots past
the committed tokens, which the target's verification pass overwrites before it reads them:
the output does not change.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from specdec_kernels import compact_kv_cache, sampling_probs
from specdec_kernels.decoding.coupling import gumbel_top_k
from specdec_kernels.decoding.draft import (
    Draft,
    Drafter,
    DraftRequest,
    StepResult,
    draft_distribution,
    sample_tokens,
)
from specdec_kernels.decoding.model import Transformer
from specdec_kernels.decoding.paged import PagedKVCache, length_groups
from specdec_kernels.tree import ancestor_mask


def tree_shape(widths: Sequence[int], depth: int, max_nodes: int):
    """Parent list and depths of the static tree: widths[d] children per node at depth d
    (1 past the list), ``depth`` levels below the root, nodes breadth-first, cut at max_nodes."""
    parents, depths, level = [-1], [0], [0]
    for d in range(depth):
        w = widths[d] if d < len(widths) else 1
        nxt = []
        for node in level:
            for _ in range(w):
                if len(parents) >= max_nodes:
                    return parents, depths
                nxt.append(len(parents))
                parents.append(node)
                depths.append(d + 1)
        level = nxt
    return parents, depths


class ModelDrafter(Drafter):
    """Draft with a causal LM that shares the target's tokenizer.

    Args:
        model: the draft model (our ``Transformer``).
        num_layers: run only its first layers (layer-skip self-drafting); None runs all.
        tree_widths: None drafts a chain; else the static tree's children per node by depth,
            e.g. (2, 2) (4 leaves at depth 2, chains below).
        max_nodes: the most tree nodes, root included.
        deterministic: draft the top tokens even when sampling (the verifier then treats q as
            one-hot); by default a sampling run samples the drafts.
        share_target_cache: True (default): when the layers it runs are the target's own
            (``DraftRun.target`` / ``target_kv_cache``), read and write the target's KV cache
            instead of a cache of its own; False always keeps its own (and feeds the prompt
            through its layers).

    Attributes:
        shares_target_cache: True after the start of a run in which it took the target's KV
            cache (a composite drafter then offers that cache to no other sub-drafter); False
            before the first run and when it keeps a cache of its own.

    Raises:
        ValueError: num_layers outside 1..model layers, a width < 1, max_nodes < 2.
    """

    name = "draft-model"
    shares_target_cache = False

    def __init__(
        self,
        model: Transformer,
        *,
        num_layers: Optional[int] = None,
        tree_widths: Optional[Sequence[int]] = None,
        max_nodes: int = 64,
        deterministic: bool = False,
        share_target_cache: bool = True,
    ):
        L = model.args.num_layers
        if num_layers is not None and not 1 <= num_layers <= L:
            raise ValueError(f"num_layers must lie in 1..{L}, got {num_layers}")
        if tree_widths is not None and (len(tree_widths) == 0 or min(tree_widths) < 1):
            raise ValueError(f"tree_widths must be positive ints, got {tree_widths}")
        if max_nodes < 2:
            raise ValueError(f"max_nodes must be >= 2, got {max_nodes}")
        self.model = model
        self.num_layers = num_layers if num_layers is not None else L
        self.tree_widths = tuple(tree_widths) if tree_widths is not None else None
        self.max_nodes = max_nodes
        self.deterministic = deterministic
        self.share_target_cache = bool(share_target_cache)

    def _can_share(self, target, kv_cache) -> bool:
        """Whether the drafter may read and write the target's KV cache ``kv_cache`` (dense
        tensor or ``paged.PagedKVCache``; None for either: no): the drafter's model and
        ``target`` are ``Transformer``s, the drafter's embeddings and the layers it runs are
        the very modules of ``target``'s first layers (same weights, dtype and device), and
        ``share_target_cache`` is set (module docstring)."""
        m = self.model
        return bool(
            self.share_target_cache
            and isinstance(m, Transformer)  # our model: a transformers adapter keeps its own
            and isinstance(target, Transformer)
            and kv_cache is not None
            and m.tok_embeddings is target.tok_embeddings
            and len(target.layers) >= self.num_layers
            and all(a is b for a, b in zip(m.layers[: self.num_layers], target.layers))
            and m.dtype == target.dtype
            and m.device == target.device
            and m.args.num_kv_heads == target.args.num_kv_heads
            and m.args.head_dim == target.args.head_dim
        )

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    def _start(self, result: StepResult) -> None:
        """A new run (``result.started``): the target's cache where the run offers it and the
        drafter can share it, else a cache of its own laid out as ``run.cache_layout``."""
        run, histories = result.run, result.histories
        capacity, layout = run.capacity, run.cache_layout
        # a drafter object shares with at most one engine run at a time: the next run rebinds it
        self.shares_target_cache = self._can_share(run.target, run.target_kv_cache)
        if self.shares_target_cache:  # the target's cache holds every committed token but the root
            self.cache = run.target_kv_cache
            self._prefill_pending = False
        elif layout is not None and layout.paged:
            # the drafter's cache holds each prompt but its last token (the root) before drafting
            self.cache = PagedKVCache.allocate(
                self.model, [list(h[:-1]) for h in histories], capacity, layout, self.num_layers
            )
            self._prefill_pending = True
        else:
            self.cache = self.model.new_kv_cache(len(histories), capacity, self.num_layers)
            self._prefill_pending = False
        self.model_tokens = 0  # positions fed through the draft model (padding included)
        self.seqlens = [0] * len(histories)  # committed tokens in the drafter's cache
        self.capacity = capacity
        self._root_slot: Optional[List[int]] = None
        self._fed_depth = 0

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the drafter's own KV cache (0 before the first run and when it shares the
        target's)."""
        cache = getattr(self, "cache", None)
        if cache is None or self.shares_target_cache:
            return 0
        return cache.nbytes if isinstance(cache, PagedKVCache) else cache.numel() * cache.element_size()

    # ------------------------------------------------------------------ helpers
    def _forward(self, tokens, positions, seqlens, mask=None, rows=None, cache=None):
        device = self.model.device
        as_t = lambda x: torch.as_tensor(x, dtype=torch.int64).to(device)  # noqa: E731
        tokens = as_t(tokens)
        self.model_tokens += tokens.numel()
        return self.model(
            tokens,
            as_t(positions),
            self.cache if cache is None else cache,
            as_t(seqlens).to(torch.int32),
            mask,
            num_layers=self.num_layers,
            logit_rows=None if rows is None else as_t(rows),
        )

    def _children(self, logits: torch.Tensor, width: int, active, index: Sequence[int]):
        """Children of R nodes per sequence: logits (B, R, V) -> tokens (B, R, width) and the
        distribution they were drawn from (B, R, V), or None when greedy or drawn with the
        Gumbel coupling (the Gumbel-top-``width`` of ``log q`` with the noise of token index
        ``index[b]``, which the target's own sample uses: ``coupling.py``)."""
        sp = self.sampling
        if sp.greedy or self.deterministic:
            return logits.topk(width, dim=-1).indices.cpu(), None
        B, R, V = logits.shape
        q = sampling_probs(logits, sp.temperature, sp.top_k, sp.top_p)
        if self.coupling is not None:
            picks = torch.zeros(B, R, width, dtype=torch.int64)
            logq = q.float().log().cpu()
            for b in range(B):
                if active[b]:
                    picks[b] = gumbel_top_k(logq[b], self.coupling.noise(b, index[b]), width)[1]
            return picks, None
        picks = torch.zeros(B, R, width, dtype=torch.int64)
        q_cpu = q.cpu()
        for b in range(B):
            if active[b]:
                picks[b] = sample_tokens(q_cpu[b], width, self.generators[b])
        return picks, q

    def _feed_pending(self, histories, active) -> torch.Tensor:
        """Feed the committed tokens the drafter has not seen, ending at each root (a
        paged cache's prompts first); sets ``_root_slot`` (the root's slot = position) and
        returns the logits at the root, (B, 1, V)."""
        if self._prefill_pending:
            self._prefill_paged(histories)
        B = len(histories)
        if self.shares_target_cache:  # the target's cache: every committed token but the root is in it
            self.seqlens = [len(h) - 1 for h in histories]
        pending = [list(h[self.seqlens[b] :] if active[b] else h[-1:]) for b, h in enumerate(histories)]
        P = max(len(p) for p in pending)
        block = [p + [0] * (P - len(p)) for p in pending]
        positions = [[self.seqlens[b] + j for j in range(P)] for b in range(B)]
        logits = self._forward(block, positions, self.seqlens, None, [[len(p) - 1] for p in pending])
        self._root_slot = [self.seqlens[b] + len(pending[b]) - 1 for b in range(B)]
        return logits

    def _feed_level(self, tokens: torch.Tensor, level: List[int], anc: torch.Tensor, depths, root_slot):
        """Feed the tree's nodes up to the ``level`` (its nodes, ascending ids) to expand next, node i
        at slot root_slot + i (``anc``: the tree's ancestor mask, ``depths`` its nodes' depths);
        returns the logits at the level's nodes (B, len(level), V)."""
        B = tokens.shape[0]
        # feed from the first node that is not an ancestor of every node of the level
        # (those before it are in the cache already and visible as prefix)
        first = 1
        while first < level[0] and bool(anc[level][:, first].all()):
            first += 1
        end = level[-1] + 1
        mask = anc[first:end, first:end].to(self.model.device)
        pos = [[root_slot[b] + depths[i] for i in range(first, end)] for b in range(B)]
        rows = [[i - first for i in level]] * B
        return self._forward(tokens[:, first:end], pos, [s + first for s in root_slot], mask, rows)

    # ------------------------------------------------------------------ interface
    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Draft:
        """A chain, or the static tree of ``tree_widths``, below each root
        (``Drafter.propose``): the committed tokens the drafter has not seen are fed first,
        then one pass per depth.

        Args:
            request: the histories, per-sequence depths (the tree is cut at each one's depth)
                and active flags (an inactive sequence gets the root alone).

        Returns:
            A ``Draft``: tokens and parents (B, N) int64 on the host, ``probs`` (B, N, V)
            float32 when sampling without coupling (else None).
        """
        histories, num_draft_tokens, active = request.histories, request.num_draft_tokens, request.active
        B = len(histories)
        depth = max(k for k, a in zip(num_draft_tokens, active) if a) if any(active) else 0
        if depth == 0:
            self._root_slot = None
            return Draft.from_lists([([h[-1]], [-1]) for h in histories])

        # 1) feed the committed tokens the drafter has not seen, ending at the root
        logits = self._feed_pending(histories, active)
        root_slot = self._root_slot

        room = self.capacity - max(root_slot)
        parents, depths = tree_shape(self.tree_widths or (), depth, min(self.max_nodes, room))
        N = len(parents)
        anc = ancestor_mask(parents)
        tokens = torch.zeros(B, N, dtype=torch.int64)
        tokens[:, 0] = torch.tensor([h[-1] for h in histories])
        probs = None
        if not (self.sampling.greedy or self.deterministic or self.coupling is not None):
            probs = torch.zeros(B, N, self.model.args.vocab_size, dtype=torch.float32)

        # 2) expand level by level; node i's K/V go to slot root_slot + i
        level = [0]
        for d in range(1, max(depths) + 1):
            children = [i for i in range(N) if depths[i] == d]
            if d > 1:
                logits = self._feed_level(tokens, level, anc, depths, root_slot)
            width = max(sum(1 for c in children if parents[c] == level[0]), 1)
            # a sequence draws only for the depths it asked for: its randomness never depends
            # on the rest of the batch
            wanted = [a and k >= d for a, k in zip(active, num_draft_tokens)]
            # children at depth d predict token index len(history) + d - 1
            index = [len(h) + d - 1 for h in histories]
            picks, q = self._children(logits, width, wanted, index)  # (B, len(level), width)
            for r, node in enumerate(level):
                kids = [c for c in children if parents[c] == node]
                tokens[:, kids] = picks[:, r, : len(kids)]
                if q is not None:
                    probs[:, node] = q[:, r].cpu()
            level = children
        self._fed_depth = max(max(depths) - 1, 0)
        self._is_chain = max(depths) == N - 1

        max_depth = torch.tensor(depths)
        num_nodes = [int((max_depth <= k).sum()) if a else 1 for k, a in zip(num_draft_tokens, active)]
        parents_t = torch.tensor(parents, dtype=torch.int64).expand(B, N).clone()
        return Draft(tokens, parents_t, torch.tensor(num_nodes), probs, is_chain=self._is_chain)

    # ------------------------------------------------------------------ chain distributions
    @torch.inference_mode()
    def chain_begin(self, request: DraftRequest, vocab_size: int):
        """The draft model's distribution of the first draft token (``Drafter.chain_begin``):
        the committed tokens it has not seen are fed, ending at the root.  Returns probs
        (B, V) float32 on the host and has (B,) bool."""
        histories, num_draft_tokens, active = request.histories, request.num_draft_tokens, request.active
        logits = self._feed_pending(histories, active)
        self._fed_depth, self._is_chain = 0, True
        self._chain_ks = [int(k) if a else 0 for k, a in zip(num_draft_tokens, active)]
        has = torch.tensor([k >= 1 for k in self._chain_ks])
        return draft_distribution(logits[:, 0], self.sampling).cpu(), has

    @torch.inference_mode()
    def chain_extend(self, tokens):
        """Feed the chain's token at the next depth d and return the distribution of depth
        d + 1 (``Drafter.chain_extend``); nothing past the cache's capacity."""
        d = self._fed_depth + 1
        B = len(self._root_slot)
        has = torch.tensor([k >= d + 1 for k in self._chain_ks])
        if max(self._root_slot) + d >= self.capacity:
            return torch.zeros(B, self.vocab_size), torch.zeros(B, dtype=torch.bool)
        pos = [[r + d] for r in self._root_slot]
        logits = self._forward(tokens.reshape(B, 1).tolist(), pos, [r + d for r in self._root_slot], None, [[0]] * B)
        self._fed_depth = d
        return draft_distribution(logits[:, 0], self.sampling).cpu(), has

    def _prefill_paged(self, histories) -> None:
        """A paged cache, before the first draft: every prompt but its root goes through the
        draft model in groups of similar length (little padding); with prefix sharing the
        leaders first, then (after the copy-on-write of partly shared blocks) the followers
        from the end of the prefix they share (``paged.py``)."""
        cache = self.cache
        B = len(histories)
        starts = cache.prefill_starts()
        todo = [len(histories[b]) - 1 - starts[b] for b in range(B)]
        phases = length_groups(cache.leaders, todo)
        if cache.followers:  # None: the copy-on-write, once the leaders are in the cache
            phases += [None] + length_groups(cache.followers, todo)
        for rows in phases:
            if rows is None:
                cache.copy_shared_tails()
                continue
            P = max(todo[b] for b in rows)
            block = [list(histories[b][starts[b] : len(histories[b]) - 1]) + [0] * (P - todo[b]) for b in rows]
            positions = [[starts[b] + j for j in range(P)] for b in rows]
            self._forward(block, positions, [starts[b] for b in rows], None, [[]] * len(rows), cache=cache.rows(rows))
        for b in range(B):
            self.seqlens[b] = len(histories[b]) - 1
        self._prefill_pending = False

    @torch.inference_mode()
    def observe(self, result: StepResult) -> None:
        """A new run (``result.started``: its cache, see ``_start``), or the step's accepted
        path: the drafter's cache is compacted to it (``compact_kv_cache``; a tree's accepted
        drafts whose K/V it wrote), so they need not be fed again.

        Args:
            result: the step's ``StepResult``; reads ``accepted_nodes`` (B, N) int64,
                ``num_accepted`` (B,) int64 and ``active``.
        """
        super().observe(result)
        if result.started:
            self._start(result)
            return
        accepted_nodes, num_accepted, active = result.accepted_nodes, result.num_accepted, result.active
        if self._root_slot is None:
            return
        if self.shares_target_cache:  # the target compacted its cache; the next propose reads its lengths
            self._root_slot = None
            return
        fed = num_accepted.clamp(max=self._fed_depth)  # accepted drafts whose K/V the drafter wrote
        count = torch.where(torch.tensor(list(active), dtype=torch.bool), fed + 1, 0)
        root = torch.tensor(self._root_slot, dtype=torch.int64)
        if not self._is_chain and bool(count.gt(1).any()):
            if isinstance(self.cache, PagedKVCache):
                device = self.cache.pool.device
                self.cache.compact(root.to(device).to(torch.int32), accepted_nodes.to(device), count.to(device))
            else:
                compact_kv_cache(
                    self.cache,
                    root.to(self.cache.device),
                    accepted_nodes.to(self.cache.device),
                    count.to(self.cache.device),
                )
        for b, a in enumerate(active):
            if a:
                self.seqlens[b] = self._root_slot[b] + 1 + int(fed[b])
        self._root_slot = None


class LayerSkipDrafter(ModelDrafter):
    """Self-speculative drafting: the target's first ``num_layers`` layers, then its own final
    norm and head (as in LayerSkip, Elhoushi et al. 2024, and Draft & Verify, Zhang et al.
    2024).  Run by the engine of ``target``, it reads and writes the target's own KV cache
    (module docstring); ``share_target_cache=False`` gives it one of its own."""

    name = "layerskip"

    def __init__(
        self,
        target: Transformer,
        num_layers: int,
        *,
        tree_widths=None,
        max_nodes: int = 64,
        deterministic: bool = False,
        share_target_cache: bool = True,
    ):
        super().__init__(
            target,
            num_layers=num_layers,
            tree_widths=tree_widths,
            max_nodes=max_nodes,
            deterministic=deterministic,
            share_target_cache=share_target_cache,
        )


class DraftModelDrafter(ModelDrafter):
    """A separate small causal LM with the target's tokenizer (Leviathan et al. 2023)."""

    name = "draft-model"
