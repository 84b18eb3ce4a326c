"""Triton kernels of tree_attention (see ``specdec_kernels.ops.tree_attention`` for the design).

``_tree_attention_fwd_kernel``: flash-attention-style, one program per (sequence, KV head, row
tile, split), all G query heads of the KV head at once (GQA); ``_tree_attention_combine_kernel``
merges the flash-decoding splits by log-sum-exp.  The same forward kernel reads a paged cache
(``PAGED``): each key tile looks up its block ids in the block table and addresses the pool
through its strides, so the NHD and HND layouts and every block size share the kernel.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import triton
import triton.language as tl

from specdec_kernels import _device
from specdec_kernels._library import launch
from specdec_kernels.checks import pool_geometry
from specdec_kernels.ops._tree_attention_launch import (
    MASK_BOOL,  # noqa: F401  (the mask kinds, read as ta.MASK_* by bench/static.py and aot_specs.py)
    MASK_CAUSAL,
    MASK_PACKED,  # noqa: F401
    TreeAttentionLaunch,
    launch_config,
)

_LOG2E = 1.4426950408889634
# software-pipelining depth of the prefix key loop (loads of later tiles overlap this one's math)
NUM_STAGES = 2
_jit = triton.jit

# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------


@_jit
def _kv_rows(offs_k, k_ok, cache, PAGED: tl.constexpr):
    """Offsets of the rows of cache slots ``offs_k`` from the K and V bases of this program.

    Dense: slot * slot stride.  PAGED: the slot's block id from the block table (loaded only
    where k_ok, so entries past a sequence's blocks are never read; clamped into
    [0, num_blocks), so no id makes the kernel read outside the pool), times the block stride,
    plus its offset in the block times the slot stride.  ``cache``: see ``_attend_tile``.
    """
    _, _, k_strides, v_strides, table = cache
    stride_kb, stride_ks, _ = k_strides
    stride_vb, stride_vs, _ = v_strides
    bt_base, stride_tj, page_size, num_blocks = table
    if PAGED:
        blk = tl.load(bt_base + (offs_k // page_size) * stride_tj, mask=k_ok, other=0)
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
        slot = offs_k % page_size
        k_rows = blk * stride_kb + slot * stride_ks
        v_rows = blk * stride_vb + slot * stride_vs
    else:
        k_rows = offs_k * stride_ks
        v_rows = offs_k * stride_vs
    return k_rows, v_rows


@_jit
def _attend_tile(
    state,
    query,
    cache,
    offs_k,
    k_ok,
    vis,
    IEEE_DOT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PAGED: tl.constexpr,
    MAY_BE_EMPTY: tl.constexpr,
):
    """Online-softmax update of ``state`` = (acc, m_i, l_i, bad) with one tile of keys: the
    cache slots ``offs_k`` (loaded where k_ok; visible where vis).

    ``query`` = (q, offs_d, d_ok, qk_scale): the program's query tile, its head-dimension lanes
    and the softmax scale times log2(e).  ``cache`` = (k_base, v_base, (stride_kb, stride_ks,
    stride_kd), (stride_vb, stride_vs, stride_vd), (bt_base, stride_tj, page_size, num_blocks)):
    the K and V bases of this program, their (sequence or block, slot, dim) strides and, PAGED,
    the sequence's block table row (see ``_kv_rows``).

    MAY_BE_EMPTY (the tree tiles, whose keys only some rows see): keys and values that are not
    finite are replaced by 0 before the products, so a key a row cannot see never reaches it through a
    zero weight (0 * NaN); a row that does see such a key is marked in ``bad`` (its output is
    NaN, as the reference's).  Prefix keys are visible to every row: no such care is needed.

    IEEE_DOT: fp32 inputs, full-precision dots (no TF32).  UPCAST_DOT: dots on operands cast
    to fp32 (exact for bf16 products, as tensor cores compute them): the interpreter of
    triton 3.6 multiplies bf16 tiles as their uint16 storage.
    """
    acc, m_i, l_i, bad = state
    q, offs_d, d_ok, qk_scale = query
    k_base, v_base, k_strides, v_strides, _ = cache
    stride_kd = k_strides[2]
    stride_vd = v_strides[2]
    k_rows, v_rows = _kv_rows(offs_k, k_ok, cache, PAGED)
    kt = tl.load(k_base + k_rows[None, :] + offs_d[:, None] * stride_kd, mask=d_ok[:, None] & k_ok[None, :], other=0.0)
    if MAY_BE_EMPTY:
        k32 = kt.to(tl.float32)
        k_bad = (k32 != k32) | (tl.abs(k32) == float("inf"))
        bad = bad | (tl.max((vis & (tl.max(k_bad.to(tl.int32), axis=0) > 0)[None, :]).to(tl.int32), axis=1) > 0)
        kt = tl.where(k_bad, 0.0, kt)
    if UPCAST_DOT:
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
    elif IEEE_DOT:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = tl.where(vis, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAY_BE_EMPTY:  # a row that has seen no visible key yet keeps m = -inf
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    alpha = tl.exp2(m_i - m_new_safe)
    p = tl.exp2(s - m_new_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    vt = tl.load(v_base + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    if MAY_BE_EMPTY:
        v32 = vt.to(tl.float32)
        v_bad = (v32 != v32) | (tl.abs(v32) == float("inf"))
        key_bad = tl.max(v_bad.to(tl.int32), axis=1) > 0
        bad = bad | (tl.max((vis & key_bad[None, :]).to(tl.int32), axis=1) > 0)
        vt = tl.where(v_bad, 0.0, vt)
    if UPCAST_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32), input_precision="ieee")
    elif IEEE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
    return acc, m_new, l_i, bad


@_jit
def _tree_visible(m_base, offs_j, j_ok, qi, row_ok, stride_mi, stride_mj, MASK_KIND: tl.constexpr):
    """[BLOCK_M, BLOCK_N] visibility of the tree keys seqlen + offs_j: key seqlen + j visible to
    row (i, g) iff mask[i, j] (MASK_KIND 0: the causal chain, j <= i)."""
    ok = row_ok[:, None] & j_ok[None, :]
    if MASK_KIND == 0:
        vis = ok & (offs_j[None, :] <= qi[:, None])
    elif MASK_KIND == 1:
        bits = tl.load(m_base + qi[:, None] * stride_mi + offs_j[None, :] * stride_mj, mask=ok, other=0)
        vis = ok & (bits != 0)
    else:
        words = tl.load(m_base + qi[:, None] * stride_mi + (offs_j // 32)[None, :] * stride_mj, mask=ok, other=0)
        vis = ok & (((words >> (offs_j % 32)[None, :]) & 1) != 0)
    return vis


@_jit
def _split_layout(seqlen, num_splits, MIN_SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(chunk, active) of a prefix of ``seqlen`` keys (``_tree_attention_launch.split_layout``):
    ``clamp(seqlen // MIN_SPLIT_KEYS, 1, num_splits)`` parts of ``chunk`` keys (a multiple of
    BLOCK_N); the splits from ``active`` on hold no key and write nothing."""
    n = tl.minimum(tl.maximum(seqlen // MIN_SPLIT_KEYS, 1), num_splits)
    chunk = tl.cdiv(tl.cdiv(seqlen, n), BLOCK_N) * BLOCK_N
    active = tl.maximum(tl.cdiv(seqlen, tl.maximum(chunk, 1)), 1)
    return chunk, active


@_jit
def _tree_attention_fwd_kernel(
    Q,
    K,
    V,
    SEQLENS,
    BLOCK_TABLE,
    MASK,
    OUT,
    OPART,
    LSE,
    N,
    S_CAP,
    G,
    Hkv,
    num_splits,
    page_size,
    num_blocks,
    qk_scale,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_tb,
    stride_tj,
    stride_mb,
    stride_mi,
    stride_mj,
    stride_ob,
    stride_on,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PAGED: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr,
):
    """One program: one (sequence, KV head), BLOCK_M rows (node, head of the group), one split.

    K/V strides are (sequence, head, slot, dim) of a dense cache, or with PAGED (block, head,
    slot-in-block, dim) of a pool, whichever its layout; S_CAP is the capacity in slots
    (max_blocks_per_seq * page_size when PAGED); BLOCK_TABLE [B, max_blocks_per_seq] int32
    (never read unless PAGED).

    NUM_STAGES: software-pipelining depth of the prefix key loop (``tl.range``): the key and
    value tiles of the next iterations are loaded while this one is computed; each stage holds
    a K and a V tile in shared memory.  The tree loop (a tile or two) is not pipelined.

    Splits (SPLIT): the sequence's prefix is cut as ``_split_layout`` says; split s < active
    attends to its slice (the last active split also to the tree keys) and writes its partial
    output and log-sum-exp; a split from ``active`` on reads no key and writes nothing.
    """
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    b64 = b.to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    M = G * N

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    qi = offs_m // G  # node of the row
    h = kvh * G + offs_m % G  # query head of the row
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    # Clamped to [0, S - N] (S >= N is checked on the host): with validate=False an invalid
    # cache_seqlens gives an unspecified result but never a key or value read outside the cache.
    seqlen = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), S_CAP - N).to(tl.int32)
    q_ptrs = Q + b64 * stride_qb + qi[:, None] * stride_qn + h[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if PAGED:  # the block of each key tile comes from the table: the base is the pool's head
        k_base = K + kvh64 * stride_kh
        v_base = V + kvh64 * stride_vh
        bt_base = BLOCK_TABLE + b64 * stride_tb
    else:
        k_base = K + b64 * stride_kb + kvh64 * stride_kh
        v_base = V + b64 * stride_vb + kvh64 * stride_vh
        bt_base = BLOCK_TABLE

    query = (q, offs_d, d_ok, qk_scale)
    k_strides = (stride_kb, stride_ks, stride_kd)
    v_strides = (stride_vb, stride_vs, stride_vd)
    cache = (k_base, v_base, k_strides, v_strides, (bt_base, stride_tj, page_size, num_blocks))

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bad = offs_m < 0  # rows that see a tree key whose value is not finite

    # 1. the prefix slice of this split: every key is visible to every row (none past `active`).
    chunk, active = _split_layout(seqlen, num_splits, MIN_SPLIT_KEYS, BLOCK_N)
    last_split = pid_s == active - 1  # walks the tree part too
    writes = pid_s < active  # holds keys: writes partials
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, seqlen)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        offs_k = start + tl.arange(0, BLOCK_N)
        k_ok = offs_k < hi
        acc, m_i, l_i, bad = _attend_tile(
            (acc, m_i, l_i, bad), query, cache, offs_k, k_ok, k_ok[None, :], IEEE_DOT, UPCAST_DOT, PAGED, False
        )

    # 2. the tree part, in the last active split: key seqlen + j visible to row (i, g) iff mask[i, j].
    if last_split:
        if MASK_KIND == 0:
            # causal chain: the rows of this tile see nodes up to their largest node index
            tree_hi = tl.minimum(N, (pid_m * BLOCK_M + BLOCK_M - 1) // G + 1)
        else:
            tree_hi = N
        m_base = MASK + b64 * stride_mb
        for j0 in tl.range(0, tree_hi, BLOCK_N, num_stages=1):  # a tile or two: not pipelined
            offs_j = j0 + tl.arange(0, BLOCK_N)
            j_ok = offs_j < tree_hi
            vis = _tree_visible(m_base, offs_j, j_ok, qi, row_ok, stride_mi, stride_mj, MASK_KIND)
            keys = seqlen + offs_j
            acc, m_i, l_i, bad = _attend_tile(
                (acc, m_i, l_i, bad), query, cache, keys, j_ok, vis, IEEE_DOT, UPCAST_DOT, PAGED, True
            )

    if SPLIT:
        # partial results [B * Hkv, M, num_splits, HEAD_DIM] and lse [B * Hkv, M, num_splits],
        # fp32; a split without keys writes nothing (the combine does not read it)
        if writes:
            row = pid_bh.to(tl.int64) * M + offs_m
            has = l_i > 0.0
            o = acc / tl.where(has, l_i, 1.0)[:, None]
            o = tl.where(bad[:, None], float("nan"), o)
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(LSE + row * num_splits + pid_s, lse, mask=row_ok)
            tl.store(
                OPART + (row * num_splits + pid_s)[:, None] * HEAD_DIM + offs_d[None, :],
                o,
                mask=row_ok[:, None] & d_ok[None, :],
            )
    else:
        o = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # 0/0 = NaN for a row that sees no key, like the reference
        o = tl.where(bad[:, None], float("nan"), o)
        o_ptrs = OUT + b64 * stride_ob + qi[:, None] * stride_on + h[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@_jit
def _tree_attention_combine_kernel(
    OPART,
    LSE,
    OUT,
    SEQLENS,
    num_rows,
    N,
    S_CAP,
    G,
    Hkv,
    num_splits,
    stride_ob,
    stride_on,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr,
):
    """BLOCK_R output rows per program: log-sum-exp weighted sum of the partial outputs of the
    splits that hold keys (``_split_layout`` of the row's sequence, as the forward kernel cut
    it: the partials of the other splits are never written, and never read)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # over B * Hkv * G * N
    r_ok = rows < num_rows
    M = G * N
    bh = rows // M
    r = rows % M
    b = bh // Hkv
    h = (bh % Hkv) * G + r % G
    qi = r // G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # the row's sequence length, clamped as the forward kernel clamps it, gives its active splits
    seqlen = tl.load(SEQLENS + b, mask=r_ok, other=0)
    seqlen = tl.minimum(tl.maximum(seqlen, 0), S_CAP - N).to(tl.int32)
    _, active = _split_layout(seqlen, num_splits, MIN_SPLIT_KEYS, BLOCK_N)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s in tl.range(0, tl.max(tl.where(r_ok, active, 0), axis=0)):
        s_ok = r_ok & (s < active)
        lse = tl.load(LSE + rows * num_splits + s, mask=s_ok, other=float("-inf"))
        o = tl.load(
            OPART + (rows * num_splits + s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split with a visible key yet
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        den = den * alpha + w
        acc = acc * alpha[:, None] + o * w[:, None]
        m = m_new
    out = acc / tl.where(r_ok, den, 1.0)[:, None]  # 0/0 = NaN for a row that sees no key, like the reference
    tl.store(
        OUT + b[:, None] * stride_ob + qi[:, None] * stride_on + h[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(OUT.dtype.element_ty),
        mask=r_ok[:, None] & d_ok[None, :],
    )


@_device.cached_launch_config  # per launch class, like the configuration (callers only read it)
def fwd_constexprs(
    cfg: TreeAttentionLaunch, head_dim: int, mask_kind: int, ieee: bool, upcast: bool, paged: bool
) -> Dict[str, object]:
    """The constexpr arguments of ``_tree_attention_fwd_kernel`` in launch ``cfg``
    (``launch_config``) over heads of ``head_dim`` with ``mask_kind`` (``MASK_*``): ``ieee``,
    fp32 inputs (full-precision dots); ``upcast``, bf16 dots on fp32 operands (the
    interpreter); ``paged``, a paged cache."""
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_D=cfg.block_d,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        MASK_KIND=mask_kind,
        SPLIT=cfg.num_splits > 1,
        IEEE_DOT=ieee,
        UPCAST_DOT=upcast,
        NUM_STAGES=NUM_STAGES,
        PAGED=paged,
        MIN_SPLIT_KEYS=cfg.min_split_keys,
    )


@_device.cached_launch_config  # per launch class (callers only read it)
def combine_constexprs(cfg: TreeAttentionLaunch, head_dim: int) -> Dict[str, object]:
    """The constexpr arguments of ``_tree_attention_combine_kernel`` in launch ``cfg`` over heads
    of ``head_dim`` (``num_warps`` apart)."""
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_D=cfg.block_d,
        BLOCK_R=cfg.combine_block_r,
        BLOCK_N=cfg.block_n,
        MIN_SPLIT_KEYS=cfg.min_split_keys,
    )


def split_workspace(rows: int, M: int, num_splits: int, head_dim: int, device: torch.device):
    """(opart [rows, M, num_splits, head_dim], lse [rows, M, num_splits]), float32, uninitialised:
    the partial outputs and log-sum-exps of a split launch over ``rows`` (sequence, KV head)
    pairs of ``M`` query rows.  Only the splits that hold keys write (and the combine reads)
    their entries; the tests replace this function to fill them with guard values."""
    opart = torch.empty(rows, M, num_splits, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(rows, M, num_splits, dtype=torch.float32, device=device)
    return opart, lse


class LaunchPlan:
    """One call's launches with everything that depends only on the inputs' metadata (shapes,
    strides, dtypes, devices, the mask kind, the scale and the split count) worked out once:
    ``run`` allocates the output (and the split workspace) and launches.  ``plan`` builds it;
    every launch goes ``plan(...).run(...)``, so the planned and unplanned calls share one path.
    The public front keeps plans per metadata signature (``tree_attention``'s plan cache)."""

    __slots__ = ("fwd_grid", "fwd_scalars", "fwd_meta", "combine", "split", "rows", "M", "D", "causal", "empty")

    def run(self, q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=None) -> torch.Tensor:
        """The launches on tensors with the metadata this plan was made for; returns the
        output (q's shape and dtype, contiguous)."""
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # faster than empty(q.shape)
        if self.empty:
            return out
        if self.causal:
            mask = cache_seqlens  # never read
        else:
            mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
        table = cache_seqlens if block_table is None else block_table  # dense: never read
        if self.split:
            opart, lse = split_workspace(self.rows, self.M, self.split, self.D, q.device)
        else:
            opart = lse = out  # never written
        launch(_tree_attention_fwd_kernel)[self.fwd_grid](
            q, k_cache, v_cache, cache_seqlens, table, mask, out, opart, lse, *self.fwd_scalars, **self.fwd_meta
        )
        if self.split:
            grid, scalars, meta = self.combine
            launch(_tree_attention_combine_kernel)[grid](opart, lse, out, cache_seqlens, *scalars, **meta)
        return out


def plan(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    tree_mask,
    mask_kind: int,
    sm_scale: float,
    num_splits: int,
    block_table=None,
    kv_layout: str = "NHD",
) -> LaunchPlan:
    """The ``LaunchPlan`` of a call on checked inputs (as ``paged_tree_attention_triton`` takes
    them; ``block_table`` None for a dense cache); reads only
    metadata (shapes, strides, dtypes, devices), never values."""
    B, N, H, D = q.shape
    if block_table is None:  # dense [B, Hkv, S, D]: strides (sequence, head, slot, dim)
        Hkv, capacity = k_cache.shape[1], k_cache.shape[2]
        k_strides, v_strides = k_cache.stride(), v_cache.stride()
        table_strides, page_size, num_blocks = (0, 0), 1, 1  # table never read
    else:  # a pool: strides (block, head, slot in the block, dim) whatever the layout
        num_blocks, page_size, Hkv, _ = pool_geometry(k_cache, kv_layout)
        capacity = block_table.shape[1] * page_size
        order = (0, 2, 1, 3) if kv_layout == "NHD" else (0, 1, 2, 3)
        ks, vs = k_cache.stride(), v_cache.stride()  # one call each: stride(i) costs as much
        k_strides = tuple([ks[i] for i in order])
        v_strides = tuple([vs[i] for i in order])
        table_strides = block_table.stride()
    G = H // Hkv
    M = G * N
    p = LaunchPlan()
    p.empty = B == 0 or N == 0 or H == 0
    if p.empty:
        return p
    sms = _device.sm_count(q.device)
    ieee, paged = q.dtype == torch.float32, block_table is not None
    cfg = launch_config(B, Hkv, N, G, D, sms, ieee=ieee, num_splits=num_splits)
    p.causal = mask_kind == MASK_CAUSAL
    if p.causal:
        smb = smi = smj = 0
    else:
        mst = tree_mask.stride()
        smb = mst[0] if len(mst) == 3 else 0
        smi, smj = mst[-2], mst[-1]
    out_strides = (N * H * D, H * D, D, 1)  # the contiguous output
    p.split = num_splits if num_splits > 1 else 0
    p.rows, p.M, p.D = B * Hkv, M, D
    p.fwd_grid = cfg.grid
    p.fwd_scalars = (
        N,
        capacity,
        G,
        Hkv,
        num_splits,
        page_size,
        num_blocks,
        sm_scale * _LOG2E,
        *q.stride(),
        *k_strides,
        *v_strides,
        *table_strides,
        smb,
        smi,
        smj,
        *out_strides,
    )
    p.fwd_meta = dict(
        fwd_constexprs(cfg, D, mask_kind, ieee, sms is None and q.dtype == torch.bfloat16, paged),
        num_warps=cfg.num_warps,
    )
    if p.split:
        p.combine = (
            cfg.combine_grid,
            (B * Hkv * M, N, capacity, G, Hkv, num_splits, *out_strides),
            dict(combine_constexprs(cfg, D), num_warps=cfg.combine_num_warps),
        )
    return p


# --------------------------------------------------------------------------------------
# The launchers of tree_attention's "triton" backend (plain functions, not ops)
# --------------------------------------------------------------------------------------


def tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: Optional[torch.Tensor],
    mask_kind: int,
    sm_scale: float,
    num_splits: int,
) -> torch.Tensor:
    """Triton launcher on checked inputs (the public ``tree_attention`` checks them).

    mask_kind: 0 causal chain (tree_mask None), 1 bool mask, 2 bit-packed int32 mask;
    sm_scale: the softmax scale (not yet multiplied by log2(e)); num_splits 1..MAX_SPLITS.
    Returns the output, q's shape and dtype.
    """
    return plan(q, k_cache, v_cache, cache_seqlens, tree_mask, mask_kind, sm_scale, num_splits).run(
        q, k_cache, v_cache, cache_seqlens, tree_mask
    )


def paged_tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: Optional[torch.Tensor],
    block_table: torch.Tensor,
    kv_layout: str,
    mask_kind: int,
    sm_scale: float,
    num_splits: int,
) -> torch.Tensor:
    """Triton launcher over a paged cache on checked inputs (see the public ``tree_attention``).

    k_cache, v_cache: pools in ``kv_layout`` ("NHD" [num_blocks, block_size, Hkv, D] or "HND"
    [num_blocks, Hkv, block_size, D]); block_table int32 [B, max_blocks_per_seq]; the other
    arguments as ``tree_attention_triton``.  Block ids are clamped into the pool in the kernel.
    """
    p = plan(q, k_cache, v_cache, cache_seqlens, tree_mask, mask_kind, sm_scale, num_splits, block_table, kv_layout)
    return p.run(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table)
