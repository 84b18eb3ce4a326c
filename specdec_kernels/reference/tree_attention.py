"""Reference tree attention: dense masked softmax in float64 (plain PyTorch).

Two cache forms: a dense cache ``[B, Hkv, S, D]``, and a paged one (vLLM's PagedAttention,
Kwon et al. 2023; FlashInfer's page table): pools of fixed-size blocks
``[num_blocks, block_size, Hkv, D]`` ("NHD") or ``[num_blocks, Hkv, block_size, D]`` ("HND")
and a block table that lists, per sequence, the physical block of each logical block.  The
paged reference gathers each sequence's logical slots through its table into a dense cache
and then runs the dense math, so both forms share one definition of the result.
"""
from __future__ import annotations

from typing import Optional

import torch

from specdec_kernels.checks import FLOAT_DTYPES, check_shape, check_tensor, want_value_checks

SUPPORTED_HEAD_DIMS = tuple(range(16, 257, 16))


KV_LAYOUTS = ("NHD", "HND")


def _check_q_and_caches(q, k_cache, v_cache):
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=q.device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(q.dtype,), device=q.device)
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q's head dim must be one of {SUPPORTED_HEAD_DIMS}, got shape {tuple(q.shape)}")


def _check_heads_seqlens_mask(q, Hkv, cache_seqlens, tree_mask):
    B, N, H, _ = q.shape
    device = q.device
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"q's heads ({H}) must be a multiple of k_cache's heads ({Hkv}) (GQA)")
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=(torch.int32, torch.int64), device=device)
    check_shape("cache_seqlens", cache_seqlens, (B,))
    if tree_mask is not None:
        check_tensor("tree_mask", tree_mask, ndim=(2, 3), dtypes=(torch.bool,), device=device)
        if tree_mask.dim() == 2:
            check_shape("tree_mask", tree_mask, (N, N), "one ancestor mask for the batch")
        else:
            check_shape("tree_mask", tree_mask, (B, N, N), "one ancestor mask per sequence")


def check_kv_layout(kv_layout) -> str:
    """``kv_layout`` of a paged cache: "NHD" or "HND" (ValueError otherwise)."""
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    return kv_layout


def check_tree_attention_args(q, k_cache, v_cache, cache_seqlens, tree_mask, validate=None):
    """Validate the arguments of ``tree_attention`` (dense cache); return (B, N, H, D, Hkv, S)."""
    _check_q_and_caches(q, k_cache, v_cache)
    B, N, H, D = q.shape
    _, Hkv, S, _ = k_cache.shape
    check_shape("k_cache", k_cache, (B, Hkv, S, D), "(batch, kv_heads, capacity, head_dim) matching q")
    check_shape("v_cache", v_cache, (B, Hkv, S, D), "like k_cache")
    _check_heads_seqlens_mask(q, Hkv, cache_seqlens, tree_mask)
    if N > S:
        raise ValueError(f"k_cache's capacity S={S} is smaller than the N={N} new keys it must hold (q's dim 1)")
    if want_value_checks(validate, cache_seqlens) and B:
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0 or hi + N > S:
            raise ValueError(
                f"cache_seqlens + N must lie in [N, S={S}] (the N new keys are already in the cache), "
                f"got cache_seqlens in {lo}..{hi} with N={N}"
            )
    return B, N, H, D, Hkv, S


def paged_geometry(k_cache: torch.Tensor, kv_layout: str):
    """(num_blocks, block_size, kv_heads, head_dim) of a paged pool in ``kv_layout``."""
    if kv_layout == "NHD":
        num_blocks, block_size, Hkv, D = k_cache.shape
    else:
        num_blocks, Hkv, block_size, D = k_cache.shape
    return num_blocks, block_size, Hkv, D


def blocks_needed(cache_seqlens: torch.Tensor, num_new: int, block_size: int) -> torch.Tensor:
    """Blocks of its table each sequence uses: ceil((cache_seqlens + N) / block_size), int64 [B]."""
    return (cache_seqlens.to(torch.int64) + num_new + block_size - 1) // block_size


