"""The "torch" backend of ``tree_attention``: ``scaled_dot_product_attention`` over the cache
(dense), or over the blocks a paged cache's table names, gathered into a per-thread workspace.

On CPU the automatic backend takes the C++ kernel instead wherever the extension has it (this
path is not row-independent: SDPA rounds a row differently with the number of query rows and of
key slots; ``specdec_kernels.ops.tree_attention``, "Automatic CPU path"), this one where it
lacks it or ``SPECDEC_DENSE_ATTENTION`` / ``SPECDEC_PAGED_ATTENTION`` = ``torch`` forces it; on
CUDA it is chosen only explicitly.
"""

from __future__ import annotations

import threading

import torch

from specdec_kernels.checks import pool_geometry
from specdec_kernels.reference.tree_attention import visible_keys

# Per-thread CPU buffer that the torch backend gathers paged K/V into.  A fresh multi-MB
# tensor per call comes from fresh pages (glibc returns large freed chunks to the OS), and
# the page faults cost more than the gather itself (measured: 480 faults, 2.3 ms on top of a
# 0.5 ms call); CUDA's caching allocator needs no such help.  Buffers above the cap are not kept.
_WORKSPACE = threading.local()
WORKSPACE_MAX_BYTES = 256 << 20


def _workspace(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``numel`` elements (uninitialised), reused by later calls on this thread.

    Only a plain tensor made outside every mode is kept: under a FakeTensorMode, a tracer or a
    dispatch mode a fresh one is returned; the kept buffer is made with inference mode off, so
    that a buffer first needed inside ``torch.inference_mode`` (the engine) can still be written
    outside it (an inference tensor could not)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return torch.empty(numel, dtype=dtype)
    key = str(dtype)
    buf = getattr(_WORKSPACE, key, None)
    if buf is not None and buf.numel() >= numel:
        return buf[:numel]
    with torch.inference_mode(False):
        buf = torch.empty(numel, dtype=dtype)
    if type(buf) is torch.Tensor and numel * buf.element_size() <= WORKSPACE_MAX_BYTES:
        setattr(_WORKSPACE, key, buf)
    return buf


def _gather_paged(cache, block_ids, kv_layout, out):
    """The blocks ``block_ids`` [B, M] (ids in the pool) of a paged pool as a dense cache
    [B, Hkv, M * block_size, D], copied into ``out`` (B * M * block_size * Hkv * D elements).

    NHD: one ``index_select`` of whole blocks, viewed as [B, Hkv, slots, D] through strides
    (SDPA reads that view about as fast as a contiguous cache, and a second, head-major copy
    would cost more).  HND: one ``index_select`` of the (block, head) rows of block_size * D
    elements, which lands head-major at once; a pool whose (block, head) rows are not one
    stride apart is first selected by block, then rearranged.
    """
    num_blocks, block_size, Hkv, D = pool_geometry(cache, kv_layout)
    B, M = block_ids.shape
    if kv_layout == "NHD":
        blocks = torch.index_select(cache, 0, block_ids.reshape(-1), out=out.view(B * M, block_size, Hkv, D))
        return blocks.view(B, M * block_size, Hkv, D).transpose(1, 2)
    try:
        rows = cache.view(num_blocks * Hkv, block_size * D)
    except RuntimeError:
        blocks = cache.index_select(0, block_ids.reshape(-1)).view(B, M, Hkv, block_size, D)
        return out.view(B, Hkv, M, block_size, D).copy_(blocks.transpose(1, 2)).view(B, Hkv, M * block_size, D)
    index = block_ids.to(torch.int64).mul_(Hkv).view(B, 1, M) + torch.arange(Hkv, device=cache.device).view(1, Hkv, 1)
    torch.index_select(rows, 0, index.view(-1), out=out.view(B * Hkv * M, block_size * D))
    return out.view(B, Hkv, M * block_size, D)


def sdpa_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale):
    """SDPA over the cache sliced to max(cache_seqlens) + N slots; tree_mask bool or None.

    GQA without copying the cache: the G query heads of each KV head become G * N rows of
    one attention problem per KV head (row r = i * G + g), so q is [B, Hkv, N * G, D].  The
    mask is additive (0 / -inf) in q's dtype, which SDPA takes as is (a bool mask costs a
    conversion); with one prefix length for the batch its prefix columns are plain zeros.
    """
    B, N, H, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    if B == 0 or N == 0:
        return torch.empty_like(q)
    S = k_cache.shape[2]
    # Slots past the sequence (cache_seqlens clamped into [0, S - N]) are masked, and their
    # values replaced by zeros, so that garbage there (NaN from torch.empty) never reaches the
    # output.  On CPU the cache is first sliced to max(cache_seqlens) + N slots (reading the
    # lengths is free there); on other devices the whole capacity is used, never synchronising.
    lens_t = cache_seqlens.to(torch.int64).clamp(0, S - N)
    if q.device.type == "cpu":
        lens = lens_t.tolist()
        T, uniform = max(lens) + N, min(lens) == max(lens)
    else:
        T, uniform = S, False
    k = k_cache[:, :, :T]
    v = v_cache[:, :, :T]
    # Keys or values that are not finite reach exactly the queries that see their slot (NaN
    # there), as in the reference: zeroed before SDPA (an additive -inf mask plus inf, or a zero
    # weight times NaN, is NaN), and the queries that see one set to NaN after it.  On CPU one
    # reduction per tensor decides whether any care is needed (free to read there).
    bad = None
    if q.device.type != "cpu" or not (bool(torch.isfinite(k.sum())) and bool(torch.isfinite(v.sum()))):
        bad = ~(k.isfinite().all(-1) & v.isfinite().all(-1))  # [B, Hkv, T]
        k = torch.where(bad[..., None], 0, k)
        v = torch.where(bad[..., None], 0, v)
    qg = q.view(B, N, Hkv, G, D).transpose(1, 2).reshape(B, Hkv, N * G, D)
    if uniform:  # one prefix length and T = length + N: every slot belongs to the sequence
        if tree_mask is None and N == 1:
            attn_mask = None
        else:
            tm = torch.ones(N, N, dtype=torch.bool, device=q.device).tril_() if tree_mask is None else tree_mask
            Bm = tm.shape[0] if tm.dim() == 3 else 1
            attn_mask = torch.zeros(Bm, N, G, T, dtype=q.dtype, device=q.device)
            tree_add = torch.zeros(tm.shape, dtype=q.dtype, device=q.device).masked_fill_(~tm, float("-inf"))
            attn_mask[..., T - N :] = tree_add.view(Bm, N, 1, N)
            attn_mask = attn_mask.view(Bm, 1, N * G, T)
    else:
        vis = visible_keys(lens_t, tree_mask, N, T)  # [B, N, T]
        attn_mask = torch.zeros(B, N, G, T, dtype=q.dtype, device=q.device)
        attn_mask.masked_fill_(~vis[:, :, None, :], float("-inf"))
        attn_mask = attn_mask.view(B, 1, N * G, T)
    out = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=attn_mask, scale=sm_scale)
    out = out.view(B, Hkv, N, G, D).transpose(1, 2).reshape(B, N, H, D)
    if bad is not None:
        vis = visible_keys(lens_t, tree_mask, N, T)  # [B, N, T]
        sees_bad = (vis[:, None, :, :] & bad[:, :, None, :]).any(-1)  # [B, Hkv, N]
        sees_bad = sees_bad.transpose(1, 2).repeat_interleave(G, dim=2)  # [B, N, H]
        out = torch.where(sees_bad[..., None], float("nan"), out)
    return out


