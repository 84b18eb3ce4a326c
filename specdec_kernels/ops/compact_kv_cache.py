"""compact_kv_cache: move the accepted tokens' K/V into place after verification,
``torch.ops.specdec.compact_kv_cache`` (in place).

Backends: "reference" (plain PyTorch) and "native" (``torch.ops.specdec.compact_kv_cache_native``
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

The registered op takes ``caches``: a list holding either the one [L, 2, B, Hkv, S, D] buffer
or the [B, Hkv, S, D] tensors of every layer's keys and values; it mutates them.

Paged caches (``block_table`` given) go to a second registered op,
``torch.ops.specdec.paged_compact_kv_cache`` (native kernel
``torch.ops.specdec.paged_compact_kv_cache_native``): ``caches`` then holds the one
[L, 2, num_blocks, block_size, Hkv, D] ("NHD") / [L, 2, num_blocks, Hkv, block_size, D]
("HND") pool or the per-layer [num_blocks, block_size, Hkv, D] (or HND) pools.  The kernels
are the dense ones with one more step: a logical slot s of sequence b is looked up as row
s % block_size of block block_table[b, s // block_size]; a slot outside the table or in a
block outside [0, num_blocks) is skipped, whatever ``validate`` says.  The ascending order
stays safe in place because the block table is one-to-one on the slots that one call reads
or writes (shared blocks are refused by the value checks; proof in the C++/CUDA comments).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from specdec_kernels import _backend, _library, _native
from specdec_kernels.reference import compact_kv_cache as _ref
from specdec_kernels.reference.compact_kv_cache import (
    KVCache,
    _compact_kv_cache,
    _paged_compact_kv_cache,
    check_compact_kv_cache_args,
    check_kv_layout,
    check_paged_compact_kv_cache_args,
)

IMPLEMENTED = ("reference", "native")


def _as_kv_cache(caches):
    """The op's list argument as the front's kv_cache: the 6-D buffer alone, or the list."""
    if len(caches) == 1 and caches[0].dim() == 6:
        return caches[0]
    return list(caches)


def _impl(
    caches: List[torch.Tensor],
    cache_seqlens: torch.Tensor,
    accepted_indices: torch.Tensor,
    num_accepted: Optional[torch.Tensor] = None,
    backend: str = "",
) -> None:
    kv_cache = _as_kv_cache(caches)
    views, _, _, _, n = check_compact_kv_cache_args(kv_cache, cache_seqlens, accepted_indices, num_accepted, validate=False)
    chosen = _backend.resolve("compact_kv_cache", views[0].device, backend or None, IMPLEMENTED)
    if chosen == "native":
        # One [L, 2, B, Hkv, S, D] buffer goes over whole (the kernels read its strides);
        # otherwise the [B, Hkv, S, D] views.  Value checks are the front's (validate=).
        native_caches = [kv_cache] if isinstance(kv_cache, torch.Tensor) else views
        torch.ops.specdec.compact_kv_cache_native(native_caches, cache_seqlens, accepted_indices, n, False)
        return
    _compact_kv_cache(views, cache_seqlens, accepted_indices, n)


def _fake(caches, cache_seqlens, accepted_indices, num_accepted=None, backend=""):
    """Shape checks only: nothing to compute (the op writes its caches in place)."""
    check_compact_kv_cache_args(_as_kv_cache(caches), cache_seqlens, accepted_indices, num_accepted, validate=False)
    _library.check_backend_name(backend)
    return _native._compact_kv_cache_native_fake(
        caches, cache_seqlens, accepted_indices, num_accepted if num_accepted is not None else cache_seqlens
    )


op = _library.define("compact_kv_cache", _impl, cpu=_impl, cuda=_impl, fake=_fake, mutates_args=("caches",))


def _paged_impl(
    caches: List[torch.Tensor],
    cache_seqlens: torch.Tensor,
    accepted_indices: torch.Tensor,
    num_accepted: Optional[torch.Tensor],
    block_table: torch.Tensor,
    kv_layout: str = "NHD",
    backend: str = "",
) -> None:
    kv_cache = _as_kv_cache(caches)
    views, _, _, _, n = check_paged_compact_kv_cache_args(kv_cache, cache_seqlens, accepted_indices, num_accepted,
                                                          block_table, kv_layout, validate=False)
    chosen = _backend.resolve("paged_compact_kv_cache", views[0].device, backend or None, IMPLEMENTED)
    if chosen == "native":
        native_caches = [kv_cache] if isinstance(kv_cache, torch.Tensor) else views
        torch.ops.specdec.paged_compact_kv_cache_native(native_caches, cache_seqlens, accepted_indices, n, block_table,
                                                        kv_layout, False)
        return
    _paged_compact_kv_cache(views, kv_layout, cache_seqlens, accepted_indices, n, block_table)


def _paged_fake(caches, cache_seqlens, accepted_indices, num_accepted, block_table, kv_layout="NHD", backend=""):
    """Shape checks only (the op writes its pools in place)."""
    check_paged_compact_kv_cache_args(_as_kv_cache(caches), cache_seqlens, accepted_indices, num_accepted, block_table,
                                      kv_layout, validate=False)
    _library.check_backend_name(backend)
    return _native._paged_compact_kv_cache_native_fake(
        caches, cache_seqlens, accepted_indices, num_accepted if num_accepted is not None else cache_seqlens,
        block_table, kv_layout,
    )


paged_op = _library.define("paged_compact_kv_cache", _paged_impl, cpu=_paged_impl, cuda=_paged_impl, fake=_paged_fake,
                           mutates_args=("caches",))


def compact_kv_cache(
    kv_cache: KVCache,
    cache_seqlens: torch.Tensor,
    accepted_indices: torch.Tensor,
    num_accepted: Optional[torch.Tensor] = None,
    *,
    block_table: Optional[torch.Tensor] = None,
    kv_layout: str = "NHD",
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> None:
    check_kv_layout(kv_layout)
    if block_table is not None:
        views, _, _, _, n = check_paged_compact_kv_cache_args(kv_cache, cache_seqlens, accepted_indices, num_accepted,
                                                              block_table, kv_layout, validate)
        caches = [kv_cache] if isinstance(kv_cache, torch.Tensor) else views
        torch.ops.specdec.paged_compact_kv_cache(caches, cache_seqlens, accepted_indices, n, block_table, kv_layout,
                                                 backend or "")
        return
    views, _, _, _, n = check_compact_kv_cache_args(kv_cache, cache_seqlens, accepted_indices, num_accepted, validate)
    caches = [kv_cache] if isinstance(kv_cache, torch.Tensor) else views
    torch.ops.specdec.compact_kv_cache(caches, cache_seqlens, accepted_indices, n, backend or "")


compact_kv_cache.__doc__ = _backend.public_doc(_ref, "compact_kv_cache").replace(
    "    Registered as ``torch.ops.specdec.compact_kv_cache``",
    "    Registered as ``torch.ops.specdec.compact_kv_cache`` (dense) and\n"
    "    ``torch.ops.specdec.paged_compact_kv_cache`` (with ``block_table``)",
)


def register_fake(paged: bool = False) -> bool:
    """Load the extension (which registers the fakes of ``compact_kv_cache_native`` and
    ``paged_compact_kv_cache_native``); return whether the native op (the paged one with
    ``paged=True``) exists.  Kept for callers of the native ops."""
    name = "paged_compact_kv_cache_native" if paged else "compact_kv_cache_native"
    return _native.load() and hasattr(torch.ops.specdec, name)