def check_paged_tree_attention_args(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, validate=None):
    """Validate the arguments of ``tree_attention`` over a paged cache.

    Returns (B, N, H, D, Hkv, capacity, block_size, num_blocks), capacity =
    max_blocks_per_seq * block_size.  Shapes, dtypes and devices are always checked; with
    value checks (``validate``, default on for CPU tensors) also cache_seqlens + N <= capacity
    and every block id a sequence uses (its first ceil((cache_seqlens + N) / block_size)
    table entries) in [0, num_blocks).  Entries past those are never read and may hold anything.
    """
    check_kv_layout(kv_layout)
    _check_q_and_caches(q, k_cache, v_cache)
    B, N, H, D = q.shape
    num_blocks, block_size, Hkv, _ = paged_geometry(k_cache, kv_layout)
    what = {"NHD": "(num_blocks, block_size, kv_heads, head_dim) for kv_layout='NHD'",
            "HND": "(num_blocks, kv_heads, block_size, head_dim) for kv_layout='HND'"}[kv_layout]
    check_shape("k_cache", k_cache, k_cache.shape[:3] + (D,), what + ", head_dim matching q")
    check_shape("v_cache", v_cache, tuple(k_cache.shape), "like k_cache")
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"k_cache must hold at least one block of at least one slot, got shape {tuple(k_cache.shape)} ({what})")
    _check_heads_seqlens_mask(q, Hkv, cache_seqlens, tree_mask)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=q.device)
    max_blocks = block_table.shape[1]
    check_shape("block_table", block_table, (B, max_blocks), "(batch, max_blocks_per_seq): one row of block ids per sequence")
    capacity = max_blocks * block_size
    if N > capacity:
        raise ValueError(
            f"block_table's capacity {max_blocks} blocks x {block_size} slots = {capacity} is smaller than "
            f"the N={N} new keys it must hold (q's dim 1)"
        )
    if want_value_checks(validate, cache_seqlens, block_table) and B:
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0 or hi + N > capacity:
            raise ValueError(
                f"cache_seqlens + N must lie in [N, capacity={capacity}] (block_table has {max_blocks} blocks of "
                f"{block_size} slots; the N new keys are already in the cache), got cache_seqlens in {lo}..{hi} with N={N}"
            )
        used = torch.arange(max_blocks, device=block_table.device)[None, :] < blocks_needed(cache_seqlens, N, block_size)[:, None]
        wrong = used & ((block_table < 0) | (block_table >= num_blocks))
        if bool(wrong.any()):
            b, j = (int(x) for x in wrong.nonzero()[0])
            raise ValueError(
                f"block_table entries a sequence uses must lie in [0, num_blocks={num_blocks}); "
                f"block_table[{b}, {j}] = {int(block_table[b, j])}"
            )
    return B, N, H, D, Hkv, capacity, block_size, num_blocks


