"""rejection_sample: lossless speculative sampling of a chain of draft tokens."""
from __future__ import annotations

from specdec_kernels import _backend
from specdec_kernels._random import draw_uniforms
from specdec_kernels.reference import rejection_sample as _ref
from specdec_kernels.reference.rejection_sample import _rejection_sample, check_rejection_sample_args

IMPLEMENTED = ("reference",)


def rejection_sample(
    target_probs,
    draft_probs,
    draft_tokens,
    num_draft_tokens=None,
    *,
    generator=None,
    uniform_samples=None,
    sample_uniforms=None,
    backend=None,
    validate=None,
):
    B, K, _, n = check_rejection_sample_args(target_probs, draft_probs, draft_tokens, num_draft_tokens, validate)
    coins, final_u = draw_uniforms(B, K, target_probs.device, generator, uniform_samples, sample_uniforms)
    _backend.resolve("rejection_sample", target_probs.device, backend, IMPLEMENTED)
    return _rejection_sample(target_probs, draft_probs, draft_tokens, n, coins, final_u)


rejection_sample.__doc__ = _backend.public_doc(_ref)
