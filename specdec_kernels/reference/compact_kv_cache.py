"""Reference KV-cache compaction after verification (plain PyTorch)."""
from __future__ import annotations

from typing import List, Sequence, Union

import torch

from specdec_kernels._checks import INDEX_DTYPES, check_counts, check_shape, check_tensor, want_value_checks

KVCache = Union[torch.Tensor, Sequence[torch.Tensor], Sequence[Sequence[torch.Tensor]]]


def cache_views(kv_cache: KVCache) -> List[torch.Tensor]:
    """The cache as a list of [B, Hkv, S, D] tensors (views, nothing copied).

    Accepts one [L, 2, B, Hkv, S, D] tensor, a flat sequence of [B, Hkv, S, D] tensors, or a
    sequence of (key, value) pairs of them.
    """
    if isinstance(kv_cache, torch.Tensor):
        check_tensor("kv_cache", kv_cache, ndim=6)
        if kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache must be [L, 2, B, Hkv, S, D] (keys and values), got shape {tuple(kv_cache.shape)}")
        # index, never flatten: flatten copies a buffer whose first two dims do not merge
        # (e.g. a [2, L, ...] allocation permuted to [L, 2, ...]), and the copy would be written
        return [kv_cache[layer, kv] for layer in range(kv_cache.shape[0]) for kv in range(kv_cache.shape[1])]
    if not isinstance(kv_cache, (list, tuple)):
        raise TypeError(f"kv_cache must be a tensor or a sequence of tensors, got {type(kv_cache).__name__}")
    flat = []
    for i, item in enumerate(kv_cache):
        if isinstance(item, (list, tuple)):
            flat.extend(item)
        else:
            flat.append(item)
    for i, t in enumerate(flat):
        check_tensor(f"kv_cache[{i}]", t, ndim=4)
    return flat


def _extent(t: torch.Tensor):
    """(storage address, first element, one past the last element) that ``t`` can touch."""
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.untyped_storage().data_ptr(), t.storage_offset(), last + 1


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory.  Decided from the strides when, sorted, each
    is at least the extent of the dimensions below it (every usual layout); otherwise by
    counting the elements' offsets (rare layouts only)."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    extent = 1
    for st, n in dims:
        if st < extent:
            break
        extent = st * (n - 1) + extent
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for st, n in zip(t.stride(), t.shape):
        offsets = (offsets[..., None] + torch.arange(n, dtype=torch.int64) * st)
    return bool((torch.bincount(offsets.reshape(-1)) > 1).any()) if offsets.numel() else False


def _check_no_aliasing(views: Sequence[torch.Tensor]) -> None:
    """In-place compaction needs every element written once: no cache may overlap itself (an
    expanded tensor, stride 0) and no two caches may share an element (the same tensor twice,
    or views ``base[:, :, i:i + S]`` of one buffer, would be compacted twice, in an order that
    depends on the threads).  Caches whose address ranges overlap are checked element by
    element (only then: interleaved layouts such as ``base[..., ::2]`` and ``base[..., 1::2]``
    are fine).  No device synchronisation unless ranges overlap."""
    from torch._subclasses.fake_tensor import is_fake

    # Traced (torch.compile) or fake tensors have no addresses: only the stride check applies.
    addresses = not torch.compiler.is_compiling() and not any(is_fake(t) for t in views)
    for i, t in enumerate(views):
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)) or (addresses and _overlaps_itself(t)):
            raise ValueError(f"kv_cache[{i}] overlaps itself (a stride-0, e.g. expanded, dimension, or rows closer "
                             "than their length) and cannot be written in place")
    if not addresses:
        return
    by_storage = {}
    for i, t in enumerate(views):
        if t.numel():
            base, lo, hi = _extent(t)
            by_storage.setdefault((t.device, base), []).append((lo, hi, i, t))
    for group in by_storage.values():
        if len(group) < 2:
            continue
        group.sort(key=lambda g: g[0])
        if all(a[1] <= b[0] for a, b in zip(group, group[1:])):
            continue  # disjoint address ranges: the common case, decided without a sync
        lo = min(g[0] for g in group)
        hi = max(g[1] for g in group)
        mark = torch.zeros(hi - lo, dtype=torch.int32, device=group[0][3].device)
        for start, _, i, t in group:
            covered = torch.as_strided(mark, t.shape, t.stride(), start - lo)
            if bool((covered > 0).any()):
                raise ValueError(f"kv_cache[{i}] overlaps (aliases) another cache: they share elements and would be compacted twice")
            covered += 1


