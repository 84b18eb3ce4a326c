"""tree_rejection_sample: multi-candidate rejection sampling over a token tree.

Backends: "reference" (plain PyTorch) and "triton" (``_tree_rejection_sample_kernel``,
registered as ``torch.ops.specdec.tree_rejection_sample_triton``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from specdec_kernels.ops._triton._sampling_common import (
    NOT_FOUND,
    _cdf_search_tile,
    _last_with_mass,
    _mass64,
    _pick_token,
    _row_mass_total,
    next_pow2,
    tile_sizes,
)

from specdec_kernels._library import kernel_op, launch


@triton.jit
def _sampled_residual_tile(p_rows, q_rows, s_rows, stored, safe_total, rmask, offs, V):
    """mass(r / total - q) in float64 for one tile: r is the stored residual where ``stored``,
    else mass(p); q = mass(draft row).  Rows off ``rmask`` give 0."""
    m2 = rmask[:, None] & (offs < V)[None, :]
    p = _mass64(tl.load(p_rows[:, None] + offs[None, :], mask=m2 & ~stored[:, None], other=0.0))
    s = tl.load(s_rows[:, None] + offs[None, :], mask=m2 & stored[:, None], other=0.0)
    q = _mass64(tl.load(q_rows[:, None] + offs[None, :], mask=m2, other=0.0))
    r = tl.where(stored[:, None], s, p)
    return tl.where(m2, _mass64(r / safe_total[:, None] - q), 0.0)

@triton.jit
def _zeroed(offs, rej, nrej_max, slots, rmask):
    """[BB, BV] mask of the columns listed in ``rej`` [BB, NP] (rejected deterministic children)."""
    hit = rmask[:, None] & (offs[None, :] < 0)  # all False, [BB, BV]
    for i in tl.range(0, nrej_max):
        col = tl.sum(tl.where(slots[None, :] == i, rej, 0), axis=1)  # slot i of each row (-1 if unused)
        hit = hit | (offs[None, :] == col[:, None])
    return hit

@triton.jit
def _final_tile(p_rows, s_rows, stored, rej, nrej_max, slots, rmask, offs, V, HAS_DRAFT: tl.constexpr):
    """Weights of the final sample for one tile: (residual, target row) as float64 [BB, BV]."""
    m2 = rmask[:, None] & (offs < V)[None, :]
    if HAS_DRAFT:
        p = _mass64(tl.load(p_rows[:, None] + offs[None, :], mask=m2 & ~stored[:, None], other=0.0))
        s = tl.load(s_rows[:, None] + offs[None, :], mask=m2 & stored[:, None], other=0.0)
        w = tl.where(stored[:, None], s, p)
    else:
        p = _mass64(tl.load(p_rows[:, None] + offs[None, :], mask=m2, other=0.0))
        w = tl.where(_zeroed(offs, rej, nrej_max, slots, rmask), 0.0, p)
    return w, p

@triton.jit
def _tree_rejection_sample_kernel(
    target_ptr,  # [B, N, V] fp32/fp16/bf16, last dim contiguous
    draft_ptr,  # [B, N, V] like target (unused when HAS_DRAFT is False)
    tokens_ptr,  # [B, N] int32/int64, contiguous
    parents_ptr,  # [B, N] int64 with row stride stride_pb (0: one tree for the batch)
    num_nodes_ptr,  # [B] int64
    coins_ptr,  # [B, N-1] fp32, contiguous
    final_u_ptr,  # [B] fp32
    scratch_ptr,  # [B, V] fp64 workspace (HAS_DRAFT only)
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
    HAS_DRAFT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NP: tl.constexpr,  # next power of two >= N
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    slots = tl.arange(0, NP)
    # counts clamped to 0..N in int64 before any narrowing, whatever the caller validated
    nn = tl.minimum(tl.maximum(tl.load(num_nodes_ptr + rows64, mask=rmask, other=0), 0), N).to(tl.int32)
    t_rows = target_ptr + rows64 * stride_tb
    d_rows = draft_ptr + rows64 * stride_db
    s_rows = scratch_ptr + rows64 * V

    current = tl.zeros([BLOCK_B], dtype=tl.int32)
    total = _row_mass_total(t_rows, rmask, V, BLOCK_B, BLOCK_V)  # mass of p' = p[root]
    stored = rows < 0  # HAS_DRAFT: the residual is in the scratch row (else it is mass(p[current]))
    rej = tl.full([BLOCK_B, NP], -1, tl.int64)  # deterministic: children rejected at `current`
    nrej = tl.zeros([BLOCK_B], dtype=tl.int32)
    num_acc = tl.zeros([BLOCK_B], dtype=tl.int32)
    path = tl.where(slots[None, :] == 0, 0, tl.full([BLOCK_B, NP], -1, tl.int32))
    out_tok = tl.full([BLOCK_B, NP], -1, tl.int64)

    # One pass in node order visits every node's children in index order (as the reference).
    for j in tl.range(1, N):
        # parents are only compared, in int64: a huge parent never aliases a node by narrowing
        par = tl.load(parents_ptr + rows64 * stride_pb + j, mask=rmask, other=-1).to(tl.int64)
        is_child = rmask & (par == current.to(tl.int64)) & (j < nn)
        if tl.max(is_child.to(tl.int32), axis=0) > 0:
            x = tl.load(tokens_ptr + rows64 * N + j, mask=is_child, other=-1).to(tl.int64)
            in_vocab = (x >= 0) & (x < V)
            xs = tl.minimum(tl.maximum(x, 0), V - 1)
            u = tl.load(coins_ptr + rows64 * (N - 1) + (j - 1), mask=is_child, other=0.0).to(tl.float64)
            p_cur = t_rows + current.to(tl.int64) * stride_tn
            if HAS_DRAFT:
                q_cur = d_rows + current.to(tl.int64) * stride_dn
                qx = _mass64(tl.load(q_cur + xs, mask=is_child, other=0.0))
                px = _mass64(tl.load(p_cur + xs, mask=is_child & ~stored, other=0.0))
                sx = tl.load(s_rows + xs, mask=is_child & stored, other=0.0)
                rx = tl.where(stored, sx, px)
                # accept with probability min(1, p'(x) / q(x)), p' = r / total
                accept = is_child & in_vocab & (u * qx * total < rx)
                reject = is_child & ~accept
                if tl.max(reject.to(tl.int32), axis=0) > 0:
                    # p' <- norm(max(0, p' - q)), kept as it was when that has no mass
                    safe_total = tl.where(total > 0, total, 1.0)
                    new_total = tl.zeros([BLOCK_B], dtype=tl.float64)
                    for start in tl.range(0, V, BLOCK_V, num_stages=3):
                        offs = start + tl.arange(0, BLOCK_V)
                        nr = _sampled_residual_tile(p_cur, q_cur, s_rows, stored, safe_total, reject, offs, V)
                        new_total += tl.sum(nr, axis=1)
                    update = reject & (new_total > 0)
                    if tl.max(update.to(tl.int32), axis=0) > 0:
                        for start in tl.range(0, V, BLOCK_V):
                            offs = start + tl.arange(0, BLOCK_V)
                            nr = _sampled_residual_tile(p_cur, q_cur, s_rows, stored, safe_total, update, offs, V)
                            tl.debug_barrier()  # every thread has read the tile before it is overwritten
                            tl.store(s_rows[:, None] + offs[None, :], nr, mask=update[:, None] & (offs < V)[None, :])
                        tl.debug_barrier()  # the new residual is visible to the whole program
                    stored = stored | update
                    total = tl.where(update, new_total, total)
            else:
                # a deterministic child is accepted with probability p'(x); on rejection x is
                # removed from p' (zeroed, the total reduced by its weight)
                px = _mass64(tl.load(p_cur + xs, mask=is_child, other=0.0))
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
                fresh = _row_mass_total(t_rows + current.to(tl.int64) * stride_tn, accept, V, BLOCK_B, BLOCK_V)
                total = tl.where(accept, fresh, total)
                stored = stored & ~accept
                rej = tl.where(accept[:, None], -1, rej)
                nrej = tl.where(accept, 0, nrej)

    # Final sample from p' (from the target row when p' has no mass) by inverse CDF.
    p_cur = t_rows + current.to(tl.int64) * stride_tn
    nrej_max = tl.max(nrej, axis=0)
    tot_w = tl.zeros([BLOCK_B], dtype=tl.float64)
    tot_p = tl.zeros([BLOCK_B], dtype=tl.float64)
    last_w = tl.full([BLOCK_B], -1, tl.int32)
    last_p = tl.full([BLOCK_B], -1, tl.int32)
    for start in tl.range(0, V, BLOCK_V, num_stages=3):
        offs = start + tl.arange(0, BLOCK_V)
        w, p = _final_tile(p_cur, s_rows, stored, rej, nrej_max, slots, rmask, offs, V, HAS_DRAFT)
        tot_w += tl.sum(w, axis=1)
        tot_p += tl.sum(p, axis=1)
        last_w = _last_with_mass(w, offs, last_w)
        last_p = _last_with_mass(p, offs, last_p)
    use_w = tot_w > 0
    total = tl.where(use_w, tot_w, tot_p)
    last = tl.where(use_w, last_w, last_p)
    if not HAS_DRAFT:
        nrej = tl.where(use_w, nrej, 0)  # no mass left: sample from the target row
        rej = tl.where(use_w[:, None], rej, -1)
    u_final = tl.load(final_u_ptr + rows64, mask=rmask, other=0.0).to(tl.float64)
    threshold = u_final * total
    searching = rmask & (total > 0)
    found = tl.full([BLOCK_B], NOT_FOUND, tl.int32)
    carry = tl.zeros([BLOCK_B], dtype=tl.float64)
    pending = tl.sum(searching.to(tl.int32), axis=0)
    for start in tl.range(0, V, BLOCK_V):
        if pending > 0:  # the tiles after every row has found its token are not read
            offs = start + tl.arange(0, BLOCK_V)
            w, p = _final_tile(p_cur, s_rows, stored, rej, nrej_max, slots, searching, offs, V, HAS_DRAFT)
            carry, found = _cdf_search_tile(w, offs, carry, threshold, found)
            pending = tl.sum((searching & (found == NOT_FOUND)).to(tl.int32), axis=0)
    sampled = _pick_token(found, last, total)

    out_tok = tl.where(slots[None, :] == num_acc[:, None], sampled[:, None], out_tok)
    m2 = rmask[:, None] & (slots < N)[None, :]
    tl.store(out_tokens_ptr + rows64[:, None] * N + slots[None, :], out_tok, mask=m2)
    tl.store(out_nodes_ptr + rows64[:, None] * N + slots[None, :], path.to(tl.int64), mask=m2)
    tl.store(num_accepted_ptr + rows64, num_acc.to(tl.int64), mask=rmask)

def num_warps(block_v: int, has_draft: bool) -> int:
    """Warps per program: 8 for full 1024-column tiles with draft distributions (the float64
    residual tiles spill registers with 4: ``python -m bench.kernels --static``), else 4."""
    return 8 if has_draft and block_v >= 1024 else 4


def _dummy(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype, device=like.device)

def _tree_rejection_sample_triton_impl(
    target_probs: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    num_nodes: torch.Tensor,
    uniform_samples: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch ``_tree_rejection_sample_kernel`` on validated inputs (see ``tree_rejection_sample``).

    Args:
        target_probs: Shape (B, N, V), float32/float16/bfloat16, CUDA (or CPU under
            TRITON_INTERPRET=1).
        tree_tokens: Shape (B, N), int32/int64.
        tree_parents: Shape (B, N) (a shared tree may be an expanded (N,) tensor: batch
            stride 0) or (N,), int32/int64, topological (not checked here).
        draft_probs: Shape (B, N, V) like target_probs, or None (deterministic children).
        num_nodes: Shape (B,), int64 in 0..N.
        uniform_samples: Shape (B, N - 1), float32: column c - 1 is node c's coin.
        sample_uniforms: Shape (B,), float32: the final sample's uniform.

    Returns:
        (output_tokens (B, N), accepted_nodes (B, N), num_accepted (B,)), all int64.  With
        draft_probs a float64 workspace of B * V elements is allocated per call.
    """
    B, N, V = target_probs.shape
    device = target_probs.device
    out_tokens = torch.empty((B, N), dtype=torch.int64, device=device)
    out_nodes = torch.empty((B, N), dtype=torch.int64, device=device)
    num_accepted = torch.empty((B,), dtype=torch.int64, device=device)
    if B == 0:
        return out_tokens, out_nodes, num_accepted
    target = target_probs if target_probs.stride(-1) == 1 else target_probs.contiguous()
    has_draft = draft_probs is not None
    if has_draft:
        draft = draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()
        scratch = torch.empty((B, V), dtype=torch.float64, device=device)
    else:
        draft, scratch = target, _dummy(target, torch.float64)
    parents = tree_parents if tree_parents.dim() == 2 else tree_parents[None, :]
    if parents.stride(-1) != 1:
        parents = parents.contiguous()
    stride_pb = parents.stride(0) if parents.shape[0] == B and B > 1 else 0
    coins = uniform_samples.to(torch.float32).contiguous() if N > 1 else _dummy(target, torch.float32)
    block_b, block_v = tile_sizes(V, B, device.type == "cuda")
    grid = (triton.cdiv(B, block_b),)
    launch(_tree_rejection_sample_kernel)[grid](
        target,
        draft,
        tree_tokens.contiguous(),
        parents,
        num_nodes.to(torch.int64).contiguous(),
        coins,
        sample_uniforms.to(torch.float32).contiguous(),
        scratch,
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
        HAS_DRAFT=has_draft,
        BLOCK_B=block_b,
        BLOCK_V=block_v,
        NP=next_pow2(N),
        num_warps=num_warps(block_v, has_draft),
    )
    return out_tokens, out_nodes, num_accepted

