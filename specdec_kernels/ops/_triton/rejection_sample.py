"""rejection_sample: lossless speculative sampling of a chain of draft tokens.

Backends: "reference" (plain PyTorch) and "triton" (``_rejection_sample_kernel``, registered
as ``torch.ops.specdec.rejection_sample_triton``).  The same kernel serves the flattened
(vLLM v1) layout with ``FLAT=True`` (``torch.ops.specdec.rejection_sample_flattened_triton``):
each request's rows are found from ``cu_num_draft_tokens`` instead of ``b * (K + 1)``.
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
    next_pow2,
    tile_sizes,
)

from specdec_kernels._library import kernel_op, launch


@triton.jit
def _chain_tile(p_rows, q_rows, at, use_q, rmask, offs, V, HAS_DRAFT: tl.constexpr):
    """Target row p and the draft row q to subtract (0 where ``use_q`` is off), float32 [BB, BV]."""
    m2 = rmask[:, None] & (offs < V)[None, :]
    p = tl.load(p_rows[:, None] + offs[None, :], mask=m2, other=0.0).to(tl.float32)
    if HAS_DRAFT:
        q = tl.load(q_rows[:, None] + offs[None, :], mask=m2 & use_q[:, None], other=0.0).to(tl.float32)
    else:
        # one-hot at the rejected draft; at == -1 when unused or out of the vocabulary
        q = tl.where(offs[None, :] == at[:, None], 1.0, 0.0)
    return p, q

@triton.jit
def _rejection_sample_kernel(
    target_ptr,  # padded: [B, K+1, V]; FLAT: [T + B, V] or [T, V] (BONUS_IDS); fp32/fp16/bf16, last dim contiguous
    draft_ptr,  # padded: [B, K, V]; FLAT: [T, V]; like target (unused when HAS_DRAFT is False)
    tokens_ptr,  # padded: [B, K]; FLAT: [T]; int32/int64, contiguous
    num_draft_ptr,  # padded: [B] int64 counts; FLAT: cu_num_draft_tokens [B] int32/int64
    bonus_ptr,  # BONUS_IDS: [B] int32/int64 bonus tokens (else unused)
    coins_ptr,  # padded: [B, K]; FLAT: [T]; fp32, contiguous
    final_u_ptr,  # [B] fp32
    out_ptr,  # [B, K+1] int64, contiguous (written)
    num_accepted_ptr,  # [B] int64 (written)
    B,
    K,  # padded width (FLAT: max_spec_len)
    V,
    T,  # FLAT: number of draft tokens (spans are clamped into [0, T])
    stride_tb,  # padded only
    stride_tk,  # target row stride (FLAT: of the 2-D tensor)
    stride_db,  # padded only
    stride_dk,  # draft row stride
    FLAT: tl.constexpr,  # the flattened (vLLM v1) layout
    BONUS_IDS: tl.constexpr,  # FLAT with [T, V] targets and the bonus tokens given
    HAS_DRAFT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    KP: tl.constexpr,  # next power of two >= K + 1
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    if FLAT:
        # request spans from the inclusive cumsum, clamped as in specdec_kernels/_flattened.py:
        # start + n <= end <= T, so every row and token below stays inside its tensor
        end = tl.load(num_draft_ptr + rows64, mask=rmask, other=0).to(tl.int64)
        prev = tl.load(num_draft_ptr + tl.maximum(rows64 - 1, 0), mask=rmask & (rows > 0), other=0).to(tl.int64)
        end = tl.minimum(tl.maximum(end, 0), T)
        start = tl.minimum(tl.maximum(prev, 0), T)
        n = tl.minimum(tl.maximum(end - start, 0), K).to(tl.int32)
        tok0 = start  # first flat draft: its token, coin and draft row
        if BONUS_IDS:
            t_rows = target_ptr + start * stride_tk
        else:
            t_rows = target_ptr + (start + rows64) * stride_tk
        d_rows = draft_ptr + start * stride_dk
    else:
        # counts are clamped to 0..K whatever the caller validated: every address below stays inside
        n = tl.minimum(tl.maximum(tl.load(num_draft_ptr + rows64, mask=rmask, other=0), 0), K).to(tl.int32)
        tok0 = rows64 * K
        t_rows = target_ptr + rows64 * stride_tb
        d_rows = draft_ptr + rows64 * stride_db

    # 1. accept/reject along the chain: accept x_j iff u_j * q_j(x_j) < p_j(x_j) in float32.
    num_acc = tl.zeros([BLOCK_B], dtype=tl.int32)
    alive = rmask
    j = pid * 0
    while j < K:
        live = alive & (j < n)
        x = tl.load(tokens_ptr + tok0 + j, mask=live, other=-1).to(tl.int64)
        in_vocab = (x >= 0) & (x < V)
        xs = tl.minimum(tl.maximum(x, 0), V - 1)
        p = tl.load(t_rows + j * stride_tk + xs, mask=live, other=0.0).to(tl.float32)
        if HAS_DRAFT:
            q = tl.load(d_rows + j * stride_dk + xs, mask=live, other=0.0).to(tl.float32)
        else:
            q = tl.full([BLOCK_B], 1.0, tl.float32)
        u = tl.load(coins_ptr + tok0 + j, mask=live, other=1.0)
        acc = live & in_vocab & (u * q < p)
        num_acc += acc.to(tl.int32)
        alive = acc
        j += 1

    # 2. the row to sample from: the residual max(0, p - q) at the first rejection (p
    #    itself if that has no mass), else the bonus row after the last draft.  With
    #    BONUS_IDS a fully accepted request has no row: it takes its bonus token and its
    #    rows are masked out of both passes.
    rejected = rmask & (num_acc < n)
    if BONUS_IDS:
        need = rejected
    else:
        need = rmask
    p_rows = t_rows + num_acc.to(tl.int64) * stride_tk
    q_rows = d_rows + tl.minimum(num_acc, K - 1).to(tl.int64) * stride_dk
    at = tl.load(tokens_ptr + tok0 + num_acc, mask=rejected, other=-1).to(tl.int64)
    at = tl.where((at >= 0) & (at < V), at, -1)

    # pass 1: mass of p and of the residual, and their last indices with mass
    tot_p = tl.zeros([BLOCK_B], dtype=tl.float64)
    tot_r = tl.zeros([BLOCK_B], dtype=tl.float64)
    last_p = tl.full([BLOCK_B], -1, tl.int32)
    last_r = tl.full([BLOCK_B], -1, tl.int32)
    start_v = pid * 0
    while start_v < V:
        offs = start_v + tl.arange(0, BLOCK_V)
        p, q = _chain_tile(p_rows, q_rows, at, rejected, need, offs, V, HAS_DRAFT)
        wp = _mass64(p)
        wr = _mass64(p - q)
        tot_p += tl.sum(wp, axis=1)
        tot_r += tl.sum(wr, axis=1)
        last_p = _last_with_mass(wp, offs, last_p)
        last_r = _last_with_mass(wr, offs, last_r)
        start_v += BLOCK_V
    use_q = rejected & (tot_r > 0)
    total = tl.where(use_q, tot_r, tot_p)
    last = tl.where(use_q, last_r, last_p)
    at = tl.where(use_q, at, -1)

    # pass 2: first index whose running float64 CDF exceeds u * total; stop early
    u_final = tl.load(final_u_ptr + rows64, mask=need, other=0.0).to(tl.float64)
    threshold = u_final * total
    searching = need & (total > 0)
    found = tl.full([BLOCK_B], NOT_FOUND, tl.int32)
    carry = tl.zeros([BLOCK_B], dtype=tl.float64)
    start_v = pid * 0
    pending = tl.sum(searching.to(tl.int32), axis=0)
    while (start_v < V) & (pending > 0):
        offs = start_v + tl.arange(0, BLOCK_V)
        p, q = _chain_tile(p_rows, q_rows, at, use_q & searching, searching, offs, V, HAS_DRAFT)
        carry, found = _cdf_search_tile(_mass64(p - q), offs, carry, threshold, found)
        pending = tl.sum((searching & (found == NOT_FOUND)).to(tl.int32), axis=0)
        start_v += BLOCK_V
    sampled = _pick_token(found, last, total)
    if BONUS_IDS:
        bonus = tl.load(bonus_ptr + rows64, mask=rmask & ~rejected, other=0).to(tl.int64)
        sampled = tl.where(rejected, sampled, bonus)

    # 3. accepted drafts, the sampled token, then -1
    cols = tl.arange(0, KP)
    c2 = cols[None, :]
    keep = rmask[:, None] & (c2 < num_acc[:, None])
    toks = tl.load(tokens_ptr + tok0[:, None] + c2, mask=keep, other=-1).to(tl.int64)
    out = tl.where(c2 == num_acc[:, None], sampled[:, None], tl.where(keep, toks, -1))
    tl.store(out_ptr + rows64[:, None] * (K + 1) + c2, out, mask=rmask[:, None] & (c2 < K + 1))
    tl.store(num_accepted_ptr + rows64, num_acc.to(tl.int64), mask=rmask)

def _dummy(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype, device=like.device)

def _rejection_sample_triton_impl(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_tokens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    uniform_samples: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch ``_rejection_sample_kernel`` on validated inputs (see ``rejection_sample``).

    Args:
        target_probs: Shape (B, K + 1, V), float32/float16/bfloat16, CUDA (or CPU under
            TRITON_INTERPRET=1).
        draft_probs: Shape (B, K, V) like target_probs, or None (one-hot drafts).
        draft_tokens: Shape (B, K), int32/int64.
        num_draft_tokens: Shape (B,), int64 in 0..K (not checked here).
        uniform_samples: Shape (B, K), float32 in [0, 1): acceptance coins.
        sample_uniforms: Shape (B,), float32 in [0, 1): residual / bonus uniform.

    Returns:
        (output_tokens (B, K + 1) int64, num_accepted (B,) int64), bit-identical to the
        reference for the same uniforms except when the residual/bonus threshold
        ``u * total`` lies within float64 rounding of a CDF boundary (the kernel sums in
        tiles, the reference sequentially).  The residual is never written to memory.
    """
    B, K1, V = target_probs.shape
    K = K1 - 1
    device = target_probs.device
    out = torch.empty((B, K1), dtype=torch.int64, device=device)
    num_accepted = torch.empty((B,), dtype=torch.int64, device=device)
    if B == 0:
        return out, num_accepted
    target = target_probs if target_probs.stride(-1) == 1 else target_probs.contiguous()
    has_draft = draft_probs is not None
    if has_draft:
        draft = draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()
    else:
        draft = target
    if K > 0:
        tokens = draft_tokens.contiguous()
        coins = uniform_samples.to(torch.float32).contiguous()
    else:  # empty tensors may have no storage; the kernel never reads these
        tokens, coins = _dummy(target, torch.int64), _dummy(target, torch.float32)
    block_b, block_v = tile_sizes(V, B, device.type == "cuda")
    grid = (triton.cdiv(B, block_b),)
    counts = num_draft_tokens.to(torch.int64).contiguous()
    launch(_rejection_sample_kernel)[grid](
        target,
        draft,
        tokens,
        counts,
        counts,  # bonus_ptr: unused without BONUS_IDS
        coins,
        sample_uniforms.to(torch.float32).contiguous(),
        out,
        num_accepted,
        B,
        K,
        V,
        0,
        target.stride(0),
        target.stride(1),
        draft.stride(0),
        draft.stride(1) if has_draft else 0,
        FLAT=False,
        BONUS_IDS=False,
        HAS_DRAFT=has_draft,
        BLOCK_B=block_b,
        BLOCK_V=block_v,
        KP=next_pow2(K1),
    )
    return out, num_accepted

