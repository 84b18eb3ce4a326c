"""tree_rejection_sample: multi-candidate rejection sampling over a token tree.

The "triton" backend of ``ops/tree_rejection_sample.py`` (the op's other backends are listed
there): the kernels below, launched by ``tree_rejection_sample_triton`` as ``launch_config`` says.

Two launches:

1. ``_tree_mass_kernel`` over (node-row blocks, vocabulary chunks): each chunk's float64 mass
   of the target row of every node a sequence uses, so that the walk reads a node's total
   t_0 by summing a few partials (``split_vocab`` spreads a batch of one tree over the GPU).
2. ``_tree_sample_kernel``, one program per block of sequences: walks the nodes in order, as
   the reference does, with point loads for the accept tests; with draft distributions, a
   rejection at a node updates the residual r_k = mass(r_{k-1} * (1 / t_{k-1}) - q) (every
   child of a node is drawn from the same draft row q, so r_k depends on k alone), and the
   new total t_k is one pass over the row that rebuilds element x of r_k from p(x), q(x) and
   the reciprocals 1 / t_0..1 / t_{k-1} (kept in registers) with the reference's own float64
   operations; nothing of size V is stored.  After the walk it samples the last residual
   (with deterministic children: the target row with the rejected tokens zeroed; the target
   row if the residual has no mass) by inverse CDF: one pass for its total and last index
   with mass, one for the running float64 CDF (tile by tile: a ``tl.cumsum`` and the carry
   of the tiles before), which stops loading once every row has its token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from specdec_kernels import _device
from specdec_kernels._device import cdiv, next_pow2
from specdec_kernels._library import launch
from specdec_kernels.ops._triton._launch import dummy, new_int64, unit_stride
from specdec_kernels.ops._triton._sampling_common import (
    NOT_FOUND,
    VocabSplit,
    _cdf_search_tile,
    _last_with_mass,
    _mass64,
    _mul_rn,
    _pick_token,
    tile_sizes,
    vocab_split,
)
from specdec_kernels.ops._triton._uniforms import _coin, _final_uniform, _request_key


@triton.jit
def _inverse(t):
    """The reference's 1 / safe_total: 1 / t where t > 0, else 1 (one division per row)."""
    return 1.0 / tl.where(t > 0, t, 1.0)


@triton.jit
def _slot(v, i):
    """Column ``i`` ([BB] int32, per row) of the [BB, NP] vector ``v``."""
    cols = tl.arange(0, v.shape[1])
    return tl.sum(tl.where(cols[None, :] == i[:, None], v, tl.zeros_like(v)), axis=1)


@triton.jit
def _residual_tile(r, q, invs, steps, rmask):
    """Apply r <- mass(r * inv_i - q) for i = 0..steps-1 to a [BB, BV] tile (``steps`` [BB]
    per row; inv_i = 1 / safe(t_i), column i of ``invs`` [BB, NP]): element x of the residual
    after ``steps`` updates, from mass(p)(x) and q(x), in the reference's float64 operations."""
    for i in tl.range(0, tl.max(tl.where(rmask, steps, 0), axis=0)):
        live = rmask & (i < steps)
        inv = _slot(invs, tl.zeros_like(steps) + i)
        r = tl.where(live[:, None], _mass64(_mul_rn(r, inv[:, None]) - q), r)
    return r


@triton.jit
def _residual_point(r, q, invs, steps, rmask):
    """``_residual_tile`` for one element per row ([BB] vectors)."""
    for i in tl.range(0, tl.max(tl.where(rmask, steps, 0), axis=0)):
        live = rmask & (i < steps)
        inv = _slot(invs, tl.zeros_like(steps) + i)
        r = tl.where(live, _mass64(_mul_rn(r, inv) - q), r)
    return r


