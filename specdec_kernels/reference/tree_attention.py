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

from specdec_kernels.checks import pool_geometry


def gather_paged_kv(cache: torch.Tensor, block_table: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """The dense cache [B, Hkv, max_blocks_per_seq * block_size, D] that a paged pool holds.

    Logical slot s of sequence b is slot s % block_size of block block_table[b, s // block_size].
    Block ids are clamped into [0, num_blocks) first, so an entry that no sequence uses (-1,
    huge) gathers some block of the pool, never memory outside it; the slots it fills are past
    the sequence's length and invisible.
    """
    B, max_blocks = block_table.shape
    num_blocks, block_size, Hkv, D = pool_geometry(cache, kv_layout)
    ids = block_table.to(torch.int64).clamp(0, num_blocks - 1)
    blocks = cache[ids]  # NHD: [B, M, block_size, Hkv, D]; HND: [B, M, Hkv, block_size, D]
    blocks = blocks.permute(0, 3, 1, 2, 4) if kv_layout == "NHD" else blocks.permute(0, 2, 1, 3, 4)
    return blocks.reshape(B, Hkv, max_blocks * block_size, D)  # [B, Hkv, M, block_size, D] -> slots


def visible_keys(
    cache_seqlens: torch.Tensor, tree_mask: Optional[torch.Tensor], num_new: int, capacity: int
) -> torch.Tensor:
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
    v_cache: Optional[torch.Tensor],
    cache_seqlens: torch.Tensor,
    tree_mask: Optional[torch.Tensor] = None,
    *,
    block_table: Optional[torch.Tensor] = None,
    kv_layout: str = "NHD",
    sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention of a draft token tree's queries to the cached prefix and their ancestors
    (reference of ``specdec_kernels.tree_attention``: SpecInfer / Medusa tree attention over a
    dense or paged cache, PagedAttention, Kwon et al. 2023), densely in float64 with -inf
    masking, then cast; a paged cache is first gathered through its block table.

    Same arguments (a bool or None ``tree_mask``), shapes, dtypes and results as the op, whose
    docstring has them (without ``num_splits``, ``backend`` and ``validate``; v_cache None:
    k_cache is one layer's keys and values (2, ...)); no argument checks
    (``tree_attention(..., backend="reference")`` runs this with the op's checks).
    """
    if v_cache is None:  # vLLM's per-layer kv_cache: keys at [0], values at [1]
        k_cache, v_cache = k_cache[0], k_cache[1]
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    if block_table is None:
        return _tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, scale)
    return paged_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, scale)


def paged_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, sm_scale):
    """The paged reference: gather through the block table, then the dense math."""
    k = gather_paged_kv(k_cache, block_table, kv_layout)
    v = gather_paged_kv(v_cache, block_table, kv_layout)
    return _tree_attention(q, k, v, cache_seqlens, tree_mask, sm_scale)
