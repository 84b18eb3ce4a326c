"""compact_kv_cache: move the accepted tokens' K/V into place after verification."""
from __future__ import annotations

from specdec_kernels import _backend
from specdec_kernels.reference import compact_kv_cache as _ref
from specdec_kernels.reference.compact_kv_cache import _compact_kv_cache, check_compact_kv_cache_args

IMPLEMENTED = ("reference",)


def compact_kv_cache(kv_cache, cache_seqlens, accepted_indices, num_accepted, *, backend=None, validate=None):
    views, _, _, _, n = check_compact_kv_cache_args(kv_cache, cache_seqlens, accepted_indices, num_accepted, validate)
    _backend.resolve("compact_kv_cache", views[0].device, backend, IMPLEMENTED)
    _compact_kv_cache(views, cache_seqlens, accepted_indices, n)


compact_kv_cache.__doc__ = _backend.public_doc(_ref)