def sdpa_paged_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, sm_scale):
    """The SDPA path on the blocks that cover max(cache_seqlens) + N slots, gathered.

    Lengths act as clamped to [0, capacity - N] as in the reference (the dense path clamps
    them to its gathered capacity, which is the table's whenever a length reaches past it);
    block ids are clamped into the pool, so unused or hostile table entries gather some block
    of the pool (invisible slots) and never memory outside it.  Off CPU the whole table is
    gathered (no host read of the lengths).
    """
    B, N = q.shape[0], q.shape[1]
    num_blocks, block_size, Hkv, D = pool_geometry(k_cache, kv_layout)
    max_blocks = block_table.shape[1]
    if B == 0 or N == 0:
        return torch.empty_like(q)
    if q.device.type == "cpu":
        longest = min(max(int(cache_seqlens.max()), 0), max_blocks * block_size - N)
        used = -(-(longest + N) // block_size)
        kv = _workspace(2 * B * used * block_size * Hkv * D, q.dtype).view(2, -1)
    else:
        used = max_blocks
        kv = torch.empty(2, B * used * block_size * Hkv * D, dtype=q.dtype, device=q.device)
    ids = block_table[:, :used].clamp(0, num_blocks - 1)
    k = _gather_paged(k_cache, ids, kv_layout, kv[0])
    v = _gather_paged(v_cache, ids, kv_layout, kv[1])
    return sdpa_tree_attention(q, k, v, cache_seqlens, tree_mask, sm_scale)
