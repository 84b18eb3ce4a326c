"""compact_kv_cache: move the accepted tokens' K/V into place after verification,
``torch.ops.specdec.compact_kv_cache`` (in place).

Backends: "reference" (``specdec_kernels.reference.compact_kv_cache``) and "native"
(``torch.ops.specdec_native.compact_kv_cache`` from the extension ``specdec_kernels._C``:
``csrc/compact_kv_cache.cpp`` on CPU, ``csrc/compact_kv_cache_kernel.cu`` on CUDA).

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
``torch.ops.specdec_native.paged_compact_kv_cache``): ``caches`` then holds the one
[L, 2, num_blocks, block_size, Hkv, D] ("NHD") / [L, 2, num_blocks, Hkv, block_size, D]
("HND") pool or the per-layer [num_blocks, block_size, Hkv, D] (or HND) pools.  The kernels
are the dense ones with one more step: a logical slot s of sequence b is looked up as row
s % block_size of block block_table[b, s // block_size]; a slot outside the table or in a
block outside [0, num_blocks) is skipped, whatever ``validate`` says.  The ascending order
stays safe in place because the block table is one-to-one on the slots that one call reads
or writes (shared blocks are refused by the value checks; proof in the C++/CUDA comments).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import torch

from specdec_kernels import _backend, _library, _native
from specdec_kernels.checks import (
    INDEX_DTYPES,
    check_counts,
    check_kv_layout,
    check_shape,
    check_tensor,
    want_value_checks,
)
from specdec_kernels.reference.compact_kv_cache import (
    PAGED_LAYOUTS,
    BufferViews,
    KVCache,
    _compact_kv_cache,
    _paged_compact_kv_cache,
    _physical_slots,
    accepted_lengths,
    cache_views,
)

IMPLEMENTED = ("reference", "native")


def _extent(t: torch.Tensor):
    """(storage address, first element, one past the last element) that ``t`` can touch."""
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.untyped_storage().data_ptr(), t.storage_offset(), last + 1


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (``_layout_overlaps`` of its shape and
    strides, decided once per layout)."""
    return _layout_overlaps(tuple(t.shape), t.stride())


@functools.lru_cache(maxsize=256)
def _layout_overlaps(shape: Tuple[int, ...], stride: Tuple[int, ...]) -> bool:
    """Whether two elements of a tensor of ``shape`` and ``stride`` share memory.  Decided from
    the strides when, sorted, each is at least the extent of the dimensions below it (every
    usual layout); otherwise by counting the elements' offsets (rare layouts only)."""
    dims = sorted((st, n) for st, n in zip(stride, shape) if n > 1)
    extent = 1
    for st, n in dims:
        if st < extent:
            break
        extent = st * (n - 1) + extent
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for st, n in zip(stride, shape):
        offsets = offsets[..., None] + torch.arange(n, dtype=torch.int64) * st
    return bool((torch.bincount(offsets.reshape(-1)) > 1).any()) if offsets.numel() else False


