"""sampling_probs: temperature, top-k and top-p applied once for drafter and verifier,
``torch.ops.specdec.sampling_probs``.

Backends: "reference" (``specdec_kernels.reference.sampling_probs``, every device), "native"
(the C++ CPU kernel, ``csrc/verify_sample_cpu.cpp``; the automatic CPU backend) and "triton"
(CUDA, or CPU under ``TRITON_INTERPRET=1``: ``specdec_kernels.ops._triton.sampling_probs``). The
registered op takes per-row tensors (temperature [B] float32, top_k [B] int64 or None, top_p [B]
float32 or None: None skips that stage); the Python front also takes numbers.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from specdec_kernels import _backend, _library
from specdec_kernels._eager import filled
from specdec_kernels.checks import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_shape,
    check_tensor,
    sampling_temperature,
    sampling_top_k,
    sampling_top_p,
    want_value_checks,
)
from specdec_kernels.reference.sampling_probs import _sampling_probs

IMPLEMENTED = ("reference", "native", "triton")
_TRITON = "specdec_kernels.ops._triton.sampling_probs:sampling_probs_triton"
Param = Union[None, int, float, torch.Tensor]


def _per_row(name: str, value, batch: int, device, dtype, default, scalar) -> torch.Tensor:
    """A number (checked as given and converted by ``scalar``, e.g. ``checks.sampling_top_p``)
    or a [B] tensor (checked for shape and kind here; its values, in its own dtype, by the
    caller), returned as a [B] tensor: a number (or None: ``default``) as a constant in
    ``dtype`` (``_eager.filled``: no kernel on the eager path), a tensor as given."""
    if value is None:
        return filled(batch, default, dtype, device)
    if isinstance(value, torch.Tensor):
        check_tensor(name, value, ndim=1, device=device)
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number tensor, got {value.dtype}")
        check_shape(name, value, (batch,), "one value per sequence (the first dimension of logits)")
        return value
    return filled(batch, scalar(name, value), dtype, device)  # a number, or the TypeError naming it


def check_sampling_args(logits, temperature, top_k, top_p, validate=None):
    """Validate the arguments of ``sampling_probs``; return them as [B] tensors: float32
    temperature, int64 top_k, float32 top_p.

    Numbers are checked exactly as given, always (it costs nothing), and then converted as
    ``checks.sampling_temperature`` / ``sampling_top_k`` / ``sampling_top_p`` say, so that
    rounding to float32 / int64 never carries a valid value out of its range (top_p 1e-50 is
    not 0.0); they (and None) cost no kernel.  Tensors are checked in their own dtype
    (temperature >= 0, top_k >= 0, top_p in (0, 1]) when ``validate`` allows (default: CPU
    tensors), then cast the same way: a float64 temperature above float32's largest value
    becomes that value, a top_p below float32's smallest normal becomes that normal, and a NaN
    top_p (unchecked) acts as 1 on every backend."""
    check_tensor("logits", logits, ndim=(2, 3), dtypes=FLOAT_DTYPES)
    if logits.shape[-1] < 1:
        raise ValueError(f"logits must have a vocabulary of at least 1, got shape {tuple(logits.shape)}")
    B, dev = logits.shape[0], logits.device
    if isinstance(top_k, torch.Tensor):
        check_tensor("top_k", top_k, dtypes=INDEX_DTYPES)
    t = _per_row("temperature", temperature, B, dev, torch.float32, 1.0, sampling_temperature)
    k = _per_row("top_k", top_k, B, dev, torch.int64, 0, sampling_top_k)
    p = _per_row("top_p", top_p, B, dev, torch.float32, 1.0, sampling_top_p)
    given = [x for x in (temperature, top_k, top_p) if isinstance(x, torch.Tensor)]
    if not given:
        return t, k, p
    if B and want_value_checks(validate, *given):
        if isinstance(temperature, torch.Tensor) and ((t < 0).any() or t.isnan().any()):
            raise ValueError(f"temperature must be >= 0, got {t.flatten().tolist()[:8]}")
        if isinstance(top_k, torch.Tensor) and (k < 0).any():
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {k.flatten().tolist()[:8]}")
        if isinstance(top_p, torch.Tensor) and ((p <= 0) | (p > 1) | p.isnan()).any():
            raise ValueError(f"top_p must lie in (0, 1], got {p.flatten().tolist()[:8]}")
    if t.dtype == torch.float64:  # finite beyond float32's range: its largest value, not inf
        t = torch.where(t.isinf(), t, t.clamp(-FLOAT32_MAX, FLOAT32_MAX))
    t = t if t.dtype == torch.float32 else t.to(torch.float32)
    k = k if k.dtype == torch.int64 else k.to(torch.int64)
    if isinstance(top_p, torch.Tensor):
        p = p.to(torch.float32).clamp_min(FLOAT32_TINY)  # a positive top_p never becomes 0.0 (NaN stays NaN)
        p = torch.nan_to_num(p, nan=1.0)  # NaN top_p (unchecked input) acts as 1, on every backend
    return t, k, p


def _run(backend: str, logits, t, k, p, use_top_k: bool, use_top_p: bool) -> torch.Tensor:
    """The backend ``backend`` on checked [B] parameters (``check_sampling_args``): the op's
    kernel after its checks, and the front's eager path (one check pass, no dispatcher)."""
    if backend == "triton":
        return _backend.triton_launcher(_TRITON)(logits, t, k, p, use_top_k, use_top_p)
    if backend == "native":
        return torch.ops.specdec_native.sampling_probs(
            logits,  # read in place, any strides
            t,
            k if use_top_k else None,
            p if use_top_p else None,
        )
    shape = (logits.shape[0],) + (1,) * (logits.dim() - 1)  # broadcast over (B, ..., V)
    return _sampling_probs(logits, t.view(shape), k.view(shape), p.view(shape))


