"""tree_rejection_sample: multi-candidate rejection sampling over a token tree.

The "triton" backend of ``ops/tree_rejection_sample.py`` (the op's other backends are listed
there): ``torch.ops.specdec.tree_rejection_sample_triton``, launched as ``launch_config`` says.

The Triton backend spreads a row's vocabulary over many programs (``split_vocab``), so a
batch of one tree fills the GPU.  What makes that possible: every child of a node is drawn
from the same draft row q = draft[node], so the residual after the k-th rejection at a node
depends on k alone, not on which children were rejected.  With r_0 = mass(p[node]) and
t_k = sum(r_k), the reference's update is r_k = mass(r_{k-1} * (1 / t_{k-1}) - q) (kept
as r_{k-1} when r_k has no mass, and then every later update fails as well), so

1. ``_tree_level_kernel`` computes t_0 for every node, then t_1, t_2, ... for every node that
   has that many children, each level over (row blocks, vocabulary chunks) from the chunk
   partials of the level before; element x of r_k is rebuilt from p(x), q(x) and the
   reciprocals 1 / t_0..1 / t_{k-1} with the reference's own float64 operations (no division
   per element), so nothing of size V is stored.
   Levels above ``split_levels`` (nodes with many children) run serially per row.
2. ``_tree_walk_kernel`` walks the nodes in order, as the reference does, with point loads
   only: the accept tests need r_k(x) and t_k.
3. ``_tree_final_partials_kernel`` and ``_tree_final_sample_kernel`` sample the last residual
   by inverse CDF as the chain op does: its weights (stored, B x V float64) and chunk masses
   over (row blocks, chunks), then a search inside the one chunk that holds u * total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from specdec_kernels import _device
from specdec_kernels._device import cdiv, next_pow2
from specdec_kernels._library import kernel_op, launch
from specdec_kernels.ops._triton._launch import dummy, new_int64, unit_stride
from specdec_kernels.ops._triton._sampling_common import (
    VocabSplit,
    _add_chunk_partials,
    _cdf_search_tile,
    _load_chunk_partials,
    _mass64,
    _mul_rn,
    _no_chunk_partials,
    _pick_token,
    _start_search,
    _store_chunk_partials,
    vocab_split,
)
from specdec_kernels.ops._triton._uniforms import _coin, _request_key

# Residual levels computed over vocabulary chunks (one launch each); the levels above run
# serially per row in one launch.
DEFAULT_SPLIT_LEVELS = 2


@triton.jit
def _inverse(t):
    """The reference's 1 / safe_total: 1 / t where t > 0, else 1 (one division per row)."""
    return 1.0 / tl.where(t > 0, t, 1.0)


@triton.jit
def _residual_tile(r, q, tinv_rows, steps, rmask):
    """Apply r <- mass(r * inv_i - q) for i = 0..steps-1 to a [BB, BV] tile (``steps`` [BB]
    per row; inv_i = 1 / safe(t_i) read from ``tinv_rows`` + i): element x of the residual
    after ``steps`` updates, from mass(p)(x) and q(x), in the reference's float64 operations."""
    for i in tl.range(0, tl.max(steps, axis=0)):
        live = rmask & (i < steps)
        inv = tl.load(tinv_rows + i, mask=live, other=1.0)
        r = tl.where(live[:, None], _mass64(_mul_rn(r, inv[:, None]) - q), r)
    return r


@triton.jit
def _residual_point(r, q, tinv_rows, steps, rmask):
    """``_residual_tile`` for one element per row ([BB] vectors)."""
    for i in tl.range(0, tl.max(steps, axis=0)):
        live = rmask & (i < steps)
        inv = tl.load(tinv_rows + i, mask=live, other=1.0)
        r = tl.where(live, _mass64(_mul_rn(r, inv) - q), r)
    return r


