"""The sampled softmax, its losses, the optimiser and the options both trainers use.

The sampled softmax: a drafter's logits through the target's frozen
output head cost a 49152-way softmax per label (about 5 s a minibatch on a 2-core CPU), so
each minibatch scores a candidate set instead (Jean et al. 2015, "On Using Very Large
Target Vocabulary for Neural Machine Translation"): the most frequent labels of the data,
the minibatch's own labels, and tokens drawn uniformly from the rest of the vocabulary,
whose logits get + log(rest / drawn), the mass of the tokens not drawn.

``TrainingOptions`` bundles what both trainers' train functions take alike: the optimiser's
schedule (steps, learning rate, weight decay, seed, progress bar), the sampled softmax's
sizes and the weight of the soft labels.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from specdec_kernels.optional import require


@dataclass(frozen=True)
class TrainingOptions:
    """The options both trainers' train functions take (``training.eagle.train_head``,
    ``training.medusa.train_heads``); ``training.data.training_options`` builds them from
    the command line.

    Attributes:
        steps: optimiser steps (AdamW, warm-up and cosine decay: ``Optimiser``), >= 1.
        lr: the peak learning rate, > 0.
        seed: seeds the minibatches and the sampled softmax's negatives.
        distill: weight of the soft labels (the target's own distribution) against the hard
            label (its argmax), in [0, 1]; 0 (the default): the hard label only.
        weight_decay: AdamW's decoupled weight decay, >= 0.
        frequent: the most frequent labels always among the sampled softmax's candidates, >= 0.
        negatives: tokens drawn per step from the rest of the vocabulary, >= 0.
        desc: the progress bar's name.

    Raises:
        ValueError: a field out of its range (the message names the field).
    """

    steps: int
    lr: float
    seed: int
    distill: float = 0.0
    weight_decay: float = 0.0
    frequent: int = 4096
    negatives: int = 2048
    desc: str = "train"

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not 0.0 <= self.distill <= 1.0:
            raise ValueError(f"distill must lie in [0, 1], got {self.distill}")
        for name in ("weight_decay", "frequent", "negatives"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")

    def optimiser(self, params: Iterable[torch.nn.Parameter]) -> Optimiser:
        """An ``Optimiser`` of ``params`` with these steps, learning rate and weight decay."""
        return Optimiser(params, self.lr, self.steps, self.weight_decay)

    def softmax(self, output_weight: torch.Tensor, labels: torch.Tensor) -> Tuple[SampledSoftmax, torch.Tensor]:
        """``output_head_softmax`` with these ``frequent`` and ``negatives``."""
        return output_head_softmax(output_weight, labels, self.frequent, self.negatives)

    def generator(self) -> torch.Generator:
        """A CPU generator seeded with ``seed`` (the minibatches and the negatives)."""
        return torch.Generator().manual_seed(self.seed)


class Candidates(NamedTuple):
    """One minibatch's candidate set.

    tokens: (C,) int64 vocabulary ids; bias: (C,) float32, added to their logits;
    remap: (V,) int64, a token's index among the candidates (-100: not a candidate).
    """

    tokens: torch.Tensor
    bias: torch.Tensor
    remap: torch.Tensor

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """labels (any shape, -100 ignored) as candidate indices (-100 stays)."""
        return torch.where(labels >= 0, self.remap[labels.clamp(min=0)], -100)


def label_ranking(labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The tokens that occur among ``labels`` (any shape, int64, -100 ignored), most frequent
    first (ties: the smaller id first): (M,) int64 with M <= ``vocab_size``.

    The trainers' frequency ranking: the sampled softmax's always-present candidates, and the
    EAGLE head's draft vocabulary (FR-Spec, Zhao et al. 2025), are its head.

    Raises:
        ValueError: a label outside [0, vocab_size).
    """
    y = labels[labels >= 0].reshape(-1)
    if y.numel() and int(y.max()) >= vocab_size:
        raise ValueError(f"labels hold token {int(y.max())}, outside a vocabulary of {vocab_size}")
    counts = torch.bincount(y, minlength=int(vocab_size))
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[: int((counts > 0).sum())]


class SampledSoftmax:
    """Candidate sets for a vocabulary of ``vocab_size`` from the data's labels.

    Args:
        labels: every training label (any shape, -100 ignored), for the frequencies.
        vocab_size: V.
        frequent: the most frequent labels always among the candidates.
        negatives: tokens drawn per minibatch from the rest; when the rest is no larger,
            every token is a candidate (the full softmax).
    """

    def __init__(self, labels: torch.Tensor, vocab_size: int, frequent: int = 4096, negatives: int = 2048):
        V = int(vocab_size)
        self.vocab_size = V
        self.negatives = int(negatives)
        self.common = label_ranking(labels, V)[:frequent].sort().values
        self.in_common = torch.zeros(V, dtype=torch.bool)
        self.in_common[self.common] = True
        self.rest = (~self.in_common).nonzero()[:, 0]
        self.sampled = self.rest.numel() > self.negatives

    def draw(self, labels: torch.Tensor, generator: torch.Generator) -> Candidates:
        """The candidates of a minibatch with these labels (-100 ignored), negatives drawn
        with ``generator``."""
        V = self.vocab_size
        if self.sampled:
            present = torch.unique(labels[labels >= 0])
            extra = present[~self.in_common[present]]
            draw = self.rest[torch.randperm(self.rest.numel(), generator=generator)[: self.negatives]]
            draw = draw[~torch.isin(draw, extra)]
            cands = torch.cat([self.common, extra, draw])
            bias = torch.zeros(cands.numel())
            bias[self.common.numel() + extra.numel() :] = math.log(
                (self.rest.numel() - extra.numel()) / max(1, draw.numel())
            )
        else:
            cands, bias = torch.arange(V), torch.zeros(V)
        remap = torch.full((V,), -100, dtype=torch.int64)
        remap[cands] = torch.arange(cands.numel())
        return Candidates(cands, bias, remap)


def output_head_softmax(
    output_weight: torch.Tensor, labels: torch.Tensor, frequent: int, negatives: int
) -> Tuple[SampledSoftmax, torch.Tensor]:
    """The sampled softmax over the vocabulary of the frozen output head ``output_weight``
    (V, hidden) for these ``labels`` (``SampledSoftmax``), and that head (V, hidden) in
    bfloat16, the dtype the trainers' logits are computed in."""
    W = output_weight.detach().float()
    return SampledSoftmax(labels, W.shape[0], frequent, negatives), W.to(torch.bfloat16)


def candidate_logits(states: torch.Tensor, W_c: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """(..., C) float32 logits of ``states`` (..., hidden) over one minibatch's candidates:
    ``W_c`` (hidden, C) bfloat16, the output head's candidate rows transposed, and their
    ``bias`` (C,) (``Candidates.bias``); the product in bfloat16."""
    return (states.to(torch.bfloat16) @ W_c).float() + bias


class DistillationLosses(NamedTuple):
    """Per label, (B, k) float32 each: ``hard``, the cross-entropy against the target model's
    argmax; ``soft``, against its distribution; ``top``, HASS's top-K distillation term (None
    unless asked for)."""

    hard: torch.Tensor
    soft: torch.Tensor
    top: Optional[torch.Tensor]


def hard_and_soft_losses(
    logits: torch.Tensor,
    target: torch.Tensor,
    teacher_states: torch.Tensor,
    W_c: torch.Tensor,
    bias: torch.Tensor,
    top_k: int = 0,
) -> DistillationLosses:
    """Per label, the cross-entropy of ``logits`` (B, k, C) over the candidates against
    ``target`` (B, k) candidate indices (hard; 0 where -100) and against the target model's
    own distribution p over the candidates, the ``candidate_logits`` of ``teacher_states``
    (B, k, hidden) without gradient (soft).  ``W_c`` (hidden, C) bfloat16 and ``bias`` (C,)
    float32 are one minibatch's ``Candidates`` (``candidate_logits``); both ``logits`` and
    p carry ``bias``, so in a sampled softmax a drawn negative stands for the tokens it was
    drawn from.

    With ``top_k`` > 0 also HASS's harmonized objective distillation term (Zhang et al.,
    "Learning Harmonized Representations for Speculative Sampling", ICLR 2025): -sum over
    the ``top_k`` candidates of highest p of p(x) log q(x), the soft cross-entropy again on
    the tokens that a tree drafts and verification accepts.  It is per token: p and q of a
    drawn negative are its own (the bias taken off), and the ranking is by the teacher's own
    logits.  Only candidates can be among the K: a likely token outside the minibatch's
    candidates (beyond the frequent ones, the labels and the drawn negatives) is missed.

    Returns:
        ``DistillationLosses`` (hard, soft, top), each (B, k) float32; top None when
        ``top_k`` is 0.

    Raises:
        ValueError: ``top_k`` not an int >= 0.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    hard = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="none")
    logq = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        t = candidate_logits(teacher_states, W_c, bias)
        soft_p = torch.softmax(t, dim=-1)
    soft = -(soft_p * logq).sum(-1)
    top = None
    if top_k:
        with torch.no_grad():
            idx = (t - bias).topk(min(top_k, t.shape[-1]), dim=-1).indices
            p_own = (soft_p * torch.exp(-bias)).gather(-1, idx)
        top = -(p_own * (logq - bias).gather(-1, idx)).sum(-1)
    return DistillationLosses(hard, soft, top)


class Optimiser:
    """AdamW (betas 0.9, 0.98) with a linear warm-up over the first 5 % of ``steps`` and a
    cosine decay to 0 (Loshchilov & Hutter 2019); ``step(loss)`` takes one step and records
    the loss, shown as a running mean on ``bar`` (a tqdm bar) every 10 steps."""

    def __init__(self, params, lr: float, steps: int, weight_decay: float = 0.0, bar=None):
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
        warm = max(1, steps // 20)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        )
        self.losses: list = []
        self.bar = bar
        self.steps = steps

    def run(self, desc: str = "train") -> Iterator[int]:
        """The steps 0 .. ``steps`` - 1, under a tqdm progress bar named ``desc`` (on stderr)
        that shows the running loss.

        Raises:
            ImportError: tqdm is not installed (the engine extra).
        """
        tqdm = require("tqdm", purpose="training the heads (progress bars)", extra="engine").tqdm
        with tqdm(range(self.steps), desc=desc, unit="step", file=sys.stderr) as bar:
            self.bar = bar
            yield from bar

    def step(self, loss: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.losses.append(float(loss.detach()))
        if self.bar is not None and len(self.losses) % 10 == 1:
            self.bar.set_postfix(loss=f"{sum(self.losses[-10:]) / len(self.losses[-10:]):.3f}")
