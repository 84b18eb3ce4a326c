"""verify_greedy_flattened: greedy verification in the flattened (vLLM v1) layout,
``torch.ops.specdec.verify_greedy_flattened``.

Backends: "reference" (plain PyTorch, every device), "native" (the C++ CPU kernel of
``verify_greedy``, csrc/verify_sample_cpu.cpp, given the request spans) and "triton" (the
``verify_greedy`` kernels, ``specdec_kernels.ops._triton.verify_greedy``: the split argmax over
all flat rows, then the acceptance kernel with ``FLAT=True``, which derives each request's rows
from ``cu_num_draft_tokens``).  No backend copies the rows into a padded layout.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels import _backend, _library
from specdec_kernels._flattened import FlatBatch, check_greedy_flattened_args
from specdec_kernels.reference.verify_greedy_flattened import _verify_greedy_flattened

IMPLEMENTED = ("reference", "native", "triton")
OP = "verify_greedy_flattened"
_TRITON = "specdec_kernels.ops._triton.verify_greedy:_verify_greedy_flattened_triton_impl"  # tiling at its defaults


def check_verify_greedy_flattened_args(
    target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate=None
) -> FlatBatch:
    """Validate the arguments of ``verify_greedy_flattened``; return their ``FlatBatch``."""
    return check_greedy_flattened_args(
        target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate
    )


def _run(backend: str, target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len):
    """The backend ``backend`` on checked arguments: the op's kernel after its checks, and the
    front's eager path (one check pass, no dispatcher)."""
    args = (target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len)
    if backend == "triton":
        verify_greedy_flattened_triton = _backend.triton_launcher(_TRITON)
        return verify_greedy_flattened_triton(*args)
    if backend == "native":
        return torch.ops.specdec_native.verify_greedy_flattened(*args)
    return _verify_greedy_flattened(*args)


def _impl(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor],
    max_spec_len: int,
    backend: str = "",
) -> Tuple[torch.Tensor, torch.Tensor]:
    check_verify_greedy_flattened_args(
        target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate=False
    )
    name = _backend.resolve(OP, target_logits.device, backend or None, IMPLEMENTED)
    return _run(name, target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len)


def _fake(target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, backend=""):
    # the eager op's checks that need no values: the same ValueError/TypeError when traced
    check_verify_greedy_flattened_args(
        target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate=False
    )
    _library.check_backend_name(backend)
    B = cu_num_draft_tokens.shape[0]
    new = lambda *shape: target_logits.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return new(B, max_spec_len + 1), new(B)


op = _library.define(OP, _impl, fake=_fake, implemented=IMPLEMENTED, decompose_to_triton=True, grad_inputs="ignore")


def verify_greedy_flattened(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor] = None,
    *,
    max_spec_len: Optional[int] = None,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of draft chains in the flattened (vLLM v1) layout.

    The algorithm of ``verify_greedy`` (Leviathan et al. 2023, greedy case: accept drafts
    while they equal the target's argmax, then emit the argmax at the first mismatch, or the
    bonus token) on vLLM v1's ragged layout (``SpecDecodeMetadata``): no padding of the
    inputs, -1 padding of the output.  Same tokens as ``verify_greedy`` on the same data
    padded to K = max_spec_len.

    Args:
        target_logits: Shape (T + B, vocab) without ``bonus_token_ids``: request b's K_b rows
            for its drafts then its bonus row (rows cu[b-1] + b .. cu[b] + b); or (T, vocab)
            with ``bonus_token_ids``.  float32/float16/bfloat16, rows read in place.
        draft_token_ids: Shape (T,), int32/int64: all requests' drafts concatenated.  Ids
            outside [0, vocab) never match.
        cu_num_draft_tokens: Shape (B,), int32/int64: the inclusive cumsum of the draft counts
            (request b's drafts are flat positions cu[b-1] .. cu[b] - 1, cu[-1] read as 0);
            zero-draft requests are allowed.
        bonus_token_ids: Shape (B,) (or (B, 1) as vLLM passes them), int32/int64, or None.
            When given, a request that accepts all its drafts emits bonus_token_ids[b] (copied
            as given, not checked against the vocabulary); at a mismatch the correction
            token is the rejected row's argmax as usual.
        max_spec_len: the output's padded width minus 1, >= max K_b.  None computes it from
            cu_num_draft_tokens: a host read (a synchronisation on CUDA); pass it to avoid
            that, as vLLM does.

    Returns:
        output_tokens: Shape (batch, max_spec_len + 1), int64: accepted drafts, the correction
            or bonus token, then -1 (vLLM's PLACEHOLDER_TOKEN_ID).
        num_accepted: Shape (batch,), int64: accepted drafts; a row emits num_accepted + 1.

    Raises:
        TypeError: a tensor of the wrong dtype or not a tensor; max_spec_len not an int.
        ValueError: wrong ranks; target_logits without T + B rows (or T with
            bonus_token_ids); bonus_token_ids not (B,); devices that differ; with value
            checks, cu_num_draft_tokens negative, decreasing or not ending at T, and
            max_spec_len below the largest draft count.

    Registered as ``torch.ops.specdec.verify_greedy_flattened``. backend: None (automatic,
    chosen once per process and device type), "reference", "native" or "triton". validate: None
    (value checks on CPU tensors only), True or False (docs/API.md#backends).
    """
    flat = check_verify_greedy_flattened_args(
        target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate
    )
    args = (target_logits, draft_token_ids, cu_num_draft_tokens, flat.bonus_token_ids, flat.max_spec_len)
    if _library.direct_call(target_logits, draft_token_ids, cu_num_draft_tokens, flat.bonus_token_ids):
        return _run(_backend.resolve(OP, target_logits.device, backend or None, IMPLEMENTED), *args)
    return torch.ops.specdec.verify_greedy_flattened(*args, backend or "")
