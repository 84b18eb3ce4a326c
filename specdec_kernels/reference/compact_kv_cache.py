"""Reference KV-cache compaction after verification (plain PyTorch), dense or paged."""
from __future__ import annotations

from collections import abc
from typing import List, Optional, Sequence, Tuple, Union

import torch

from specdec_kernels.checks import INDEX_DTYPES, check_counts, check_shape, check_tensor, want_value_checks

KVCache = Union[torch.Tensor, Sequence[torch.Tensor], Sequence[Sequence[torch.Tensor]]]


DENSE_LAYOUT = "[L, 2, B, Hkv, S, D]"
PAGED_LAYOUTS = {"NHD": "[L, 2, num_blocks, block_size, Hkv, D]", "HND": "[L, 2, num_blocks, Hkv, block_size, D]"}


class BufferViews(abc.Sequence):
    """The 2L per-layer [..] views of one [L, 2, ...] buffer, made on access (an engine's
    compaction per step should not pay for 2L view objects it never touches: the native
    kernels take the buffer whole).  ``buffer`` is the 6-D tensor."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self._pairs = int(buffer.shape[1])  # 2 (keys, values); a concrete int under tracing too
        self._len = int(buffer.shape[0]) * self._pairs

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if not -self._len <= i < self._len:
            raise IndexError(i)
        i = i + self._len if i < 0 else i
        return self.buffer[i // self._pairs, i % self._pairs]


def cache_views(kv_cache: KVCache, layout: str = DENSE_LAYOUT) -> Sequence[torch.Tensor]:
    """The cache as a list of 4-D tensors, one per layer's keys or values (views, nothing copied).

    Accepts one 6-D tensor (``layout``: [L, 2, B, Hkv, S, D] for a dense cache, or a paged
    pool such as [L, 2, num_blocks, block_size, Hkv, D]), a flat sequence of the 4-D per-layer
    tensors, or a sequence of (key, value) pairs of them.
    """
    if isinstance(kv_cache, torch.Tensor):
        check_tensor("kv_cache", kv_cache, ndim=6)
        if kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache must be {layout} (keys and values), got shape {tuple(kv_cache.shape)}")
        # index, never flatten: flatten copies a buffer whose first two dims do not merge
        # (e.g. a [2, L, ...] allocation permuted to [L, 2, ...]), and the copy would be written
        return BufferViews(kv_cache)
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

    if isinstance(views, BufferViews):
        # the slices of one buffer are disjoint unless the buffer overlaps itself: one check
        _check_no_aliasing([views.buffer])
        return
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


# --------------------------------------------------------------------------- paged KV cache
#
# A paged cache (vLLM's PagedAttention, FlashInfer, TensorRT-LLM's KVBlockArray) stores every
# layer's keys and values in a pool of fixed-size blocks; block_table[b, j] names the physical
# block that holds logical slots j * block_size .. (j + 1) * block_size - 1 of sequence b.  The
# compaction is the dense one on logical slots: logical slot s of sequence b is row
# s % block_size of block block_table[b, s // block_size].


def check_kv_layout(kv_layout) -> str:
    """``kv_layout``: "NHD" (a block is [block_size, Hkv, D]) or "HND" ([Hkv, block_size, D])."""
    if not isinstance(kv_layout, str):
        raise TypeError(f"kv_layout must be a str ('NHD' or 'HND'), got {type(kv_layout).__name__}")
    if kv_layout not in PAGED_LAYOUTS:
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    return kv_layout


def pool_geometry(pool: torch.Tensor, kv_layout: str) -> Tuple[int, int, int, int]:
    """(num_blocks, block_size, Hkv, D) of one per-layer pool tensor in ``kv_layout``."""
    if kv_layout == "NHD":
        num_blocks, block_size, heads, head_dim = pool.shape
    else:
        num_blocks, heads, block_size, head_dim = pool.shape
    return num_blocks, block_size, heads, head_dim


def _physical_slots(block_table: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Physical slot (block id * block_size + offset) of logical ``slots`` [B, M] (int64,
    inside the table: 0 <= slot < max_blocks_per_seq * block_size)."""
    blocks = block_table.to(torch.int64).gather(1, slots // block_size)
    return blocks * block_size + slots % block_size


def _check_paged_sharing(cache_seqlens, idx, counted, block_table, block_size) -> None:
    """No physical slot that the compaction writes may also hold another live logical slot.

    Live slots of sequence b: its committed prefix [0, cache_seqlens[b]) and the slots the
    compaction reads or writes for it.  A written physical slot reached from a second live
    logical slot (another sequence sharing the block, or one sequence's table naming the block
    twice) would be corrupted or written twice; the caller must copy such blocks first
    (copy-on-write).  Sharing prefix blocks is fine: they are never written.
    """
    B, M = idx.shape
    if B == 0 or M == 0 or block_size == 0:
        return
    device = idx.device
    capacity = block_table.shape[1] * block_size
    pos = torch.arange(M, device=device)[None, :]
    start = cache_seqlens.to(torch.int64)[:, None]
    moved = counted & (idx != pos)  # identity moves write nothing
    seq = torch.arange(B, device=device)[:, None].expand(B, M)
    source = torch.where(counted, start + idx, 0)
    dest = torch.where(counted, start + pos, 0)
    w_phys = _physical_slots(block_table, dest, block_size)[moved]
    w_key = (seq * capacity + dest)[moved]  # (sequence, logical slot) as one number
    if w_phys.numel() == 0:
        return
    r_phys = _physical_slots(block_table, source, block_size)[counted]
    r_key = (seq * capacity + source)[counted]
    # prefix slots of every sequence inside the written blocks
    table = block_table.to(torch.int64)
    hit_b, hit_j = torch.isin(table, torch.unique(w_phys // block_size)).nonzero(as_tuple=True)
    offset = torch.arange(block_size, device=device)[None, :]
    logical = hit_j[:, None] * block_size + offset
    prefix = logical < cache_seqlens.to(torch.int64)[hit_b][:, None]
    p_phys = (table[hit_b, hit_j][:, None] * block_size + offset)[prefix]
    p_key = (hit_b[:, None] * capacity + logical)[prefix]
    pairs = torch.unique(torch.stack([torch.cat([w_phys, r_phys, p_phys]), torch.cat([w_key, r_key, p_key])]), dim=1)
    phys, owners = torch.unique(pairs[0], return_counts=True)
    shared = phys[owners > 1]
    bad = torch.isin(w_phys, shared)
    if bool(bad.any()):
        p = int(w_phys[bad][0])
        keys = pairs[1][pairs[0] == p].tolist()
        (b1, s1), (b2, s2) = divmod(keys[0], capacity), divmod(keys[1], capacity)
        raise ValueError(
            f"block_table maps logical slot {s1} of sequence {b1} and logical slot {s2} of sequence {b2} to the same "
            f"physical slot (block {p // block_size}, offset {p % block_size}), which compact_kv_cache writes: blocks "
            "holding a sequence's tree region must not be shared (copy-on-write is the caller's job)"
        )


def check_paged_compact_kv_cache_args(
    kv_cache, cache_seqlens, accepted_indices, num_accepted, block_table, kv_layout="NHD", validate=None
):
    """Validate the paged ``compact_kv_cache``'s arguments; return (views, B, block_size, M,
    num_accepted int64), views being the 4-D per-layer pools in ``kv_layout``."""
    kv_layout = check_kv_layout(kv_layout)
    views = cache_views(kv_cache, PAGED_LAYOUTS[kv_layout])
    if not views:
        raise ValueError("kv_cache must hold at least one layer")
    first = views[0]
    for i, t in enumerate([] if isinstance(kv_cache, torch.Tensor) else views[1:], start=1):
        check_tensor(f"kv_cache[{i}]", t, dtypes=(first.dtype,), device=first.device)
        check_shape(f"kv_cache[{i}]", t, tuple(first.shape), "every layer's keys and values alike")
    _check_no_aliasing(views)
    num_blocks, block_size, _, _ = pool_geometry(first, kv_layout)
    device = first.device
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    B = cache_seqlens.shape[0]
    check_tensor("accepted_indices", accepted_indices, ndim=2, dtypes=INDEX_DTYPES, device=device)
    if accepted_indices.shape[0] != B:
        raise ValueError(f"accepted_indices must have shape ({B}, M) (one row per cache_seqlens entry), got "
                         f"{tuple(accepted_indices.shape)}")
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, device=device)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table must have shape ({B}, max_blocks_per_seq), got {tuple(block_table.shape)}")
    M = accepted_indices.shape[1]
    n = check_counts("num_accepted", num_accepted, B, M, device, validate)
    if want_value_checks(validate, accepted_indices, cache_seqlens, block_table) and B and M:
        idx = accepted_indices.to(torch.int64)
        pos = torch.arange(M, device=device)[None, :]
        counted = pos < n[:, None]
        if (counted & (idx < pos)).any():
            raise ValueError("accepted_indices[b, i] must be >= i (a token never moves to a later slot)")
        if M > 1 and (counted[:, 1:] & (idx[:, 1:] <= idx[:, :-1])).any():
            raise ValueError("accepted_indices must be strictly increasing within num_accepted")
        start = cache_seqlens.to(torch.int64)[:, None]
        if (counted & (start < 0)).any():
            raise ValueError("cache_seqlens must be >= 0")
        capacity = block_table.shape[1] * block_size
        if (counted & (start + idx >= capacity)).any():
            raise ValueError(f"cache_seqlens + accepted_indices must be below the capacity of the block table, "
                             f"max_blocks_per_seq * block_size = {block_table.shape[1]} * {block_size} = {capacity}")
        table = block_table.to(torch.int64)
        for what, slots in (("source", start + idx), ("destination", start + pos)):
            blocks = table.gather(1, torch.where(counted, slots, 0) // block_size)
            bad = counted & ((blocks < 0) | (blocks >= num_blocks))
            if bad.any():
                b, i = (int(v) for v in bad.nonzero()[0])
                j = int(slots[b, i]) // block_size
                raise ValueError(f"block_table[{b}, {j}] = {int(table[b, j])} (the block of a {what} slot) must be a "
                                 f"block of the pool, 0..{num_blocks - 1}")
        _check_paged_sharing(cache_seqlens, idx, counted, block_table, block_size)
    return views, B, block_size, M, n


def _paged_compact_kv_cache(views, kv_layout, cache_seqlens, accepted_indices, num_accepted, block_table) -> None:
    if cache_seqlens.device.type == "meta":  # shapes only, no data: nothing to move
        return
    num_blocks, block_size, _, _ = pool_geometry(views[0], kv_layout)
    M = accepted_indices.shape[1]
    capacity = block_table.shape[1] * block_size
    if num_blocks == 0 or capacity == 0:
        return
    # every pool as [num_blocks, block_size, Hkv, D]: a view (HND pools are transposed, not copied)
    pools = views if kv_layout == "NHD" else [v.transpose(1, 2) for v in views]
    for b in range(cache_seqlens.shape[0]):
        n = min(max(int(num_accepted[b]), 0), M)  # counts clamped to 0..M, as the native kernels do
        if n == 0:
            continue
        start = int(cache_seqlens[b])
        table = block_table[b].to(torch.int64)
        source = start + accepted_indices[b, :n].to(torch.int64)
        dest = start + torch.arange(n, device=source.device)

        def locate(slots):
            """(block, offset, inside): slots outside the table or in a block outside the pool
            are not inside (the native kernels skip them too)."""
            inside = (slots >= 0) & (slots < capacity)
            blocks = table[slots.clamp(0, capacity - 1) // block_size]
            return blocks, slots % block_size, inside & (blocks >= 0) & (blocks < num_blocks)

        s_block, s_off, s_in = locate(source)
        d_block, d_off, d_in = locate(dest)
        keep = s_in & d_in & (source != dest)  # identity moves change nothing
        if not bool(keep.any()):
            continue
        s_block, s_off, d_block, d_off = s_block[keep], s_off[keep], d_block[keep], d_off[keep]
        for pool in pools:
            rows = pool[s_block, s_off]  # [moved, Hkv, D], a copy: safe although slots overlap
            pool[d_block, d_off] = rows


def compact_kv_cache(
    kv_cache: KVCache,
    cache_seqlens: torch.Tensor,
    accepted_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    block_table: Optional[torch.Tensor] = None,
    kv_layout: str = "NHD",
) -> None:
    """Move the accepted tokens' keys and values into place after verification (reference).

    After tree (or chain) verification the accepted nodes' K/V sit at scattered slots
    cache_seqlens[b] + accepted_indices[b, i]; they must become contiguous after the prefix.
    For every layer, K and V, head and i < num_accepted[b]: slot cache_seqlens[b] + i receives
    slot cache_seqlens[b] + accepted_indices[b, i].  Nothing else changes.  (The KV "path
    compaction" step of SpecInfer / Medusa / EAGLE implementations; TensorRT-LLM's
    ``updateKVCacheDraftTokenLocation`` for linear and block caches.)

    Paged caches (``block_table`` given; vLLM / FlashInfer / TensorRT-LLM block pools): the
    slots above are LOGICAL; logical slot s of sequence b is row s % block_size of physical
    block block_table[b, s // block_size].  Only the blocks holding the tree region are
    written; shared prefix blocks are never touched.  Blocks holding a sequence's tree region
    must not be shared with another sequence (copy-on-write is the caller's job).

    Args:
        kv_cache: dense: one tensor of shape (L, 2, batch, kv_heads, S, head_dim), or a
            sequence of (batch, kv_heads, S, head_dim) tensors (flat, or (key, value) pairs).
            Paged: one pool of shape (L, 2, num_blocks, block_size, kv_heads, head_dim)
            ("NHD", vLLM's per-layer (num_blocks, block_size, kv_heads, head_dim) stacked) or
            (L, 2, num_blocks, kv_heads, block_size, head_dim) ("HND"), or a sequence of
            per-layer pools (num_blocks, block_size, kv_heads, head_dim) (or HND), flat or
            (key, value) pairs.  Any dtype.  Modified in place.
        cache_seqlens: Shape (batch,), int32/int64: committed tokens before the new block.
        accepted_indices: Shape (batch, M), int32/int64: node indices of the accepted path
            relative to cache_seqlens[b], strictly increasing, accepted_indices[b, i] >= i,
            cache_seqlens[b] + index < S (paged: < max_blocks_per_seq * block_size).  Entries
            at or past num_accepted[b] are ignored.
        num_accepted: Shape (batch,), int in 0..M: how many slots to fill.
        block_table: None (dense cache) or Shape (batch, max_blocks_per_seq), int32 (or
            int64): the physical block of each logical block of each sequence; entries outside
            [0, num_blocks) are allowed where the compaction reads or writes nothing.
        kv_layout: "NHD" or "HND", the order of a paged block's dimensions (block_size before
            or after kv_heads); used only with ``block_table`` (a dense cache is always
            (batch, kv_heads, S, head_dim)), checked always.  Any block size >= 1.

    Returns:
        None; ``kv_cache`` is modified in place.

    Raises:
        TypeError: not tensors, wrong dtypes, mixed cache dtypes, kv_layout not a str.
        ValueError: wrong ranks or shapes, layers of different shapes or devices, kv_layout
            not "NHD"/"HND"; with the value checks (on CPU by default): indices not
            increasing, index below its own position, slot >= S (paged: beyond the block
            table), a block id outside the pool, two sequences (or two logical slots) sharing
            a physical slot that the compaction writes (paged).
    """
    check_kv_layout(kv_layout)
    if block_table is not None:
        views, _, _, _, n = check_paged_compact_kv_cache_args(kv_cache, cache_seqlens, accepted_indices, num_accepted,
                                                              block_table, kv_layout)
        _paged_compact_kv_cache(views, kv_layout, cache_seqlens, accepted_indices, n, block_table)
        return
    views, _, _, _, n = check_compact_kv_cache_args(kv_cache, cache_seqlens, accepted_indices, num_accepted)
    _compact_kv_cache(views, cache_seqlens, accepted_indices, n)
