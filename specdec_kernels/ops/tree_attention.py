"""tree_attention: draft-tree queries attend to the cached prefix and to their ancestors."""
from __future__ import annotations

from specdec_kernels import _backend
from specdec_kernels.reference import tree_attention as _ref
from specdec_kernels.reference.tree_attention import _tree_attention, check_tree_attention_args

IMPLEMENTED = ("reference",)


def tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask=None, *, sm_scale=None, backend=None, validate=None):
    check_tree_attention_args(q, k_cache, v_cache, cache_seqlens, tree_mask, validate)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    _backend.resolve("tree_attention", q.device, backend, IMPLEMENTED)
    return _tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, scale)


tree_attention.__doc__ = _backend.public_doc(_ref)