@triton.jit
def _tree_level_kernel(
    target_ptr,  # [B, N, V] fp32/fp16/bf16, last dim contiguous
    draft_ptr,  # [B, N, V] like target (unused when HAS_DRAFT is False)
    parents_ptr,  # [B, N] int32/int64 with row stride stride_pb (0: one tree for the batch)
    num_nodes_ptr,  # [B] int64
    part_ptr,  # [B * N, N, S] fp64: chunk s of t_k of node row r at (r * N + k) * S + s (written)
    tsum_ptr,  # [2, B * N, N] fp64: t_k of node row r at r * N + k, 1 / safe(t_k) at (R + r) * N + k
    R,  # B * N node rows
    N,
    V,
    stride_tb,
    stride_tn,
    stride_db,
    stride_dn,
    stride_pb,
    S,  # chunks of the split levels
    level,  # first level of this launch
    level_end,  # one past the last (split launches: level + 1)
    TILES_PER_SPLIT,  # vocabulary tiles per program
    TAIL: tl.constexpr,  # serial levels: grid (row blocks, 1), each program walks its whole rows
    HAS_DRAFT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,  # power of two >= S
):
    """Program (i, s): node rows i * BLOCK_R.., vocabulary chunk s.  Level 0: the chunk's mass
    of the target row (for t_0).  Level k >= 1, rows whose node has k children or more
    (others write 0): the chunk's mass of r_k, from t_{k-1} summed from the level before."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    b = (rows // N).to(tl.int64)  # R = B * N < 2**31 (the launcher checks)
    n = (rows % N).to(tl.int64)
    # counts clamped to 0..N in int64 before any use, whatever the caller validated
    nn = tl.minimum(tl.maximum(tl.load(num_nodes_ptr + b, mask=rmask, other=0), 0), N)
    p_rows = target_ptr + b * stride_tb + n * stride_tn
    q_rows = draft_ptr + b * stride_db + n * stride_dn
    ts_rows = tsum_ptr + rows64 * N
    inv_rows = tsum_ptr + (R + rows64) * N
    part_rows = part_ptr + rows64 * N * S
    lo = split * TILES_PER_SPLIT * BLOCK_V
    if level == 0:
        live = rmask & (n < tl.maximum(nn, 1))  # node 0 always: the sample of an empty tree
        acc = tl.zeros([BLOCK_R], dtype=tl.float64)
        for t in tl.range(0, TILES_PER_SPLIT, num_stages=3):
            offs = lo + t * BLOCK_V + tl.arange(0, BLOCK_V)
            m2 = live[:, None] & (offs < V)[None, :]
            acc += tl.sum(_mass64(tl.load(p_rows[:, None] + offs[None, :], mask=m2, other=0.0)), axis=1)
        tl.store(part_rows + split, acc, mask=rmask)
    else:
        # children of node n among the first nn nodes; parents compared in int64 (a huge
        # parent never aliases a node by narrowing), only later nodes count (as in the walk)
        m = tl.zeros([BLOCK_R], dtype=tl.int32)
        for j in tl.range(1, N * (level < level_end)):
            inside = rmask & (j > n) & (j < nn)
            par = tl.load(parents_ptr + b * stride_pb + j, mask=inside, other=-1).to(tl.int64)
            m += (inside & (par == n)).to(tl.int32)
        cs = tl.arange(0, BLOCK_S)
        m2s = rmask[:, None] & (cs < S)[None, :]
        t_prev = tl.sum(tl.load(part_rows[:, None] + (level - 1) * S + cs[None, :], mask=m2s, other=0.0), axis=1)
        for k in tl.range(level, level_end):
            inv_prev = _inverse(t_prev)
            if split == 0:
                tl.store(ts_rows + (k - 1), t_prev, mask=rmask)
                tl.store(inv_rows + (k - 1), inv_prev, mask=rmask)
            if TAIL:
                tl.debug_barrier()  # 1 / t_{k-2}, stored by other threads, is read below
            # a failed update (t_{k-1} == 0 for k >= 2) fails at every later level: rows write 0
            active = rmask & (m >= k) & ((k == 1) | (t_prev > 0))
            acc = tl.zeros([BLOCK_R], dtype=tl.float64)
            if tl.max(active.to(tl.int32), axis=0) > 0:
                steps = tl.where(active, k - 1, 0)
                for t in tl.range(0, TILES_PER_SPLIT, num_stages=3):
                    offs = lo + t * BLOCK_V + tl.arange(0, BLOCK_V)
                    m2 = active[:, None] & (offs < V)[None, :]
                    r = _mass64(tl.load(p_rows[:, None] + offs[None, :], mask=m2, other=0.0))
                    q = _mass64(tl.load(q_rows[:, None] + offs[None, :], mask=m2, other=0.0))
                    r = _residual_tile(r, q, inv_rows, steps, active)
                    r = _mass64(_mul_rn(r, inv_prev[:, None]) - q)
                    acc += tl.sum(tl.where(m2, r, 0.0), axis=1)
            if not TAIL:
                tl.store(part_rows + k * S + split, acc, mask=rmask)
            t_prev = acc
        if TAIL:
            tl.store(ts_rows + (level_end - 1), t_prev, mask=rmask)
            tl.store(inv_rows + (level_end - 1), _inverse(t_prev), mask=rmask)


@triton.jit
def _tree_walk_kernel(
    target_ptr,  # [B, N, V], as _tree_level_kernel
    draft_ptr,
    tokens_ptr,  # [B, N] int32/int64, contiguous
    parents_ptr,  # [B, N] int32/int64 with row stride stride_pb
    num_nodes_ptr,  # [B] int64
    coins_ptr,  # [B, N-1] fp32/fp64, contiguous (unused with PHILOX_COINS)
    seeds_ptr,  # [B] int32/int64 (read with PHILOX_COINS)
    offsets_ptr,  # [B] int32/int64 (likewise)
    tsum_ptr,  # [2, B * N, N] fp64 from _tree_level_kernel: t_k and 1 / safe(t_k) of every node row
    out_tokens_ptr,  # [B, N] int64 (written; slot num_accepted by the final sample)
    out_nodes_ptr,  # [B, N] int64 (written)
    num_accepted_ptr,  # [B] int64 (written)
    state_ptr,  # [2, B] int32 (written): the last node, and its updates (HAS_DRAFT) / rejections
    rej_ptr,  # [B, NP] int64 (written, deterministic children): the tokens rejected there
    B,
    N,
    V,
    stride_tb,
    stride_tn,
    stride_db,
    stride_dn,
    stride_pb,
    HAS_DRAFT: tl.constexpr,
    PHILOX_COINS: tl.constexpr,  # node c's coin from seeds/offsets (stream 0 at offset + c - 1)
    BLOCK_B: tl.constexpr,
    NP: tl.constexpr,  # next power of two >= N
):
    """Program i: sequences i * BLOCK_B..: one pass in node order visits every node's children
    in index order (as the reference), with the totals t_k precomputed and point loads."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    slots = tl.arange(0, NP)
    nn = tl.minimum(tl.maximum(tl.load(num_nodes_ptr + rows64, mask=rmask, other=0), 0), N)
    t_rows = target_ptr + rows64 * stride_tb
    d_rows = draft_ptr + rows64 * stride_db
    zero = tl.zeros([BLOCK_B], dtype=tl.int32)
    seed, offset = _request_key(seeds_ptr, offsets_ptr, rows64, rmask, PHILOX_COINS)

    current = zero
    k = zero  # rejections at `current`
    upd = zero  # successful residual updates at `current` (a prefix of the rejections)
    cur_row = rows64 * N
    # t_0 of the root (only read if the root has children)
    total = tl.load(tsum_ptr + cur_row * N, mask=rmask & (nn > 1), other=0.0)
    rej = tl.full([BLOCK_B, NP], -1, tl.int64)  # deterministic: children rejected at `current`
    nrej = zero
    num_acc = zero
    path = tl.where(slots[None, :] == 0, 0, tl.full([BLOCK_B, NP], -1, tl.int32))
    out_tok = tl.full([BLOCK_B, NP], -1, tl.int64)

    for j in tl.range(1, N):
        # parents are only compared, in int64: a huge parent never aliases a node by narrowing
        par = tl.load(parents_ptr + rows64 * stride_pb + j, mask=rmask, other=-1).to(tl.int64)
        is_child = rmask & (par == current.to(tl.int64)) & (j < nn)
        if tl.max(is_child.to(tl.int32), axis=0) > 0:
            x = tl.load(tokens_ptr + rows64 * N + j, mask=is_child, other=-1).to(tl.int64)
            in_vocab = (x >= 0) & (x < V)
            xs = tl.minimum(tl.maximum(x, 0), V - 1)
            u = _coin(coins_ptr, rows64 * (N - 1) + (j - 1), seed, offset, j - 1, is_child, PHILOX_COINS)
            u = u.to(tl.float64)
            cur64 = current.to(tl.int64)
            px = _mass64(tl.load(t_rows + cur64 * stride_tn + xs, mask=is_child, other=0.0))
            if HAS_DRAFT:
                qx = _mass64(tl.load(d_rows + cur64 * stride_dn + xs, mask=is_child, other=0.0))
                rx = _residual_point(px, qx, tsum_ptr + (B * N + cur_row) * N, tl.where(is_child, upd, 0), is_child)
                # accept with probability min(1, p'(x) / q(x)), p' = r / total
                accept = is_child & in_vocab & (u * qx * total < rx)
                reject = is_child & ~accept
                # p' <- norm(max(0, p' - q)): t_k precomputed, kept as it was when it is 0
                k = tl.where(reject, k + 1, k)
                t_k = tl.load(tsum_ptr + cur_row * N + tl.minimum(k, N - 1), mask=reject, other=0.0)
                moved = reject & (t_k > 0)
                upd = tl.where(moved, k, upd)
                total = tl.where(moved, t_k, total)
            else:
                # a deterministic child is accepted with probability p'(x); on rejection x is
                # removed from p' (zeroed, the total reduced by its weight)
                seen = tl.max((rej == xs[:, None]).to(tl.int32), axis=1) > 0
                rx = tl.where(seen, 0.0, px)
                accept = is_child & in_vocab & (u * total < rx)
                reject = is_child & ~accept & in_vocab
                total = tl.where(reject, total - rx, total)
                rej = tl.where(reject[:, None] & (slots[None, :] == nrej[:, None]), xs[:, None], rej)
                nrej += reject.to(tl.int32)
            if tl.max(accept.to(tl.int32), axis=0) > 0:
                out_tok = tl.where(accept[:, None] & (slots[None, :] == num_acc[:, None]), x[:, None], out_tok)
                num_acc += accept.to(tl.int32)
                path = tl.where(accept[:, None] & (slots[None, :] == num_acc[:, None]), j, path)
                current = tl.where(accept, j, current)
                cur_row = tl.where(accept, rows64 * N + j, cur_row)
                fresh = tl.load(tsum_ptr + cur_row * N, mask=accept & (j + 1 < nn), other=0.0)
                total = tl.where(accept, fresh, total)
                k = tl.where(accept, 0, k)
                upd = tl.where(accept, 0, upd)
                rej = tl.where(accept[:, None], -1, rej)
                nrej = tl.where(accept, 0, nrej)

    m2 = rmask[:, None] & (slots < N)[None, :]
    tl.store(out_tokens_ptr + rows64[:, None] * N + slots[None, :], out_tok, mask=m2)
    tl.store(out_nodes_ptr + rows64[:, None] * N + slots[None, :], path.to(tl.int64), mask=m2)
    tl.store(num_accepted_ptr + rows64, num_acc.to(tl.int64), mask=rmask)
    tl.store(state_ptr + rows64, current, mask=rmask)
    if HAS_DRAFT:
        tl.store(state_ptr + B + rows64, upd, mask=rmask)
    else:
        tl.store(state_ptr + B + rows64, nrej, mask=rmask)
        tl.store(rej_ptr + rows64[:, None] * NP + slots[None, :], rej, mask=rmask[:, None])