def gather_paged_kv(cache: torch.Tensor, block_table: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """The dense cache [B, Hkv, max_blocks_per_seq * block_size, D] that a paged pool holds.

    Logical slot s of sequence b is slot s % block_size of block block_table[b, s // block_size].
    Block ids are clamped into [0, num_blocks) first, so an entry that no sequence uses (-1,
    huge) gathers some block of the pool, never memory outside it; the slots it fills are past
    the sequence's length and invisible.
    """
    B, max_blocks = block_table.shape
    num_blocks, block_size, Hkv, D = paged_geometry(cache, kv_layout)
    ids = block_table.to(torch.int64).clamp(0, num_blocks - 1)
    blocks = cache[ids]  # NHD: [B, M, block_size, Hkv, D]; HND: [B, M, Hkv, block_size, D]
    blocks = blocks.permute(0, 3, 1, 2, 4) if kv_layout == "NHD" else blocks.permute(0, 2, 1, 3, 4)
    return blocks.reshape(B, Hkv, max_blocks * block_size, D)  # [B, Hkv, M, block_size, D] -> slots


def visible_keys(cache_seqlens: torch.Tensor, tree_mask: Optional[torch.Tensor], num_new: int, capacity: int) -> torch.Tensor:
    """Which cache slots each new query may attend to: bool [B, N, S].

    Slots before cache_seqlens[b] (the prefix) are visible to every query; slot
    cache_seqlens[b] + j is visible to query i iff tree_mask[i, j] (the causal chain when
    tree_mask is None); no other slot is.
    """
    B, N, S = cache_seqlens.shape[0], num_new, capacity
    device = cache_seqlens.device
    slot = torch.arange(S, device=device)[None, :]
    seqlen = cache_seqlens.to(torch.int64)[:, None]
    prefix = (slot < seqlen)[:, None, :].expand(B, N, S)
    j = slot - seqlen  # position of the slot inside the new block
    in_block = (j >= 0) & (j < N)
    if tree_mask is None:
        tree_mask = torch.ones(N, N, dtype=torch.bool, device=device).tril()
    mask = tree_mask.expand(B, N, N)
    tree = mask.gather(2, j.clamp(0, max(N - 1, 0))[:, None, :].expand(B, N, S)) & in_block[:, None, :]
    return prefix | tree


def _tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale):
    B, N, H, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    group = H // Hkv
    # Lengths outside [0, S - N] (unchecked input) act as the nearest valid one, as in the kernels.
    cache_seqlens = cache_seqlens.to(torch.int64).clamp(0, S - N)
    # A key or value that is not finite (NaN from torch.empty, say) must reach exactly the
    # queries that see its slot: those get NaN, and nobody else.  So such slots are zeroed
    # before the products (a zero attention weight times NaN would be NaN) and the queries that
    # see one are set to NaN afterwards.
    k64, v64 = k_cache.to(torch.float64), v_cache.to(torch.float64)
    bad = ~(k64.isfinite().all(-1) & v64.isfinite().all(-1))  # [B, Hkv, S]
    k = torch.where(bad[..., None], 0.0, k64).repeat_interleave(group, dim=1)  # [B, H, S, D]
    v = torch.where(bad[..., None], 0.0, v64).repeat_interleave(group, dim=1)
    scores = torch.einsum("bnhd,bhsd->bhns", q.to(torch.float64), k) * sm_scale
    visible = visible_keys(cache_seqlens, tree_mask, N, S)[:, None]  # [B, 1, N, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("bhns,bhsd->bnhd", torch.softmax(scores, dim=-1), v)
    sees_bad = (visible & bad.repeat_interleave(group, dim=1)[:, :, None, :]).any(-1)  # [B, H, N]
    out = torch.where(sees_bad.transpose(1, 2)[..., None], float("nan"), out)
    return out.to(q.dtype)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: Optional[torch.Tensor] = None,
    *,
    block_table: Optional[torch.Tensor] = None,
    kv_layout: str = "NHD",
    sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention of a draft token tree's queries to the cached prefix and their ancestors (reference).

    Tree attention as in SpecInfer (Miao et al. 2024) and Medusa (Cai et al. 2024): the N new
    tokens' keys and values are already written at cache slots cache_seqlens[b] ..
    cache_seqlens[b] + N - 1; each query sees the whole prefix and the new keys of its own
    ancestors (and itself).  Computed densely in float64 with -inf masking, then cast.  A
    paged cache (``block_table`` given; PagedAttention, Kwon et al. 2023) is first gathered
    into the dense form through the block table (block ids clamped into the pool), then the
    same math runs.

    Args:
        q: Shape (batch, N, heads, head_dim), float32/float16/bfloat16.  head_dim a multiple
            of 16 up to 256.
        k_cache, v_cache: q's dtype.  Dense (block_table None): shape (batch, kv_heads,
            capacity, head_dim).  Paged: pools of blocks, shape (num_blocks, block_size,
            kv_heads, head_dim) for kv_layout "NHD" (vLLM's and FlashInfer's default) or
            (num_blocks, kv_heads, block_size, head_dim) for "HND"; any block_size >= 1.
            heads must be a multiple of kv_heads (GQA; query head h reads kv head
            h // (heads / kv_heads)).
        cache_seqlens: Shape (batch,), int32/int64: committed tokens per sequence, with
            cache_seqlens + N <= capacity.
        tree_mask: bool, shape (N, N) or (batch, N, N); mask[i, j] is true when node j is node
            i or one of its ancestors.  None means the causal chain.
        block_table: None (dense cache) or int32, shape (batch, max_blocks_per_seq): logical
            slot s of sequence b lives at offset s % block_size of physical block
            block_table[b, s // block_size]; capacity = max_blocks_per_seq * block_size.
            Blocks may come in any order and be shared between sequences (a common prefix).
            Entries past the ceil((cache_seqlens[b] + N) / block_size) blocks a sequence
            uses are never read and may hold anything (-1 padding).
        kv_layout: "NHD" or "HND", the layout of the paged pools (ignored for a dense cache).
        sm_scale: softmax scale, default head_dim ** -0.5.

    Returns:
        Shape (batch, N, heads, head_dim), q's dtype.

    Raises:
        TypeError: wrong dtypes (k/v must share q's dtype; the mask must be bool; the block
            table int32).
        ValueError: wrong ranks or shapes, heads not a multiple of kv_heads, unsupported
            head_dim, a kv_layout other than "NHD"/"HND", cache_seqlens + N beyond capacity,
            a used block id outside [0, num_blocks) (the last two checked on CPU tensors).

    Example:
        >>> pool = torch.randn(8, 16, 3, 64)            # 8 blocks of 16 slots, NHD
        >>> table = torch.tensor([[5, 2, -1]], dtype=torch.int32)  # slots 0..31 of sequence 0
        >>> q = torch.randn(1, 4, 9, 64)                 # 4 new tokens at slots 20..23
        >>> tree_attention(q, pool, pool, torch.tensor([20]), block_table=table).shape
        torch.Size([1, 4, 9, 64])
    """
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    if block_table is None:
        check_kv_layout(kv_layout)
        check_tree_attention_args(q, k_cache, v_cache, cache_seqlens, tree_mask)
        return _tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, scale)
    check_paged_tree_attention_args(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout)
    return paged_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, scale)


def paged_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, sm_scale):
    """The paged reference on checked arguments: gather through the block table, dense math."""
    k = gather_paged_kv(k_cache, block_table, kv_layout)
    v = gather_paged_kv(v_cache, block_table, kv_layout)
    return _tree_attention(q, k, v, cache_seqlens, tree_mask, sm_scale)
