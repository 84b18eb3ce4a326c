"""compact_kv_cache: move the accepted tokens' K/V into place after verification.

Backends: "reference" (plain PyTorch) and "native" (``torch.ops.specdec.compact_kv_cache``
from the extension ``specdec_kernels._C``: ``csrc/compact_kv_cache.cpp`` on CPU,
``csrc/compact_kv_cache.cu`` on CUDA).

Native design:

- CPU: ``at::parallel_for`` over (cache, sequence, head), where a cache is one layer's keys
  or values; each task walks its accepted rows in ascending order and moves whole head rows
  (one memmove of head_dim * element_size bytes, element by element when the last dimension
  is strided).  Ascending order is safe in place because accepted_indices[b, i] >= i and
  strictly increasing: row i's source is never a row written before it (proof in the C++).
- CUDA: one launch for all layers, keys and values; one thread block per (cache, sequence,
  head) slice, moving 16-byte words when rows, bases and strides allow (else 8/4/2/1).  The
  block walks its destination words in ascending chunks, loading a chunk into registers,
  synchronising, then storing: the same ascending-order argument across threads.
- Any dtype (the copy moves bytes).  One [L, 2, B, Hkv, S, D] buffer is handed over whole
  (its 2L slices are found through its strides, never copied); a list of per-layer tensors
  is handed over as views.  On CUDA the last dimension must be contiguous; a single buffer
  (or a list of evenly spaced views of one) needs no host-to-device copy and can be captured
  in a CUDA graph, separately allocated layers cannot.
- Bounds: with value checks off, an index whose slot falls outside [0, S) is skipped and the
  count is clamped to [0, M]: the kernels never touch memory outside the caches (the result
  is then unspecified).  The public op runs the value checks on CPU tensors by default and on
  CUDA only with ``validate=True`` (they synchronise); the native op takes the same checks
  as its own ``validate`` argument for direct callers.
"""
from __future__ import annotations

import torch

from specdec_kernels import _backend, _native
from specdec_kernels.reference import compact_kv_cache as _ref
from specdec_kernels.reference.compact_kv_cache import _compact_kv_cache, check_compact_kv_cache_args

IMPLEMENTED = ("reference", "native")

_fake_registered = False


def _compact_kv_cache_fake(caches, cache_seqlens, accepted_indices, num_accepted, validate=False):
    """Fake (meta) implementation of specdec::compact_kv_cache: shape checks, no output."""
    torch._check(len(caches) > 0, lambda: "caches must hold at least one tensor")
    first = caches[0]
    torch._check(first.dim() in (4, 6), lambda: f"caches[0] must be [B, Hkv, S, D] or [L, 2, B, Hkv, S, D], got {tuple(first.shape)}")
    inner = first.shape[-4:]
    for k, t in enumerate(caches):
        torch._check(t.dim() in (4, 6), lambda: f"caches[{k}] must have 4 or 6 dimensions, got {tuple(t.shape)}")
        torch._check(t.dtype == first.dtype, lambda: f"caches[{k}] must have dtype {first.dtype}, got {t.dtype}")
        torch._check(t.device == first.device, lambda: f"caches[{k}] must be on {first.device}, got {t.device}")
        for d in range(4):
            torch._check(t.shape[t.dim() - 4 + d] == inner[d], lambda: f"caches[{k}] must end in {tuple(inner)}, got {tuple(t.shape)}")
        if t.dim() == 6:
            torch._check(t.shape[1] == 2, lambda: f"caches[{k}] must be [L, 2, B, Hkv, S, D], got {tuple(t.shape)}")
    B = inner[0]
    for name, t, ndim in (("cache_seqlens", cache_seqlens, 1), ("accepted_indices", accepted_indices, 2),
                          ("num_accepted", num_accepted, 1)):
        torch._check(t.dtype in (torch.int32, torch.int64), lambda: f"{name} must be int32 or int64, got {t.dtype}")
        torch._check(t.dim() == ndim, lambda: f"{name} must have {ndim} dimensions, got {tuple(t.shape)}")
        torch._check(t.shape[0] == B, lambda: f"{name} must have {B} rows, got {tuple(t.shape)}")
    return None


def register_fake() -> bool:
    """Register the fake implementation of ``torch.ops.specdec.compact_kv_cache`` once.

    The op is declared by the extension, so this can only run after ``specdec_kernels._C``
    has loaded; the public op calls it before its first native dispatch (in time for
    torch.compile tracing).  Returns whether the native op exists.
    """
    global _fake_registered
    if _fake_registered:
        return True
    if not _native.load() or not hasattr(torch.ops.specdec, "compact_kv_cache"):
        return False
    torch.library.register_fake("specdec::compact_kv_cache")(_compact_kv_cache_fake)
    _fake_registered = True
    return True


def compact_kv_cache(kv_cache, cache_seqlens, accepted_indices, num_accepted, *, backend=None, validate=None):
    views, _, _, _, n = check_compact_kv_cache_args(kv_cache, cache_seqlens, accepted_indices, num_accepted, validate)
    chosen = _backend.resolve("compact_kv_cache", views[0].device, backend, IMPLEMENTED)
    if chosen == "native":
        register_fake()
        # One [L, 2, B, Hkv, S, D] buffer goes over whole (the kernels read its strides);
        # otherwise the [B, Hkv, S, D] views.  Value checks were done above as requested.
        caches = [kv_cache] if isinstance(kv_cache, torch.Tensor) else views
        torch.ops.specdec.compact_kv_cache(caches, cache_seqlens, accepted_indices, n, False)
        return
    _compact_kv_cache(views, cache_seqlens, accepted_indices, n)


compact_kv_cache.__doc__ = _backend.public_doc(_ref)
