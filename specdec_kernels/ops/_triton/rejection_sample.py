"""rejection_sample: lossless speculative sampling of a chain of draft tokens.

The "triton" backend of ``ops/rejection_sample.py`` (the op's other backends are listed
there): ``_rejection_partials_kernel`` and ``_rejection_sample_kernel``, launched by
``rejection_sample_triton`` as ``launch_config`` says.  The same kernels serve the flattened
(vLLM v1) layout with ``FLAT=True`` (``rejection_sample_flattened_triton``): each request's
rows are found from ``cu_num_draft_tokens`` instead of ``b * (K + 1)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from specdec_kernels import _device
from specdec_kernels._device import next_pow2
from specdec_kernels._library import launch
from specdec_kernels.ops._triton._launch import dummy
from specdec_kernels.ops._triton._sampling_common import (
    VocabSplit,
    _add_chunk_partials,
    _cdf_search_tile,
    _load_chunk_partials,
    _mass64,
    _no_chunk_partials,
    _pick_token,
    _start_search,
    _store_chunk_partials,
    vocab_split,
)
from specdec_kernels.ops._triton._uniforms import _coin, _request_key


@triton.jit
def _chain_rows(ptrs, strides, rows, rmask, K, T, FLAT: tl.constexpr, BONUS_IDS: tl.constexpr):
    """(n, tok0, t_rows, d_rows) of each of the [BB] requests: its draft count (clamped to
    0..K), its first flat draft, and the pointers of its first target and draft rows.
    ``ptrs`` and ``strides``: the kernels' tensors and row strides (see ``_chain_state``)."""
    target_ptr, draft_ptr, _, num_draft_ptr, _ = ptrs
    stride_tb, stride_tk, stride_db, stride_dk = strides
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
    return n, tok0, t_rows, d_rows