def _rejection_sample_triton_fake(target_probs, draft_probs, draft_tokens, num_draft_tokens, uniform_samples, sample_uniforms):
    B, K1, _ = target_probs.shape
    torch._check(draft_tokens.shape == (B, K1 - 1), lambda: "draft_tokens must have shape (B, K)")
    return (
        target_probs.new_empty((B, K1), dtype=torch.int64),
        target_probs.new_empty((B,), dtype=torch.int64),
    )


rejection_sample_triton = kernel_op("rejection_sample_triton", _rejection_sample_triton_impl, _rejection_sample_triton_fake)

def _rejection_sample_flattened_triton_impl(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor],
    uniform_samples: torch.Tensor,
    sample_uniforms: torch.Tensor,
    max_spec_len: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch ``_rejection_sample_kernel`` with ``FLAT=True`` on checked inputs (see
    ``rejection_sample_flattened``).

    Args:
        target_probs: Shape (T + B, V) (each request's draft rows then its bonus row), or
            (T, V) with ``bonus_token_ids``; float32/float16/bfloat16, CUDA (or CPU under
            TRITON_INTERPRET=1); any row stride (a last dimension that is not unit-stride is
            made contiguous).
        draft_probs: Shape (T, V) like target_probs, or None (one-hot drafts).
        draft_token_ids: Shape (T,), int32/int64.
        cu_num_draft_tokens: Shape (B,), int32/int64, inclusive cumsum (clamped into [0, T]).
        bonus_token_ids: Shape (B,), int32/int64, or None.
        uniform_samples: Shape (T,), float32 in [0, 1): coin t is flat draft t's.
        sample_uniforms: Shape (B,), float32 in [0, 1).
        max_spec_len: padded width of the output minus 1 (counts above it are clamped).

    Returns:
        (output_tokens (B, max_spec_len + 1) int64 with -1 padding, num_accepted (B,) int64):
        the padded kernel's arithmetic on the flat rows, read in place.
    """
    T, B, V = draft_token_ids.shape[0], cu_num_draft_tokens.shape[0], target_probs.shape[1]
    K = max_spec_len
    device = target_probs.device
    out = torch.empty((B, K + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty((B,), dtype=torch.int64, device=device)
    if B == 0:
        return out, num_accepted
    target = target_probs if target_probs.stride(-1) == 1 else target_probs.contiguous()
    if target.shape[0] == 0:  # T = 0 with bonus ids: nothing is read
        target = _dummy(target, target.dtype)
    has_draft = draft_probs is not None and T > 0
    if has_draft:
        draft = draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()
    else:
        draft = target
    if T > 0:
        tokens = draft_token_ids.contiguous()
        coins = uniform_samples.to(torch.float32).contiguous()
    else:  # empty tensors may have no storage; the kernel never reads these
        tokens, coins = _dummy(target, torch.int64), _dummy(target, torch.float32)
    block_b, block_v = tile_sizes(V, B, device.type == "cuda")
    grid = (triton.cdiv(B, block_b),)
    cu = cu_num_draft_tokens.contiguous()
    launch(_rejection_sample_kernel)[grid](
        target,
        draft,
        tokens,
        cu,
        bonus_token_ids.contiguous() if bonus_token_ids is not None else cu,  # unused without BONUS_IDS
        coins,
        sample_uniforms.to(torch.float32).contiguous(),
        out,
        num_accepted,
        B,
        K,
        V,
        T,
        0,
        target.stride(0),
        0,
        draft.stride(0) if has_draft else 0,
        FLAT=True,
        BONUS_IDS=bonus_token_ids is not None,
        HAS_DRAFT=has_draft,
        BLOCK_B=block_b,
        BLOCK_V=block_v,
        KP=next_pow2(K + 1),
    )
    return out, num_accepted


def _rejection_sample_flattened_triton_fake(target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens,
                                            bonus_token_ids, uniform_samples, sample_uniforms, max_spec_len):
    B = cu_num_draft_tokens.shape[0]
    torch._check(target_probs.dim() == 2, lambda: "target_probs must be [T + B, V] or [T, V]")
    return (
        target_probs.new_empty((B, max_spec_len + 1), dtype=torch.int64),
        target_probs.new_empty((B,), dtype=torch.int64),
    )


rejection_sample_flattened_triton = kernel_op(
    "rejection_sample_flattened_triton", _rejection_sample_flattened_triton_impl, _rejection_sample_flattened_triton_fake
)


def _spec(has_draft, block_b, block_v, kp, prob="*fp32", tok="*i64", flat=False, bonus_ids=False, cu="*i64"):
    return {
        "kernel": _rejection_sample_kernel,
        "name": (f"rejection_sample draft={has_draft} {prob[1:]} {tok[1:]} BLOCK_B={block_b} BLOCK_V={block_v}"
                 f" flat={flat} bonus_ids={bonus_ids} cu={cu[1:]}"),
        "signature": {
            "target_ptr": prob,
            "draft_ptr": prob,
            "tokens_ptr": tok,
            "num_draft_ptr": cu,
            "bonus_ptr": cu,
            "coins_ptr": "*fp32",
            "final_u_ptr": "*fp32",
            "out_ptr": "*i64",
            "num_accepted_ptr": "*i64",
            "B": "i32",
            "K": "i32",
            "V": "i32",
            "T": "i32",
            "stride_tb": "i64",
            "stride_tk": "i32",
            "stride_db": "i64",
            "stride_dk": "i32",
            "FLAT": "constexpr",
            "BONUS_IDS": "constexpr",
            "HAS_DRAFT": "constexpr",
            "BLOCK_B": "constexpr",
            "BLOCK_V": "constexpr",
            "KP": "constexpr",
        },
        "constexprs": {"FLAT": flat, "BONUS_IDS": bonus_ids, "HAS_DRAFT": has_draft, "BLOCK_B": block_b,
                       "BLOCK_V": block_v, "KP": kp},
    }

AOT_SPECS = [
    _spec(True, 1, 1024, 16),
    _spec(False, 1, 1024, 32, prob="*bf16", tok="*i32"),
    _spec(True, 8, 128, 8, prob="*fp16"),
    # the flattened (vLLM v1) layout: int32 ids and cu as vLLM passes them, bonus rows or ids
    _spec(True, 1, 1024, 16, tok="*i32", flat=True, cu="*i32"),
    _spec(False, 1, 1024, 32, prob="*bf16", tok="*i32", flat=True, bonus_ids=True, cu="*i32"),
    _spec(True, 8, 128, 8, prob="*fp16", flat=True, bonus_ids=True),
]
