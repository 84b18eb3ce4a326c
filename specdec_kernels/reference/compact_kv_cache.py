"""Reference KV-cache compaction after verification (plain PyTorch, no argument checks), dense or paged."""

from __future__ import annotations

from collections import abc
from typing import Optional, Sequence, Union

import torch

from specdec_kernels.checks import check_tensor, pool_geometry

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


def _layer_layout(layout: str) -> str:
    """One layer's form of a 6-D ``layout``: "[L, 2, B, ...]" -> "[2, B, ...]"."""
    return layout.replace("[L, ", "[", 1)


def _split_layer(name: str, t: torch.Tensor, layout: str) -> list:
    """One layer's 5-D keys-and-values tensor (vLLM's per-layer ``kv_cache``: keys at [0],
    values at [1]) as its two 4-D views."""
    if t.shape[0] != 2:
        raise ValueError(
            f"{name} must be one layer's keys and values {_layer_layout(layout)} (a 5-D tensor whose first "
            f"dimension is 2), got shape {tuple(t.shape)}"
        )
    return [t[0], t[1]]


def cache_views(kv_cache: KVCache, layout: str = DENSE_LAYOUT) -> Sequence[torch.Tensor]:
    """The cache as a list of 4-D tensors, one per layer's keys or values (views, nothing copied).

    Accepts one 6-D tensor (``layout``: [L, 2, B, Hkv, S, D] for a dense cache, or a paged
    pool such as [L, 2, num_blocks, block_size, Hkv, D]), one layer's 5-D [2, ...] tensor
    (keys at [0], values at [1]: vLLM's per-layer ``kv_cache``, e.g.
    [2, num_blocks, block_size, Hkv, D]), or a sequence of layers, each given as its two 4-D
    tensors (flat, or as a (key, value) pair) or as one 5-D [2, ...] tensor.
    """
    if isinstance(kv_cache, torch.Tensor):
        check_tensor("kv_cache", kv_cache, ndim=(5, 6))
        if kv_cache.dim() == 5:
            return _split_layer("kv_cache", kv_cache, layout)
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
        elif isinstance(item, torch.Tensor) and item.dim() == 5:
            flat.extend(_split_layer(f"kv_cache[{i}]", item, layout))
        else:
            flat.append(item)
    for i, t in enumerate(flat):
        check_tensor(f"kv_cache[{i}]", t, ndim=4)
    return flat


def accepted_lengths(accepted_indices: torch.Tensor) -> torch.Tensor:
    """Per row of ``accepted_indices`` (B, M) the entries before its first negative one (M
    when it has none): the slots to fill of verify's -1-padded ``accepted_nodes``
    (num_accepted + 1).  int64 (B,), on the input's device, no host read."""
    negative = accepted_indices < 0
    first = negative.to(torch.int32).argmax(dim=1).to(torch.int64)
    return torch.where(negative.any(dim=1), first, accepted_indices.shape[1])


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


def _physical_slots(block_table: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Physical slot (block id * block_size + offset) of logical ``slots`` [B, M] (int64,
    inside the table: 0 <= slot < max_blocks_per_seq * block_size)."""
    blocks = block_table.to(torch.int64).gather(1, slots // block_size)
    return blocks * block_size + slots % block_size


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
    num_slots: Optional[torch.Tensor] = None,
    *,
    num_accepted: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    kv_layout: str = "NHD",
) -> None:
    """Move the accepted tokens' keys and values into place after verification (reference of
    ``specdec_kernels.compact_kv_cache``: the compaction step of EAGLE / Medusa engines, SGLang's
    ``updateKVCacheDraftTokenLocation``), dense or paged, in place.

    Same arguments and effect as the op, whose docstring has them (without ``backend`` and
    ``validate``): ``num_slots`` the slots to fill (root included), or ``num_accepted``
    verify's count of accepted drafts (num_accepted + 1 slots), or neither (a row ends at
    its first -1).  No argument checks beyond the cache's form
    (``compact_kv_cache(..., backend="reference")`` runs this with the op's checks).

    Raises:
        ValueError: both num_slots and num_accepted given; a cache of the wrong form.
    """
    if num_accepted is not None:
        if num_slots is not None:
            raise ValueError("pass num_slots (slots to fill) or num_accepted (verify's count), not both")
        n = num_accepted.to(torch.int64) + 1
    elif num_slots is None:
        n = accepted_lengths(accepted_indices)
    else:
        n = num_slots.to(torch.int64)
    if block_table is not None:
        views = cache_views(kv_cache, PAGED_LAYOUTS[kv_layout])
        _paged_compact_kv_cache(views, kv_layout, cache_seqlens, accepted_indices, n, block_table)
        return
    _compact_kv_cache(cache_views(kv_cache), cache_seqlens, accepted_indices, n)
