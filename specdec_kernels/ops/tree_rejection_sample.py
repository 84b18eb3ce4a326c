"""tree_rejection_sample: multi-candidate rejection sampling over a token tree."""
from __future__ import annotations

from specdec_kernels import _backend
from specdec_kernels._random import draw_uniforms
from specdec_kernels.reference import tree_rejection_sample as _ref
from specdec_kernels.reference.tree_rejection_sample import _tree_rejection_sample, check_tree_rejection_sample_args

IMPLEMENTED = ("reference",)


def tree_rejection_sample(
    target_probs,
    tree_tokens,
    tree_parents,
    draft_probs=None,
    num_nodes=None,
    *,
    generator=None,
    uniform_samples=None,
    sample_uniforms=None,
    backend=None,
    validate=None,
):
    B, N, _, parents, n = check_tree_rejection_sample_args(
        target_probs, tree_tokens, tree_parents, draft_probs, num_nodes, validate
    )
    coins, final_u = draw_uniforms(B, N - 1, target_probs.device, generator, uniform_samples, sample_uniforms)
    _backend.resolve("tree_rejection_sample", target_probs.device, backend, IMPLEMENTED)
    return _tree_rejection_sample(target_probs, tree_tokens, parents, draft_probs, n, coins, final_u)


tree_rejection_sample.__doc__ = _backend.public_doc(_ref)
