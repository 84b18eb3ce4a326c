"""verify_greedy: greedy acceptance of a chain of draft tokens, ``torch.ops.specdec.verify_greedy``.

Backends: "reference" (``specdec_kernels.reference.verify_greedy``, every device), "native" (the
C++ CPU kernel, ``csrc/verify_sample_cpu.cpp``; the automatic CPU backend) and "triton" (CUDA,
or CPU under ``TRITON_INTERPRET=1``: ``specdec_kernels.ops._triton.verify_greedy``, a split
argmax over V and one acceptance program per sequence).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels import _backend, _library, reference
from specdec_kernels._checks import check_chain_args

IMPLEMENTED = ("reference", "native", "triton")
OP = "verify_greedy"
# the launcher with its tiling at the defaults (verify_greedy_triton without its keyword layer)
_TRITON = "specdec_kernels.ops._triton.verify_greedy:_verify_greedy_triton_impl"


def check_verify_greedy_args(target_logits, draft_tokens, num_draft_tokens, validate=None):
    """Validate the arguments of ``verify_greedy``; return (B, K, V, num_draft_tokens int64)."""
    return check_chain_args("target_logits", target_logits, draft_tokens, num_draft_tokens, validate)


def _run(backend: str, target_logits, draft_tokens, n) -> Tuple[torch.Tensor, torch.Tensor]:
    """The backend ``backend`` on checked arguments (``n``: int64 counts): the op's kernel after
    its checks, and the front's eager path (one check pass, no dispatcher)."""
    if backend == "triton":
        verify_greedy_triton = _backend.triton_launcher(_TRITON)
        return verify_greedy_triton(target_logits, draft_tokens, n)
    if backend == "native":
        return torch.ops.specdec_native.verify_greedy(target_logits, draft_tokens, n)
    return reference.verify_greedy(target_logits, draft_tokens, n)


def _impl(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
    backend: str = "",
) -> Tuple[torch.Tensor, torch.Tensor]:
    _, _, _, n = check_verify_greedy_args(target_logits, draft_tokens, num_draft_tokens, validate=False)
    name = _backend.resolve(OP, target_logits.device, backend or None, IMPLEMENTED)
    return _run(name, target_logits, draft_tokens, n)


def _fake(target_logits, draft_tokens, num_draft_tokens=None, backend=""):
    # the eager op's checks that need no values: the same ValueError/TypeError when traced
    check_verify_greedy_args(target_logits, draft_tokens, num_draft_tokens, validate=False)
    _library.check_backend_name(backend)
    B, K1, _ = target_logits.shape
    torch._check(draft_tokens.shape == (B, K1 - 1), lambda: "draft_tokens must have shape (B, K)")
    torch._check(
        num_draft_tokens is None or num_draft_tokens.shape == (B,), lambda: "num_draft_tokens must have shape (B,)"
    )
    return target_logits.new_empty((B, K1), dtype=torch.int64), target_logits.new_empty((B,), dtype=torch.int64)


op = _library.define(OP, _impl, fake=_fake, implemented=IMPLEMENTED, decompose_to_triton=True, grad_inputs="ignore")


def verify_greedy(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
    *,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of a chain of draft tokens.

    Speculative decoding at temperature 0 (Leviathan et al. 2023, "Fast Inference from
    Transformers via Speculative Decoding", greedy case): a draft token is accepted while it
    equals the target model's argmax at its position; the first mismatch is replaced by the
    target's argmax (the correction token); when every draft is accepted the target's argmax
    after the last draft is the bonus token.

    Args:
        target_logits: Shape (batch, K + 1, vocab), float32/float16/bfloat16.  Row j scores
            the token after draft j - 1; row 0 follows the committed prefix.
        draft_tokens: Shape (batch, K), int32/int64.  Entries at or past a row's count are
            ignored whatever their value; ids outside [0, vocab) never match.
        num_draft_tokens: Shape (batch,), int32/int64 in 0..K, or None for all K.

    Returns:
        output_tokens: Shape (batch, K + 1), int64: the accepted drafts, then the correction
            or bonus token, then -1 padding.
        num_accepted: Shape (batch,), int64: accepted drafts; a row emits num_accepted + 1.

    argmax follows ``torch.argmax`` (first index of the maximum; NaN counts as the maximum),
    so an emitted id is always in [0, vocab).

    Raises:
        TypeError: a tensor argument of the wrong dtype or not a tensor.
        ValueError: wrong rank, mismatched batch, draft_tokens not (batch, K) for K + 1
            logits rows, num_draft_tokens outside 0..K, tensors on different devices.

    Registered as ``torch.ops.specdec.verify_greedy``. backend: None (automatic, chosen once per
    process and device type), "reference", "native" or "triton". validate: None (value checks on
    CPU tensors only), True or False (docs/API.md#backends).
    """
    _, _, _, n = check_verify_greedy_args(target_logits, draft_tokens, num_draft_tokens, validate)
    if _library.direct_call(target_logits, draft_tokens, n):  # eager: the backend itself, checked once
        return _run(
            _backend.resolve(OP, target_logits.device, backend or None, IMPLEMENTED), target_logits, draft_tokens, n
        )
    return torch.ops.specdec.verify_greedy(target_logits, draft_tokens, n, backend or "")
