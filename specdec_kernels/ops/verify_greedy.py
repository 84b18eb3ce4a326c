"""verify_greedy: greedy acceptance of a chain of draft tokens, ``torch.ops.specdec.verify_greedy``.

Backends: "reference" (plain PyTorch, every device) and "triton" (CUDA, or CPU under
``TRITON_INTERPRET=1``: ``specdec_kernels.ops._triton.verify_greedy``, a split argmax over V
and one acceptance program per sequence).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels import _backend, _library
from specdec_kernels.reference import verify_greedy as _ref
from specdec_kernels.reference.verify_greedy import _verify_greedy, check_verify_greedy_args

IMPLEMENTED = ("reference", "native", "triton")


def _impl(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
    backend: str = "",
) -> Tuple[torch.Tensor, torch.Tensor]:
    _, _, _, n = check_verify_greedy_args(target_logits, draft_tokens, num_draft_tokens, validate=False)
    name = _backend.resolve("verify_greedy", target_logits.device, backend or None, IMPLEMENTED)
    if name == "triton":
        from specdec_kernels.ops._triton.verify_greedy import verify_greedy_triton

        return verify_greedy_triton(target_logits, draft_tokens, n)
    if name == "native":
        return torch.ops.specdec.verify_greedy_native(target_logits, draft_tokens, n)
    return _verify_greedy(target_logits, draft_tokens, n)


def _fake(target_logits, draft_tokens, num_draft_tokens=None, backend=""):
    # the eager op's checks that need no values: the same ValueError/TypeError when traced
    check_verify_greedy_args(target_logits, draft_tokens, num_draft_tokens, validate=False)
    _library.check_backend_name(backend)
    B, K1, _ = target_logits.shape
    torch._check(draft_tokens.shape == (B, K1 - 1), lambda: "draft_tokens must have shape (B, K)")
    torch._check(num_draft_tokens is None or num_draft_tokens.shape == (B,), lambda: "num_draft_tokens must have shape (B,)")
    return target_logits.new_empty((B, K1), dtype=torch.int64), target_logits.new_empty((B,), dtype=torch.int64)


def _triton_decomposition(args, kwargs):
    x = _library.bound_arguments(_impl, args, kwargs)
    if _backend.resolve("verify_greedy", x["target_logits"].device, x["backend"] or None, IMPLEMENTED) != "triton":
        return None
    n = x["num_draft_tokens"]
    if n is None:
        B, K1, _ = x["target_logits"].shape
        n = torch.full((B,), K1 - 1, dtype=torch.int64, device=x["target_logits"].device)
    return torch.ops.specdec.verify_greedy_triton(x["target_logits"], x["draft_tokens"], n.to(torch.int64), 0, 0)


op = _library.define("verify_greedy", _impl, cpu=_impl, cuda=_impl, fake=_fake, triton_decomposition=_triton_decomposition)


def verify_greedy(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
    *,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    _, _, _, n = check_verify_greedy_args(target_logits, draft_tokens, num_draft_tokens, validate)
    return torch.ops.specdec.verify_greedy(target_logits, draft_tokens, n, backend or "")


verify_greedy.__doc__ = _backend.public_doc(_ref, "verify_greedy")


# the Triton launchers and kernels (verify_greedy_triton, AOT_SPECS, ...), loaded on first access
__getattr__ = _library.lazy_attributes(__name__, "specdec_kernels.ops._triton.verify_greedy")