@triton.jit
def _chain_walk(
    tokens_ptr,
    coins_ptr,
    key,
    t_rows,
    d_rows,
    tok0,
    coin0,
    n,
    rmask,
    K,
    V,
    stride_tk,
    stride_dk,
    HAS_DRAFT: tl.constexpr,
    PHILOX_COINS: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Accept/reject along the chain: x_j is accepted iff u_j * q_j(x_j) < p_j(x_j) in float32,
    until the first rejection; coin u_j read at ``coins_ptr + coin0 + j`` or, with
    PHILOX_COINS, computed from ``key`` = (seed, offset) [BB] (``_uniforms._coin``).  Returns
    the accepted count [BB] int32."""
    seed, offset = key
    num_acc = tl.zeros([BLOCK_B], dtype=tl.int32)
    alive = rmask
    for j in tl.range(0, K):
        live = alive & (j < n)
        x = tl.load(tokens_ptr + tok0 + j, mask=live, other=-1).to(tl.int64)
        in_vocab = (x >= 0) & (x < V)
        xs = tl.minimum(tl.maximum(x, 0), V - 1)
        p = tl.load(t_rows + j * stride_tk + xs, mask=live, other=0.0).to(tl.float32)
        if HAS_DRAFT:
            q = tl.load(d_rows + j * stride_dk + xs, mask=live, other=0.0).to(tl.float32)
        else:
            q = tl.full([BLOCK_B], 1.0, tl.float32)
        u = _coin(coins_ptr, coin0 + j, seed, offset, j, live, PHILOX_COINS)
        acc = live & in_vocab & (u * q < p)
        num_acc += acc.to(tl.int32)
        alive = acc
    return num_acc


@triton.jit
def _chain_state(
    ptrs,
    strides,
    key,
    rows,
    rmask,
    K,
    V,
    T,
    FLAT: tl.constexpr,
    BONUS_IDS: tl.constexpr,
    HAS_DRAFT: tl.constexpr,
    PHILOX_COINS: tl.constexpr,
    PADDED_COINS: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Everything before the vocabulary scan, for the [BB] requests ``rows``: (tok0, num_acc,
    rejected, need, p_rows, q_rows, at).  The row to sample from is the residual
    max(0, p - q) at the first rejection (p itself if that has no mass), else the bonus row
    after the last draft; with BONUS_IDS a fully accepted request has no row (``need`` off).

    ``ptrs`` = (target_ptr, draft_ptr, tokens_ptr, num_draft_ptr, coins_ptr) and ``strides`` =
    (stride_tb, stride_tk, stride_db, stride_dk): the kernels' arguments of those names; ``key``:
    the requests' (seed, offset) (``_uniforms._request_key``), used with PHILOX_COINS.  The
    coins are [B, K] (request b's coin j at b * K + j) when padded or with PADDED_COINS, else
    flat like the tokens."""
    _, _, tokens_ptr, _, coins_ptr = ptrs
    _, stride_tk, _, stride_dk = strides
    n, tok0, t_rows, d_rows = _chain_rows(ptrs, strides, rows, rmask, K, T, FLAT, BONUS_IDS)
    if PADDED_COINS:
        coin0 = rows.to(tl.int64) * K
    else:
        coin0 = tok0
    num_acc = _chain_walk(
        tokens_ptr,
        coins_ptr,
        key,
        t_rows,
        d_rows,
        tok0,
        coin0,
        n,
        rmask,
        K,
        V,
        stride_tk,
        stride_dk,
        HAS_DRAFT,
        PHILOX_COINS,
        BLOCK_B,
    )
    rejected = rmask & (num_acc < n)
    if BONUS_IDS:
        need = rejected
    else:
        need = rmask
    p_rows = t_rows + num_acc.to(tl.int64) * stride_tk
    q_rows = d_rows + tl.minimum(num_acc, K - 1).to(tl.int64) * stride_dk
    at = tl.load(tokens_ptr + tok0 + num_acc, mask=rejected, other=-1).to(tl.int64)
    at = tl.where((at >= 0) & (at < V), at, -1)
    return tok0, num_acc, rejected, need, p_rows, q_rows, at


@triton.jit
def _chain_tile(p_rows, q_rows, at, use_q, rmask, cols, inside, HAS_DRAFT: tl.constexpr):
    """Target row p and the draft row q to subtract (0 where ``use_q`` is off), float32 [BB, BV],
    at the [BB, BV] columns ``cols`` (``inside``: the columns of the row's range)."""
    m2 = rmask[:, None] & inside
    p = tl.load(p_rows[:, None] + cols, mask=m2, other=0.0).to(tl.float32)
    if HAS_DRAFT:
        q = tl.load(q_rows[:, None] + cols, mask=m2 & use_q[:, None], other=0.0).to(tl.float32)
    else:
        # one-hot at the rejected draft; at == -1 when unused or out of the vocabulary
        q = tl.where(cols == at[:, None], 1.0, 0.0)
    return p, q


@triton.jit
def _rejection_partials_kernel(
    target_ptr,  # padded: [B, K+1, V]; FLAT: [T + B, V] or [T, V] (BONUS_IDS); fp32/fp16/bf16, last dim contiguous
    draft_ptr,  # padded: [B, K, V]; FLAT: [T, V]; like target (unused when HAS_DRAFT is False)
    tokens_ptr,  # padded: [B, K]; FLAT: [T]; int32/int64, contiguous
    num_draft_ptr,  # padded: [B] int64 counts; FLAT: cu_num_draft_tokens [B] int32/int64
    coins_ptr,  # padded: [B, K]; FLAT: [T] or [B, K]; fp32/fp64, contiguous (unused with PHILOX_COINS)
    seeds_ptr,  # [B] int32/int64 (read with PHILOX_COINS or PHILOX_FINAL)
    offsets_ptr,  # [B] int32/int64 (likewise)
    part_ptr,  # [3, S, B] fp64 (written): [2, S, B] mass of p and of the residual per chunk,
    #            then [2, S, B] int32: their last indices with mass (-1: none)
    B,
    K,  # padded width (FLAT: max_spec_len)
    V,
    T,  # FLAT: number of draft tokens (spans are clamped into [0, T])
    stride_tb,  # padded only
    stride_tk,  # target row stride (FLAT: of the 2-D tensor)
    stride_db,  # padded only
    stride_dk,  # draft row stride
    TILES_PER_SPLIT,  # vocabulary tiles per chunk
    FLAT: tl.constexpr,
    BONUS_IDS: tl.constexpr,
    HAS_DRAFT: tl.constexpr,
    PHILOX_COINS: tl.constexpr,  # coins from seeds/offsets (stream 0), not coins_ptr
    PADDED_COINS: tl.constexpr,  # FLAT with [B, K] coins (request b's coin j at b * K + j)
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program (i, s): requests i * BLOCK_B.., vocabulary chunk s: the chain walk (a few
    loads), then the float64 mass of p and of the residual over the chunk and their last
    indices with mass.  Many chunks per row spread one request over the whole GPU."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    S = tl.num_programs(1)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    ptrs = (target_ptr, draft_ptr, tokens_ptr, num_draft_ptr, coins_ptr)
    strides = (stride_tb, stride_tk, stride_db, stride_dk)
    key = _request_key(seeds_ptr, offsets_ptr, rows.to(tl.int64), rmask, PHILOX_COINS)
    _, _, rejected, need, p_rows, q_rows, at = _chain_state(
        ptrs, strides, key, rows, rmask, K, V, T, FLAT, BONUS_IDS, HAS_DRAFT, PHILOX_COINS, PADDED_COINS, BLOCK_B
    )
    partials = _no_chunk_partials(BLOCK_B)
    lo = split * TILES_PER_SPLIT * BLOCK_V
    for t in tl.range(0, TILES_PER_SPLIT, num_stages=3):
        offs = lo + t * BLOCK_V + tl.arange(0, BLOCK_V)
        p, q = _chain_tile(p_rows, q_rows, at, rejected, need, offs[None, :], (offs < V)[None, :], HAS_DRAFT)
        partials = _add_chunk_partials(partials, _mass64(p), _mass64(p - q), offs)
    _store_chunk_partials(part_ptr, split, S, B, rows, rmask, partials)


@triton.jit
def _rejection_sample_kernel(
    target_ptr,  # as _rejection_partials_kernel
    draft_ptr,
    tokens_ptr,
    num_draft_ptr,
    bonus_ptr,  # BONUS_IDS: [B] int32/int64 bonus tokens (else unused)
    coins_ptr,
    final_u_ptr,  # [B] fp32/fp64 (unused with PHILOX_FINAL)
    seeds_ptr,
    offsets_ptr,
    part_ptr,  # [3, S, B] fp64 from _rejection_partials_kernel
    out_ptr,  # [B, K+1] int64, contiguous (written)
    num_accepted_ptr,  # [B] int64 (written)
    B,
    K,
    V,
    T,
    stride_tb,
    stride_tk,
    stride_db,
    stride_dk,
    S,  # chunks per row
    TILES_PER_SPLIT,
    FLAT: tl.constexpr,  # the flattened (vLLM v1) layout
    BONUS_IDS: tl.constexpr,  # FLAT with [T, V] targets and the bonus tokens given
    HAS_DRAFT: tl.constexpr,
    PHILOX_COINS: tl.constexpr,
    PADDED_COINS: tl.constexpr,
    PHILOX_FINAL: tl.constexpr,  # the sample uniform from seeds/offsets (stream 1), not final_u_ptr
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    KP: tl.constexpr,  # next power of two >= K + 1
    BLOCK_S: tl.constexpr,  # power of two >= S: the chunks' masses are read as one vector
):
    """Program i: requests i * BLOCK_B..: the chunks' masses combined in chunk order, the chunk
    that holds u * total found from them, the inverse-CDF search inside that chunk only, then
    the output row."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    ptrs = (target_ptr, draft_ptr, tokens_ptr, num_draft_ptr, coins_ptr)
    strides = (stride_tb, stride_tk, stride_db, stride_dk)
    key = _request_key(seeds_ptr, offsets_ptr, rows64, rmask, PHILOX_COINS or PHILOX_FINAL)
    tok0, num_acc, rejected, need, p_rows, q_rows, at = _chain_state(
        ptrs, strides, key, rows, rmask, K, V, T, FLAT, BONUS_IDS, HAS_DRAFT, PHILOX_COINS, PADDED_COINS, BLOCK_B
    )

    # the chunks' masses, one vector load per row (no loop over chunks)
    mass_p, mass_r, last_p, last_r = _load_chunk_partials(part_ptr, S, B, rows64, rmask, BLOCK_S)
    use_q = rejected & (tl.sum(mass_r, axis=1) > 0)  # the residual has mass
    at = tl.where(use_q, at, -1)
    total, last, threshold, searching, lo, carry, found = _start_search(
        use_q,
        (mass_r, mass_p, last_r, last_p),
        final_u_ptr,
        rows64,
        key,
        need,
        TILES_PER_SPLIT,
        BLOCK_V,
        BLOCK_S,
        PHILOX_FINAL,
    )

    # inverse CDF inside that chunk (columns per row: the chunks differ between rows)
    for t in tl.range(0, TILES_PER_SPLIT, num_stages=3):
        cols = lo[:, None] + t * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
        p, q = _chain_tile(p_rows, q_rows, at, use_q & searching, searching, cols, cols < V, HAS_DRAFT)
        carry, found = _cdf_search_tile(_mass64(p - q), cols, carry, threshold, found)
    sampled = _pick_token(found, last, total)
    if BONUS_IDS:
        bonus = tl.load(bonus_ptr + rows64, mask=rmask & ~rejected, other=0).to(tl.int64)
        sampled = tl.where(rejected, sampled, bonus)

    # accepted drafts, the sampled token, then -1
    cols = tl.arange(0, KP)
    c2 = cols[None, :]
    keep = rmask[:, None] & (c2 < num_acc[:, None])
    toks = tl.load(tokens_ptr + tok0[:, None] + c2, mask=keep, other=-1).to(tl.int64)
    out = tl.where(c2 == num_acc[:, None], sampled[:, None], tl.where(keep, toks, -1))
    tl.store(out_ptr + rows64[:, None] * (K + 1) + c2, out, mask=rmask[:, None] & (c2 < K + 1))
    tl.store(num_accepted_ptr + rows64, num_acc.to(tl.int64), mask=rmask)


def sample_num_warps(block_v: int) -> int:
    """Warps of ``_rejection_sample_kernel``: 8 for full 1024-column tiles (4 spill registers
    in some configurations, ``python -m specdec_kernels.bench.kernels --static``), else 4."""
    return 8 if block_v >= 1024 else 4


@dataclass(frozen=True)
class RejectionSampleLaunch:
    """The two launches of one call: ``_rejection_partials_kernel`` on ``vocab.grid``
    (request blocks, vocabulary chunks), then ``_rejection_sample_kernel`` on ``sample_grid``
    with ``KP`` output columns, ``vocab.block_s`` chunk lanes and ``sample_num_warps`` warps."""

    vocab: VocabSplit
    kp: int
    sample_num_warps: int

    @functools.cached_property  # computed once per (cached) configuration
    def sample_grid(self) -> Tuple[int]:
        return (self.vocab.row_blocks,)


@_device.cached_launch_config
def launch_config(
    batch: int,
    num_drafts: int,
    vocab: int,
    sm_count: Optional[int],
    *,
    tile: Optional[Tuple[int, int]] = None,
    num_splits: Optional[int] = None,
) -> RejectionSampleLaunch:
    """The launch configuration for ``batch`` requests of up to ``num_drafts`` (K) drafts over
    ``vocab`` entries, on a GPU of ``sm_count`` SMs (None: the interpreter).  ``tile`` and
    ``num_splits`` override the choice (see ``vocab_split``)."""
    split = vocab_split(vocab, batch, sm_count, tile=tile, num_splits=num_splits)
    return RejectionSampleLaunch(split, next_pow2(num_drafts + 1), sample_num_warps(split.block_v))


def _unit_stride_rows(x: torch.Tensor, flat: bool) -> Tuple[torch.Tensor, Tuple[int, int]]:
    """A target or draft tensor read unit-stride along the vocabulary (``_launch.unit_stride``) and its
    (sequence, row) strides: a flattened tensor's rows are its first dimension (sequence stride
    0: the kernels find the rows from the counts).  One ``stride()`` call."""
    st = x.stride()
    if st[-1] != 1:
        x = x.contiguous()
        st = x.stride()
    return x, ((0, st[0]) if flat else (st[0], st[1]))


@functools.lru_cache(maxsize=1024)
def _chain_meta(cfg, flat: bool, bonus_ids: bool, has_draft: bool, philox_coins: bool, padded_coins: bool) -> dict:
    """The constexprs both chain kernels take (one dict per launch class; callers only read it)."""
    return dict(
        FLAT=flat,
        BONUS_IDS=bonus_ids,
        HAS_DRAFT=has_draft,
        PHILOX_COINS=philox_coins,
        PADDED_COINS=padded_coins,
        BLOCK_B=cfg.vocab.block_b,
        BLOCK_V=cfg.vocab.block_v,
    )


def _launch_chain(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    tokens: torch.Tensor,
    counts: torch.Tensor,
    coins: Optional[torch.Tensor],
    final_u: Optional[torch.Tensor],
    K: int,
    bonus_ids: Optional[torch.Tensor] = None,
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The two launches of one call (``launch_config``) in either layout: padded (a [B, K + 1, V]
    target) or flattened (``FLAT``: a [T + B, V] target, or [T, V] with ``bonus_ids``).

    Allocates the outputs (B = ``counts.shape[0]``), reads the last dimensions unit-stride and
    stands one-element dummies for the empty tensors the kernels never read.  ``coins`` /
    ``final_u`` None: the kernels compute them from ``seeds`` and ``offsets``
    (``_uniforms``); given ones (float32 or float64) are read as they are and clamped in the
    kernels, so no torch op prepares the random numbers.  Returns (output_tokens (B, K + 1)
    int64, num_accepted (B,) int64)."""
    flat = target_probs.dim() == 2
    B, V = counts.shape[0], target_probs.shape[-1]
    out = target_probs.new_empty(B, K + 1, dtype=torch.int64)
    num_accepted = target_probs.new_empty(B, dtype=torch.int64)
    if B == 0:
        return out, num_accepted
    T = tokens.shape[0] if flat else 0
    target, t_st = _unit_stride_rows(target_probs, flat)
    if target.shape[0] == 0:  # flattened, T = 0 with bonus ids: nothing is read
        target = dummy(target, target.dtype)
    has_draft = draft_probs is not None and (T > 0 or not flat)
    draft, d_st = _unit_stride_rows(draft_probs, flat) if has_draft else (target, (0, 0))
    philox_coins, philox_final = coins is None, final_u is None
    counts = counts.contiguous()
    if tokens.numel() > 0:
        tokens = tokens.contiguous()
        coins = counts if philox_coins else coins.contiguous()  # Philox: a stand-in, never read
    else:  # empty tensors may have no storage; the kernels never read these
        tokens, coins = dummy(target, torch.int64), dummy(target, torch.float32)
    final_u = counts if philox_final else final_u.contiguous()
    if philox_coins or philox_final:
        seeds, offsets = seeds.contiguous(), offsets.contiguous()
    else:  # stand-ins, never read
        seeds, offsets = counts, counts
    bonus = bonus_ids.contiguous() if bonus_ids is not None else counts  # unused without BONUS_IDS
    strides = (*t_st, *d_st)
    cfg = launch_config(B, K, V, _device.sm_count(target.device))
    S, tiles_per_split = cfg.vocab.splits, cfg.vocab.tiles_per_split
    partials = torch.empty(3, S, B, dtype=torch.float64, device=target.device)  # masses, then indices
    meta = _chain_meta(
        cfg, flat, bonus_ids is not None, has_draft, philox_coins, flat and not philox_coins and coins.dim() == 2
    )
    launch(_rejection_partials_kernel)[cfg.vocab.grid](
        target,
        draft,
        tokens,
        counts,
        coins,
        seeds,
        offsets,
        partials,
        B,
        K,
        V,
        T,
        *strides,
        tiles_per_split,
        **meta,
    )
    launch(_rejection_sample_kernel)[cfg.sample_grid](
        target,
        draft,
        tokens,
        counts,
        bonus,
        coins,
        final_u,
        seeds,
        offsets,
        partials,
        out,
        num_accepted,
        B,
        K,
        V,
        T,
        *strides,
        S,
        tiles_per_split,
        PHILOX_FINAL=philox_final,
        KP=cfg.kp,
        BLOCK_S=cfg.vocab.block_s,
        num_warps=cfg.sample_num_warps,
        **meta,
    )
    return out, num_accepted


def _rejection_sample_triton_impl(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_tokens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    uniform_samples: Optional[torch.Tensor],
    sample_uniforms: Optional[torch.Tensor],
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch ``_rejection_sample_kernel`` on validated inputs (see ``rejection_sample``).

    Args:
        target_probs: Shape (B, K + 1, V), float32/float16/bfloat16, CUDA (or CPU under
            TRITON_INTERPRET=1).
        draft_probs: Shape (B, K, V) like target_probs, or None (one-hot drafts).
        draft_tokens: Shape (B, K), int32/int64.
        num_draft_tokens: Shape (B,), int64 in 0..K (not checked here).
        uniform_samples: Shape (B, K), float32/float64: acceptance coins (clamped into
            [0, 1) in the kernels, NaN as 0), or None: Philox from seeds and offsets.
        sample_uniforms: Shape (B,), float32/float64: residual / bonus uniform, or None.
        seeds, offsets: Shape (B,), int32/int64: the requests' Philox keys and counters
            (``specdec_kernels._random``), needed when a uniform tensor is None.

    Returns:
        (output_tokens (B, K + 1) int64, num_accepted (B,) int64), bit-identical to the
        reference for the same uniforms except when the residual/bonus threshold
        ``u * total`` lies within float64 rounding of a CDF boundary (the kernel sums in
        tiles, the reference sequentially).  The residual is never written to memory.
    """
    K = target_probs.shape[1] - 1
    counts = num_draft_tokens if num_draft_tokens.dtype == torch.int64 else num_draft_tokens.to(torch.int64)
    return _launch_chain(
        target_probs,
        draft_probs,
        draft_tokens,
        counts,
        uniform_samples,
        sample_uniforms,
        K,
        seeds=seeds,
        offsets=offsets,
    )


rejection_sample_triton = _rejection_sample_triton_impl  # the launcher (not an op: _library's docstring)


def _rejection_sample_flattened_triton_impl(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor],
    uniform_samples: Optional[torch.Tensor],
    sample_uniforms: Optional[torch.Tensor],
    max_spec_len: int,
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
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
        uniform_samples: Shape (T,), float32/float64: coin t is flat draft t's (clamped into
            [0, 1) in the kernels, NaN as 0); or (B, max_spec_len): request b's coin j at
            [b, j]; or None: request b's coin j is Philox stream 0 at offsets[b] + j.
        sample_uniforms: Shape (B,), float32/float64, or None: Philox stream 1 at offsets[b].
        max_spec_len: padded width of the output minus 1 (counts above it are clamped).
        seeds, offsets: Shape (B,), int32/int64, needed when a uniform tensor is None.

    Returns:
        (output_tokens (B, max_spec_len + 1) int64 with -1 padding, num_accepted (B,) int64):
        the padded kernel's arithmetic on the flat rows, read in place.
    """
    return _launch_chain(
        target_probs,
        draft_probs,
        draft_token_ids,
        cu_num_draft_tokens,
        uniform_samples,
        sample_uniforms,
        max_spec_len,
        bonus_ids=bonus_token_ids,
        seeds=seeds,
        offsets=offsets,
    )


rejection_sample_flattened_triton = _rejection_sample_flattened_triton_impl
