"""sampling_probs: temperature, top-k and top-p applied once for drafter and verifier.

The "triton" backend of ``ops/sampling_probs.py`` (the op's other backends are listed there):
``_sampling_probs_kernel``, launched by ``sampling_probs_triton`` as ``launch_config`` says.

Design (GPU-shaped, exact).  Every row is cut into S vocabulary chunks (``split_vocab``: about
``PROGRAMS_PER_SM`` programs per SM even at batch 1) and the work runs as a few launches of
one kernel over (row blocks, chunks), each a stage (``STAGE``) that reads the small per-row
partial results of the launch before it:

1. ``STATS``: per chunk, the argmax key and index (first maximum; NaN counts as the maximum),
   the maximum, and NaN / +inf flags.
2. ``TOPK`` (``PASSES`` launches): the k-th largest order key by a multi-pivot search: each
   launch narrows the interval that holds it with ``NPIV`` pivots at once (counts of keys
   above each pivot), so the 2**32 keys take ``PASSES`` = 8 passes over V, not 32
   bisection steps.  The threshold is exact: the smallest key with fewer than k keys above.
3. ``DENOM``: per chunk, the softmax denominator over the kept logits (float32).
4. ``TOPP`` (``PASSES`` launches): the same search over the float32 bits of the probabilities
   with float64 masses above each pivot: the smallest probability whose mass strictly above
   is below top_p, and the nucleus mass.  Probabilities are recomputed from the logits in
   each pass (never stored between passes).
5. ``FINAL``: the output row: renormalised nucleus, one-hot argmax, or NaN.

A pass reads the interval left by the pass before (written by the chunk-0 programs into one
of two ping-pong buffers) and that pass's per-chunk pivot counts, so no program ever waits
for another inside a launch.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from specdec_kernels import _device
from specdec_kernels._library import launch
from specdec_kernels.ops._triton._sampling_common import VocabSplit, vocab_split

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


STATS, TOPK, DENOM, TOPP, FINAL = 0, 1, 2, 3, 4  # the stages (STAGE), host side
_STATS, _TOPK, _DENOM, _TOPP, _FINAL = (tl.constexpr(i) for i in range(5))  # the same, inside kernels
NPIV = 16  # pivots per pass of the top-k / top-p search
# passes that narrow an interval of 2**32 + 1 keys (or 2**31 probability bits) to one key:
# each pass cuts the interval's width w to at most ceil(w / (NPIV + 1)), and 17**8 > 2**33
PASSES = 8


@triton.jit
def _pivots(lo, hi, NP: tl.constexpr):
    """[BB, NP] int64 pivots strictly above lo and at most hi, evenly spaced over (lo, hi]."""
    step = tl.maximum((hi - lo + NP) // (NP + 1), 1)
    i = tl.arange(0, NP).to(tl.int64) + 1
    return tl.minimum(lo[:, None] + step[:, None] * i[None, :], hi[:, None])


@triton.jit
def _refine(lo, hi, piv, below):
    """The narrower interval (lo, hi]: ``below`` [BB, NP] says which pivots lie at or above the
    answer (count / mass above them is below the target)."""
    new_lo = tl.maximum(lo, tl.max(tl.where(below, lo[:, None], piv), axis=1))
    new_hi = tl.minimum(hi, tl.min(tl.where(below, piv, hi[:, None]), axis=1))
    return new_lo, new_hi


@triton.jit
def _store_interval(ivl_ptr, PASS, split, rows64, rmask, R, lo, hi):
    """Pass ``PASS``'s interval (lo, hi] into its ping-pong slot of ``ivl_ptr`` [2, 2, R]
    (written once per row: by the chunk-0 programs; the next pass reads it)."""
    if split == 0:
        cur = PASS % 2
        tl.store(ivl_ptr + (cur * 2) * R + rows64, lo, mask=rmask)
        tl.store(ivl_ptr + (cur * 2 + 1) * R + rows64, hi, mask=rmask)


@triton.jit
def _row_stats(stat_key_ptr, stat_idx_ptr, stat_max_ptr, stat_flag_ptr, rows64, rmask, R, S, BLOCK_B: tl.constexpr):
    """The chunks' STATS partials combined in chunk order: (argmax, maximum, has NaN, has +inf)."""
    best_key = tl.full([BLOCK_B], _INT32_MIN, tl.int32)
    best_idx = tl.zeros([BLOCK_B], dtype=tl.int32)
    ymax = tl.full([BLOCK_B], float("-inf"), tl.float32)
    flags = tl.zeros([BLOCK_B], dtype=tl.int32)
    for s in tl.range(0, S):
        at = s * R + rows64
        key = tl.load(stat_key_ptr + at, mask=rmask, other=_INT32_MIN)
        better = key > best_key  # a tie keeps the earlier chunk (lower index)
        best_idx = tl.where(better, tl.load(stat_idx_ptr + at, mask=rmask, other=0), best_idx)
        best_key = tl.where(better, key, best_key)
        ymax = tl.maximum(ymax, tl.load(stat_max_ptr + at, mask=rmask, other=float("-inf")))
        flags = flags | tl.load(stat_flag_ptr + at, mask=rmask, other=0)
    return best_idx, ymax, (flags & 1) != 0, (flags & 2) != 0


