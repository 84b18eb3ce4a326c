"""Reference temperature / top-k / top-p processing of logits into probabilities."""
from __future__ import annotations

from typing import Union

import torch

from specdec_kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_shape, check_tensor, want_value_checks

Param = Union[None, int, float, torch.Tensor]


def _per_row(name: str, value, batch: int, ndim: int, device, dtype, default):
    """A scalar or a [B] tensor, returned as a tensor broadcastable over (B, ..., V)."""
    if value is None:
        value = default
    if isinstance(value, torch.Tensor):
        check_tensor(name, value, ndim=1, device=device)
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number tensor, got {value.dtype}")
        check_shape(name, value, (batch,), "one value per sequence (the first dimension of logits)")
        t = value.to(dtype)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a tensor of shape ({batch},), got {type(value).__name__}")
    else:
        t = torch.full((batch,), value, dtype=dtype, device=device)
    return t.view((batch,) + (1,) * (ndim - 1))


def check_sampling_args(logits, temperature, top_k, top_p, validate=None):
    """Validate and broadcast the arguments of ``sampling_probs``; value checks (temperature
    >= 0, top_p in (0, 1]) when ``validate`` allows (default: CPU tensors)."""
    check_tensor("logits", logits, ndim=(2, 3), dtypes=FLOAT_DTYPES)
    if logits.shape[-1] < 1:
        raise ValueError(f"logits must have a vocabulary of at least 1, got shape {tuple(logits.shape)}")
    B, nd, dev = logits.shape[0], logits.dim(), logits.device
    if isinstance(top_k, torch.Tensor):
        check_tensor("top_k", top_k, dtypes=INDEX_DTYPES)
    elif isinstance(top_k, float):
        raise TypeError(f"top_k must be an int or an integer tensor, got float {top_k}")
    t = _per_row("temperature", temperature, B, nd, dev, torch.float32, 1.0)
    k = _per_row("top_k", top_k, B, nd, dev, torch.int64, 0)
    p = _per_row("top_p", top_p, B, nd, dev, torch.float32, 1.0)
    if B and want_value_checks(validate, t, p):
        if (t < 0).any() or t.isnan().any():
            raise ValueError(f"temperature must be >= 0, got {t.flatten().tolist()[:8]}")
        if ((p <= 0) | (p > 1) | p.isnan()).any():
            raise ValueError(f"top_p must lie in (0, 1], got {p.flatten().tolist()[:8]}")
    # NaN top_p (unchecked input) acts as 1, on every backend
    return t, k, torch.nan_to_num(p, nan=1.0)


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
    probs = torch.softmax(x, dim=-1)

    # top-p: the nucleus is the smallest set of the most probable tokens whose mass reaches
    # top_p; every token as probable as the least probable member is kept (ties kept).
    sorted_p = probs.sort(dim=-1, descending=True).values
    mass_before = sorted_p.double().cumsum(dim=-1) - sorted_p.double()
    size = (mass_before < top_p.double()).sum(dim=-1, keepdim=True).clamp(1, V)
    threshold = sorted_p.gather(-1, size - 1)
    nucleus = (probs >= threshold) | (top_p >= 1)
    probs = torch.where(nucleus, probs, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)

    # Temperature 0, or a +inf logit after temperature (an infinite logit, or a temperature so
    # small that the division overflows): one-hot at the argmax (the first +inf), not NaN.
    scaled = logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature)
    infinite = (scaled == float("inf")).any(dim=-1, keepdim=True) & ~scaled.isnan().any(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, scaled.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy | infinite, one_hot, probs)


def sampling_probs(logits: torch.Tensor, temperature: Param = 1.0, top_k: Param = None, top_p: Param = None) -> torch.Tensor:
    """The one distribution that the drafter samples from and the verifier checks against.

    Applies, in this order (as Hugging Face's logits warpers do): temperature, top-k, softmax,
    top-p (nucleus sampling, Holtzman et al. 2020), renormalisation.

    Args:
        logits: Shape (batch, vocab) or (batch, rows, vocab), float32/float16/bfloat16.
        temperature: float >= 0, or a float tensor of shape (batch,).  0 is greedy: the row
            becomes one-hot at ``torch.argmax`` (first maximum, NaN counts as maximum).  A row
            with a +inf logit after temperature (an infinite logit, or a temperature so small
            that the division overflows) is one-hot at its first +inf as well.
        top_k: int or integer tensor (batch,); keep the logits >= the k-th largest (ties at the
            boundary kept).  None, 0 or >= vocab disables it.
        top_p: float in (0, 1] or tensor (batch,); keep the smallest set of most probable tokens
            whose mass reaches top_p, plus every token tied with its least probable member.
            None or 1.0 disables it.

    Returns:
        probs: the shape of logits, float32, rows summing to 1.

    Raises:
        TypeError: logits not a float tensor; top_k a float; a parameter of the wrong type.
        ValueError: wrong rank; a per-sequence parameter not of shape (batch,); temperature < 0
            or top_p outside (0, 1] (value checks on CPU tensors).
    """
    t, k, p = check_sampling_args(logits, temperature, top_k, top_p)
    return _sampling_probs(logits, t, k, p)