def _tree_rejection_sample_triton_fake(
    target_probs, tree_tokens, tree_parents, draft_probs, num_nodes, uniform_samples, sample_uniforms
):
    B, N, _ = target_probs.shape
    torch._check(tree_tokens.shape == (B, N), lambda: "tree_tokens must have shape (B, N)")
    return (
        target_probs.new_empty((B, N), dtype=torch.int64),
        target_probs.new_empty((B, N), dtype=torch.int64),
        target_probs.new_empty((B,), dtype=torch.int64),
    )


tree_rejection_sample_triton = kernel_op("tree_rejection_sample_triton", _tree_rejection_sample_triton_impl, _tree_rejection_sample_triton_fake)

def _spec(has_draft, block_b, block_v, np_, prob="*fp32", tok="*i64", parent="*i64"):
    return {
        "kernel": _tree_rejection_sample_kernel,
        "name": f"tree_rejection_sample draft={has_draft} {prob[1:]} BLOCK_B={block_b} BLOCK_V={block_v} NP={np_}",
        "signature": {
            "target_ptr": prob,
            "draft_ptr": prob,
            "tokens_ptr": tok,
            "parents_ptr": parent,
            "num_nodes_ptr": "*i64",
            "coins_ptr": "*fp32",
            "final_u_ptr": "*fp32",
            "scratch_ptr": "*fp64",
            "out_tokens_ptr": "*i64",
            "out_nodes_ptr": "*i64",
            "num_accepted_ptr": "*i64",
            "B": "i32",
            "N": "i32",
            "V": "i32",
            "stride_tb": "i64",
            "stride_tn": "i32",
            "stride_db": "i64",
            "stride_dn": "i32",
            "stride_pb": "i32",
            "HAS_DRAFT": "constexpr",
            "BLOCK_B": "constexpr",
            "BLOCK_V": "constexpr",
            "NP": "constexpr",
        },
        "constexprs": {"HAS_DRAFT": has_draft, "BLOCK_B": block_b, "BLOCK_V": block_v, "NP": np_},
        "options": {"num_warps": num_warps(block_v, has_draft)},
    }

AOT_SPECS = [
    _spec(True, 1, 1024, 64),
    _spec(False, 1, 1024, 64, prob="*bf16", tok="*i32", parent="*i32"),
    _spec(True, 8, 128, 8, prob="*fp16"),
    _spec(False, 16, 64, 128),
]