@triton.jit
def _zeroed(cols, rej, nrej, NP: tl.constexpr, rmask):
    """[BB, BV] mask of the columns ``cols`` listed in ``rej`` [BB, NP] (rejected
    deterministic children; the first ``nrej`` [BB] slots are used)."""
    slots = tl.arange(0, NP)
    hit = rmask[:, None] & (cols < 0)  # all False, [BB, BV]
    for i in tl.range(0, tl.max(nrej, axis=0)):
        col = tl.sum(tl.where(slots[None, :] == i, rej, 0), axis=1)  # slot i of each row
        hit = hit | ((cols == col[:, None]) & (i < nrej)[:, None])
    return hit


@triton.jit
def _final_state(ptrs, strides, rows, rmask, B, N, HAS_DRAFT: tl.constexpr, BLOCK_B: tl.constexpr, NP: tl.constexpr):
    """(p_rows, q_rows, ts_rows, n_upd, rej, nrej) of the [BB] sequences: the last node's rows
    and how its residual is rebuilt.  ``ptrs`` = (target_ptr, draft_ptr, tsum_ptr, state_ptr,
    rej_ptr) and ``strides`` = (stride_tb, stride_tn, stride_db, stride_dn): the arguments of
    those names of ``_tree_final_partials_kernel``."""
    target_ptr, draft_ptr, tsum_ptr, state_ptr, rej_ptr = ptrs
    stride_tb, stride_tn, stride_db, stride_dn = strides
    rows64 = rows.to(tl.int64)
    cur = tl.minimum(tl.maximum(tl.load(state_ptr + rows64, mask=rmask, other=0), 0), N - 1).to(tl.int64)
    count = tl.minimum(tl.maximum(tl.load(state_ptr + B + rows64, mask=rmask, other=0), 0), N - 1)
    p_rows = target_ptr + rows64 * stride_tb + cur * stride_tn
    q_rows = draft_ptr + rows64 * stride_db + cur * stride_dn
    ts_rows = tsum_ptr + (B * N + rows64 * N + cur) * N  # the reciprocals 1 / safe(t_k)
    slots = tl.arange(0, NP)
    if HAS_DRAFT:
        n_upd = count
        nrej = tl.zeros_like(count)
        rej = tl.full([BLOCK_B, NP], -1, tl.int64)
    else:
        n_upd = tl.zeros_like(count)
        nrej = count
        rej = tl.load(
            rej_ptr + rows64[:, None] * NP + slots[None, :],
            mask=rmask[:, None] & (slots[None, :] < count[:, None]),
            other=-1,
        )
    return p_rows, q_rows, ts_rows, n_upd, rej, nrej