def _impl(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: Optional[torch.Tensor] = None,
    top_p: Optional[torch.Tensor] = None,
    backend: str = "",
) -> torch.Tensor:
    t, k, p = check_sampling_args(logits, temperature, top_k, top_p, validate=False)
    name = _backend.resolve("sampling_probs", logits.device, backend or None, IMPLEMENTED)
    return _run(name, logits, t, k, p, top_k is not None, top_p is not None)


def _fake(logits, temperature, top_k=None, top_p=None, backend=""):
    check_sampling_args(logits, temperature, top_k, top_p, validate=False)
    _library.check_backend_name(backend)
    torch._check(temperature.shape == (logits.shape[0],), lambda: "temperature must have shape (B,)")
    return logits.new_empty(logits.shape, dtype=torch.float32)


op = _library.define("sampling_probs", _impl, fake=_fake, implemented=IMPLEMENTED, decompose_to_triton=True)


def sampling_probs(
    logits: torch.Tensor,
    temperature: Param = 1.0,
    top_k: Param = None,
    top_p: Param = None,
    *,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> torch.Tensor:
    """The one distribution that the drafter samples from and the verifier checks against.

    Applies, in this order (as Hugging Face's logits warpers do): temperature, top-k, softmax,
    top-p (nucleus sampling, Holtzman et al. 2020), renormalisation.

    Args:
        logits: Shape (batch, vocab) or (batch, rows, vocab), float32/float16/bfloat16.
        temperature: float >= 0, or a float tensor of shape (batch,).  0 is greedy: the row
            becomes one-hot at ``torch.argmax`` (first maximum, NaN counts as maximum).  A row
            with a +inf logit after temperature (an infinite logit, or a temperature so small
            that the division overflows) is one-hot at its largest logit as well (the limit of
            T -> 0; the first of equal ones).  Computed in
            float32: a positive temperature <= 2**-150 rounds to 0 (greedy), one above
            float32's largest value (3.4e38) acts as that value; +inf gives a uniform row.
        top_k: int >= 0 or integer tensor (batch,); keep the logits >= the k-th largest (ties
            at the boundary kept).  None, 0 or >= vocab disables it.
        top_p: float in (0, 1] or tensor (batch,); keep the smallest set of most probable tokens
            whose mass reaches top_p, plus every token tied with its least probable member.
            None or 1.0 disables it.  A positive top_p below float32's smallest normal value
            (e.g. 1e-50) acts as that value: the same nucleus, the most probable token and
            its ties.

    Numbers are checked exactly as given (before any cast), whatever ``validate`` says;
    tensors in their own dtype, when ``validate`` allows.

    Returns:
        probs: the shape of logits, float32, rows summing to 1.

    Raises:
        TypeError: logits not a float tensor; top_k a float or a bool; a parameter of the
            wrong type.
        ValueError: wrong rank; a per-sequence parameter not of shape (batch,); temperature < 0
            or NaN, top_k < 0, top_p NaN or outside (0, 1] (numbers always, tensors when
            ``validate`` allows).

    Registered as ``torch.ops.specdec.sampling_probs``. backend: None (automatic, chosen once
    per process and device type), "reference", "native" or "triton". validate: None (value
    checks on CPU tensors only), True or False (docs/API.md#backends).

    Triton backend:
        Two launches, no sort (``ops/_triton/sampling_probs.py``, docs/API.md).
        ``_sampling_search_kernel``, one program per row, passes over the row: temperature
        (IEEE division), the argmax and maximum; the top-k threshold, the k-th largest order
        key of the scaled logits (keep x >= it: ties kept), by a radix select of 4 passes of
        256-bin histograms; the softmax denominator; the top-p threshold by a multi-pivot
        search on the probabilities' bit patterns with float64 masses (keep p >= t where t is
        the smallest value with float64 mass strictly above it < top_p: the reference's
        nucleus, ties kept), 16 pivots a pass, at most 8 passes.  ``_sampling_write_kernel``
        writes the renormalised rows over (row blocks, vocabulary chunks), so batch 1 spreads
        over the GPU.  Probabilities agree with the reference's within float32 rounding (the
        kernel's exp and sums are not PyTorch's), so the kept set is exactly the reference's
        whenever no float64 partial mass is within rounding of top_p and the probabilities at
        the nucleus boundary are not within float32 rounding of each other: two logits a few
        ulps apart can give one float32 probability in one and two in the other, and a tie at
        the boundary is kept whole.  A row holding NaN after temperature, or only -inf, gives
        NaN everywhere, and a row holding +inf after temperature is one-hot at its largest
        logit, as in the reference.
    """
    t, k, p = check_sampling_args(logits, temperature, top_k, top_p, validate)
    use_top_k, use_top_p = top_k is not None, top_p is not None
    if _library.direct_call(logits, t, k, p, grad_check=True):  # eager: checked once, no dispatcher
        name = _backend.resolve("sampling_probs", logits.device, backend or None, IMPLEMENTED)
        return _run(name, logits, t, k, p, use_top_k, use_top_p)
    return torch.ops.specdec.sampling_probs(
        logits, t, k if use_top_k else None, p if use_top_p else None, backend or ""
    )
