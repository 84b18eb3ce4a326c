"""sampling_probs: temperature, top-k and top-p applied once for drafter and verifier.

The "triton" backend of ``ops/sampling_probs.py`` (the op's other backends are listed there):
``_sampling_search_kernel`` then ``_sampling_write_kernel``, launched by ``sampling_probs_triton``
as ``launch_config`` says.

Design: two launches, the searches on one program per row, exact (no sort).

1. ``_sampling_search_kernel``, one program per row (as FlashInfer's sampling kernels: the
   searches need the whole row), passes over the row's logits (L2-resident after the first):

   - statistics: the argmax (first maximum; NaN counts as the maximum), the maximum after
     temperature, NaN / +inf flags;
   - top-k: the k-th largest order key (the integer image of the scaled logits that sorts as
     they do, -0.0 = +0.0) by a radix select: ``RADIX_PASSES`` = 4 passes, each a 256-bin
     ``tl.histogram`` of the next 8 bits among the keys that share the bits found so far
     (counts only, no pivot comparisons); the threshold is exact, ties kept;
   - the softmax denominator over the kept logits (float32);
   - top-p: the smallest probability whose float64 mass strictly above is below top_p, by a
     multi-pivot search over the probabilities' float32 bits: each pass counts the masses
     above ``NPIV`` pivots at once, so the 2**31 candidates take at most ``PASSES`` = 8
     passes, and the search stops as soon as one candidate is left.

   It writes a few numbers per row (``ROW_I32`` int32 and ``ROW_F32`` float32 values).
2. ``_sampling_write_kernel`` over (row blocks, vocabulary chunks), so batch 1 spreads over
   the GPU: the output row from those numbers (renormalised nucleus, one-hot argmax, or NaN),
   with the same float32 operations as the search, so the kept set is the searched one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from specdec_kernels import _device
from specdec_kernels._library import launch
from specdec_kernels.ops._triton._sampling_common import VocabSplit, vocab_split

_INT32_MIN = tl.constexpr(-2147483648)
_INT32_MAX = tl.constexpr(2147483647)
_INF_BITS = tl.constexpr(2139095040)  # the float32 bits of +inf: no probability lies above

NPIV = 16  # pivots per pass of the top-p search
# passes that narrow an interval of 2**31 probability bits to one: each pass cuts the
# interval's width w to at most ceil(w / (NPIV + 1)), and 17**8 > 2**32
PASSES = 8
RADIX_BITS = 8  # bits of the order key resolved per pass of the top-k radix select
RADIX_PASSES = 32 // RADIX_BITS

# the per-row results of the search: one [R, ROW_WORDS] int32 workspace (one allocation), each
# row ROW_I32 int32 words then ROW_F32 float32 values (their bits)
ROW_I32 = 4  # argmax, mode (0: probabilities, 1: one-hot, 2: NaN), top-k key, top-p bits
ROW_F32 = 3  # maximum after temperature, softmax denominator, nucleus mass
ROW_WORDS = ROW_I32 + ROW_F32
MODE_PROBS, MODE_ONE_HOT, MODE_NAN = 0, 1, 2
_MODE_PROBS, _MODE_ONE_HOT, _MODE_NAN = (tl.constexpr(m) for m in (MODE_PROBS, MODE_ONE_HOT, MODE_NAN))


@triton.jit
def _order_key(y):
    """int32 key with key(a) < key(b) iff a < b for non-NaN floats (-0.0 and +0.0 equal)."""
    bits = y.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(y == 0, 0, key)


@triton.jit
def _row_tile(l_row, tdiv, t, V, BLOCK_V: tl.constexpr):
    """Tile ``t`` of one row: (logits / temperature in float32 (IEEE division), -inf outside the
    vocabulary; the logits; the in-vocabulary mask; the columns)."""
    offs = t * BLOCK_V + tl.arange(0, BLOCK_V)
    m = offs < V
    x = tl.load(l_row + offs, mask=m, other=0.0).to(tl.float32)
    # padding lanes: loaded as 0 (with temperature inf, -inf / inf would be NaN), then -inf
    return tl.where(m, tl.math.div_rn(x, tdiv), float("-inf")), x, m, offs


@triton.jit
def _probability(y, keep_key, ymax, denom):
    """exp(y - max) / denominator where y's order key is kept by top-k, else 0 (float32): the
    same operations in both kernels, so both see the same bits."""
    return tl.where(_order_key(y) >= keep_key, tl.exp(y - ymax) / denom, 0.0)


@triton.jit
def _kth_largest_key(l_row, tdiv, V, k, BLOCK_V: tl.constexpr, BITS: tl.constexpr):
    """The k-th largest order key of the row's scaled logits (1 <= k <= V), by a radix select
    over the unsigned image of the keys, ``BITS`` bits a pass (MSB first): each pass counts
    the keys sharing the prefix found so far by their next digit, then takes the digit that
    holds the k-th largest.  Returns int32."""
    NB: tl.constexpr = 1 << BITS
    digits = tl.arange(0, NB)
    prefix = tl.zeros([], dtype=tl.int64)  # the digits found so far
    above = tl.zeros([], dtype=tl.int32)  # keys above the prefix's range
    for level in tl.static_range(32 // BITS):
        shift = 32 - BITS * (level + 1)
        hist = tl.zeros([NB], dtype=tl.int32)
        for t in tl.range(0, tl.cdiv(V, BLOCK_V)):
            y, _, m, _ = _row_tile(l_row, tdiv, t, V, BLOCK_V)
            uk = _order_key(y).to(tl.int64) + 2147483648  # in [0, 2**32), in key order
            match = m & ((uk >> (shift + BITS)) == prefix)
            hist += tl.histogram(((uk >> shift) & (NB - 1)).to(tl.int32), NB, mask=match)
        ge = tl.cumsum(hist, 0, reverse=True)  # keys with this digit or a larger one
        d = tl.sum((ge >= k - above).to(tl.int32), axis=0) - 1  # the largest digit reaching k
        above += tl.sum(tl.where(digits > d, hist, 0), axis=0)
        prefix = prefix * NB + d
    return (prefix - 2147483648).to(tl.int32)


@triton.jit
def _pivots(lo, hi, NP: tl.constexpr):
    """[NP] int32 pivots strictly above lo and at most hi, evenly spaced over (lo, hi]."""
    step = tl.maximum((hi - lo + NP) // (NP + 1), 1)
    return tl.minimum(lo + step * (tl.arange(0, NP) + 1), hi)


@triton.jit
def _sampling_search_kernel(
    logits_ptr,  # [R, V] fp32/fp16/bf16, row stride stride_lr, last dim contiguous
    temp_ptr,  # [B] fp32
    topk_ptr,  # [B] int64
    topp_ptr,  # [B] fp32
    row_ptr,  # [R, ROW_WORDS] int32 (written): ROW_I32 int32 words, then ROW_F32 fp32 bits
    V,
    rows_per_seq,  # R // B: rows of logits per sequence (parameters are per sequence)
    stride_lr,
    HAS_TOPK: tl.constexpr,
    HAS_TOPP: tl.constexpr,
    NP: tl.constexpr,  # pivots per pass of the top-p search (NPIV)
    NUM_PASSES: tl.constexpr,  # PASSES
    BITS: tl.constexpr,  # RADIX_BITS
    BLOCK_V: tl.constexpr,
):
    """Program r: row r's argmax, maximum, mode, top-k key, softmax denominator, top-p bits and
    nucleus mass (see the module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    seq = row // rows_per_seq
    l_row = logits_ptr + row * stride_lr
    temp = tl.load(temp_ptr + seq)
    greedy = temp == 0
    tdiv = tl.where(greedy, 1.0, temp)
    NT = tl.cdiv(V, BLOCK_V)

    # statistics: argmax of the logits themselves (a temperature so small that the division
    # overflows makes several +inf, and the limit of T -> 0 is the largest logit), maximum
    # after temperature, NaN and +inf after temperature
    best_key = tl.full([], _INT32_MIN, tl.int32)
    best_idx = tl.zeros([], dtype=tl.int32)
    ymax = tl.full([], float("-inf"), tl.float32)
    has_nan = tl.zeros([], dtype=tl.int32)
    has_inf = tl.zeros([], dtype=tl.int32)
    for t in tl.range(0, NT):
        y, x, m, offs = _row_tile(l_row, tdiv, t, V, BLOCK_V)
        isnan = y != y
        key = tl.where(m, tl.where(isnan, _INT32_MAX, _order_key(x)), _INT32_MIN)
        tile_best = tl.max(key, axis=0)
        tile_idx = tl.min(tl.where(key == tile_best, offs, _INT32_MAX), axis=0)
        better = tile_best > best_key  # a tie keeps the earlier tile (lower index)
        best_idx = tl.where(better, tile_idx, best_idx)
        best_key = tl.where(better, tile_best, best_key)
        ymax = tl.maximum(ymax, tl.max(tl.where(isnan, float("-inf"), y), axis=0))
        has_nan = tl.maximum(has_nan, tl.max(isnan.to(tl.int32), axis=0))
        has_inf = tl.maximum(has_inf, tl.max((y == float("inf")).to(tl.int32), axis=0))
    bad = (has_nan > 0) | (ymax == float("-inf"))  # NaN, or no finite mass at all: NaN out
    # temperature 0, or a +inf logit after temperature (an infinite logit, or a temperature so
    # small that the division overflows): one-hot at the largest logit
    one_hot = greedy | ((has_inf > 0) & (has_nan == 0))
    live = ~one_hot & ~bad  # rows whose probabilities are computed
    ymax = tl.where(live, ymax, 0.0)  # finite on every row: no inf - inf below

    # top-k: keep the keys >= the k-th largest (ties kept)
    keep_key = tl.full([], _INT32_MIN, tl.int32)
    if HAS_TOPK:
        k = tl.load(topk_ptr + seq)
        k = tl.where((k <= 0) | (k > V), V, k).to(tl.int32)
        if live & (k < V):
            keep_key = _kth_largest_key(l_row, tdiv, V, k, BLOCK_V, BITS)

    denom = tl.zeros([], dtype=tl.float32)
    if live:
        for t in tl.range(0, NT):
            y, _, m, _ = _row_tile(l_row, tdiv, t, V, BLOCK_V)
            denom += tl.sum(tl.where(m & (_order_key(y) >= keep_key), tl.exp(y - ymax), 0.0), axis=0)
    denom = tl.where(live, denom, 1.0)

    # top-p: keep p >= t, t the smallest float32 value whose float64 mass strictly above is
    # below top_p; (lo, hi] holds t's bits, the mass above lo reaches top_p (lo = -1: all)
    keep_bits = tl.full([], -1, tl.int32)
    psum = tl.full([], 1.0, tl.float32)
    if HAS_TOPP:
        top_p = tl.load(topp_ptr + seq)
        if live & (top_p < 1.0):
            # top_p <= 0 (unchecked input) keeps the maximum and its ties, as the reference (a
            # nucleus of at least one token): a float64 floor, not a float32 one (denormals may
            # be flushed to zero on GPUs)
            top_p64 = tl.maximum(top_p.to(tl.float64), 1e-300)
            lo = tl.full([], -1, tl.int32)
            hi = tl.full([], _INF_BITS, tl.int32)
            mass_lo = tl.zeros([], dtype=tl.float64)  # the mass above lo, once a pass has run
            for _pass in tl.range(0, NUM_PASSES):
                if hi - lo > 1:  # more than one candidate left
                    piv = _pivots(lo, hi, NP)
                    mass = tl.zeros([NP], dtype=tl.float64)
                    above_lo = tl.zeros([], dtype=tl.float64)
                    for t in tl.range(0, NT):
                        y, _, m, _ = _row_tile(l_row, tdiv, t, V, BLOCK_V)
                        p = _probability(y, keep_key, ymax, denom)
                        bits = p.to(tl.int32, bitcast=True)
                        p64 = p.to(tl.float64)
                        above_lo += tl.sum(tl.where(bits > lo, p64, 0.0), axis=0)
                        mass += tl.sum(tl.where(bits[None, :] > piv[:, None], p64[None, :], 0.0), axis=1)
                    below = mass < top_p64  # pivots at or above the answer
                    # the mass above the new lo: that of the largest pivot not below (the
                    # smallest such mass), else (lo unchanged) the mass above lo
                    lo_mass = tl.min(tl.where(below, float("inf"), mass), axis=0)
                    mass_lo = tl.where(lo_mass < float("inf"), lo_mass, above_lo)
                    lo_new = tl.maximum(lo, tl.max(tl.where(below, lo, piv), axis=0))
                    hi = tl.minimum(hi, tl.min(tl.where(below, piv, hi), axis=0))
                    lo = lo_new
            keep_bits = hi
            psum = mass_lo.to(tl.float32)
    psum = tl.where(live & (psum > 0), psum, 1.0)

    mode = tl.where(one_hot, _MODE_ONE_HOT, tl.where(bad, _MODE_NAN, _MODE_PROBS))
    ri = row_ptr + row * 7  # ROW_WORDS
    tl.store(ri, best_idx)
    tl.store(ri + 1, mode)
    tl.store(ri + 2, keep_key)
    tl.store(ri + 3, keep_bits)
    rf = (ri + 4).to(tl.pointer_type(tl.float32), bitcast=True)  # after the ROW_I32 words
    tl.store(rf, ymax)
    tl.store(rf + 1, denom)
    tl.store(rf + 2, psum)


@triton.jit
def _sampling_write_kernel(
    logits_ptr,  # [R, V] fp32/fp16/bf16, row stride stride_lr, last dim contiguous
    out_ptr,  # [R, V] fp32, contiguous (written)
    temp_ptr,  # [B] fp32
    row_ptr,  # [R, ROW_WORDS] int32 from _sampling_search_kernel
    R,
    V,
    rows_per_seq,
    stride_lr,
    TILES_PER_SPLIT,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program (i, s): rows i * BLOCK_B.., vocabulary chunk s of the output: the renormalised
    nucleus, the one-hot argmax, or NaN, as the search decided."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    temp = tl.load(temp_ptr + rows64 // rows_per_seq, mask=rmask, other=1.0)
    tdiv = tl.where(temp == 0, 1.0, temp)
    ri = row_ptr + rows64 * 7  # ROW_WORDS
    best_idx = tl.load(ri, mask=rmask, other=0)
    mode = tl.load(ri + 1, mask=rmask, other=_MODE_NAN)
    keep_key = tl.load(ri + 2, mask=rmask, other=_INT32_MIN)
    keep_bits = tl.load(ri + 3, mask=rmask, other=-1)
    rf = (row_ptr + 4).to(tl.pointer_type(tl.float32), bitcast=True) + rows64 * 7  # after ROW_I32 words
    ymax = tl.load(rf, mask=rmask, other=0.0)
    denom = tl.load(rf + 1, mask=rmask, other=1.0)
    psum = tl.load(rf + 2, mask=rmask, other=1.0)
    live = (mode == _MODE_PROBS)[:, None]
    l_rows = logits_ptr + rows64 * stride_lr
    lo = split * TILES_PER_SPLIT * BLOCK_V
    for t in tl.range(0, TILES_PER_SPLIT, num_stages=3):
        offs = lo + t * BLOCK_V + tl.arange(0, BLOCK_V)
        m2 = rmask[:, None] & (offs < V)[None, :]
        x = tl.load(l_rows[:, None] + offs[None, :], mask=m2 & live, other=0.0).to(tl.float32)
        y = tl.where(m2, tl.math.div_rn(x, tdiv[:, None]), float("-inf"))
        p = _probability(y, keep_key[:, None], ymax[:, None], denom[:, None])
        p = tl.where(p.to(tl.int32, bitcast=True) >= keep_bits[:, None], p / psum[:, None], 0.0)
        one_hot = tl.where(offs[None, :] == best_idx[:, None], 1.0, 0.0)
        res = tl.where((mode == _MODE_ONE_HOT)[:, None], one_hot, tl.where(live, p, float("nan")))
        tl.store(out_ptr + rows64[:, None] * V + offs[None, :], res, mask=m2)


@dataclass(frozen=True)
class SamplingProbsLaunch:
    """The two launches of one call: ``_sampling_search_kernel`` on ``(rows,)`` with
    ``search_block_v`` columns a tile and ``search_num_warps`` warps, then
    ``_sampling_write_kernel`` on ``write.grid`` (row blocks, vocabulary chunks)."""

    rows: int
    search_block_v: int
    search_num_warps: int
    write: VocabSplit

    @functools.cached_property  # computed once per (cached) configuration
    def search_grid(self) -> Tuple[int]:
        return (self.rows,)


@_device.cached_launch_config
def launch_config(
    rows: int,
    vocab: int,
    sm_count: Optional[int],
    *,
    tile: Optional[Tuple[int, int]] = None,
    num_splits: Optional[int] = None,
) -> SamplingProbsLaunch:
    """The launch configuration for ``rows`` rows of ``vocab`` logits on a GPU of ``sm_count``
    SMs (None: the interpreter).

    The search: one program per row, tiles of 512 columns and 8 warps on a GPU (its 16-pivot
    float64 masses are a [16, 512] block), 4096 columns in the interpreter; the write: tiles of
    at most 512 elements over about 8 programs per SM (``vocab_split``).  ``tile`` (BLOCK_B,
    BLOCK_V) overrides the write's tile and the search's columns, ``num_splits`` the write's
    chunks: how the tests drive the multi-tile and multi-chunk paths on small inputs.
    """
    write = vocab_split(vocab, rows, sm_count, max_tile_cuda=512, tile=tile, num_splits=num_splits)
    gpu = sm_count is not None
    if tile is not None:
        block_v = tile[1]
    else:
        block_v = max(16, min(triton.next_power_of_2(max(vocab, 1)), 512 if gpu else 4096))
    num_warps = 8 if gpu and block_v >= 512 else 4
    return SamplingProbsLaunch(rows, block_v, num_warps, write)


def _sampling_probs_triton_impl(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    use_top_k: bool,
    use_top_p: bool,
) -> torch.Tensor:
    """Launch the two sampling_probs kernels on validated inputs (see ``sampling_probs``).

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
    shape = logits.shape
    V, B = shape[-1], shape[0]
    if len(shape) == 2:  # no reshape: its view costs as much as an allocation
        x = logits
    else:
        x = logits.reshape(-1, V) if logits.numel() else logits.new_empty((0, V))
    if x.stride(-1) != 1:
        x = x.contiguous()
    R = x.shape[0]
    device = logits.device
    out = torch.empty(R, V, dtype=torch.float32, device=device)
    if R == 0:
        return out.reshape(shape)
    cfg = launch_config(R, V, _device.sm_count(device))
    rows = torch.empty(R, ROW_WORDS, dtype=torch.int32, device=device)
    temperature = _as(temperature, torch.float32)
    launch(_sampling_search_kernel)[cfg.search_grid](
        x,
        temperature,
        _as(top_k, torch.int64),
        _as(top_p, torch.float32),
        rows,
        V,
        R // B,
        x.stride(0),
        HAS_TOPK=use_top_k,
        HAS_TOPP=use_top_p,
        NP=NPIV,
        NUM_PASSES=PASSES,
        BITS=RADIX_BITS,
        BLOCK_V=cfg.search_block_v,
        num_warps=cfg.search_num_warps,
    )
    w = cfg.write
    launch(_sampling_write_kernel)[w.grid](
        x,
        out,
        temperature,
        rows,
        R,
        V,
        R // B,
        x.stride(0),
        w.tiles_per_split,
        BLOCK_B=w.block_b,
        BLOCK_V=w.block_v,
    )
    return out if len(shape) == 2 else out.reshape(shape)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, contiguous (itself when it is: no ``to`` call)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


sampling_probs_triton = _sampling_probs_triton_impl  # the launcher (not an op: _library's docstring)