@triton.jit
def _final_tile(
    p_rows, q_rows, ts_rows, n_upd, rej, nrej, rmask, cols, inside, HAS_DRAFT: tl.constexpr, NP: tl.constexpr
):
    """Weights of the final sample at the [BB, BV] columns ``cols``: (residual, target row),
    float64 (0 off ``rmask`` and ``inside``)."""
    m2 = rmask[:, None] & inside
    p = _mass64(tl.load(p_rows[:, None] + cols, mask=m2, other=0.0))
    if HAS_DRAFT:
        q = _mass64(tl.load(q_rows[:, None] + cols, mask=m2 & (n_upd > 0)[:, None], other=0.0))
        w = tl.where(m2, _residual_tile(p, q, ts_rows, n_upd, rmask), 0.0)
    else:
        w = tl.where(_zeroed(cols, rej, nrej, NP, rmask), 0.0, p)
    return w, p


@triton.jit
def _tree_final_partials_kernel(
    target_ptr,
    draft_ptr,
    tsum_ptr,
    state_ptr,  # [2, B] int32 from _tree_walk_kernel
    rej_ptr,  # [B, NP] int64 from _tree_walk_kernel
    weights_ptr,  # [B, V] fp64 (written): the residual's weights, searched by the final sample
    part_mass_ptr,  # [2, S, B] fp64 (written): mass of the residual and of p per chunk
    part_last_ptr,  # [2, S, B] int32 (written): their last indices with mass (-1: none)
    B,
    N,
    V,
    stride_tb,
    stride_tn,
    stride_db,
    stride_dn,
    TILES_PER_SPLIT,
    HAS_DRAFT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NP: tl.constexpr,
):
    """Program (i, s): sequences i * BLOCK_B.., vocabulary chunk s of the last node's row: the
    residual's weights (stored) and the chunk's masses of them and of the target row."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    S = tl.num_programs(1)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    w_rows = weights_ptr + rows.to(tl.int64) * V
    ptrs = (target_ptr, draft_ptr, tsum_ptr, state_ptr, rej_ptr)
    strides = (stride_tb, stride_tn, stride_db, stride_dn)
    p_rows, q_rows, ts_rows, n_upd, rej, nrej = _final_state(ptrs, strides, rows, rmask, B, N, HAS_DRAFT, BLOCK_B, NP)
    partials = _no_chunk_partials(BLOCK_B)
    lo = split * TILES_PER_SPLIT * BLOCK_V
    for t in tl.range(0, TILES_PER_SPLIT, num_stages=3):
        offs = lo + t * BLOCK_V + tl.arange(0, BLOCK_V)
        w, p = _final_tile(
            p_rows, q_rows, ts_rows, n_upd, rej, nrej, rmask, offs[None, :], (offs < V)[None, :], HAS_DRAFT, NP
        )
        tl.store(w_rows[:, None] + offs[None, :], w, mask=rmask[:, None] & (offs < V)[None, :])
        partials = _add_chunk_partials(partials, w, p, offs)
    _store_chunk_partials(part_mass_ptr, part_last_ptr, split, S, B, rows, rmask, partials)


@triton.jit
def _tree_final_sample_kernel(
    target_ptr,  # [B, N, V]
    state_ptr,  # [2, B] int32 from _tree_walk_kernel
    weights_ptr,  # [B, V] fp64 from _tree_final_partials_kernel
    final_u_ptr,  # [B] fp32/fp64 (unused with PHILOX_FINAL)
    seeds_ptr,  # [B] int32/int64 (read with PHILOX_FINAL)
    offsets_ptr,  # [B] int32/int64 (likewise)
    part_mass_ptr,  # [2, S, B] fp64 from _tree_final_partials_kernel
    part_last_ptr,  # [2, S, B] int32
    out_tokens_ptr,  # [B, N] int64: slot num_accepted written
    num_accepted_ptr,  # [B] int64 from _tree_walk_kernel
    B,
    N,
    V,
    stride_tb,
    stride_tn,
    S,
    TILES_PER_SPLIT,
    PHILOX_FINAL: tl.constexpr,  # the uniform from seeds/offsets (stream 1 at offset)
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,  # power of two >= S
):
    """Program i: sequences i * BLOCK_B..: the residual (the target row if it has no mass)
    sampled by inverse CDF, searching only the chunk that holds u * total."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    cur = tl.minimum(tl.maximum(tl.load(state_ptr + rows64, mask=rmask, other=0), 0), N - 1).to(tl.int64)
    p_rows = target_ptr + rows64 * stride_tb + cur * stride_tn
    w_rows = weights_ptr + rows64 * V
    partials = _load_chunk_partials(part_mass_ptr, part_last_ptr, S, B, rows64, rmask, BLOCK_S)
    use_w = tl.sum(partials[0], axis=1) > 0  # else (no residual mass) the target row
    key = _request_key(seeds_ptr, offsets_ptr, rows64, rmask, PHILOX_FINAL)
    total, last, threshold, searching, lo, carry, found = _start_search(
        use_w, partials, final_u_ptr, rows64, key, rmask, TILES_PER_SPLIT, BLOCK_V, BLOCK_S, PHILOX_FINAL
    )
    for t in tl.range(0, TILES_PER_SPLIT):
        cols = lo[:, None] + t * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
        inside = searching[:, None] & (cols < V)
        w = tl.load(w_rows[:, None] + cols, mask=inside & use_w[:, None], other=0.0)
        p = _mass64(tl.load(p_rows[:, None] + cols, mask=inside & ~use_w[:, None], other=0.0))
        carry, found = _cdf_search_tile(tl.where(use_w[:, None], w, p), cols, carry, threshold, found)
    sampled = _pick_token(found, last, total)
    num_acc = tl.minimum(tl.maximum(tl.load(num_accepted_ptr + rows64, mask=rmask, other=0), 0), N - 1)
    tl.store(out_tokens_ptr + rows64 * N + num_acc, sampled, mask=rmask)