def _first(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensor whose dtype, device and last four dimensions every cache shares: one buffer's
    6-D tensor (indexing a layer out of it costs a view per call), else the first layer."""
    return views.buffer if isinstance(views, BufferViews) else views[0]


def _any_fake(views: Sequence[torch.Tensor]) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return any(is_fake(t) for t in views)


def _check_no_aliasing(views: Sequence[torch.Tensor]) -> None:
    """In-place compaction needs every element written once: no cache may overlap itself (an
    expanded tensor, stride 0) and no two caches may share an element (the same tensor twice,
    or views ``base[:, :, i:i + S]`` of one buffer, would be compacted twice, in an order that
    depends on the threads).  Caches whose address ranges overlap are checked element by
    element (only then: interleaved layouts such as ``base[..., ::2]`` and ``base[..., 1::2]``
    are fine).  No device synchronisation unless ranges overlap."""
    if isinstance(views, BufferViews):
        # the slices of one buffer are disjoint unless the buffer overlaps itself: one check
        views = [views.buffer]
    if len(views) == 1 and views[0].is_contiguous():  # one dense buffer: nothing can overlap
        return
    # Traced (torch.compile) or fake tensors have no addresses: only the stride check applies.
    addresses = not torch.compiler.is_compiling() and (
        all(type(t) is torch.Tensor for t in views) or not _any_fake(views)
    )
    for i, t in enumerate(views):
        if t.is_contiguous():  # neither a stride 0 over 2+ entries nor overlapping rows
            continue
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)) or (addresses and _overlaps_itself(t)):
            raise ValueError(
                f"kv_cache[{i}] overlaps itself (a stride-0, e.g. expanded, dimension, or rows closer "
                "than their length) and cannot be written in place"
            )
    if not addresses or len(views) < 2:
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
                raise ValueError(
                    f"kv_cache[{i}] overlaps (aliases) another cache: they share elements and would be compacted twice"
                )
            covered += 1


# The two counts (docs/API.md, "One count, two names"): verify's ``num_accepted`` counts the
# accepted drafts, the root not counted; compaction fills ``num_slots = num_accepted + 1`` slots.
NUM_ACCEPTED_MEANING = "verify's count of accepted drafts, the root not counted; it fills num_accepted + 1 slots"


def slot_counts(accepted_indices, num_slots, num_accepted, batch: int, device, validate) -> torch.Tensor:
    """The slots to fill per sequence, int64 [B]: ``num_slots`` (0..M), or ``num_accepted + 1``
    (``num_accepted`` in 0..M-1, verify's count), or with neither the entries of each row
    before its first negative one (-1 padding ends a row, as verify pads ``accepted_nodes``).
    Ranges are checked when ``validate`` allows; no host read otherwise.

    Raises:
        ValueError: both counts given; a count out of range (with value checks).
    """
    M = accepted_indices.shape[1]
    if num_accepted is not None:
        if num_slots is not None:
            raise ValueError(
                "pass num_slots (the slots to fill, root included) or num_accepted (verify's count of accepted "
                "drafts, root not counted: num_accepted + 1 slots), not both"
            )
        if M == 0:
            raise ValueError(
                f"num_accepted ({NUM_ACCEPTED_MEANING}) needs accepted_indices with at least one column (the root), "
                f"got shape {tuple(accepted_indices.shape)}"
            )
        name = f"num_accepted ({NUM_ACCEPTED_MEANING}; a count of slots goes in num_slots)"
        return check_counts(name, num_accepted, batch, M - 1, device, validate) + 1
    if num_slots is None:
        return accepted_lengths(accepted_indices)
    return check_counts("num_slots", num_slots, batch, M, device, validate)


def _check_paths(idx: torch.Tensor, n: torch.Tensor, device) -> torch.Tensor:
    """Value checks of the accepted paths ``idx`` (int64 [B, M]) within their counts ``n``
    (slots to fill, [B]): each index >= its position (a -1 there is padding inside the count)
    and strictly increasing.  Returns the [B, M] mask of the counted entries."""
    B, M = idx.shape
    pos = torch.arange(M, device=device)[None, :]
    counted = pos < n[:, None]
    below = counted & (idx < pos)
    if below.any():
        b, i = (int(v) for v in below.nonzero()[0])
        value, count = int(idx[b, i]), int(n[b])
        if value < 0:
            raise ValueError(
                f"accepted_indices[{b}, {i}] = {value} is padding, but the count asks for {count} slots for "
                f"sequence {b}: verify's num_accepted counts the accepted drafts, not the root; pass it as "
                "num_accepted= (or num_slots = num_accepted + 1), or leave the count out (padding ends a row)"
            )
        raise ValueError(
            f"accepted_indices[b, i] must be >= i (a token never moves to a later slot); accepted_indices[{b}, {i}] "
            f"= {value}"
        )
    if M > 1 and (counted[:, 1:] & (idx[:, 1:] <= idx[:, :-1])).any():
        raise ValueError("accepted_indices must be strictly increasing within the slots to fill")
    return counted


def check_compact_kv_cache_args(
    kv_cache, cache_seqlens, accepted_indices, num_slots, validate=None, *, num_accepted=None
):
    """Validate ``compact_kv_cache``'s arguments; return (views, B, S, M, slots to fill int64 [B])."""
    views = cache_views(kv_cache)
    if not views:
        raise ValueError("kv_cache must hold at least one layer")
    first = _first(views)  # the 6-D buffer itself (no view made), or the first 4-D tensor
    B, Hkv, S, D = first.shape[-4:]
    # the slices of one [L, 2, B, Hkv, S, D] buffer agree by construction; lists are checked
    for i, t in enumerate([] if isinstance(kv_cache, torch.Tensor) else views[1:], start=1):
        check_tensor(f"kv_cache[{i}]", t, dtypes=(first.dtype,), device=first.device)
        check_shape(f"kv_cache[{i}]", t, (B, Hkv, S, D), "every layer's keys and values alike")
    _check_no_aliasing(views)
    device = first.device
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if cache_seqlens.shape[0] != B:
        check_shape("cache_seqlens", cache_seqlens, (B,))
    check_tensor("accepted_indices", accepted_indices, ndim=2, dtypes=INDEX_DTYPES, device=device)
    if accepted_indices.shape[0] != B:
        raise ValueError(f"accepted_indices must have shape ({B}, M), got {tuple(accepted_indices.shape)}")
    M = accepted_indices.shape[1]
    n = slot_counts(accepted_indices, num_slots, num_accepted, B, device, validate)
    if want_value_checks(validate, accepted_indices, cache_seqlens) and B and M:
        idx = accepted_indices.to(torch.int64)
        counted = _check_paths(idx, n, device)
        slot = cache_seqlens.to(torch.int64)[:, None] + idx
        if (counted & ((slot >= S) | (cache_seqlens[:, None] < 0))).any():
            raise ValueError(f"cache_seqlens + accepted_indices must be below the capacity S={S}")
    return views, B, S, M, n


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
    kv_cache,
    cache_seqlens,
    accepted_indices,
    num_slots,
    block_table,
    kv_layout="NHD",
    validate=None,
    *,
    num_accepted=None,
):
    """Validate the paged ``compact_kv_cache``'s arguments; return (views, B, block_size, M,
    slots to fill int64 [B]), views being the 4-D per-layer pools in ``kv_layout``."""
    kv_layout = check_kv_layout(kv_layout)
    views = cache_views(kv_cache, PAGED_LAYOUTS[kv_layout])
    if not views:
        raise ValueError("kv_cache must hold at least one layer")
    first = _first(views)  # the 6-D buffer itself (no view made), or the first 4-D pool
    for i, t in enumerate([] if isinstance(kv_cache, torch.Tensor) else views[1:], start=1):
        check_tensor(f"kv_cache[{i}]", t, dtypes=(first.dtype,), device=first.device)
        check_shape(f"kv_cache[{i}]", t, tuple(first.shape), "every layer's keys and values alike")
    _check_no_aliasing(views)
    pool = first.shape[-4:]  # NHD [num_blocks, block_size, Hkv, D], HND [num_blocks, Hkv, block_size, D]
    num_blocks, block_size = pool[0], pool[1] if kv_layout == "NHD" else pool[2]
    device = first.device
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    B = cache_seqlens.shape[0]
    check_tensor("accepted_indices", accepted_indices, ndim=2, dtypes=INDEX_DTYPES, device=device)
    if accepted_indices.shape[0] != B:
        raise ValueError(
            f"accepted_indices must have shape ({B}, M) (one row per cache_seqlens entry), got "
            f"{tuple(accepted_indices.shape)}"
        )
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, device=device)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table must have shape ({B}, max_blocks_per_seq), got {tuple(block_table.shape)}")
    M = accepted_indices.shape[1]
    n = slot_counts(accepted_indices, num_slots, num_accepted, B, device, validate)
    if want_value_checks(validate, accepted_indices, cache_seqlens, block_table) and B and M:
        idx = accepted_indices.to(torch.int64)
        pos = torch.arange(M, device=device)[None, :]
        counted = _check_paths(idx, n, device)
        start = cache_seqlens.to(torch.int64)[:, None]
        if (counted & (start < 0)).any():
            raise ValueError("cache_seqlens must be >= 0")
        capacity = block_table.shape[1] * block_size
        if (counted & (start + idx >= capacity)).any():
            raise ValueError(
                f"cache_seqlens + accepted_indices must be below the capacity of the block table, "
                f"max_blocks_per_seq * block_size = {block_table.shape[1]} * {block_size} = {capacity}"
            )
        table = block_table.to(torch.int64)
        for what, slots in (("source", start + idx), ("destination", start + pos)):
            blocks = table.gather(1, torch.where(counted, slots, 0) // block_size)
            bad = counted & ((blocks < 0) | (blocks >= num_blocks))
            if bad.any():
                b, i = (int(v) for v in bad.nonzero()[0])
                j = int(slots[b, i]) // block_size
                raise ValueError(
                    f"block_table[{b}, {j}] = {int(table[b, j])} (the block of a {what} slot) must be a "
                    f"block of the pool, 0..{num_blocks - 1}"
                )
        _check_paged_sharing(cache_seqlens, idx, counted, block_table, block_size)
    return views, B, block_size, M, n


def _as_kv_cache(caches):
    """The op's list argument as the front's kv_cache: the 6-D buffer alone, or the list."""
    if len(caches) == 1 and caches[0].dim() == 6:
        return caches[0]
    return list(caches)


def _op_caches(kv_cache, views) -> List[torch.Tensor]:
    """The front's kv_cache as the registered op's (and the native kernels') list: one
    [L, 2, ...] buffer whole (its slices are found through its strides), otherwise the 4-D
    per-layer views (a 5-D per-layer [2, ...] tensor as its keys and values)."""
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 6:
        return [kv_cache]
    return list(views)


_NATIVE_OPS: dict = {}  # op name -> its native kernel's OpOverload


def _backend_run(op_name, reference, kv_cache, views, cache_seqlens, accepted_indices, n, extra, backend) -> None:
    """The backend of ``op_name`` (dense: ``extra`` is (), paged: (block_table, kv_layout)) on
    checked arguments (``n``: the slots to fill): the native op ``<op_name>_native`` (value
    checks are the front's, ``validate=``) or the reference.  The registered ops' kernel after
    their checks, and the front's eager path (one check pass, no dispatcher)."""
    if _backend.resolve(op_name, cache_seqlens.device, backend or None, IMPLEMENTED) == "native":
        # One [L, 2, ...] buffer goes over whole (the kernels read its strides); otherwise the 4-D views.
        native_op = _NATIVE_OPS.get(op_name)
        if native_op is None:  # the overload itself: no packet lookup per call
            native_op = _NATIVE_OPS[op_name] = getattr(torch.ops.specdec_native, op_name).default
        native_op(_op_caches(kv_cache, views), cache_seqlens, accepted_indices, n, *extra, False)
    else:
        reference(views, cache_seqlens, accepted_indices, n, *extra)


def _run(op_name, check_args, reference, caches, cache_seqlens, accepted_indices, num_slots, extra, backend):
    """The kernel of both registered ops (dense: ``extra`` is (), paged: (block_table,
    kv_layout)): their shape checks, then ``_backend_run``."""
    kv_cache = _as_kv_cache(caches)
    views, _, _, _, n = check_args(kv_cache, cache_seqlens, accepted_indices, num_slots, *extra, validate=False)
    _backend_run(op_name, reference, kv_cache, views, cache_seqlens, accepted_indices, n, extra, backend)


def _fake_checks(check_args, native_fake, caches, cache_seqlens, accepted_indices, num_slots, extra, backend):
    """The fake kernel of both registered ops: shape checks only (they write in place)."""
    kv_cache = _as_kv_cache(caches)
    views, _, _, _, n = check_args(kv_cache, cache_seqlens, accepted_indices, num_slots, *extra, validate=False)
    _library.check_backend_name(backend)
    return native_fake(_op_caches(kv_cache, views), cache_seqlens, accepted_indices, n, *extra)


def _impl(
    caches: List[torch.Tensor],
    cache_seqlens: torch.Tensor,
    accepted_indices: torch.Tensor,
    num_slots: Optional[torch.Tensor] = None,
    backend: str = "",
) -> None:
    args = (caches, cache_seqlens, accepted_indices, num_slots, (), backend)
    _run("compact_kv_cache", check_compact_kv_cache_args, _compact_kv_cache, *args)


def _fake(caches, cache_seqlens, accepted_indices, num_slots=None, backend=""):
    args = (caches, cache_seqlens, accepted_indices, num_slots, (), backend)
    return _fake_checks(check_compact_kv_cache_args, _native._compact_kv_cache_native_fake, *args)


op = _library.define("compact_kv_cache", _impl, fake=_fake, mutates_args=("caches",))


def _paged_impl(
    caches: List[torch.Tensor],
    cache_seqlens: torch.Tensor,
    accepted_indices: torch.Tensor,
    num_slots: Optional[torch.Tensor],
    block_table: torch.Tensor,
    kv_layout: str = "NHD",
    backend: str = "",
) -> None:
    args = (caches, cache_seqlens, accepted_indices, num_slots, (block_table, kv_layout), backend)
    _run("paged_compact_kv_cache", check_paged_compact_kv_cache_args, _paged_reference, *args)


def _paged_reference(views, cache_seqlens, accepted_indices, num_slots, block_table, kv_layout):
    _paged_compact_kv_cache(views, kv_layout, cache_seqlens, accepted_indices, num_slots, block_table)


def _paged_fake(caches, cache_seqlens, accepted_indices, num_slots, block_table, kv_layout="NHD", backend=""):
    args = (caches, cache_seqlens, accepted_indices, num_slots, (block_table, kv_layout), backend)
    return _fake_checks(check_paged_compact_kv_cache_args, _native._paged_compact_kv_cache_native_fake, *args)


paged_op = _library.define("paged_compact_kv_cache", _paged_impl, fake=_paged_fake, mutates_args=("caches",))


def compact_kv_cache(
    kv_cache: KVCache,
    cache_seqlens: torch.Tensor,
    accepted_indices: torch.Tensor,
    num_slots: Optional[torch.Tensor] = None,
    *,
    num_accepted: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    kv_layout: str = "NHD",
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> None:
    """Move the accepted tokens' keys and values into place after verification.

    After tree (or chain) verification the accepted nodes' K/V sit at scattered slots
    cache_seqlens[b] + accepted_indices[b, i]; they must become contiguous after the prefix.
    For every layer, K and V, head and i < n_b (the slots to fill, below): slot
    cache_seqlens[b] + i receives slot cache_seqlens[b] + accepted_indices[b, i].  Nothing
    else changes.  (The KV "path compaction" step of SpecInfer / Medusa / EAGLE
    implementations; TensorRT-LLM's ``updateKVCacheDraftTokenLocation`` for linear and block
    caches.)

    Verify's outputs go in as they come: ``accepted_nodes`` of ``verify_tree_greedy`` /
    ``tree_rejection_sample`` as ``accepted_indices`` (root first, then -1 padding), and
    their ``num_accepted`` as ``num_accepted=`` or not at all::

        out, accepted_nodes, num_accepted = verify_tree_greedy(logits, tokens, parents)
        compact_kv_cache(kv, cache_seqlens, accepted_nodes, num_accepted=num_accepted)
        cache_seqlens += num_accepted + 1          # the root and the accepted drafts

    The slots to fill, n_b, come from one of (docs/API.md, "One count, two names"):

    - ``num_accepted`` (keyword only): verify's count, the accepted DRAFTS with the root not
      counted: n_b = num_accepted[b] + 1.
    - ``num_slots``: the slots themselves, root included (num_accepted + 1); the 4th
      positional argument (named ``num_accepted`` before: positional calls keep working).
    - neither: each row's entries before its first negative one (-1 padding ends a row; all
      M entries when it has none).

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
            (key, value) pairs.  Also, in both forms, one layer's keys and values as one 5-D
            tensor (2, ...) (keys at [0], values at [1]: vLLM's per-layer ``kv_cache``, e.g.
            (2, num_blocks, block_size, kv_heads, head_dim)), or a sequence of such tensors
            (vLLM's ``kv_caches``, one per layer).  Any dtype; any strides (a
            (num_blocks, 2, ...) allocation goes in as ``t.transpose(0, 1)``).  Modified in place.
        cache_seqlens: Shape (batch,), int32/int64: committed tokens before the new block
            (the root, node 0, sits at slot cache_seqlens[b], as in ``tree_attention``).
        accepted_indices: Shape (batch, M), int32/int64: node indices of the accepted path
            relative to cache_seqlens[b] (root first), strictly increasing,
            accepted_indices[b, i] >= i, cache_seqlens[b] + index < S (paged: <
            max_blocks_per_seq * block_size), within the n_b slots to fill; entries past them
            are ignored whatever they hold (-1 padding).
        num_slots: None or Shape (batch,), int in 0..M: the slots to fill, root included.
        num_accepted: None or Shape (batch,), int in 0..M-1: verify's count of accepted
            drafts (root not counted); fills num_accepted + 1 slots.  Not with num_slots.
        block_table: None (dense cache) or Shape (batch, max_blocks_per_seq), int32 (or
            int64): the physical block of each logical block of each sequence; entries outside
            [0, num_blocks) are allowed where the compaction reads or writes nothing.
        kv_layout: "NHD" or "HND", the order of a paged block's dimensions (block_size before
            or after kv_heads); used only with ``block_table`` (a dense cache is always
            (batch, kv_heads, S, head_dim)), checked always.  Any block size >= 1.

    Returns:
        None; ``kv_cache`` is modified in place.  The caller then advances cache_seqlens by
        the slots filled (num_accepted + 1).

    Raises:
        TypeError: not tensors, wrong dtypes, mixed cache dtypes, kv_layout not a str.
        ValueError: wrong ranks or shapes, layers of different shapes or devices, kv_layout
            not "NHD"/"HND", both num_slots and num_accepted; with the value checks (on CPU
            by default): a count out of range, -1 padding inside the slots to fill (the
            message says which count to pass), indices not increasing, index below its own
            position, slot >= S (paged: beyond the block table), a block id outside the pool,
            two sequences (or two logical slots) sharing a physical slot that the compaction
            writes (paged).

    Registered as ``torch.ops.specdec.compact_kv_cache`` (dense) and
    ``torch.ops.specdec.paged_compact_kv_cache`` (with ``block_table``), which take the slot
    count ``num_slots`` (None: the padding rule above). backend: None (automatic, chosen
    once per process and device type), "reference" or "native". validate: None (value checks
    on CPU tensors only), True or False (docs/API.md#backends).
    """
    check_kv_layout(kv_layout)
    if block_table is not None:
        views, _, _, _, n = check_paged_compact_kv_cache_args(
            kv_cache,
            cache_seqlens,
            accepted_indices,
            num_slots,
            block_table,
            kv_layout,
            validate,
            num_accepted=num_accepted,
        )
        extra = (block_table, kv_layout)
        if _direct(kv_cache, views, cache_seqlens, accepted_indices, n, block_table):  # eager: checked once
            _backend_run(
                "paged_compact_kv_cache",
                _paged_reference,
                kv_cache,
                views,
                cache_seqlens,
                accepted_indices,
                n,
                extra,
                backend,
            )
            return
        torch.ops.specdec.paged_compact_kv_cache(
            _op_caches(kv_cache, views), cache_seqlens, accepted_indices, n, *extra, backend or ""
        )
        return
    views, _, _, _, n = check_compact_kv_cache_args(
        kv_cache, cache_seqlens, accepted_indices, num_slots, validate, num_accepted=num_accepted
    )
    if _direct(kv_cache, views, cache_seqlens, accepted_indices, n, None):  # eager: checked once, no dispatcher
        _backend_run(
            "compact_kv_cache", _compact_kv_cache, kv_cache, views, cache_seqlens, accepted_indices, n, (), backend
        )
        return
    torch.ops.specdec.compact_kv_cache(_op_caches(kv_cache, views), cache_seqlens, accepted_indices, n, backend or "")


def _direct(kv_cache, views, cache_seqlens, accepted_indices, n, block_table) -> bool:
    """``_library.direct_call`` for the caches (the one buffer, or every view) and the index
    tensors; an in-place op: caches that require grad go through the registered op (its error)."""
    if type(kv_cache) is torch.Tensor:  # the one buffer (or one layer's tensor): no list
        return _library.direct_call(kv_cache, cache_seqlens, accepted_indices, n, block_table, grad_check=True)
    caches = [kv_cache] if isinstance(kv_cache, torch.Tensor) else list(views)
    return _library.direct_call(*caches, cache_seqlens, accepted_indices, n, block_table, grad_check=True)


def register_fake(paged: bool = False) -> bool:
    """Load the extension (which registers the fakes of ``specdec_native::compact_kv_cache`` and
    ``specdec_native::paged_compact_kv_cache``); return whether the native op (the paged one with
    ``paged=True``) exists.  Kept for callers of the native ops."""
    name = "paged_compact_kv_cache" if paged else "compact_kv_cache"
    return _native.load() and hasattr(torch.ops.specdec_native, name)
