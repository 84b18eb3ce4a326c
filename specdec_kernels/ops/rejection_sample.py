"""rejection_sample: lossless speculative sampling of a chain, ``torch.ops.specdec.rejection_sample``.

Backends: "reference" (plain PyTorch, every device) and "triton" (CUDA, or CPU under
``TRITON_INTERPRET=1``: ``specdec_kernels.ops._triton.rejection_sample``).  The registered op
takes its random numbers explicitly; the Python front makes them from a generator, a dict of
generators, or per-sequence Philox seeds and offsets (``specdec_kernels._random``).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from specdec_kernels import _backend, _library, _native
from specdec_kernels._random import GeneratorArg, draw_uniforms
from specdec_kernels.reference import rejection_sample as _ref
from specdec_kernels.reference.rejection_sample import (
    RejectionSampleDetails,
    _rejection_sample,
    check_rejection_sample_args,
    rejection_details,
)

IMPLEMENTED = ("reference", "native", "triton")


def _impl(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_tokens: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor],
    uniform_samples: torch.Tensor,
    sample_uniforms: torch.Tensor,
    backend: str = "",
) -> Tuple[torch.Tensor, torch.Tensor]:
    B, K, _, n = check_rejection_sample_args(target_probs, draft_probs, draft_tokens, num_draft_tokens, validate=False)
    coins, final_u = draw_uniforms(B, K, target_probs.device, None, uniform_samples, sample_uniforms, validate=False)
    name = _backend.resolve("rejection_sample", target_probs.device, backend or None, IMPLEMENTED)
    if name == "triton":
        from specdec_kernels.ops._triton.rejection_sample import rejection_sample_triton

        return rejection_sample_triton(target_probs, draft_probs, draft_tokens, n, coins, final_u)
    if name == "native":
        p, q = _native.probs_operands(target_probs, draft_probs)
        return torch.ops.specdec.rejection_sample_native(p, q, draft_tokens, n, coins, final_u)
    return _rejection_sample(target_probs, draft_probs, draft_tokens, n, coins, final_u)


def _fake(target_probs, draft_probs, draft_tokens, num_draft_tokens, uniform_samples, sample_uniforms, backend=""):
    B, K, _, _ = check_rejection_sample_args(target_probs, draft_probs, draft_tokens, num_draft_tokens, validate=False)
    draw_uniforms(B, K, target_probs.device, None, uniform_samples, sample_uniforms, validate=False)
    _library.check_backend_name(backend)
    B, K1, _ = target_probs.shape
    torch._check(draft_tokens.shape == (B, K1 - 1), lambda: "draft_tokens must have shape (B, K)")
    torch._check(uniform_samples.shape == (B, K1 - 1), lambda: "uniform_samples must have shape (B, K)")
    torch._check(sample_uniforms.shape == (B,), lambda: "sample_uniforms must have shape (B,)")
    return target_probs.new_empty((B, K1), dtype=torch.int64), target_probs.new_empty((B,), dtype=torch.int64)


def _triton_decomposition(args, kwargs):
    x = _library.bound_arguments(_impl, args, kwargs)
    p = x["target_probs"]
    if _backend.resolve("rejection_sample", p.device, x["backend"] or None, IMPLEMENTED) != "triton":
        return None
    B, K1, _ = p.shape
    n = x["num_draft_tokens"]
    n = torch.full((B,), K1 - 1, dtype=torch.int64, device=p.device) if n is None else n.to(torch.int64)
    return torch.ops.specdec.rejection_sample_triton(
        p, x["draft_probs"], x["draft_tokens"], n,
        x["uniform_samples"].to(torch.float32), x["sample_uniforms"].to(torch.float32),
    )


op = _library.define("rejection_sample", _impl, cpu=_impl, cuda=_impl, fake=_fake, triton_decomposition=_triton_decomposition)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_tokens: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
    *,
    generator: GeneratorArg = None,
    uniform_samples: Optional[torch.Tensor] = None,
    sample_uniforms: Optional[torch.Tensor] = None,
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    return_details: bool = False,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> Union[Tuple[torch.Tensor, torch.Tensor], RejectionSampleDetails]:
    B, K, _, n = check_rejection_sample_args(target_probs, draft_probs, draft_tokens, num_draft_tokens, validate)
    coins, final_u = draw_uniforms(
        B, K, target_probs.device, generator, uniform_samples, sample_uniforms,
        coin_counts=n, seeds=seeds, offsets=offsets, validate=validate,
    )
    out, acc = torch.ops.specdec.rejection_sample(target_probs, draft_probs, draft_tokens, n, coins, final_u,
                                                  backend or "")
    if return_details:  # in the front: B * K gathers and a NaN scan, only when asked
        return rejection_details(target_probs, draft_probs, draft_tokens, n, coins, out, acc)
    return out, acc


rejection_sample.__doc__ = _backend.public_doc(_ref, "rejection_sample") + """
    Randomness (the front; the registered op takes ``uniform_samples`` and ``sample_uniforms``):
        seeds, offsets: Shape (batch,), int32/int64: counter-based Philox numbers, sequence b's
            depending only on (seeds[b], offsets[b]); see ``specdec_kernels._random``.
        generator: also a dict {row: torch.Generator} with gaps (rows without one use the
            default generator); per-sequence generators draw only the sequence's own
            num_draft_tokens coins.

    Triton backend:
        Two launches.  ``_rejection_partials_kernel`` over (request blocks, vocabulary chunks):
        each program walks the chain's accept/reject (a few loads), then sums the float64 mass
        of p and of the residual max(0, p - q) over its chunk; on CUDA the chunks give about 8
        programs per SM even at batch 1.  ``_rejection_sample_kernel`` over request blocks:
        the chunk masses in chunk order give the total and the chunk where the running CDF
        first exceeds u * total, and the inverse-CDF search reads that chunk only.  The residual
        is recomputed, never written to memory.  Same tokens as the reference for the same
        uniforms, except when u * total lies within float64 rounding of a CDF boundary (the
        kernel sums in tiles and chunks, the reference sequentially).
"""


# the Triton launchers and kernels (verify_greedy_triton, AOT_SPECS, ...), loaded on first access
__getattr__ = _library.lazy_attributes(__name__, "specdec_kernels.ops._triton.rejection_sample")