def level_num_warps(block_v: int) -> int:
    """Warps of ``_tree_level_kernel`` and ``_tree_final_partials_kernel``: 8 for full
    1024-column tiles (4 and 16 spill registers in some configurations, ``python -m
    specdec_kernels.bench.kernels --static``), else 4."""
    return 8 if block_v >= 1024 else 4


def sample_num_warps(block_v: int) -> int:
    """Warps of ``_tree_final_sample_kernel``: 8 for full 1024-column tiles, else 4."""
    return 8 if block_v >= 1024 else 4


WALK_NUM_WARPS = 4  # the walk is point loads (1 and 2 warps spill registers in some configurations)


@dataclass(frozen=True)
class TreeRejectionSampleLaunch:
    """The launches of one call.

    ``levels``: ``_tree_level_kernel`` on ``levels.grid`` (blocks of ``BLOCK_R`` =
    ``levels.block_b`` of the B * N node rows, vocabulary chunks) for levels 0..``split_levels``,
    one launch each, then once on (node-row blocks, 1) for the levels above.  ``rows``: the
    walk on ``(rows.row_blocks,)`` (``BLOCK_B`` sequences a program, ``np_`` node lanes), then
    ``_tree_final_partials_kernel`` on ``rows.grid`` and ``_tree_final_sample_kernel`` on
    ``(rows.row_blocks,)``."""

    levels: VocabSplit
    rows: VocabSplit
    split_levels: int
    np_: int
    level_num_warps: int
    walk_num_warps: int
    final_partials_num_warps: int
    sample_num_warps: int


