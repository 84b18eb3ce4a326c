"""rejection_sample_flattened: lossless speculative sampling in the flattened (vLLM v1) layout,
``torch.ops.specdec.rejection_sample_flattened``.

Backends: "reference" (plain PyTorch, every device), "native" (the C++ CPU kernel of
``rejection_sample``, csrc/verify_sample_cpu.cpp, given the request spans) and "triton"
(``_rejection_partials_kernel`` and ``_rejection_sample_kernel`` with ``FLAT=True``,
``specdec_kernels.ops._triton.rejection_sample``).
No backend copies the rows into a padded layout.  The registered op takes its random numbers
explicitly (coins [T], sample uniforms [B]); the Python front makes them exactly as the padded
front does for each request (``specdec_kernels.reference.rejection_sample_flattened.flattened_uniforms``).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from specdec_kernels import _backend, _library, _native
from specdec_kernels.checks import check_uniforms
from specdec_kernels._flattened import check_flattened_args
from specdec_kernels._random import GeneratorArg
from specdec_kernels.reference.rejection_sample import RejectionSampleDetails
from specdec_kernels.reference.rejection_sample_flattened import (
    _rejection_sample_flattened,
    flattened_uniforms,
    rejection_details_flattened,
)
from specdec_kernels.reference.rejection_sample_flattened import rejection_sample_flattened as _ref

IMPLEMENTED = ("reference", "native", "triton")
OP = "rejection_sample_flattened"


def _check(target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, uniform_samples,
           sample_uniforms, max_spec_len):
    """The registered op's checks (no values read); returns (FlatBatch, coins, sample uniforms)."""
    flat = check_flattened_args("target_probs", target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens,
                                bonus_token_ids, max_spec_len, validate=False, probs=True)
    device = target_probs.device
    coins = check_uniforms("uniform_samples", uniform_samples, (flat.num_tokens,), device, validate=False)
    final = check_uniforms("sample_uniforms", sample_uniforms, (flat.batch,), device, validate=False)
    return flat, coins, final


def _impl(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor],
    uniform_samples: torch.Tensor,
    sample_uniforms: torch.Tensor,
    max_spec_len: int,
    backend: str = "",
) -> Tuple[torch.Tensor, torch.Tensor]:
    _, coins, final = _check(target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids,
                             uniform_samples, sample_uniforms, max_spec_len)
    name = _backend.resolve(OP, target_probs.device, backend or None, IMPLEMENTED)
    args = (draft_token_ids, cu_num_draft_tokens, bonus_token_ids, coins, final, max_spec_len)
    if name == "triton":
        from specdec_kernels.ops._triton.rejection_sample import rejection_sample_flattened_triton

        return rejection_sample_flattened_triton(target_probs, draft_probs, *args)
    if name == "native":
        p, q = _native.probs_operands(target_probs, draft_probs)
        return torch.ops.specdec.rejection_sample_flattened_native(p, q, *args)
    return _rejection_sample_flattened(target_probs, draft_probs, *args)


def _fake(target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, uniform_samples,
          sample_uniforms, max_spec_len, backend=""):
    flat, _, _ = _check(target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids,
                        uniform_samples, sample_uniforms, max_spec_len)
    _library.check_backend_name(backend)
    new = lambda *shape: target_probs.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return new(flat.batch, max_spec_len + 1), new(flat.batch)


def _triton_decomposition(args, kwargs):
    x = _library.bound_arguments(_impl, args, kwargs)
    p = x["target_probs"]
    if _backend.resolve(OP, p.device, x["backend"] or None, IMPLEMENTED) != "triton":
        return None
    return torch.ops.specdec.rejection_sample_flattened_triton(
        p, x["draft_probs"], x["draft_token_ids"], x["cu_num_draft_tokens"], x["bonus_token_ids"],
        x["uniform_samples"].to(torch.float32), x["sample_uniforms"].to(torch.float32), x["max_spec_len"],
    )


op = _library.define(OP, _impl, cpu=_impl, cuda=_impl, fake=_fake, triton_decomposition=_triton_decomposition)


def rejection_sample_flattened(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor] = None,
    *,
    max_spec_len: Optional[int] = None,
    generator: GeneratorArg = None,
    uniform_samples: Optional[torch.Tensor] = None,
    sample_uniforms: Optional[torch.Tensor] = None,
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    return_details: bool = False,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> Union[Tuple[torch.Tensor, torch.Tensor], RejectionSampleDetails]:
    flat = check_flattened_args("target_probs", target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens,
                                bonus_token_ids, max_spec_len, validate, probs=True)
    coins, final_u = flattened_uniforms(flat, cu_num_draft_tokens, target_probs.device, generator, uniform_samples,
                                        sample_uniforms, seeds=seeds, offsets=offsets, validate=validate)
    args = (target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, flat.bonus_token_ids)
    out, acc = torch.ops.specdec.rejection_sample_flattened(*args, coins, final_u, flat.max_spec_len, backend or "")
    if return_details:
        return rejection_details_flattened(*args, coins, flat.max_spec_len, out, acc)
    return out, acc


rejection_sample_flattened.__doc__ = _backend.public_doc(_ref, OP) + """
    Triton backend:
        The padded op's two kernels (``_rejection_partials_kernel`` over vocabulary chunks,
        then ``_rejection_sample_kernel``) with ``FLAT=True``: each program reads its requests'
        spans from cu_num_draft_tokens and addresses the flat rows directly; with
        bonus_token_ids, fully accepted requests skip the sampling passes.
"""
