"""sampling_probs: temperature, top-k and top-p applied once for drafter and verifier,
``torch.ops.specdec.sampling_probs``.

Backends: "reference" (plain PyTorch, every device) and "triton" (CUDA, or CPU under
``TRITON_INTERPRET=1``: ``specdec_kernels.ops._triton.sampling_probs``).  The registered op
takes per-row tensors (temperature [B] float32, top_k [B] int64 or None, top_p [B] float32 or
None: None skips that stage); the Python front also takes numbers.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from specdec_kernels import _backend, _library
from specdec_kernels.reference import sampling_probs as _ref
from specdec_kernels.reference.sampling_probs import _sampling_probs, check_sampling_args

IMPLEMENTED = ("reference", "native", "triton")
Param = Union[None, int, float, torch.Tensor]


def _impl(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: Optional[torch.Tensor] = None,
    top_p: Optional[torch.Tensor] = None,
    backend: str = "",
) -> torch.Tensor:
    t, k, p = check_sampling_args(logits, temperature, top_k, top_p, validate=False)
    name = _backend.resolve("sampling_probs", logits.device, backend or None, IMPLEMENTED)
    if name == "triton":
        from specdec_kernels.ops._triton.sampling_probs import sampling_probs_triton

        B = logits.shape[0]
        return sampling_probs_triton(logits, t.reshape(B), k.reshape(B), p.reshape(B), top_k is not None, top_p is not None)
    if name == "native":
        B = logits.shape[0]
        return torch.ops.specdec.sampling_probs_native(
            logits.contiguous(), t.reshape(B), None if top_k is None else k.reshape(B), None if top_p is None else p.reshape(B)
        )
    return _sampling_probs(logits, t, k, p)


def _fake(logits, temperature, top_k=None, top_p=None, backend=""):
    check_sampling_args(logits, temperature, top_k, top_p, validate=False)
    _library.check_backend_name(backend)
    torch._check(temperature.shape == (logits.shape[0],), lambda: "temperature must have shape (B,)")
    return logits.new_empty(logits.shape, dtype=torch.float32)


def _triton_decomposition(args, kwargs):
    x = _library.bound_arguments(_impl, args, kwargs)
    logits = x["logits"]
    if _backend.resolve("sampling_probs", logits.device, x["backend"] or None, IMPLEMENTED) != "triton":
        return None
    B = logits.shape[0]
    k, p = x["top_k"], x["top_p"]
    return torch.ops.specdec.sampling_probs_triton(
        logits, x["temperature"].to(torch.float32),
        torch.zeros(B, dtype=torch.int64, device=logits.device) if k is None else k.to(torch.int64),
        torch.ones(B, dtype=torch.float32, device=logits.device) if p is None else p.to(torch.float32),
        k is not None, p is not None,
    )


op = _library.define("sampling_probs", _impl, cpu=_impl, cuda=_impl, fake=_fake, triton_decomposition=_triton_decomposition)


def sampling_probs(
    logits: torch.Tensor,
    temperature: Param = 1.0,
    top_k: Param = None,
    top_p: Param = None,
    *,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> torch.Tensor:
    t, k, p = check_sampling_args(logits, temperature, top_k, top_p, validate)
    B = logits.shape[0]
    return torch.ops.specdec.sampling_probs(
        logits, t.reshape(B), None if top_k is None else k.reshape(B), None if top_p is None else p.reshape(B), backend or ""
    )


sampling_probs.__doc__ = _backend.public_doc(_ref, "sampling_probs") + """
    Triton backend:
        One kernel (``_sampling_probs_kernel``) launched once per stage over (row blocks,
        vocabulary chunks), so batch 1 spreads over the GPU, and no sort: temperature (IEEE
        division) and the argmax; the top-k threshold by a multi-pivot search on the
        order-preserving integer image of the logits (keep x >= t where t is the smallest value
        with fewer than k logits above it: the k-th largest, ties kept), 16 pivots per pass,
        8 passes over V; the softmax denominator; the top-p threshold by the same search on the
        probabilities' bit patterns with float64 masses (keep p >= t where t is the smallest
        value with float64 mass strictly above it < top_p: the reference's nucleus, ties
        kept), 8 passes; the renormalised row.  Probabilities agree with the reference's within
        float32 rounding (the kernel's exp and sums are not PyTorch's), so the kept set is
        exactly the reference's whenever no float64 partial mass is within rounding of top_p
        and the probabilities at the nucleus boundary are not within float32 rounding of each
        other: two logits a few ulps apart can give one float32 probability in one and two in
        the other, and a tie at the boundary is kept whole.  A row holding NaN after
        temperature, or only -inf, gives NaN everywhere, and a row holding +inf is one-hot at
        its first +inf, as in the reference.
"""


# the Triton launchers and kernels (verify_greedy_triton, AOT_SPECS, ...), loaded on first access
__getattr__ = _library.lazy_attributes(__name__, "specdec_kernels.ops._triton.sampling_probs")