def check_compact_kv_cache_args(kv_cache, cache_seqlens, accepted_indices, num_accepted, validate=None):
    """Validate ``compact_kv_cache``'s arguments; return (views, B, S, M, num_accepted int64)."""
    views = cache_views(kv_cache)
    if not views:
        raise ValueError("kv_cache must hold at least one layer")
    first = views[0]
    B, Hkv, S, D = first.shape
    # the slices of one [L, 2, B, Hkv, S, D] buffer agree by construction; lists are checked
    for i, t in enumerate([] if isinstance(kv_cache, torch.Tensor) else views[1:], start=1):
        check_tensor(f"kv_cache[{i}]", t, dtypes=(first.dtype,), device=first.device)
        check_shape(f"kv_cache[{i}]", t, (B, Hkv, S, D), "every layer's keys and values alike")
    _check_no_aliasing(views)
    device = first.device
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_shape("cache_seqlens", cache_seqlens, (B,))
    check_tensor("accepted_indices", accepted_indices, ndim=2, dtypes=INDEX_DTYPES, device=device)
    if accepted_indices.shape[0] != B:
        raise ValueError(f"accepted_indices must have shape ({B}, M), got {tuple(accepted_indices.shape)}")
    M = accepted_indices.shape[1]
    n = check_counts("num_accepted", num_accepted, B, M, device, validate)
    if want_value_checks(validate, accepted_indices, cache_seqlens) and B and M:
        idx = accepted_indices.to(torch.int64)
        counted = torch.arange(M, device=device)[None, :] < n[:, None]
        if (counted & (idx < torch.arange(M, device=device)[None, :])).any():
            raise ValueError("accepted_indices[b, i] must be >= i (a token never moves to a later slot)")
        if M > 1 and (counted[:, 1:] & (idx[:, 1:] <= idx[:, :-1])).any():
            raise ValueError("accepted_indices must be strictly increasing within num_accepted")
        slot = cache_seqlens.to(torch.int64)[:, None] + idx
        if (counted & ((slot >= S) | (cache_seqlens[:, None] < 0))).any():
            raise ValueError(f"cache_seqlens + accepted_indices must be below the capacity S={S}")
    return views, B, S, M, n


def _compact_kv_cache(views, cache_seqlens, accepted_indices, num_accepted) -> None:
    if cache_seqlens.device.type == "meta":  # shapes only, no data: nothing to move
        return
    S, M = views[0].shape[2], accepted_indices.shape[1]
    for b in range(cache_seqlens.shape[0]):
        n = min(max(int(num_accepted[b]), 0), M)  # counts clamped to 0..M, as the native kernels do
        if n == 0:
            continue
        start = int(cache_seqlens[b])
        source = start + accepted_indices[b, :n].to(torch.int64)
        dest = start + torch.arange(n, device=source.device)
        inside = (source >= 0) & (source < S) & (dest >= 0) & (dest < S)  # slots outside are skipped
        every = bool(inside.all())
        if not every:
            source, dest = source[inside], dest[inside]
        targets = None if every else dest.tolist()
        for cache in views:
            rows = cache[b].index_select(1, source.to(cache.device))  # a copy: safe although slots overlap
            if every:  # the usual case: one contiguous run of slots (copy_ takes every dtype, fp8 too)
                cache[b, :, start : start + n] = rows
            else:
                for j, slot in enumerate(targets):
                    cache[b, :, slot] = rows[:, j]


def compact_kv_cache(
    kv_cache: KVCache,
    cache_seqlens: torch.Tensor,
    accepted_indices: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Move the accepted tokens' keys and values into place after verification (reference).

    After tree (or chain) verification the accepted nodes' K/V sit at scattered slots
    cache_seqlens[b] + accepted_indices[b, i]; they must become contiguous after the prefix.
    For every layer, K and V, head and i < num_accepted[b]: slot cache_seqlens[b] + i receives
    slot cache_seqlens[b] + accepted_indices[b, i].  Nothing else changes.  (The KV "path
    compaction" step of SpecInfer / Medusa / EAGLE implementations.)

    Args:
        kv_cache: one tensor of shape (L, 2, batch, kv_heads, S, head_dim), or a sequence of
            (batch, kv_heads, S, head_dim) tensors (flat, or (key, value) pairs); any dtype.
            Modified in place.
        cache_seqlens: Shape (batch,), int32/int64: committed tokens before the new block.
        accepted_indices: Shape (batch, M), int32/int64: node indices of the accepted path
            relative to cache_seqlens[b], strictly increasing, accepted_indices[b, i] >= i,
            cache_seqlens[b] + index < S.  Entries at or past num_accepted[b] are ignored.
        num_accepted: Shape (batch,), int in 0..M: how many slots to fill.

    Returns:
        None; ``kv_cache`` is modified in place.

    Raises:
        TypeError: not tensors, wrong dtypes, mixed cache dtypes.
        ValueError: wrong ranks or shapes, layers of different shapes or devices, indices not
            increasing, index below its own position, slot >= S (value checks on CPU).
    """
    views, _, _, _, n = check_compact_kv_cache_args(kv_cache, cache_seqlens, accepted_indices, num_accepted)
    _compact_kv_cache(views, cache_seqlens, accepted_indices, n)
