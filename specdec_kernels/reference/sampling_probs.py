"""Reference temperature / top-k / top-p processing of logits into probabilities (plain PyTorch,
no argument checks)."""

from __future__ import annotations

from typing import Union

import torch

Param = Union[None, int, float, torch.Tensor]


def _sampling_probs(logits, temperature, top_k, top_p) -> torch.Tensor:
    V = logits.shape[-1]
    x = logits.float()
    greedy = temperature == 0
    x = x / torch.where(greedy, torch.ones_like(temperature), temperature)

    # top-k: keep logits at least as large as the k-th largest (ties at the boundary kept).
    k = torch.where((top_k <= 0) | (top_k > V), V, top_k)
    sorted_x = x.sort(dim=-1, descending=True).values
    kth = sorted_x.gather(-1, (k - 1).expand(*x.shape[:-1], 1))
    x = x.masked_fill(x < kth, float("-inf"))
    # softmax with a float64 denominator rounded once to float32: torch.softmax's float32 sum
    # on the CPU is off by up to 1.4e-5 at V = 128k (its vector lanes add V / 16 terms each),
    # which moves the nucleus below; NaN, +inf and all--inf rows give NaN here as there
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    probs = e * (1.0 / e.double().sum(dim=-1, keepdim=True)).float()

    # top-p: the nucleus is the smallest set of the most probable tokens whose mass reaches
    # top_p; every token as probable as the least probable member is kept (ties kept).
    sorted_p = probs.sort(dim=-1, descending=True).values
    mass_before = sorted_p.double().cumsum(dim=-1) - sorted_p.double()
    size = (mass_before < top_p.double()).sum(dim=-1, keepdim=True).clamp(1, V)
    threshold = sorted_p.gather(-1, size - 1)
    nucleus = (probs >= threshold) | (top_p >= 1)
    probs = torch.where(nucleus, probs, 0.0)
    probs = probs / probs.double().sum(dim=-1, keepdim=True).float()

    # Temperature 0, or a +inf logit after temperature (an infinite logit, or a temperature so
    # small that the division overflows): one-hot at the largest logit (the first of equal
    # ones), the limit of T -> 0, not NaN and not the first logit that overflowed.
    scaled = logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature)
    infinite = (scaled == float("inf")).any(dim=-1, keepdim=True) & ~scaled.isnan().any(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.float().argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy | infinite, one_hot, probs)


def sampling_probs(
    logits: torch.Tensor, temperature: Param = 1.0, top_k: Param = None, top_p: Param = None
) -> torch.Tensor:
    """Temperature, top-k, softmax, top-p (Holtzman et al. 2020) and renormalisation, in
    Hugging Face's order (reference of ``specdec_kernels.sampling_probs``).

    Same arguments, shapes, dtypes and results as the op, whose docstring has them (without
    ``backend`` and ``validate``); scalars are broadcast to (batch,) and a NaN top_p acts as 1,
    with no argument checks (``sampling_probs(..., backend="reference")`` runs this with the
    op's checks).
    """
    shape = (logits.shape[0],) + (1,) * (logits.dim() - 1)

    def per_row(value, default, dtype):
        value = default if value is None else value
        if isinstance(value, torch.Tensor):
            return value.to(device=logits.device, dtype=dtype).view(shape)
        return torch.full(shape, value, dtype=dtype, device=logits.device)

    t, k = per_row(temperature, 1.0, torch.float32), per_row(top_k, 0, torch.int64)
    p = torch.nan_to_num(per_row(top_p, 1.0, torch.float32), nan=1.0)
    return _sampling_probs(logits, t, k, p)
