"""Ensemble averaging (``EnsembleDrafter``): several drafters' next-token distributions mixed
into one, and one chain drawn from the mixture.

Instead of merging drafts (``MergeDrafter``), the sub-drafters' next-token distributions q_i
(``Drafter.chain_begin`` / ``chain_extend``: each drafter's own distribution under the run's
sampling settings, given the chain so far) are averaged,

    q(x) = sum_i w_i q_i(x) / sum_i w_i        (over the drafters with an opinion there),

and each draft token is drawn from that mixture (at temperature 0: its argmax), one depth
at a time, with each sequence's own generator.  The mixture q is handed to the verifier as
``Draft.probs``: it is exactly the distribution the token was drawn from, so rejection
sampling (``rejection_sample`` with ``max(0, p - q)`` residuals) keeps the target's
distribution.  With the engine's Gumbel coupling (the default when sampling) the token is
instead the mixture's Gumbel-max with the target's noise of that token index
(``coupling.py``) and no distribution is handed over.  The weights are given (``weights``) or
learnt per sequence from what the target committed (``learn_weights``): after each step w_i
is multiplied by q_i(x) of every committed token x whose position the chain reached (the
accepted drafts and the token the target chose at the first rejection; Bayes' rule for
"which drafter's distribution is the target's", the exponentially weighted average
forecaster with log loss), then mixed with the uniform weights in proportion
``WEIGHT_SHARE`` (fixed share, Herbster & Warmuth 1998) so that a drafter that fell behind
can come back.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from specdec_kernels.decoding.coupling import gumbel_top_k
from specdec_kernels.decoding.draft import Draft, Drafter, DraftRequest, StepResult, sample_tokens
from specdec_kernels.decoding.drafters.composite import CompositeDrafter

WEIGHT_SHARE = 0.05  # ensemble weights: the uniform share mixed in after each update
LOG_FLOOR = 1e-6  # ensemble weights: q_i(x) below this counts as this (a zero would never recover)


class EnsembleDrafter(CompositeDrafter):
    """Average the sub-drafters' distributions into one chain draft (see the module docstring).

    Args:
        drafters: the sub-drafters; every one must hand over chain distributions
            (``Drafter.has_chain_distributions``), at least one must know the vocabulary
            size (``vocab_size``).
        max_depths, names: as ``CompositeDrafter`` (a capped sub-drafter has no opinion past
            its cap).
        weights: the mixture weights (one per sub-drafter, >= 0, not all 0), the initial ones
            when learnt; None: equal.
        learn_weights: update the weights per sequence from the committed tokens (None: when
            ``weights`` is None).

    Attributes:
        log_weights: (B, M) float64, each sequence's log mixture weights (after the start of
            a run).

    Raises:
        ValueError: no sub-drafter with a vocabulary size, bad ``weights``, and as
            ``CompositeDrafter``.
        TypeError: a sub-drafter without chain distributions, and as ``CompositeDrafter``.

    Example::

        drafter = EnsembleDrafter([EagleDrafter(model, tree=False), NgramDrafter()])
    """

    ensemble = True

    def __init__(
        self,
        drafters: Sequence[Drafter],
        *,
        weights: Optional[Sequence[float]] = None,
        learn_weights: Optional[bool] = None,
        **options: Any,
    ):
        super().__init__(drafters, **options)  # max_depths, names
        for i, d in enumerate(self.drafters):
            if not d.has_chain_distributions:
                raise TypeError(
                    f"drafters[{i}] ({type(d).__name__}) hands over no chain distributions "
                    "(chain_begin / chain_extend), which ensemble averaging needs"
                )
        if self.vocab_size is None:
            raise ValueError("ensemble averaging needs the vocabulary size: at least one drafter with vocab_size")
        if weights is not None:
            weights = [float(w) for w in weights]
            if (
                len(weights) != len(self.drafters)
                or any(not math.isfinite(w) or w < 0 for w in weights)
                or sum(weights) <= 0
            ):
                raise ValueError(
                    f"weights must be one finite weight >= 0 per drafter ({len(self.drafters)}), not all 0, got {weights}"
                )
        self.weights = weights
        self.learn_weights = (weights is None) if learn_weights is None else bool(learn_weights)
        self._ensemble_last = None  # the last draft's mixture inputs, for _learn and observe

    def _reset(self, batch: int) -> None:
        """Every sequence of the new batch starts with the given weights."""
        M = len(self.drafters)
        w = torch.tensor(self.weights if self.weights is not None else [1.0] * M, dtype=torch.float64)
        self.log_weights = (w / w.sum()).log().expand(batch, M).clone()  # (B, M), per sequence
        self._ensemble_last = None

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

    def propose(self, request: DraftRequest) -> Draft:
        """One chain per sequence drawn from the weighted mixture of the sub-drafters'
        distributions (``chain_begin`` with each one's own request, then ``chain_extend``).

        Args:
            request: the batch's histories, draft depths (each sub-drafter's cut at its cap:
                no opinion past it) and active flags.

        Returns:
            A chain ``Draft``: tokens (B, K + 1) int64; ``Draft.probs`` (B, K + 1, V) float32
            holds the mixture at every depth (sampling without coupling; else None).
        """
        histories, num_draft_tokens, active = request.histories, request.num_draft_tokens, request.active
        self._learn(histories)
        B, M, V = len(histories), len(self.drafters), int(self.vocab_size)
        ks = [int(k) if a else 0 for k, a in zip(num_draft_tokens, active)]
        D = max(ks) if ks else 0
        roots = [h[-1] for h in histories]
        if D == 0:
            return Draft.from_lists([([r], [-1]) for r in roots], is_chain=True)
        member_ks = [self._capped(i, ks) for i in range(M)]
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
            self._ask_members(d, request, member_ks, tokens[:, d - 1], member_q, member_has)
            has = member_has[:, :, d - 1].T  # (B, M)
            wd = w * has
            total = wd.sum(1)
            go = [(ks[b] >= d) and (depth[b] == d - 1) and bool(total[b] > 0) for b in range(B)]
            q = torch.einsum("bm,mbv->bv", wd / total.clamp(min=1e-30)[:, None], member_q[:, :, d - 1])
            for b in range(B):
                if not go[b]:
                    continue
                tokens[b, d] = self._mixture_token(q[b], b, len(histories[b]) + d - 1)
                if probs is not None:  # sampled without coupling: the q it was drawn from
                    probs[b, d - 1] = q[b]
                depth[b] = d
            if d == 1:
                self._count_first_depth(go, w, has)
            if not any(depth[b] == d for b in range(B)):
                break
        for i, name in enumerate(self.names):
            self.counters[name]["proposed"] += int(sum(int(member_has[i, b, : depth[b]].sum()) for b in range(B)))
        self._ensemble_last = ([len(h) for h in histories], member_q, member_has, depth)
        num_nodes = torch.tensor([1 + x for x in depth], dtype=torch.int64)
        parents = torch.arange(-1, D, dtype=torch.int64).expand(B, D + 1).clone()
        return Draft(tokens, parents, num_nodes, probs, is_chain=True)

    def _ask_members(self, d: int, request: DraftRequest, member_ks, previous: torch.Tensor, member_q, member_has):
        """Each sub-drafter's distribution at depth d (its ``chain_begin`` with its own request at
        d = 1, else ``chain_extend`` with the ``previous`` depth's tokens (B,)), written into
        member_q[:, :, d - 1] (M, B, V) and, where it has an opinion within its cap,
        member_has[:, :, d - 1] (M, B)."""
        for i, (drafter, name) in enumerate(zip(self.drafters, self.names)):
            with self._timed(name, "propose_time"):
                if d == 1:
                    q_i, has_i = drafter.chain_begin(
                        self._request(i, request, member_ks[i], request.active), member_q.shape[-1]
                    )
                else:
                    q_i, has_i = drafter.chain_extend(previous)
            member_q[i, :, d - 1] = q_i.float()
            member_has[i, :, d - 1] = has_i & torch.tensor([k >= d for k in member_ks[i]])

    def _mixture_token(self, q: torch.Tensor, b: int, index: int) -> int:
        """Sequence b's token from the mixture q (V,): its argmax when greedy, its Gumbel-max with the
        target's noise of token ``index`` under the coupling, else a sample with b's generator."""
        if self.sampling.greedy:
            return int(q.argmax())
        if self.coupling is not None:  # the mixture's Gumbel-max with the target's noise of this index
            noise = self.coupling.noise(b, index)
            return int(gumbel_top_k(q.clamp(min=0).log(), noise, 1)[1][0])
        return int(sample_tokens(q, 1, self.generators[b])[0])

    def _count_first_depth(self, go, w: torch.Tensor, has: torch.Tensor) -> None:
        """Credit each sub-drafter, per sequence that drafts (``go``), its mixture weight (w (B, M))
        and whether it had an opinion at the first depth (has (B, M))."""
        for i, name in enumerate(self.names):
            for b in range(len(go)):
                if go[b]:
                    self.counters[name]["weight"] += float(w[b, i])
                    self.counters[name]["steps"] += int(has[b, i])

    def observe(self, result: StepResult) -> None:
        """Begin a run (``result.started``, ``CompositeDrafter.observe``: every sequence starts
        with the given weights), or: every sub-drafter observes the shared chain; counters
        credit the drafters that had an opinion at each accepted depth.

        Args:
            result: the step's ``StepResult``: ``accepted_nodes`` (B, N) int64, the accepted
                path (root first, then -1); ``num_accepted`` (B,) int64, accepted drafts (root
                not counted); ``active``, per sequence, whether it took part in the step.
        """
        super().observe(result)
        if result.started:
            return
        last = self._ensemble_last
        if last is not None:
            member_has = last[2]
            for b, m in enumerate(result.num_accepted.tolist()):
                for i, name in enumerate(self.names):
                    self.counters[name]["accepted"] += int(member_has[i, b, :m].sum())
        self._observe_all(result)