@triton.jit
def _search_state(
    cnt_ptr,
    ivl_ptr,
    PASS,
    rows64,
    rmask,
    R,
    S,
    OWN_STAGE: tl.constexpr,
    MASS: tl.constexpr,
    NP: tl.constexpr,
    NUM_PASSES: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """The state of the top-k search (``MASS`` off) or of the top-p search (``MASS``) in this
    launch: (pass, lo, hi, pivots, tot, tot_lo).  The pass is ``PASS`` in the search's own stage
    (``OWN_STAGE``), else ``NUM_PASSES`` (after the last pass); the interval (lo, hi] is the one
    that pass starts from, before refinement: the initial one for pass 0, else the interval of
    the pass before (``ivl_ptr`` [2, 2, R] int64, ping-pong) with that pass's pivots and the
    column sums ``tot`` [BB, NP] (float64) of its per-chunk results ``cnt_ptr`` ([2, S, R, W]:
    top-k, W = NP int32 counts of keys above each pivot; top-p, W = NP + 1 float64 masses and,
    in column NP, the mass above lo, returned as ``tot_lo``)."""
    if OWN_STAGE:
        pass_ = PASS
    else:
        pass_ = PASS * 0 + NUM_PASSES  # after the last pass
    if MASS:
        init_lo = tl.full([BLOCK_B], -1, tl.int64)  # mass above: everything (>= top_p)
        init_hi = tl.full([BLOCK_B], 2139095040, tl.int64)  # bits of +inf: no probability above
    else:
        init_lo = tl.full([BLOCK_B], -2147483649, tl.int64)  # #(key > lo) = V >= k
        init_hi = tl.full([BLOCK_B], 2147483647, tl.int64)  # #(key > hi) = 0 < k
    W: tl.constexpr = NP + 1 if MASS else NP
    started = pass_ > 0
    prev = (pass_ + 1) % 2  # (pass - 1) % 2 for pass >= 1
    lo = tl.load(ivl_ptr + (prev * 2) * R + rows64, mask=rmask & started, other=0)
    hi = tl.load(ivl_ptr + (prev * 2 + 1) * R + rows64, mask=rmask & started, other=0)
    lo = tl.where(started, lo, init_lo)
    hi = tl.where(started, hi, init_hi)
    cols = tl.arange(0, NP)
    tot = tl.zeros([BLOCK_B, NP], dtype=tl.float64)
    tot_lo = tl.zeros([BLOCK_B], dtype=tl.float64)
    base = cnt_ptr + prev * S * R * W
    for s in tl.range(0, tl.where(started, S, 0)):
        row_base = base + (s * R + rows64) * W
        tot += tl.load(row_base[:, None] + cols[None, :], mask=rmask[:, None], other=0).to(tl.float64)
        if MASS:
            tot_lo += tl.load(row_base + NP, mask=rmask, other=0.0)
    return pass_, lo, hi, _pivots(lo, hi, NP), tot, tot_lo


@triton.jit
def _sampling_probs_kernel(
    logits_ptr,  # [R, V] fp32/fp16/bf16, row stride stride_lr, last dim contiguous
    out_ptr,  # [R, V] fp32, contiguous (written by FINAL)
    temp_ptr,  # [B] fp32
    topk_ptr,  # [B] int64
    topp_ptr,  # [B] fp32
    stat_key_ptr,  # [S, R] int32: chunk argmax order key (STATS)
    stat_idx_ptr,  # [S, R] int32: its first index
    stat_max_ptr,  # [S, R] fp32: chunk maximum (NaN ignored)
    stat_flag_ptr,  # [S, R] int32: 1 NaN seen, 2 +inf seen
    kcnt_ptr,  # [2, S, R, NPIV] int32: TOPK counts above each pivot (ping-pong)
    kivl_ptr,  # [2, 2, R] int64: TOPK intervals (lo, hi) (ping-pong)
    den_ptr,  # [S, R] fp32: DENOM partials
    pmass_ptr,  # [2, S, R, NPIV + 1] fp64: TOPP masses above each pivot and above lo
    pivl_ptr,  # [2, 2, R] int64: TOPP intervals
    R,
    V,
    rows_per_seq,  # R // B: rows of logits per sequence (parameters are per sequence)
    stride_lr,
    S,  # chunks per row
    TILES_PER_SPLIT,
    PASS,  # TOPK / TOPP: the pass index 0..PASSES-1
    STAGE: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_TOPP: tl.constexpr,
    NP: tl.constexpr,  # pivots per pass (NPIV)
    NUM_PASSES: tl.constexpr,  # PASSES
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    seq = rows64 // rows_per_seq
    l_rows = logits_ptr + rows64 * stride_lr
    temp = tl.load(temp_ptr + seq, mask=rmask, other=1.0)
    greedy = temp == 0
    tdiv = tl.where(greedy, 1.0, temp)
    lo_col = split * TILES_PER_SPLIT * BLOCK_V
    part = split * R + rows64  # this program's slot in the [S, R] partials

    if STAGE == _STATS:
        best_key = tl.full([BLOCK_B], _INT32_MIN, tl.int32)
        best_idx = tl.zeros([BLOCK_B], dtype=tl.int32)
        ymax = tl.full([BLOCK_B], float("-inf"), tl.float32)
        has_nan = rows < 0
        has_inf = rows < 0
        for t in tl.range(0, TILES_PER_SPLIT, num_stages=3):
            offs = lo_col + t * BLOCK_V + tl.arange(0, BLOCK_V)
            y, m2 = _scaled_logits(l_rows, tdiv, rmask, offs, V)
            isnan = y != y
            # the argmax of the logits themselves: a temperature so small that the division
            # overflows makes several +inf, and the limit of T -> 0 is the largest logit
            x = tl.load(l_rows[:, None] + offs[None, :], mask=m2, other=0.0).to(tl.float32)
            key = tl.where(isnan, _INT32_MAX, _order_key(x))
            key = tl.where(m2, key, _INT32_MIN)
            tile_best = tl.max(key, axis=1)
            tile_idx = tl.min(tl.where(key == tile_best[:, None], offs[None, :], _INT32_MAX), axis=1)
            better = tile_best > best_key
            best_idx = tl.where(better, tile_idx, best_idx)
            best_key = tl.where(better, tile_best, best_key)
            ymax = tl.maximum(ymax, tl.max(tl.where(isnan, float("-inf"), y), axis=1))
            has_nan = has_nan | (tl.max(isnan.to(tl.int32), axis=1) > 0)
            has_inf = has_inf | (tl.max((y == float("inf")).to(tl.int32), axis=1) > 0)
        tl.store(stat_key_ptr + part, best_key, mask=rmask)
        tl.store(stat_idx_ptr + part, best_idx, mask=rmask)
        tl.store(stat_max_ptr + part, ymax, mask=rmask)
        tl.store(stat_flag_ptr + part, has_nan.to(tl.int32) + 2 * has_inf.to(tl.int32), mask=rmask)
    else:
        best_idx, ymax, has_nan, has_inf = _row_stats(
            stat_key_ptr, stat_idx_ptr, stat_max_ptr, stat_flag_ptr, rows64, rmask, R, S, BLOCK_B
        )
        bad = has_nan | (ymax == float("-inf"))  # NaN, or no finite mass at all: NaN out
        # temperature 0, or a +inf logit after temperature (an infinite logit, or a temperature
        # so small that the division overflows): one-hot at the largest logit
        one_hot_row = greedy | (has_inf & ~has_nan)
        live = rmask & ~one_hot_row & ~bad  # rows whose probabilities are computed
        ymax = tl.where(live, ymax, 0.0)  # finite on every row: no inf - inf below

        # top-k: keep_key = the smallest key t with #(key > t) < k, i.e. the k-th largest
        keep_key = tl.full([BLOCK_B], _INT32_MIN, tl.int64)
        if HAS_TOPK:
            k = tl.load(topk_ptr + seq, mask=rmask, other=0)
            k = tl.where((k <= 0) | (k > V), V, k)
            k_active = live & (k < V)
            k_pass, lo, hi, piv, tot, _ = _search_state(
                kcnt_ptr, kivl_ptr, PASS, rows64, rmask, R, S, STAGE == _TOPK, False, NP, NUM_PASSES, BLOCK_B
            )
            if k_pass > 0:
                lo, hi = _refine(lo, hi, piv, tot < k.to(tl.float64)[:, None])
                piv = _pivots(lo, hi, NP)
            if STAGE == _TOPK:
                _store_interval(kivl_ptr, PASS, split, rows64, rmask, R, lo, hi)
                cols = tl.arange(0, NP)
                cnt = tl.zeros([BLOCK_B, NP], dtype=tl.int32)
                if tl.max(k_active.to(tl.int32), axis=0) > 0:
                    for t in tl.range(0, TILES_PER_SPLIT, num_stages=3):
                        offs = lo_col + t * BLOCK_V + tl.arange(0, BLOCK_V)
                        y, m2 = _scaled_logits(l_rows, tdiv, k_active, offs, V)
                        key = _order_key(y).to(tl.int64)
                        for i in tl.static_range(NP):
                            piv_i = tl.sum(tl.where(cols[None, :] == i, piv, 0), axis=1)
                            c = tl.sum((m2 & (key > piv_i[:, None])).to(tl.int32), axis=1)
                            cnt += tl.where(cols[None, :] == i, c[:, None], 0)
                dst = kcnt_ptr + (PASS % 2) * S * R * NP + part * NP
                tl.store(dst[:, None] + cols[None, :], cnt, mask=rmask[:, None])
            keep_key = tl.where(k_active, hi, keep_key)

        if STAGE == _DENOM:
            den = tl.zeros([BLOCK_B], dtype=tl.float32)
            for t in tl.range(0, TILES_PER_SPLIT, num_stages=3):
                offs = lo_col + t * BLOCK_V + tl.arange(0, BLOCK_V)
                y, m2 = _scaled_logits(l_rows, tdiv, live, offs, V)
                kept = m2 & (_order_key(y).to(tl.int64) >= keep_key[:, None])
                den += tl.sum(tl.where(kept, tl.exp(y - ymax[:, None]), 0.0), axis=1)
            tl.store(den_ptr + part, den, mask=rmask)
        if STAGE >= _TOPP:
            denom = tl.zeros([BLOCK_B], dtype=tl.float32)
            for s in tl.range(0, S):
                denom += tl.load(den_ptr + s * R + rows64, mask=rmask, other=0.0)
            denom = tl.where(live, denom, 1.0)

            # top-p: keep p >= t, t the smallest value whose float64 mass strictly above is < top_p
            keep_bits = tl.full([BLOCK_B], -1, tl.int64)
            psum = tl.full([BLOCK_B], 1.0, tl.float32)
            if HAS_TOPP:
                top_p = tl.load(topp_ptr + seq, mask=rmask, other=1.0)
                p_active = live & (top_p < 1.0)
                # top_p <= 0 (unchecked input) keeps the maximum and its ties, as the reference
                # (a nucleus of at least one token): a float64 floor, not a float32 one (denormals
                # may be flushed to zero on GPUs)
                top_p64 = tl.maximum(top_p.to(tl.float64), 1e-300)
                p_pass, lo, hi, piv, tot, tot_lo = _search_state(
                    pmass_ptr, pivl_ptr, PASS, rows64, rmask, R, S, STAGE == _TOPP, True, NP, NUM_PASSES, BLOCK_B
                )
                if p_pass > 0:
                    below = tot < top_p64[:, None]
                    # the mass above the new lo: that of the largest pivot not below (the smallest
                    # such mass), else (lo unchanged) the mass above lo
                    lo_mass = tl.min(tl.where(below, float("inf"), tot), axis=1)
                    lo, hi = _refine(lo, hi, piv, below)
                    tot_lo = tl.where(lo_mass < float("inf"), lo_mass, tot_lo)
                    piv = _pivots(lo, hi, NP)
                if STAGE == _TOPP:
                    _store_interval(pivl_ptr, PASS, split, rows64, rmask, R, lo, hi)
                    cols = tl.arange(0, NP)
                    mass = tl.zeros([BLOCK_B, NP], dtype=tl.float64)
                    mass_lo = tl.zeros([BLOCK_B], dtype=tl.float64)
                    if tl.max(p_active.to(tl.int32), axis=0) > 0:
                        for t in tl.range(0, TILES_PER_SPLIT, num_stages=3):
                            offs = lo_col + t * BLOCK_V + tl.arange(0, BLOCK_V)
                            y, m2 = _scaled_logits(l_rows, tdiv, p_active, offs, V)
                            kept = m2 & (_order_key(y).to(tl.int64) >= keep_key[:, None])
                            p = tl.where(kept, tl.exp(y - ymax[:, None]) / denom[:, None], 0.0)
                            bits = p.to(tl.int32, bitcast=True).to(tl.int64)
                            p64 = p.to(tl.float64)
                            mass_lo += tl.sum(tl.where(bits > lo[:, None], p64, 0.0), axis=1)
                            for i in tl.static_range(NP):
                                piv_i = tl.sum(tl.where(cols[None, :] == i, piv, 0), axis=1)
                                m_i = tl.sum(tl.where(bits > piv_i[:, None], p64, 0.0), axis=1)
                                mass += tl.where(cols[None, :] == i, m_i[:, None], 0.0)
                    dst = pmass_ptr + (PASS % 2) * S * R * (NP + 1) + part * (NP + 1)
                    tl.store(dst[:, None] + cols[None, :], mass, mask=rmask[:, None])
                    tl.store(dst + NP, mass_lo, mask=rmask)
                keep_bits = tl.where(p_active, hi, keep_bits)
                psum = tl.where(p_active, tot_lo.to(tl.float32), psum)
            psum = tl.where(live & (psum > 0), psum, 1.0)

            if STAGE == _FINAL:
                # final row: renormalised nucleus, one-hot argmax (temperature 0), or NaN
                for t in tl.range(0, TILES_PER_SPLIT, num_stages=3):
                    offs = lo_col + t * BLOCK_V + tl.arange(0, BLOCK_V)
                    y, m2 = _scaled_logits(l_rows, tdiv, rmask, offs, V)
                    kept = m2 & live[:, None] & (_order_key(y).to(tl.int64) >= keep_key[:, None])
                    p = tl.where(kept, tl.exp(y - ymax[:, None]) / denom[:, None], 0.0)
                    p = tl.where(
                        p.to(tl.int32, bitcast=True).to(tl.int64) >= keep_bits[:, None], p / psum[:, None], 0.0
                    )
                    one_hot = tl.where(offs[None, :] == best_idx[:, None], 1.0, 0.0)
                    res = tl.where(one_hot_row[:, None], one_hot, tl.where(bad[:, None], float("nan"), p))
                    tl.store(out_ptr + rows64[:, None] * V + offs[None, :], res, mask=m2)


@_device.cached_launch_config
def launch_config(
    rows: int,
    vocab: int,
    sm_count: Optional[int],
    *,
    tile: Optional[Tuple[int, int]] = None,
    num_splits: Optional[int] = None,
) -> VocabSplit:
    """The launch configuration of every stage (one grid for all of them): ``rows`` rows of
    ``vocab`` logits in tiles of at most 512 elements on a GPU of ``sm_count`` SMs (None: the
    interpreter); Triton's default warps.  ``tile`` and ``num_splits`` override the choice
    (see ``vocab_split``)."""
    return vocab_split(vocab, rows, sm_count, max_tile_cuda=512, tile=tile, num_splits=num_splits)


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
    device = logits.device
    out = torch.empty((R, V), dtype=torch.float32, device=device)
    if R == 0:
        return out.reshape(logits.shape)
    cfg = launch_config(R, V, _device.sm_count(device))
    S, tiles_per_split = cfg.splits, cfg.tiles_per_split
    i32, i64 = torch.int32, torch.int64
    stat_key, stat_idx, stat_flag = (torch.empty((S, R), dtype=i32, device=device) for _ in range(3))
    stat_max = torch.empty((S, R), dtype=torch.float32, device=device)
    den = torch.empty((S, R), dtype=torch.float32, device=device)
    kcnt = torch.empty((2, S, R, NPIV) if use_top_k else (1,), dtype=i32, device=device)
    kivl = torch.empty((2, 2, R) if use_top_k else (1,), dtype=i64, device=device)
    pmass = torch.empty((2, S, R, NPIV + 1) if use_top_p else (1,), dtype=torch.float64, device=device)
    pivl = torch.empty((2, 2, R) if use_top_p else (1,), dtype=i64, device=device)
    args = (
        x,
        out,
        temperature.to(torch.float32).contiguous(),
        top_k.to(i64).contiguous(),
        top_p.to(torch.float32).contiguous(),
        stat_key,
        stat_idx,
        stat_max,
        stat_flag,
        kcnt,
        kivl,
        den,
        pmass,
        pivl,
        R,
        V,
        R // B,
        x.stride(0),
        S,
        tiles_per_split,
    )
    meta = dict(
        HAS_TOPK=use_top_k, HAS_TOPP=use_top_p, NP=NPIV, NUM_PASSES=PASSES, BLOCK_B=cfg.block_b, BLOCK_V=cfg.block_v
    )
    kernel = launch(_sampling_probs_kernel)[cfg.grid]
    kernel(*args, 0, STAGE=STATS, **meta)
    for i in range(PASSES if use_top_k else 0):
        kernel(*args, i, STAGE=TOPK, **meta)
    kernel(*args, 0, STAGE=DENOM, **meta)
    for i in range(PASSES if use_top_p else 0):
        kernel(*args, i, STAGE=TOPP, **meta)
    kernel(*args, 0, STAGE=FINAL, **meta)
    return out.reshape(logits.shape)


sampling_probs_triton = _sampling_probs_triton_impl  # the launcher (not an op: _library's docstring)