def launch_config(
    batch: int,
    num_nodes: int,
    vocab: int,
    sm_count: Optional[int],
    *,
    has_draft: bool = True,
    tile: Optional[Tuple[int, int]] = None,
    num_splits: Optional[int] = None,
    split_levels: Optional[int] = None,
) -> TreeRejectionSampleLaunch:
    """The launch configuration for ``batch`` trees of ``num_nodes`` (N) nodes over ``vocab``
    entries on a GPU of ``sm_count`` SMs (None: the interpreter).

    ``split_levels``: residual levels 1..LS computed over vocabulary chunks (default
    ``DEFAULT_SPLIT_LEVELS``, at most N - 1; 0 without draft distributions).  ``tile`` and
    ``num_splits`` override the choice of both vocabulary launches (see ``vocab_split``).
    """
    levels = vocab_split(vocab, batch * num_nodes, sm_count, tile=tile, num_splits=num_splits)
    rows = vocab_split(vocab, batch, sm_count, tile=tile, num_splits=num_splits)
    wanted = DEFAULT_SPLIT_LEVELS if split_levels is None else split_levels
    ls = max(0, min(num_nodes - 1, int(wanted))) if has_draft else 0
    return TreeRejectionSampleLaunch(
        levels,
        rows,
        ls,
        next_pow2(num_nodes),
        level_num_warps(levels.block_v),
        WALK_NUM_WARPS,
        level_num_warps(rows.block_v),
        sample_num_warps(rows.block_v),
    )