@triton.jit
def _node_total(part_ptr, node_rows, S, live):
    """t_0 of the node rows ``node_rows`` ([BB] int64, b * N + node): the sum of their S chunk
    masses (``_tree_mass_kernel``) as one 16-wide vector (S <= MAX_MASS_CHUNKS = 16 by default;
    the tests' larger S, 16 at a time; wider vectors made ptxas spill); 0 where not ``live``."""
    cs = tl.arange(0, 16)
    acc = tl.zeros(node_rows.shape, dtype=tl.float64)
    for c0 in tl.range(0, S, 16):
        m2 = live[:, None] & (c0 + cs < S)[None, :]
        acc += tl.sum(tl.load(part_ptr + node_rows[:, None] * S + c0 + cs[None, :], mask=m2, other=0.0), axis=1)
    return acc


@triton.jit
def _tree_mass_kernel(
    target_ptr,  # [B, N, V] fp32/fp16/bf16, last dim contiguous
    num_nodes_ptr,  # [B] int64
    part_ptr,  # [B * N, S] fp64 (written): chunk s's mass of node row r at r * S + s
    R,  # B * N node rows
    N,
    V,
    stride_tb,
    stride_tn,
    TILES_PER_SPLIT,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program (i, s): node rows i * BLOCK_R.., vocabulary chunk s: the chunk's mass of the
    target row of each node a sequence uses (0 for the others)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    S = tl.num_programs(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    b = (rows // N).to(tl.int64)  # R = B * N < 2**31 (the launcher checks)
    n = (rows % N).to(tl.int64)
    # counts clamped to 0..N in int64 before any use, whatever the caller validated
    nn = tl.minimum(tl.maximum(tl.load(num_nodes_ptr + b, mask=rmask, other=0), 0), N)
    live = rmask & (n < tl.maximum(nn, 1))
    p_rows = target_ptr + b * stride_tb + n * stride_tn
    lo = split * TILES_PER_SPLIT * BLOCK_V
    acc = tl.zeros([BLOCK_R], dtype=tl.float64)
    for t in tl.range(0, TILES_PER_SPLIT, num_stages=3):
        offs = lo + t * BLOCK_V + tl.arange(0, BLOCK_V)
        m2 = live[:, None] & (offs < V)[None, :]
        acc += tl.sum(_mass64(tl.load(p_rows[:, None] + offs[None, :], mask=m2, other=0.0)), axis=1)
    tl.store(part_ptr + rows64 * S + split, acc, mask=rmask)


@triton.jit
def _zeroed(cols, rej_rows, nrej, rmask):
    """[BB, BV] mask of the columns ``cols`` listed in the rows' rejected tokens: the first
    ``nrej`` [BB] entries from ``rej_rows`` [BB] (pointers into the kernel's token list)."""
    hit = rmask[:, None] & (cols < 0)  # all False, [BB, BV]
    for i in tl.range(0, tl.max(tl.where(rmask, nrej, 0), axis=0)):
        col = tl.load(rej_rows + i, mask=rmask & (i < nrej), other=-1)
        hit = hit | (cols == col[:, None])
    return hit


@triton.jit
def _weights_tile(p_rows, q_rows, invs, n_upd, rej_rows, nrej, rmask, cols, inside, HAS_DRAFT: tl.constexpr):
    """The final sample's weights at the [BB, BV] columns ``cols`` of the rows ``rmask``
    (loaded where ``inside`` too): (the last residual, the target row), float64, 0 elsewhere."""
    m2 = rmask[:, None] & inside
    p = _mass64(tl.load(p_rows[:, None] + cols, mask=m2, other=0.0))
    if HAS_DRAFT:
        q = _mass64(tl.load(q_rows[:, None] + cols, mask=m2 & (n_upd > 0)[:, None], other=0.0))
        w = tl.where(m2, _residual_tile(p, q, invs, n_upd, rmask), 0.0)
    else:
        w = tl.where(_zeroed(cols, rej_rows, nrej, rmask), 0.0, p)
    return w, p


@triton.jit
def _residual_total(p_rows, q_rows, invs, steps, need, V, BLOCK_V: tl.constexpr):
    """t = sum over the row of the residual after ``steps`` [BB] updates (``_residual_tile``),
    for the rows ``need``: one pass over the vocabulary, tile by tile in column order."""
    acc = tl.zeros(steps.shape, dtype=tl.float64)
    for t in tl.range(0, tl.cdiv(V, BLOCK_V)):
        offs = t * BLOCK_V + tl.arange(0, BLOCK_V)
        m2 = need[:, None] & (offs < V)[None, :]
        r = _mass64(tl.load(p_rows[:, None] + offs[None, :], mask=m2, other=0.0))
        q = _mass64(tl.load(q_rows[:, None] + offs[None, :], mask=m2, other=0.0))
        r = _residual_tile(r, q, invs, steps, need)
        acc += tl.sum(tl.where(m2, r, 0.0), axis=1)
    return acc


@triton.jit
def _tree_sample_kernel(
    target_ptr,  # [B, N, V] fp32/fp16/bf16, last dim contiguous
    draft_ptr,  # [B, N, V] like target (unused when HAS_DRAFT is False)
    tokens_ptr,  # [B, N] int32/int64, contiguous
    parents_ptr,  # [B, N] int32/int64 with row stride stride_pb (0: one tree for the batch)
    num_nodes_ptr,  # [B] int64
    coins_ptr,  # [B, N-1] fp32/fp64, contiguous (unused with PHILOX_COINS)
    final_u_ptr,  # [B] fp32/fp64 (unused with PHILOX_FINAL)
    seeds_ptr,  # [B] int32/int64 (read with PHILOX_COINS or PHILOX_FINAL)
    offsets_ptr,  # [B] int32/int64 (likewise)
    part_ptr,  # [B * N, S] fp64 from _tree_mass_kernel
    rej_ptr,  # [B, NP] int64 (written and read, deterministic children): the last node's rejected tokens
    out_tokens_ptr,  # [B, N] int64 (written)
    out_nodes_ptr,  # [B, N] int64 (written)
    num_accepted_ptr,  # [B] int64 (written)
    B,
    N,
    V,
    stride_tb,
    stride_tn,
    stride_db,
    stride_dn,
    stride_pb,
    S,
    HAS_DRAFT: tl.constexpr,
    PHILOX_COINS: tl.constexpr,  # node c's coin from seeds/offsets (stream 0 at offset + c - 1)
    PHILOX_FINAL: tl.constexpr,  # the final sample's uniform from seeds/offsets (stream 1 at offset)
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NP: tl.constexpr,  # next power of two >= N
):
    """Program i: sequences i * BLOCK_B..: one pass in node order visits every node's children
    in index order (as the reference), then the final sample from the last residual."""
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
    upd = zero  # successful residual updates at `current`
    failed = rmask & (zero > 0)  # an update at `current` found no mass: every later one fails too
    # t_0 of the root (only read if the root has children)
    total = _node_total(part_ptr, rows64 * N, S, rmask & (nn > 1))
    invs = tl.where(slots[None, :] == 0, _inverse(total)[:, None], tl.zeros([BLOCK_B, NP], dtype=tl.float64))
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
                rx = _residual_point(px, qx, invs, tl.where(is_child, upd, 0), is_child)
                # accept with probability min(1, p'(x) / q(x)), p' = r / total
                accept = is_child & in_vocab & (u * qx * total < rx)
                # p' <- norm(max(0, p' - q)): its total by one pass over the row; kept as it
                # was when that is 0 (and then every later update at this node fails as well)
                need = is_child & ~accept & ~failed
                if tl.max(need.to(tl.int32), axis=0) > 0:
                    t_new = _residual_total(
                        t_rows + cur64 * stride_tn, d_rows + cur64 * stride_dn, invs, upd + 1, need, V, BLOCK_V
                    )
                    moved = need & (t_new > 0)
                    upd = tl.where(moved, upd + 1, upd)
                    invs = tl.where(moved[:, None] & (slots[None, :] == upd[:, None]), _inverse(t_new)[:, None], invs)
                    total = tl.where(moved, t_new, total)
                    failed = failed | (need & ~moved)
            else:
                # a deterministic child is accepted with probability p'(x); on rejection x is
                # removed from p' (zeroed, the total reduced by its weight). The children of
                # `current` before j were all tested and rejected (an accepted one would have
                # moved the walk on): x has no mass left if one of them was x.
                seen = rmask & (zero > 0)
                for k in tl.range(1, j):
                    sib = tl.load(parents_ptr + rows64 * stride_pb + k, mask=is_child, other=-1).to(tl.int64)
                    tok = tl.load(tokens_ptr + rows64 * N + k, mask=is_child, other=-1).to(tl.int64)
                    seen = seen | (is_child & (sib == cur64) & (tok == x))
                rx = tl.where(seen, 0.0, px)
                accept = is_child & in_vocab & (u * total < rx)
                reject = is_child & ~accept & in_vocab
                total = tl.where(reject, total - rx, total)
            if tl.max(accept.to(tl.int32), axis=0) > 0:
                out_tok = tl.where(accept[:, None] & (slots[None, :] == num_acc[:, None]), x[:, None], out_tok)
                num_acc += accept.to(tl.int32)
                path = tl.where(accept[:, None] & (slots[None, :] == num_acc[:, None]), j, path)
                current = tl.where(accept, j, current)
                fresh = _node_total(part_ptr, rows64 * N + j, S, accept & (j + 1 < nn))
                total = tl.where(accept, fresh, total)
                upd = tl.where(accept, 0, upd)
                failed = failed & ~accept
                invs = tl.where(accept[:, None], tl.where(slots[None, :] == 0, _inverse(fresh)[:, None], 0.0), invs)

    # the final sample from the last node's residual (its target row if that has no mass):
    # one pass for the totals and last indices with mass, one for the inverse CDF
    cur64 = current.to(tl.int64)
    rej_rows = rej_ptr + rows64 * NP
    nrej = zero
    if not HAS_DRAFT:
        # every child of the last node (below num_nodes) was rejected: its in-vocabulary
        # tokens, listed once for the passes below (a barrier: other threads read them)
        for k in tl.range(1, N):
            par = tl.load(parents_ptr + rows64 * stride_pb + k, mask=rmask, other=-1).to(tl.int64)
            tok = tl.load(tokens_ptr + rows64 * N + k, mask=rmask, other=-1).to(tl.int64)
            zero_it = rmask & (par == cur64) & (k < nn) & (tok >= 0) & (tok < V)
            tl.store(rej_rows + nrej, tok, mask=zero_it)
            nrej += zero_it.to(tl.int32)
        tl.debug_barrier()
    p_rows = t_rows + cur64 * stride_tn
    q_rows = d_rows + cur64 * stride_dn
    tot_w = tl.zeros([BLOCK_B], dtype=tl.float64)
    tot_p = tl.zeros([BLOCK_B], dtype=tl.float64)
    last_w = tl.full([BLOCK_B], -1, tl.int32)
    last_p = tl.full([BLOCK_B], -1, tl.int32)
    for t in tl.range(0, tl.cdiv(V, BLOCK_V)):
        offs = t * BLOCK_V + tl.arange(0, BLOCK_V)
        w, p = _weights_tile(
            p_rows, q_rows, invs, upd, rej_rows, nrej, rmask, offs[None, :], (offs < V)[None, :], HAS_DRAFT
        )
        tot_w += tl.sum(w, axis=1)
        tot_p += tl.sum(p, axis=1)
        last_w = _last_with_mass(w, offs, last_w)
        last_p = _last_with_mass(p, offs, last_p)
    use_w = tot_w > 0
    total = tl.where(use_w, tot_w, tot_p)
    last = tl.where(use_w, last_w, last_p)
    seed, offset = _request_key(seeds_ptr, offsets_ptr, rows64, rmask, PHILOX_FINAL)
    threshold = _final_uniform(final_u_ptr, rows64, seed, offset, rmask, PHILOX_FINAL).to(tl.float64) * total
    carry = tl.zeros([BLOCK_B], dtype=tl.float64)
    found = tl.full([BLOCK_B], NOT_FOUND, tl.int32)
    for t in tl.range(0, tl.cdiv(V, BLOCK_V)):
        offs = t * BLOCK_V + tl.arange(0, BLOCK_V)
        searching = rmask & (total > 0) & (found == NOT_FOUND)  # done rows load nothing
        w, p = _weights_tile(
            p_rows, q_rows, invs, upd, rej_rows, nrej, searching, offs[None, :], (offs < V)[None, :], HAS_DRAFT
        )
        carry, found = _cdf_search_tile(
            tl.where(use_w[:, None], w, p), offs[None, :] + zero[:, None], carry, threshold, found
        )
    sampled = _pick_token(found, last, total)
    out_tok = tl.where(slots[None, :] == num_acc[:, None], sampled[:, None], out_tok)

    m2 = rmask[:, None] & (slots < N)[None, :]
    tl.store(out_tokens_ptr + rows64[:, None] * N + slots[None, :], out_tok, mask=m2)
    tl.store(out_nodes_ptr + rows64[:, None] * N + slots[None, :], path.to(tl.int64), mask=m2)
    tl.store(num_accepted_ptr + rows64, num_acc.to(tl.int64), mask=rmask)


# Vocabulary chunks of the node masses at most (by default): the walk reads a node's total as
# one vector of its chunk masses (more chunks add no bandwidth: 16 per node row fill the GPU
# from 8 node rows on)
MAX_MASS_CHUNKS = 16


def mass_num_warps(block_v: int) -> int:
    """Warps of ``_tree_mass_kernel``: 8 for full 1024-column tiles, else 4."""
    return 8 if block_v >= 1024 else 4


def sample_num_warps(block_v: int) -> int:
    """Warps of ``_tree_sample_kernel``: 8 for full 1024-column tiles (its passes over the row),
    else 2 (the walk itself is point loads; with 4 warps on smaller tiles ptxas trades a few
    registers for spills in some configurations)."""
    return 8 if block_v >= 1024 else 2


@dataclass(frozen=True)
class TreeRejectionSampleLaunch:
    """The two launches of one call.

    ``masses``: ``_tree_mass_kernel`` on ``masses.grid`` (blocks of ``BLOCK_R`` =
    ``masses.block_b`` of the B * N node rows, vocabulary chunks); ``sample_grid``:
    ``_tree_sample_kernel`` (``sample_block_b`` sequences a program, ``sample_block_v``
    columns a tile, ``np_`` node lanes)."""

    masses: VocabSplit
    sample_block_b: int
    sample_block_v: int
    sample_grid: Tuple[int]
    np_: int
    mass_num_warps: int
    sample_num_warps: int


@_device.cached_launch_config
def launch_config(
    batch: int,
    num_nodes: int,
    vocab: int,
    sm_count: Optional[int],
    *,
    has_draft: bool = True,
    tile: Optional[Tuple[int, int]] = None,
    num_splits: Optional[int] = None,
) -> TreeRejectionSampleLaunch:
    """The launch configuration for ``batch`` trees of ``num_nodes`` (N) nodes over ``vocab``
    entries on a GPU of ``sm_count`` SMs (None: the interpreter).

    The node masses use at most ``MAX_MASS_CHUNKS`` chunks a row (as ``vocab_split`` chooses
    below that).  The walk runs one sequence a program on a GPU (several in the
    interpreter), in tiles of up to 1024 columns.  ``tile`` (BLOCK_B, BLOCK_V) overrides the tiles of both launches and
    ``num_splits`` the chunks of the node masses (see ``vocab_split``).  ``has_draft`` changes nothing today (both
    kinds of children launch the same shapes); it is kept for the callers that pass it.
    """
    masses = vocab_split(vocab, batch * num_nodes, sm_count, tile=tile, num_splits=num_splits)
    if num_splits is None and masses.splits > MAX_MASS_CHUNKS:
        masses = vocab_split(vocab, batch * num_nodes, sm_count, tile=tile, num_splits=MAX_MASS_CHUNKS)
    if tile is None:
        block_b, block_v = tile_sizes(vocab, batch, sm_count is not None)
        if sm_count is not None:  # one sequence a program: its state is a few [NP] vectors
            block_b = 1
    else:
        block_b, block_v = masses.block_b, masses.block_v
    return TreeRejectionSampleLaunch(
        masses,
        block_b,
        block_v,
        (cdiv(batch, block_b),),
        next_pow2(num_nodes),
        mass_num_warps(masses.block_v),
        sample_num_warps(block_v),
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

    Launches (``launch_config``): ``_tree_mass_kernel`` (the chunk masses of every node's
    target row; none for a tree of the root alone), then ``_tree_sample_kernel`` (the walk,
    the residual updates and the final sample).  Workspace: B*N x S float64 chunk masses
    (S: vocabulary chunks, small when B*N is large) and, with deterministic children, B x
    next_pow2(N) int64 (the last node's rejected tokens); nothing of size V.
    """
    B, N, V = target_probs.shape
    device = target_probs.device
    out_tokens, out_nodes, num_accepted = new_int64(target_probs, (B, N), (B, N), (B,))
    if B == 0:
        return out_tokens, out_nodes, num_accepted
    target = unit_stride(target_probs)
    has_draft = draft_probs is not None and N > 1
    draft = unit_stride(draft_probs) if has_draft else target
    parents = tree_parents if tree_parents.stride(-1) == 1 else tree_parents.contiguous()
    # a shared tree ([N], or [1, N] / expanded [B, N]) is read with batch stride 0, no view
    stride_pb = parents.stride(0) if parents.dim() == 2 and parents.shape[0] == B and B > 1 else 0
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
    cfg = launch_config(B, N, V, _device.sm_count(device), has_draft=has_draft)

    # 1. the chunk masses of every node row (B * N rows); a tree of the root alone tests nothing
    R = B * N
    ms = cfg.masses
    if N > 1:
        part = torch.empty(R, ms.splits, dtype=torch.float64, device=device)
        launch(_tree_mass_kernel)[ms.grid](
            target,
            counts,
            part,
            R,
            N,
            V,
            target.stride(0),
            target.stride(1),
            ms.tiles_per_split,
            BLOCK_R=ms.block_b,
            BLOCK_V=ms.block_v,
            num_warps=cfg.mass_num_warps,
        )
    else:
        part = dummy(target, torch.float64)

    # 2. the walk, the residual updates and the final sample
    # with draft rows the kernel never touches the rejected-token list: the counts stand in
    # (no dummy tensor, which a traced call would fill per call)
    rej = torch.empty(B, cfg.np_, dtype=torch.int64, device=device) if not has_draft else counts
    launch(_tree_sample_kernel)[cfg.sample_grid](
        target,
        draft,
        tree_tokens.contiguous(),
        parents,
        counts,
        coins,
        final_u,
        seeds,
        offsets,
        part,
        rej,
        out_tokens,
        out_nodes,
        num_accepted,
        B,
        N,
        V,
        target.stride(0),
        target.stride(1),
        draft.stride(0),
        draft.stride(1) if has_draft else 0,
        stride_pb,
        ms.splits,
        HAS_DRAFT=has_draft,
        PHILOX_COINS=philox_coins,
        PHILOX_FINAL=philox_final,
        BLOCK_B=cfg.sample_block_b,
        BLOCK_V=cfg.sample_block_v,
        NP=cfg.np_,
        num_warps=cfg.sample_num_warps,
    )
    return out_tokens, out_nodes, num_accepted


tree_rejection_sample_triton = _tree_rejection_sample_triton_impl  # the launcher (not an op)
