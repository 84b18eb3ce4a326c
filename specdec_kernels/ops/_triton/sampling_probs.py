"""sampling_probs: temperature, top-k and top-p applied once for drafter and verifier.

Backends: "reference" (plain PyTorch) and "triton" (``_sampling_probs_kernel``, registered as
``torch.ops.specdec.sampling_probs_triton``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from specdec_kernels.ops._triton._sampling_common import tile_sizes

from specdec_kernels._library import kernel_op, launch

_INT32_MIN = tl.constexpr(-2147483648)
_INT32_MAX = tl.constexpr(2147483647)

@triton.jit
def _scaled_logits(l_rows, tdiv, rmask, offs, V):
    """Logits / temperature in float32 (IEEE division), -inf outside the vocabulary."""
    m2 = rmask[:, None] & (offs < V)[None, :]
    x = tl.load(l_rows[:, None] + offs[None, :], mask=m2, other=0.0).to(tl.float32)
    # padding lanes: loaded as 0 (with temperature inf, -inf / inf would be NaN), then -inf
    return tl.where(m2, tl.math.div_rn(x, tdiv[:, None]), float("-inf")), m2

@triton.jit
def _order_key(y):
    """int32 key with key(a) < key(b) iff a < b for non-NaN floats (-0.0 and +0.0 equal)."""
    bits = y.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(y == 0, 0, key)

@triton.jit
def _sampling_probs_kernel(
    logits_ptr,  # [R, V] fp32/fp16/bf16, row stride stride_lr, last dim contiguous
    out_ptr,  # [R, V] fp32, contiguous (written)
    temp_ptr,  # [B] fp32
    topk_ptr,  # [B] int64
    topp_ptr,  # [B] fp32
    R,
    V,
    rows_per_seq,  # R // B: rows of logits per sequence (parameters are per sequence)
    stride_lr,
    HAS_TOPK: tl.constexpr,
    HAS_TOPP: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    seq = rows64 // rows_per_seq
    l_rows = logits_ptr + rows64 * stride_lr
    o_rows = out_ptr + rows64 * V
    temp = tl.load(temp_ptr + seq, mask=rmask, other=1.0)
    greedy = temp == 0
    tdiv = tl.where(greedy, 1.0, temp)

    # pass A: argmax (first maximum, NaN counts as the maximum), row maximum, NaN / +inf
    best_key = tl.full([BLOCK_B], _INT32_MIN, tl.int32)
    best_idx = tl.zeros([BLOCK_B], dtype=tl.int32)
    ymax = tl.full([BLOCK_B], float("-inf"), tl.float32)
    has_nan = rows < 0
    has_inf = rows < 0
    start = pid * 0
    while start < V:
        offs = start + tl.arange(0, BLOCK_V)
        y, m2 = _scaled_logits(l_rows, tdiv, rmask, offs, V)
        isnan = y != y
        key = tl.where(isnan, _INT32_MAX, _order_key(y))
        key = tl.where(m2, key, _INT32_MIN)
        tile_best = tl.max(key, axis=1)
        tile_idx = tl.min(tl.where(key == tile_best[:, None], offs[None, :], _INT32_MAX), axis=1)
        better = tile_best > best_key
        best_idx = tl.where(better, tile_idx, best_idx)
        best_key = tl.where(better, tile_best, best_key)
        ymax = tl.maximum(ymax, tl.max(tl.where(isnan, float("-inf"), y), axis=1))
        has_nan = has_nan | (tl.max(isnan.to(tl.int32), axis=1) > 0)
        has_inf = has_inf | (tl.max((y == float("inf")).to(tl.int32), axis=1) > 0)
        start += BLOCK_V
    bad = has_nan | (ymax == float("-inf"))  # NaN, or no finite mass at all: NaN out
    # temperature 0, or a +inf logit after temperature (an infinite logit, or a temperature so
    # small that the division overflows): one-hot at the argmax, the first +inf
    one_hot_row = greedy | (has_inf & ~has_nan)
    live = rmask & ~one_hot_row & ~bad  # rows whose probabilities are computed
    ymax = tl.where(live, ymax, 0.0)  # finite on every row: no inf - inf below

    # top-k: keep_key = the smallest key t with #(key > t) < k, i.e. the k-th largest.
    keep_key = tl.full([BLOCK_B], _INT32_MIN, tl.int64)
    if HAS_TOPK:
        k = tl.load(topk_ptr + seq, mask=rmask, other=0)
        k = tl.where((k <= 0) | (k > V), V, k)
        active = live & (k < V)
        if tl.max(active.to(tl.int32), axis=0) > 0:
            lo = tl.full([BLOCK_B], -2147483649, tl.int64)  # #(key > lo) = V >= k
            hi = tl.full([BLOCK_B], 2147483647, tl.int64)  # #(key > hi) = 0 < k
            for _ in range(32):
                mid = (lo + hi) >> 1
                count = tl.zeros([BLOCK_B], dtype=tl.int64)
                start = pid * 0
                while start < V:
                    offs = start + tl.arange(0, BLOCK_V)
                    y, m2 = _scaled_logits(l_rows, tdiv, active, offs, V)
                    above = m2 & (_order_key(y).to(tl.int64) > mid[:, None])
                    count += tl.sum(above.to(tl.int64), axis=1)
                    start += BLOCK_V
                ok = count < k
                hi = tl.where(ok, mid, hi)
                lo = tl.where(ok, lo, mid)
            keep_key = tl.where(active, hi, keep_key)

    # softmax over the kept logits (the row maximum is always kept)
    denom = tl.zeros([BLOCK_B], dtype=tl.float32)
    start = pid * 0
    while start < V:
        offs = start + tl.arange(0, BLOCK_V)
        y, m2 = _scaled_logits(l_rows, tdiv, live, offs, V)
        kept = m2 & (_order_key(y).to(tl.int64) >= keep_key[:, None])
        e = tl.where(kept, tl.exp(y - ymax[:, None]), 0.0)
        denom += tl.sum(e, axis=1)
        start += BLOCK_V
    denom = tl.where(live, denom, 1.0)

    # probabilities before top-p, into the output row
    pmax_bits = tl.zeros([BLOCK_B], dtype=tl.int32)
    psum = tl.zeros([BLOCK_B], dtype=tl.float32)
    start = pid * 0
    while start < V:
        offs = start + tl.arange(0, BLOCK_V)
        y, m2 = _scaled_logits(l_rows, tdiv, live, offs, V)
        kept = m2 & (_order_key(y).to(tl.int64) >= keep_key[:, None])
        p = tl.where(kept, tl.exp(y - ymax[:, None]) / denom[:, None], 0.0)
        pmax_bits = tl.maximum(pmax_bits, tl.max(p.to(tl.int32, bitcast=True), axis=1))
        psum += tl.sum(p, axis=1)
        tl.store(o_rows[:, None] + offs[None, :], p, mask=m2)
        start += BLOCK_V
    tl.debug_barrier()  # the stored probabilities are visible to the whole program

    # top-p: keep p >= t, t the smallest value whose float64 mass strictly above is < top_p
    keep_bits = tl.full([BLOCK_B], -1, tl.int32)
    if HAS_TOPP:
        top_p = tl.load(topp_ptr + seq, mask=rmask, other=1.0)
        active = live & (top_p < 1.0)
        if tl.max(active.to(tl.int32), axis=0) > 0:
            top_p64 = top_p.to(tl.float64)
            lo = tl.full([BLOCK_B], -1, tl.int32)
            hi = pmax_bits  # nothing lies above the maximum: mass 0 < top_p
            for _ in range(31):
                mid = lo + ((hi - lo) >> 1)
                above = tl.zeros([BLOCK_B], dtype=tl.float64)
                start = pid * 0
                while start < V:
                    offs = start + tl.arange(0, BLOCK_V)
                    m2 = active[:, None] & (offs < V)[None, :]
                    p = tl.load(o_rows[:, None] + offs[None, :], mask=m2, other=0.0)
                    big = p.to(tl.int32, bitcast=True) > mid[:, None]
                    above += tl.sum(tl.where(big, p.to(tl.float64), 0.0), axis=1)
                    start += BLOCK_V
                ok = above < top_p64
                hi = tl.where(ok, mid, hi)
                lo = tl.where(ok, lo, mid)
            keep_bits = tl.where(active, hi, keep_bits)
            psum = tl.zeros([BLOCK_B], dtype=tl.float32)
            start = pid * 0
            while start < V:
                offs = start + tl.arange(0, BLOCK_V)
                m2 = live[:, None] & (offs < V)[None, :]
                p = tl.load(o_rows[:, None] + offs[None, :], mask=m2, other=0.0)
                psum += tl.sum(tl.where(p.to(tl.int32, bitcast=True) >= keep_bits[:, None], p, 0.0), axis=1)
                start += BLOCK_V
    psum = tl.where(live, psum, 1.0)

    # final row: renormalised nucleus, one-hot argmax (temperature 0), or NaN
    start = pid * 0
    while start < V:
        offs = start + tl.arange(0, BLOCK_V)
        m2 = rmask[:, None] & (offs < V)[None, :]
        p = tl.load(o_rows[:, None] + offs[None, :], mask=m2 & live[:, None], other=0.0)
        p = tl.where(p.to(tl.int32, bitcast=True) >= keep_bits[:, None], p / psum[:, None], 0.0)
        one_hot = tl.where(offs[None, :] == best_idx[:, None], 1.0, 0.0)
        res = tl.where(one_hot_row[:, None], one_hot, tl.where(bad[:, None], float("nan"), p))
        tl.debug_barrier()  # every thread has read the tile before it is overwritten
        tl.store(o_rows[:, None] + offs[None, :], res, mask=m2)
        start += BLOCK_V

def _sampling_probs_triton_impl(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    use_top_k: bool,
    use_top_p: bool,
) -> torch.Tensor:
    """Launch ``_sampling_probs_kernel`` on validated inputs (see ``sampling_probs``).

    Args:
        logits: Shape (B, V) or (B, rows, V), float32/float16/bfloat16, CUDA (or CPU under
            TRITON_INTERPRET=1).
        temperature: Shape (B,), float32 >= 0 (0: one-hot argmax).
        top_k: Shape (B,), int64; <= 0 or >= V keeps everything.
        top_p: Shape (B,), float32 in (0, 1]; 1 keeps everything.
        use_top_k, use_top_p: False skips that stage entirely (compiled out).

    Returns:
        probs: the shape of logits, float32.
    """
    V = logits.shape[-1]
    B = logits.shape[0]
    x = logits.reshape(-1, V) if logits.numel() else logits.new_empty((0, V))
    if x.stride(-1) != 1:
        x = x.contiguous()
    R = x.shape[0]
    out = torch.empty((R, V), dtype=torch.float32, device=logits.device)
    if R > 0:
        block_b, block_v = tile_sizes(V, R, logits.device.type == "cuda")
        grid = (triton.cdiv(R, block_b),)
        launch(_sampling_probs_kernel)[grid](
            x,
            out,
            temperature.to(torch.float32).contiguous(),
            top_k.to(torch.int64).contiguous(),
            top_p.to(torch.float32).contiguous(),
            R,
            V,
            R // B,
            x.stride(0),
            HAS_TOPK=use_top_k,
            HAS_TOPP=use_top_p,
            BLOCK_B=block_b,
            BLOCK_V=block_v,
        )
    return out.reshape(logits.shape)

def _sampling_probs_triton_fake(logits, temperature, top_k, top_p, use_top_k, use_top_p):
    torch._check(temperature.shape == (logits.shape[0],), lambda: "temperature must have shape (B,)")
    return logits.new_empty(logits.shape, dtype=torch.float32)


sampling_probs_triton = kernel_op("sampling_probs_triton", _sampling_probs_triton_impl, _sampling_probs_triton_fake)

def _spec(top_k, top_p, block_b, block_v, dtype="*fp32"):
    return {
        "kernel": _sampling_probs_kernel,
        "name": f"sampling_probs top_k={top_k} top_p={top_p} {dtype[1:]} BLOCK_B={block_b} BLOCK_V={block_v}",
        "signature": {
            "logits_ptr": dtype,
            "out_ptr": "*fp32",
            "temp_ptr": "*fp32",
            "topk_ptr": "*i64",
            "topp_ptr": "*fp32",
            "R": "i32",
            "V": "i32",
            "rows_per_seq": "i32",
            "stride_lr": "i64",
            "HAS_TOPK": "constexpr",
            "HAS_TOPP": "constexpr",
            "BLOCK_B": "constexpr",
            "BLOCK_V": "constexpr",
        },
        "constexprs": {"HAS_TOPK": top_k, "HAS_TOPP": top_p, "BLOCK_B": block_b, "BLOCK_V": block_v},
    }

AOT_SPECS = [
    _spec(False, False, 1, 1024),
    _spec(True, True, 1, 1024, "*bf16"),
    _spec(True, False, 8, 128, "*fp16"),
    _spec(False, True, 16, 64),
]