def _tree_rejection_sample_triton_impl(
    target_probs: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    num_nodes: torch.Tensor,
    uniform_samples: Optional[torch.Tensor],
    sample_uniforms: Optional[torch.Tensor],
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the tree kernels on validated inputs (see ``tree_rejection_sample``).

    Args:
        target_probs: Shape (B, N, V), float32/float16/bfloat16, CUDA (or CPU under
            TRITON_INTERPRET=1).
        tree_tokens: Shape (B, N), int32/int64.
        tree_parents: Shape (B, N) (a shared tree may be an expanded (N,) tensor: batch
            stride 0) or (N,), int32/int64, topological (not checked here; any values are
            safe).
        draft_probs: Shape (B, N, V) like target_probs, or None (deterministic children).
        num_nodes: Shape (B,), int64 in 0..N (clamped).
        uniform_samples: Shape (B, N - 1), float32/float64: column c - 1 is node c's coin
            (clamped into [0, 1) in the kernel, NaN as 0), or None: Philox stream 0 at
            offsets[b] + c - 1.
        sample_uniforms: Shape (B,), float32/float64: the final sample's uniform, or None:
            Philox stream 1 at offsets[b].
        seeds, offsets: Shape (B,), int32/int64, needed when a uniform tensor is None.

    Returns:
        (output_tokens (B, N), accepted_nodes (B, N), num_accepted (B,)), all int64.

    Launches (``launch_config``): ``_tree_level_kernel`` for level 0 (t_0 of every node) and,
    with draft_probs, levels 1..``split_levels`` over (node-row blocks, vocabulary chunks),
    then once for the levels above (serial per row); ``_tree_walk_kernel``;
    ``_tree_final_partials_kernel`` and ``_tree_final_sample_kernel``.  Workspaces: B*N*N*S + 2*B*N*N float64 (S: vocabulary
    chunks, small when B*N is large), the final residual's B*V float64 weights and a few
    B-sized tensors; nothing of size V per node.
    """
    B, N, V = target_probs.shape
    device = target_probs.device
    out_tokens, out_nodes, num_accepted = new_int64(target_probs, (B, N), (B, N), (B,))
    if B == 0:
        return out_tokens, out_nodes, num_accepted
    target = unit_stride(target_probs)
    has_draft = draft_probs is not None and N > 1
    draft = unit_stride(draft_probs) if has_draft else target
    parents = tree_parents if tree_parents.dim() == 2 else tree_parents[None, :]
    if parents.stride(-1) != 1:
        parents = parents.contiguous()
    stride_pb = parents.stride(0) if parents.shape[0] == B and B > 1 else 0
    counts = num_nodes.to(torch.int64).contiguous()
    philox_coins, philox_final = uniform_samples is None, sample_uniforms is None
    # stand-ins (never read) where the kernels compute the numbers from seeds/offsets
    if philox_coins:
        coins = counts
    else:
        coins = uniform_samples.contiguous() if N > 1 else dummy(target, torch.float32)
    final_u = counts if philox_final else sample_uniforms.contiguous()
    if philox_coins or philox_final:
        seeds, offsets = seeds.contiguous(), offsets.contiguous()
    else:
        seeds, offsets = counts, counts
    strides = (target.stride(0), target.stride(1), draft.stride(0), draft.stride(1) if has_draft else 0)
    cfg = launch_config(B, N, V, _device.sm_count(device), has_draft=has_draft)

    # 1. t_k of every node row (B * N rows), level by level
    R = B * N
    lv = cfg.levels
    S, LS = lv.splits, cfg.split_levels
    part = torch.empty((R, N, S), dtype=torch.float64, device=device)
    tsum = torch.empty((2, R, N), dtype=torch.float64, device=device)
    level_args = (target, draft, parents, counts, part, tsum, R, N, V, *strides, stride_pb, S)
    level_meta = dict(
        HAS_DRAFT=has_draft, BLOCK_R=lv.block_b, BLOCK_V=lv.block_v, BLOCK_S=lv.block_s, num_warps=cfg.level_num_warps
    )
    if N > 1:  # a tree of the root alone tests nothing: the sample below needs no total
        for level in range(0, LS + 1):
            launch(_tree_level_kernel)[lv.grid](
                *level_args, level, level + 1, lv.tiles_per_split, TAIL=False, **level_meta
            )
        # the serial levels LS + 1..N - 1 (none without draft distributions or when LS = N - 1);
        # it also stores t_LS, so that the walk reads every total from tsum
        end = N if has_draft else 1
        launch(_tree_level_kernel)[(lv.row_blocks, 1)](
            *level_args, LS + 1, end, cdiv(V, lv.block_v), TAIL=True, **level_meta
        )

    # 2. the walk over the nodes
    rw = cfg.rows
    np_ = cfg.np_
    state = torch.empty((2, B), dtype=torch.int32, device=device)
    rej = torch.empty((B, np_), dtype=torch.int64, device=device) if not has_draft else dummy(target, torch.int64)
    launch(_tree_walk_kernel)[(rw.row_blocks,)](
        target,
        draft,
        tree_tokens.contiguous(),
        parents,
        counts,
        coins,
        seeds,
        offsets,
        tsum,
        out_tokens,
        out_nodes,
        num_accepted,
        state,
        rej,
        B,
        N,
        V,
        *strides,
        stride_pb,
        HAS_DRAFT=has_draft,
        PHILOX_COINS=philox_coins,
        BLOCK_B=rw.block_b,
        NP=np_,
        num_warps=cfg.walk_num_warps,
    )

    # 3. the final sample from the last node's residual
    S2, tiles2 = rw.splits, rw.tiles_per_split
    weights = torch.empty((B, V), dtype=torch.float64, device=device)
    part_mass = torch.empty((2, S2, B), dtype=torch.float64, device=device)
    part_last = torch.empty((2, S2, B), dtype=torch.int32, device=device)
    tiles = dict(BLOCK_B=rw.block_b, BLOCK_V=rw.block_v)  # the final partials' and the final sample's
    launch(_tree_final_partials_kernel)[rw.grid](
        target,
        draft,
        tsum,
        state,
        rej,
        weights,
        part_mass,
        part_last,
        B,
        N,
        V,
        *strides,
        tiles2,
        HAS_DRAFT=has_draft,
        NP=np_,
        num_warps=cfg.final_partials_num_warps,
        **tiles,
    )
    launch(_tree_final_sample_kernel)[(rw.row_blocks,)](
        target,
        state,
        weights,
        final_u,
        seeds,
        offsets,
        part_mass,
        part_last,
        out_tokens,
        num_accepted,
        B,
        N,
        V,
        target.stride(0),
        target.stride(1),
        S2,
        tiles2,
        PHILOX_FINAL=philox_final,
        BLOCK_S=rw.block_s,
        num_warps=cfg.sample_num_warps,
        **tiles,
    )
    return out_tokens, out_nodes, num_accepted


def _tree_rejection_sample_triton_fake(
    target_probs,
    tree_tokens,
    tree_parents,
    draft_probs,
    num_nodes,
    uniform_samples,
    sample_uniforms,
    seeds=None,
    offsets=None,
):
    B, N, _ = target_probs.shape
    torch._check(tree_tokens.shape == (B, N), lambda: "tree_tokens must have shape (B, N)")
    return new_int64(target_probs, (B, N), (B, N), (B,))


tree_rejection_sample_triton = kernel_op(
    "tree_rejection_sample_triton", _tree_rejection_sample_triton_impl, _tree_rejection_sample_triton_fake
)
