"""The EAGLE drafter (``EagleDrafter``): an EAGLE-style draft head with EAGLE-2's dynamic
token tree.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty") drafts autoregressively at the feature level with a one-layer head that reads
the target's final hidden state (EAGLE-3, Li et al. 2025: and other layers' outputs, fused).
The head lives in three modules, re-exported here: ``eagle_head`` (``EagleHead``, the
``nn.Module``, its equations and EAGLE-3's feature fusion), ``eagle_format`` (its file
format: ``EagleHead.save`` / ``load_eagle_head``, ``SHIPPED``) and ``eagle_quant`` (its Q8_0
copy, ``EagleHead.quantized``).  This module runs it: the draft steps, the tree, the draft
vocabulary.

EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees") shapes the tree by the head's confidence: the path probability of a node is the
product of the head's probabilities along its path; each round expands the ``top_k`` nodes
of the newest depth with the highest path probability (each gets its ``top_k`` best
children), and after the last round all generated nodes are reranked by path probability
and the best ``max_nodes - 1`` kept (a prefix-closed set: a child is never more probable
than its parent).

The head's own KV cache holds the committed positions (their real features, which the
engine hands to ``observe`` in ``StepResult.features.context``), at most ``window`` of them
(a sliding window; the training segments are as long); the draft tree's nodes attend to it
and to their own ancestors in the tree.

Each draft step runs the head's layer and an output head over V tokens; with SmolLM2's
49152 x 576 output head the latter dominates a draft step on a CPU.  The drafter therefore
drafts over a draft vocabulary (FR-Spec, Zhao et al. 2025, "FR-Spec: Accelerating
Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling"; EAGLE-3's
draft vocabulary): the most frequent tokens of the head's training labels, stored with the
head (``token_ranking``, ``config["draft_vocab_size"]``).  A token outside it is never
drafted; the target still verifies every draft, so nothing but the acceptance changes.

Drafts are deterministic (top-k children; ``Draft.probs`` is None): greedy verification
keeps the output identical to greedy decoding and tree rejection sampling with one-hot q
keeps sampling exact.

Example::

    model, tok = load_smollm2()
    drafter = EagleDrafter(model)                # shipped SmolLM2-135M-Instruct head
    decoder = SpeculativeDecoder(model, drafter, stop_token_ids=[tok.eos_token_id])
    result = decoder.generate([ids], max_new_tokens=128, num_draft_tokens=6)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import torch

from specdec_kernels.checks import integer_at_least
from specdec_kernels.decoding import packed
from specdec_kernels.decoding.draft import Draft, Drafter, DraftRequest, StepResult, chain_parents, draft_distribution
from specdec_kernels.decoding.drafters.eagle_format import FEATURE_LAYERS_FORMAT, FORMAT, KIND, SHIPPED
from specdec_kernels.decoding.drafters.eagle_head import EagleHead, check_token_ids, load_eagle_head
from specdec_kernels.decoding.engine.adaptive import TreeBudget
from specdec_kernels.decoding.model import Transformer, fused_layer_args, linear

__all__ = ["FEATURE_LAYERS_FORMAT", "FORMAT", "KIND", "SHIPPED", "EagleDrafter", "EagleHead", "load_eagle_head"]

# the most new rows the head's one-call layer takes whole when a step ingests them (their
# outputs but the last are not needed: a longer block computes its keys with ``project``)
FUSED_INGEST_ROWS = 8
#: the default draft depth of an EAGLE-2 dynamic tree (a chain: ``EagleDrafter.default_k``)
TREE_DEFAULT_K = 7


class EagleDrafter(Drafter):
    """Draft with an EAGLE-style head: EAGLE-2's dynamic tree, or a chain.

    Args:
        model: the target (its embedding and output head are shared with the head).
        head: an ``EagleHead``, a path to a head file, or None for the shipped head.
        tree: draft EAGLE-2's dynamic tree; False: a chain (the head's argmax at each depth).
        top_k: nodes expanded per depth and children per expanded node (tree only).
        max_nodes: the largest draft, root included (a tree's node budget; it caps a chain
            only through ``size_by_cost``'s rule, as the chain's K caps it anyway).
        size_by_cost: each step, keep per sequence the number of nodes that maximises
            expected tokens per second (``adaptive.TreeBudget``: EAGLE-2's rule, the expected
            accepted length as the sum of the kept nodes' path probabilities, scaled by the
            acceptance this drafter measures as it runs, against the step cost by node count
            that the engine's cost-model policy measured on this machine), at most
            ``max_nodes``; without a cost-model policy ``max_nodes``.  A chain sized so
            verifies only the nodes the rule keeps, and where its draft steps run in one
            native call each (``_chain_start``) it stops drafting once the rule could keep no
            deeper node (``TreeBudget.wants_more``).  False: a tree keeps ``max_nodes``, a
            chain its K.
        max_depth: the deepest draft; the engine's K (``num_draft_tokens``) caps it further.
        check_fingerprint: warn when the head was trained on another model.
        draft_vocab: the tokens the head may draft (FR-Spec, Zhao et al. 2025; EAGLE-3's
            draft vocabulary): its output head is the target's restricted to them, so a
            draft step reads a fraction of the (V, H) output head.  ``"auto"``: the
            head's recommended size (``config["draft_vocab_size"]``) of its
            ``token_ranking``, or the whole vocabulary when the head has none; an int n:
            the n most frequent tokens of its ranking (n >= V: the whole vocabulary);
            a sequence of token ids; None: the whole vocabulary.  Lossless either way:
            the target verifies every draft, and a chain's distribution (``chain_begin``)
            is the head's over the draft vocabulary, 0 elsewhere, which is what is sampled.
        quantize_head: draft with ``head.quantized()``, a copy whose matrices are rounded to
            Q8_0 and read packed (a CPU draft step streams about a quarter of the bytes; with
            the model's ``numerics`` "int8", 8-bit products).  None (default): when the head
            is float32 on CPU and the C++ extension is built; True: always (ValueError where
            it cannot); False: never.  The head passed in is not changed.

    A sequence whose features do not reach its root (a one-token prompt's first step) gets
    no drafts.

    Attributes:
        budget: the ``TreeBudget`` (size_by_cost) or None; bound to each run's calibration
            (``DraftRun.calibration``) as the run starts.
        path_logprobs: after each ``propose``, per sequence, the head's log path probability
            (natural log, float; the head's softmax over the draft vocabulary) of every node
            of its draft, root (0.0) first.
        draft_vocab: None (the whole vocabulary) or (Vd,) int64 on the model's device, the
            draft vocabulary, ascending ids.
        head: the head that drafts (with ``head_quantized``, the drafter's quantized copy).
        head_quantized: whether it is ``head.quantized()`` (see ``quantize_head``).

    Raises:
        ValueError: a head whose hidden size differs from the model's; top_k, max_nodes or
            max_depth < 1; a draft_vocab that is not "auto", None, an int >= 1 or distinct
            ids inside the vocabulary, an int with a head that stores no ranking, or one
            smaller than top_k; quantize_head=True with a head that is not float32 on CPU or
            without the C++ extension; a head whose weights are not all finite, whatever
            quantize_head (``HeadFile.check_finite``: the message names the head, its file
            and the weight).
        TypeError: quantize_head not None or a bool; size_by_cost not a bool.
    """

    name = "eagle"
    default_k = 6  # a chain; a tree: TREE_DEFAULT_K
    wants_hidden = True

    def __init__(
        self,
        model: Transformer,
        head: Union[EagleHead, str, Path, None] = None,
        *,
        tree: bool = True,
        top_k: int = 10,
        max_nodes: int = 64,
        max_depth: int = 7,
        size_by_cost: bool = True,
        check_fingerprint: bool = True,
        draft_vocab: Union[str, int, Sequence[int], torch.Tensor, None] = "auto",
        quantize_head: Optional[bool] = None,
    ):
        for name, v in (("top_k", top_k), ("max_nodes", max_nodes), ("max_depth", max_depth)):
            integer_at_least(name, v, 1)
        if quantize_head is not None and not isinstance(quantize_head, bool):
            raise TypeError(f"quantize_head must be None, True or False, got {quantize_head!r}")
        self.model = model
        self.head = EagleHead.for_target(head, model, check_fingerprint=check_fingerprint)
        self.head_quantized = self.head.quantizable() if quantize_head is None else quantize_head
        if self.head_quantized:
            self.head = self.head.quantized()
        self.tree = bool(tree)
        self.top_k = int(top_k) if tree else 1
        self.max_nodes = int(max_nodes)
        self.max_depth = int(max_depth)
        if not isinstance(size_by_cost, bool):
            raise TypeError(f"size_by_cost must be True or False, got {size_by_cost!r}")
        self.budget = TreeBudget(self.max_nodes) if size_by_cost else None
        self.context_window = self.head.window  # the engine hands over the committed positions' features
        self.feature_layers = self.head.feature_layers  # and, for an EAGLE-3 head, these layers' outputs
        W_out = model.output.weight
        self.draft_vocab = self._draft_vocab(draft_vocab)
        if self.draft_vocab is not None:
            self.draft_vocab = self.draft_vocab.to(W_out.device)
        self._W_draft = W_out if self.draft_vocab is None else W_out[self.draft_vocab].contiguous()
        if self._W_draft is not W_out and packed.packed_form(W_out) is not None:
            # rows of an exactly block-quantised output head are too: ``linear`` may then
            # measure the packed product on them as on the target's own head
            form = packed.pack_weight(self._W_draft)
            if form is not None:
                packed.register(self._W_draft, form)
        if self._W_draft.shape[0] < self.top_k:
            raise ValueError(f"top_k ({self.top_k}) exceeds the draft vocabulary ({self._W_draft.shape[0]} tokens)")
        self.name = "eagle-tree" if tree else "eagle"
        self.default_k = TREE_DEFAULT_K if tree else type(self).default_k
        self._reset(0)

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    def _draft_vocab(self, spec) -> Optional[torch.Tensor]:
        """The draft vocabulary (ascending ids) that ``spec`` names, None for the whole one."""
        V, ranking = self.vocab_size, self.head.token_ranking
        if isinstance(spec, str):
            if spec != "auto":
                raise ValueError(f'draft_vocab must be "auto", None, an int or token ids, got {spec!r}')
            n = self.head.config.get("draft_vocab_size")
            if ranking is None or not n:
                return None
            spec = int(n)
        if spec is None:
            return None
        if isinstance(spec, bool):
            raise ValueError(f'draft_vocab must be "auto", None, an int or token ids, got {spec!r}')
        if isinstance(spec, numbers.Integral) or (
            isinstance(spec, torch.Tensor) and spec.dim() == 0 and not spec.dtype.is_floating_point
        ):
            n = int(spec)
            if n < 1:
                raise ValueError(f"draft_vocab must be >= 1 tokens, got {n}")
            if n >= V:
                return None
            if ranking is None:
                raise ValueError("draft_vocab as a size needs a head that stores its token ranking (this one has none)")
            if int(ranking.max()) >= V:
                raise ValueError(
                    f"the head's token ranking holds token {int(ranking.max())}, outside the model's vocabulary of {V}"
                )
            ids = ranking[:n]
        else:
            ids = check_token_ids(spec, V, "draft_vocab")
        return None if ids.numel() >= V else ids.sort().values

    def _tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary as token ids."""
        return idx if self.draft_vocab is None else self.draft_vocab[idx]

    def _full(self, probs: torch.Tensor) -> torch.Tensor:
        """(R, Vd) probabilities over the draft vocabulary as (R, V), 0 outside it."""
        if self.draft_vocab is None:
            return probs
        out = probs.new_zeros(probs.shape[0], self.vocab_size)
        out[:, self.draft_vocab] = probs
        return out

    def _reset(self, batch: int) -> None:
        self._keys: List[Optional[torch.Tensor]] = [None] * batch  # (n, nkv, hd) committed positions, last `window`
        self._values: List[Optional[torch.Tensor]] = [None] * batch
        self._end = [-1] * batch  # the last position in the cache
        self._root: List[Optional[torch.Tensor]] = [None] * batch  # (H,) the head's output at position end
        self._pending: List[List[Tuple[int, torch.Tensor]]] = [[] for _ in range(batch)]

    def observe(self, result: StepResult) -> None:
        """Begin a run (``result.started``: reset the head's cache and the tree budget) or
        count each sequence's accepted drafts for the tree budget's calibration; then keep
        the committed positions' features (``result.features.context``, ``_keep_context``)."""
        super().observe(result)
        if result.started:
            if self.head_quantized:  # our copy: its products follow the target's numerics
                self.head.numerics = self.model.numerics
            self._reset(result.batch_size)
            if self.budget is not None:
                self.budget.start(result.batch_size, result.run.calibration)
        elif self.budget is not None:
            self.budget.observe(result.num_accepted, result.active)
        f = result.features
        if f is not None and f.context is not None:
            self._keep_context(f.context, f.context_positions, f.valid)

    def _keep_context(self, hidden, first_positions, active) -> None:
        """Keep the committed positions' features (hidden[b] (n_b, H') of positions
        first_positions[b]..; ``TargetFeatures.context``) until a step that drafts feeds them to the
        head's cache (it needs the token that followed each, known by then); blocks that lie
        wholly before the newest ``window`` positions are dropped (the cache would drop them)."""
        for b, (rows, first, a) in enumerate(zip(hidden, first_positions, active)):
            if a and rows is not None and rows.shape[0]:
                pending = self._pending[b]
                pending.append((int(first), rows.detach()))
                oldest = int(first) + rows.shape[0] - self.head.window  # the oldest position still needed
                while pending and pending[0][0] + pending[0][1].shape[0] <= oldest:
                    pending.pop(0)

    def _ingest(self, b: int, history: Sequence[int]) -> bool:
        """Feed sequence b's pending features (positions up to its root's predecessor) to the
        head's cache and compute the head's output at the last of them (the root query, which
        every draft of the step starts from); True when the cache then ends just before the
        root.  Called only when the sequence drafts: the features wait in ``_pending``
        meanwhile.  Rows before the window that ends at the root's predecessor are skipped (a
        row's key and value depend on that row alone, and the window would drop them).  With
        ``_fused_layer`` the new rows run through the head's layer in one native call, else
        through its Python ops."""
        root_pos = len(history) - 1
        E = self.model.tok_embeddings.weight
        blocks, start = [], None
        for first, rows in self._pending[b]:
            lo = max(first, root_pos - self.head.window)
            if lo > self._end[b] + 1:  # a gap, or nothing cached inside the window: start over
                self._keys[b] = self._values[b] = self._root[b] = None
                self._end[b] = lo - 1
                blocks, start = [], None
            skip = self._end[b] + 1 - first
            rows = rows[max(0, skip) : max(0, root_pos - first)]
            if rows.shape[0] == 0:
                continue
            start = first + max(0, skip) if start is None else start
            blocks.append(rows)
            self._end[b] = first + max(0, skip) + rows.shape[0] - 1
        self._pending[b] = []
        if blocks:
            rows = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
            N = rows.shape[0]
            nxt = torch.tensor(history[start + 1 : start + 1 + N], dtype=torch.int64, device=E.device)
            u = self.head.inputs(self.head.fuse_features(rows.to(E.dtype)[None]), E[nxt][None])  # (1, N, H)
            old = 0 if self._keys[b] is None else min(self._keys[b].shape[0], self.head.window - N)
            fused = self._fused_layer() if E.dtype == torch.float32 else None
            if fused is not None:
                keys, values, g = self._fused_rows(b, u, start, old, fused)
            else:
                pos = torch.arange(start, start + N, device=E.device)
                q, k, v = self.head.project(u, pos[None])
                keys = k[0] if not old else torch.cat([self._keys[b][-old:], k[0]])
                values = v[0] if not old else torch.cat([self._values[b][-old:], v[0]])
                ok = torch.ones(1, 1, keys.shape[0], dtype=torch.bool, device=E.device)
                g = self.head.finish(u[:, -1:], self.head.attend(q[:, -1:], keys[None], values[None], ok))
            self._keys[b], self._values[b], self._root[b] = keys, values, g[0, -1]
        return self._end[b] == root_pos - 1 and self._root[b] is not None

    def _fused_rows(self, b: int, u: torch.Tensor, start: int, old: int, fused: tuple):
        """The head's layer over sequence b's new rows u (1, N, H) at positions start.. in one
        ``specdec_engine::decoder_layer`` call, after its last ``old`` committed keys: the committed
        keys and values then ((old + N, nkv, hd) each) and the outputs of the rows the call
        ran ((1, M, H), the last row's last).  Only the last row's output is used: beyond
        ``FUSED_INGEST_ROWS`` rows (a prompt, a long run of steps without drafts) the others
        get their keys and values from ``project`` alone instead of the whole layer."""
        head, N = self.head, u.shape[1]
        k_cache = torch.empty(1, head.num_kv_heads, old + N, head.head_dim)
        v_cache = torch.empty_like(k_cache)
        if old:
            k_cache[0, :, :old] = self._keys[b][-old:].transpose(0, 1)
            v_cache[0, :, :old] = self._values[b][-old:].transpose(0, 1)
        lead = N - 1 if N > FUSED_INGEST_ROWS else 0
        if lead:
            _, k, v = head.project(u[:, :lead], torch.arange(start, start + lead)[None])
            k_cache[0, :, old : old + lead] = k[0].transpose(0, 1)
            v_cache[0, :, old : old + lead] = v[0].transpose(0, 1)
        cos, sin = head.rotary(torch.arange(start + lead, start + N)[None], torch.float32)
        lens = torch.tensor([old + lead], dtype=torch.int32)
        g = self._layer_call(u[:, lead:], cos, sin, k_cache, v_cache, lens, fused)
        return k_cache[0].transpose(0, 1).contiguous(), v_cache[0].transpose(0, 1).contiguous(), g

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Draft:
        """EAGLE-2's dynamic tree (or a chain) below each root, at most min(K, max_depth)
        deep and ``max_nodes`` large (fewer with the tree budget), from the head over the
        features ``observe`` kept: tokens (B, N) int64 on the host, ``probs`` None; the root
        alone where the features do not reach the root.  Sets ``path_logprobs``."""
        roots, depth = self._draft_depths(request)
        D = max(depth)
        if D == 0:
            self.path_logprobs = [[0.0] for _ in roots]
            return Draft.from_lists([([r], [-1]) for r in roots])
        run = [b for b in range(len(roots)) if depth[b] > 0]
        # the frontier width: top_k, or what the tree budget's latest choices can use
        k = self.top_k if self.budget is None else self.budget.width(run, self.top_k)
        if not self.tree:
            state = self._chain_start(run)
            if state is not None:
                return self._fused_chain(state, roots, run, depth, D)
        ctx = self._root_outputs(run)
        pool = self._root_pool(roots, run, ctx[3], k)
        ends = torch.tensor([self._end[b] for b in run], device=pool.tok.device)[:, None]
        for d in range(1, D):
            self._expand(pool, d, ctx, ends)
        return self._select(roots, run, depth, pool.tok.cpu(), pool.par.cpu(), pool.score.cpu(), pool.dep.cpu())

    def _draft_depths(self, request: DraftRequest) -> Tuple[List[int], List[int]]:
        """``propose``'s roots and each sequence's draft depth: min(K, max_depth) where the features
        reach its root (``_ingest``), else 0."""
        histories, num_draft_tokens, active = request.histories, request.num_draft_tokens, request.active
        roots = [h[-1] for h in histories]
        depth = [0] * len(histories)
        for b in range(len(histories)):
            # a sequence that drafts nothing this step leaves its features pending
            ready = self._ingest(b, histories[b]) if active[b] and int(num_draft_tokens[b]) > 0 else False
            depth[b] = min(int(num_draft_tokens[b]), self.max_depth) if ready else 0
        return roots, depth

    def _root_pool(self, roots, run: List[int], g: torch.Tensor, k: int) -> "_TreePool":
        """The pool of the sequences ``run``: each root and its k most likely children from the head's
        output g (R, 1, H) at the root, the children the frontier, nothing expanded yet."""
        E = self.model.tok_embeddings.weight
        dev, dt, R = E.device, E.dtype, len(run)
        logp = torch.log_softmax(self._logits(g), dim=-1)  # (R, 1, V)
        top = logp[:, 0].topk(k, dim=-1)
        tok = torch.cat(
            [torch.tensor([[roots[b]] for b in run], device=dev), self._tokens(top.indices)], dim=1
        )  # (R, 1 + k)
        par = torch.cat([torch.full((R, 1), -1, device=dev), torch.zeros(R, k, dtype=torch.int64, device=dev)], dim=1)
        score = torch.cat([torch.zeros(R, 1, device=dev), top.values], dim=1)
        dep = torch.cat(
            [torch.zeros(R, 1, dtype=torch.int64, device=dev), torch.ones(R, k, dtype=torch.int64, device=dev)], dim=1
        )
        frontier = torch.arange(1, 1 + k, device=dev).expand(R, k)
        tree_k = torch.zeros(R, 0, self.head.num_kv_heads, self.head.head_dim, dtype=dt, device=dev)
        anc = torch.zeros(R, k, 0, dtype=torch.bool, device=dev)
        return _TreePool(tok, par, score, dep, frontier, g.expand(R, k, -1), tree_k, torch.zeros_like(tree_k), anc)

    def _expand(self, pool: "_TreePool", d: int, ctx: tuple, ends: torch.Tensor) -> None:
        """Expand the pool's frontier (at depth d): each frontier node's k most likely children join
        the pool, the k best of them by path probability become the next frontier.  ``ctx``: the
        committed keys, values and their validity (``_root_outputs``); ``ends`` (R, 1): each
        sequence's last cached position (a frontier node at depth d projects at ends + d)."""
        head, E = self.head, self.model.tok_embeddings.weight
        ctx_k, ctx_v, ctx_ok = ctx[:3]
        (R, k), S, dev = pool.frontier.shape, ctx_k.shape[1], E.device
        u = head.inputs(pool.parent_g, E[pool.tok.gather(1, pool.frontier)])
        q, kk, vv = head.project(u, (ends + d).expand(R, k))
        pool.tree_k, pool.tree_v = torch.cat([pool.tree_k, kk], dim=1), torch.cat([pool.tree_v, vv], dim=1)
        own = torch.zeros(R, k, k, dtype=torch.bool, device=dev)
        own[:, torch.arange(k), torch.arange(k)] = True
        anc = torch.cat([pool.anc, own], dim=2)  # (R, k, n_exp + k): ancestors and itself
        mask = torch.cat([ctx_ok[:, None].expand(R, k, S), anc], dim=2)
        g_f = head.finish(
            u, head.attend(q, torch.cat([ctx_k, pool.tree_k], 1), torch.cat([ctx_v, pool.tree_v], 1), mask)
        )  # (R, k, H)
        logp = torch.log_softmax(self._logits(g_f), dim=-1)
        ctop = logp.topk(k, dim=-1)  # (R, k, k) children of each frontier node
        cand_score = (pool.score.gather(1, pool.frontier)[:, :, None] + ctop.values).reshape(R, k * k)
        base = pool.tok.shape[1]
        pool.tok = torch.cat([pool.tok, self._tokens(ctop.indices).reshape(R, k * k)], dim=1)
        pool.par = torch.cat([pool.par, pool.frontier[:, :, None].expand(R, k, k).reshape(R, k * k)], dim=1)
        pool.score = torch.cat([pool.score, cand_score], dim=1)
        pool.dep = torch.cat([pool.dep, torch.full((R, k * k), d + 1, dtype=torch.int64, device=dev)], dim=1)
        # the next frontier: the k best new candidates by path probability
        best = cand_score.topk(k, dim=-1).indices  # (R, k) among the k * k
        slot = best // k  # which frontier node is the parent (its expanded slot: n_exp + slot)
        pool.frontier = base + best
        pool.parent_g = g_f.gather(1, slot[:, :, None].expand(R, k, g_f.shape[-1]))
        pool.anc = anc.gather(1, slot[:, :, None].expand(R, k, anc.shape[2]))

    def _fused_chain(self, state: dict, roots, run, depth, D: int) -> Draft:
        """``propose``'s chain (top-1 at each depth) through ``_fused_step``: the pool of nodes
        the tree loop builds with top_k = 1, handed to ``_select``; with a tree budget it
        stops at the depth where no sequence could keep a deeper node (``_chain_wants_more``)."""
        E = self.model.tok_embeddings.weight
        R, dev = len(run), E.device
        g, total = state["g"], torch.zeros(len(run), device=dev)
        toks, scores = [torch.tensor([roots[b] for b in run], device=dev)], [total]
        for d in range(1, D + 1):
            top = torch.log_softmax(self._logits(g[:, 0]), dim=-1).topk(1, dim=-1)
            total = total + top.values[:, 0]
            toks.append(self._tokens(top.indices[:, 0]))
            scores.append(total)
            if d < D and not self._chain_wants_more(run, depth, torch.stack(scores[1:], 1)):
                D = d  # no sequence would keep a deeper node
            if d < D:
                g = self._fused_step(state, self.head.inputs(g, E[toks[-1]][:, None]))
            else:
                break
        tok, score = torch.stack(toks, 1), torch.stack(scores, 1)
        par = torch.arange(-1, D, device=dev).expand(R, D + 1)
        dep = torch.arange(0, D + 1, device=dev).expand(R, D + 1)
        return self._select(roots, run, depth, tok.cpu(), par.cpu(), score.cpu(), dep.cpu())

    def _chain_wants_more(self, run: List[int], depth: List[int], scores: torch.Tensor) -> bool:
        """Whether any running sequence could keep a node deeper than its d nodes so far
        (scores (R, d): their log path probabilities; ``TreeBudget.wants_more`` up to its
        depth); True without a budget.  A sequence's kept nodes do not depend on whether
        another one kept the drafting going (``wants_more`` never stops short of them)."""
        if self.budget is None:
            return True
        values = scores.exp().tolist()
        return any(self.budget.wants_more(b, values[r], depth[b]) for r, b in enumerate(run))

    def _fused_layer(self) -> Optional[tuple]:
        """``specdec_engine::decoder_layer``'s weight arguments for the head's layer (one row per sequence
        and step), or None where it runs the head's Python ops: the target layers' rule
        (``model.fused_layer_args``), the norms float32 on CPU too."""
        head = self.head
        return fused_layer_args(
            self, (head.wqkv, head.wo, head.w13, head.w2), head.numerics, 1, norms=(head.attention_norm, head.ffn_norm)
        )

    def _chain_start(self, run: List[int]) -> Optional[dict]:
        """A chain's state for the sequences ``run`` when the head's layer runs in one native call
        per draft step (``_fused_layer``), else None: their committed keys and values in
        right-padded caches [R, nkv, S + max_depth, hd] with their lengths, and ``g``, the head's
        output at each root (R, 1, H, from ``_ingest``); the first draft step is at position
        end + 1."""
        fused = self._fused_layer()
        if fused is None or any(self._keys[b].dtype != torch.float32 for b in run):
            return None
        head = self.head
        n = [self._keys[b].shape[0] for b in run]
        k_cache = torch.zeros(len(run), head.num_kv_heads, max(n) + self.max_depth, head.head_dim)
        v_cache = torch.zeros_like(k_cache)
        for r, b in enumerate(run):
            k_cache[r, :, : n[r]] = self._keys[b].transpose(0, 1)
            v_cache[r, :, : n[r]] = self._values[b].transpose(0, 1)
        state = {
            "fused": fused,
            "k": k_cache,
            "v": v_cache,
            "lens": torch.tensor(n, dtype=torch.int32),
            "ends": torch.tensor([self._end[b] for b in run]),
            "depth": 1,
            "g": torch.stack([self._root[b] for b in run])[:, None],
        }
        return state

    def _fused_step(self, state: dict, u: torch.Tensor) -> torch.Tensor:
        """The head's layer on one row per sequence, u (R, 1, H) at position end + depth, in one
        ``specdec_engine::decoder_layer`` call (the ops of ``project``, ``attend`` and ``finish``; the
        row attends to the cache's first lens + 1 slots, its own written last): g (R, 1, H)."""
        if int(state["lens"].max()) >= state["k"].shape[2]:  # extended past max_depth (an ensemble's longer
            # chain keeps asking, as the Python ops allow): room for max_depth more steps
            more = torch.zeros(*state["k"].shape[:2], self.max_depth, state["k"].shape[3])
            state["k"], state["v"] = torch.cat([state["k"], more], 2), torch.cat([state["v"], more], 2)
        cos, sin = self.head.rotary((state["ends"] + state["depth"])[:, None], torch.float32)
        g = self._layer_call(u, cos, sin, state["k"], state["v"], state["lens"], state["fused"])
        state["lens"] = state["lens"] + 1
        state["depth"] += 1
        return g

    def _layer_call(self, u, cos, sin, k_cache, v_cache, lens, fused) -> torch.Tensor:
        """``specdec_engine::decoder_layer`` with the head's layer: u (B, N, H) written after lens[b]
        slots of the caches [B, nkv, S, hd], causal within the block: the outputs (B, N, H)."""
        head = self.head
        return torch.ops.specdec_engine.decoder_layer(
            u.contiguous(),
            head.attention_norm,
            head.ffn_norm,
            head.eps,
            cos,
            sin,
            k_cache,
            v_cache,
            lens,
            None,
            None,
            *fused,
            head.num_heads,
            head.num_kv_heads,
            packed.isa_code(None),
        )

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        """The head's logits over the draft vocabulary: (..., Vd) float32 from g (..., H)."""
        return linear(g.to(self._W_draft.dtype), self._W_draft, self.head.numerics).float()

    def _root_outputs(self, run: List[int]):
        """For the sequences ``run``: the committed keys and values (left-padded to the
        longest, (R, S, nkv, hd)), their validity (R, S) and the head's output at each root
        query (R, 1, H), computed by ``_ingest``."""
        head, E = self.head, self.model.tok_embeddings.weight
        R, S = len(run), max(self._keys[b].shape[0] for b in run)
        ctx_k = torch.zeros(R, S, head.num_kv_heads, head.head_dim, dtype=E.dtype, device=E.device)
        ctx_v = torch.zeros_like(ctx_k)
        ctx_ok = torch.zeros(R, S, dtype=torch.bool, device=E.device)
        for r, b in enumerate(run):
            n = self._keys[b].shape[0]
            ctx_k[r, S - n :], ctx_v[r, S - n :], ctx_ok[r, S - n :] = self._keys[b], self._values[b], True
        return ctx_k, ctx_v, ctx_ok, torch.stack([self._root[b] for b in run])[:, None]

    # ------------------------------------------------------------------ chain distributions
    @torch.inference_mode()
    def chain_begin(self, request: DraftRequest, vocab_size: int):
        """The head's distribution of the first draft token (``Drafter.chain_begin``)."""
        histories, num_draft_tokens, active = request.histories, request.num_draft_tokens, request.active
        B = len(histories)
        ready = [bool(active[b]) and int(num_draft_tokens[b]) >= 1 and self._ingest(b, histories[b]) for b in range(B)]
        self._chain_ks = [min(int(k), self.max_depth) if r else 0 for k, r in zip(num_draft_tokens, ready)]
        self._chain_run = [b for b in range(B) if ready[b]]
        probs = torch.zeros(B, vocab_size)
        if not self._chain_run:
            return probs, torch.zeros(B, dtype=torch.bool)
        with torch.inference_mode():
            self._chain = self._chain_start(self._chain_run)
            if self._chain is None:
                ctx_k, ctx_v, ctx_ok, g = self._root_outputs(self._chain_run)
                self._chain = {"k": ctx_k, "v": ctx_v, "ok": ctx_ok, "g": g, "depth": 0}
        g = self._chain["g"]
        probs[self._chain_run] = self._full(draft_distribution(self._logits(g[:, 0]), self.sampling)).cpu()
        return probs, torch.tensor(ready)

    @torch.inference_mode()
    def chain_extend(self, tokens):
        """Feed the chain's token at depth d with the head's own feature and return the
        distribution of depth d + 1 (``Drafter.chain_extend``)."""
        B = len(self._chain_ks)
        probs = torch.zeros(B, self.vocab_size)
        if not self._chain_run:
            return probs, torch.zeros(B, dtype=torch.bool)
        c = self._chain
        run, head, E = self._chain_run, self.head, self.model.tok_embeddings.weight
        tok = tokens.to(E.device)[torch.tensor(run, device=E.device)]
        u = head.inputs(c["g"], E[tok][:, None])
        if "fused" in c:  # one native call (``_chain_start``)
            c["g"] = self._fused_step(c, u)
            probs[run] = self._full(draft_distribution(self._logits(c["g"][:, 0]), self.sampling)).cpu()
            return probs, torch.tensor([k >= c["depth"] for k in self._chain_ks])
        c["depth"] += 1
        d = c["depth"]
        q, k, v = head.project(u, torch.tensor([[self._end[b] + d] for b in run], device=E.device))
        c["k"], c["v"] = torch.cat([c["k"], k], 1), torch.cat([c["v"], v], 1)
        c["ok"] = torch.cat([c["ok"], torch.ones(len(run), 1, dtype=torch.bool, device=E.device)], 1)
        c["g"] = head.finish(u, head.attend(q, c["k"], c["v"], c["ok"][:, None]))
        probs[run] = self._full(draft_distribution(self._logits(c["g"][:, 0]), self.sampling)).cpu()
        return probs, torch.tensor([k >= d + 1 for k in self._chain_ks])

    def _select(self, roots, run, depth, tok, par, score, dep) -> Draft:
        """Rerank each running sequence's pool by path probability (ties: shallower first),
        keep the best ``n - 1`` no deeper than its depth (n: the budget's choice, else
        ``max_nodes``), in topological order."""
        trees = [([r], [-1]) for r in roots]
        self.path_logprobs = [[0.0] for _ in roots]
        for r, b in enumerate(run):
            n = tok.shape[1]
            ok = (dep[r] <= depth[b]) & (torch.arange(n) > 0)
            ids = ok.nonzero()[:, 0].tolist()
            ids.sort(key=lambda i: (-float(score[r, i]), int(dep[r, i]), i))
            n_keep = self.max_nodes
            if self.budget is not None:
                values = [math.exp(float(score[r, i])) for i in ids[: self.max_nodes - 1]]
                n_keep = self.budget.choose(b, values)
                self.budget.kept(b, values[: n_keep - 1])
            keep = sorted(ids[: n_keep - 1], key=lambda i: (int(dep[r, i]), -float(score[r, i]), i))
            where = {0: 0}
            t, p = [roots[b]], [-1]
            for i in keep:
                where[i] = len(t)
                t.append(int(tok[r, i]))
                p.append(where[int(par[r, i])])  # the parent is kept and earlier (prefix-closed)
            trees[b] = (t, p)
            self.path_logprobs[b] = [0.0] + [float(score[r, i]) for i in keep]
        draft = Draft.from_lists(trees, is_chain=None)  # on the host: the loop moves it, reading nothing back
        if not self.tree:
            draft.is_chain = all(list(p) == chain_parents(len(p)) for _, p in trees)
        return draft


@dataclass
class _TreePool:
    """EAGLE-2's node pool while ``EagleDrafter.propose`` grows the tree of R running sequences.

    tok, par, score, dep: (R, n) the nodes' tokens, parents, scores (log path probability) and
    depths, node 0 the root; frontier: (R, k) the pool ids of the nodes to expand next, parent_g:
    (R, k, H) the head output of each frontier node's parent; tree_k, tree_v: (R, n_exp, nkv, hd)
    the expanded nodes' keys and values; anc: (R, k, n_exp) each frontier node's expanded ancestors.
    """

    tok: torch.Tensor
    par: torch.Tensor
    score: torch.Tensor
    dep: torch.Tensor
    frontier: torch.Tensor
    parent_g: torch.Tensor
    tree_k: torch.Tensor
    tree_v: torch.Tensor
    anc: torch.Tensor
