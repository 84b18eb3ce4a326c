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
from specdec_kernels._flattened import check_flattened_args
from specdec_kernels.reference.verify_greedy_flattened import _verify_greedy_flattened
from specdec_kernels.reference.verify_greedy_flattened import verify_greedy_flattened as _ref

IMPLEMENTED = ("reference", "native", "triton")
OP = "verify_greedy_flattened"


def _impl(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor],
    max_spec_len: int,
    backend: str = "",
) -> Tuple[torch.Tensor, torch.Tensor]:
    check_flattened_args("target_logits", target_logits, None, draft_token_ids, cu_num_draft_tokens, bonus_token_ids,
                         max_spec_len, validate=False)
    name = _backend.resolve(OP, target_logits.device, backend or None, IMPLEMENTED)
    if name == "triton":
        from specdec_kernels.ops._triton.verify_greedy import verify_greedy_flattened_triton

        return verify_greedy_flattened_triton(target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids,
                                              max_spec_len)
    if name == "native":
        return torch.ops.specdec.verify_greedy_flattened_native(
            target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len
        )
    return _verify_greedy_flattened(target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len)


def _fake(target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, backend=""):
    # the eager op's checks that need no values: the same ValueError/TypeError when traced
    check_flattened_args("target_logits", target_logits, None, draft_token_ids, cu_num_draft_tokens, bonus_token_ids,
                         max_spec_len, validate=False)
    _library.check_backend_name(backend)
    B = cu_num_draft_tokens.shape[0]
    new = lambda *shape: target_logits.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return new(B, max_spec_len + 1), new(B)


def _triton_decomposition(args, kwargs):
    x = _library.bound_arguments(_impl, args, kwargs)
    if _backend.resolve(OP, x["target_logits"].device, x["backend"] or None, IMPLEMENTED) != "triton":
        return None
    return torch.ops.specdec.verify_greedy_flattened_triton(
        x["target_logits"], x["draft_token_ids"], x["cu_num_draft_tokens"], x["bonus_token_ids"], x["max_spec_len"],
        0, 0,
    )


op = _library.define(OP, _impl, cpu=_impl, cuda=_impl, fake=_fake, triton_decomposition=_triton_decomposition)


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
    flat = check_flattened_args("target_logits", target_logits, None, draft_token_ids, cu_num_draft_tokens,
                                bonus_token_ids, max_spec_len, validate)
    return torch.ops.specdec.verify_greedy_flattened(
        target_logits, draft_token_ids, cu_num_draft_tokens, flat.bonus_token_ids, flat.max_spec_len, backend or ""
    )


verify_greedy_flattened.__doc__ = _backend.public_doc(_ref, OP)
