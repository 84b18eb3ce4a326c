"""verify_greedy: greedy acceptance of a chain of draft tokens.

The "triton" backend of ``ops/verify_greedy.py`` and ``ops/verify_greedy_flattened.py`` (the
ops' other backends are listed there): two Triton kernels, below, launched as
``launch_config`` says.

Triton design (two launches; the second is tiny):

1. ``_argmax_partials_kernel``, grid (B * (K + 1), S): program (row, s) scans the s-th
   chunk of that row's vocabulary in tiles of BLOCK_V and writes the chunk's (max, argmax)
   to a workspace of shape [S, B * (K + 1)].  The split S over V exists for small batches:
   with B * (K + 1) = 8 rows and V = 128256, one program per row would leave most of a GPU
   idle, so the launcher splits V until there are about PROGRAMS_PER_SM programs per SM.
   In the interpreter (CPU) it does not split by default (programs run one after another).
2. ``_verify_greedy_accept_kernel``, grid (B,): program b combines the S partials of its
   K + 1 rows (in split order), compares the drafts with the argmaxes, finds the leading
   run of matches and writes the output row and num_accepted.  With ``FLAT=True`` (the
   flattened vLLM v1 layout, ``verify_greedy_flattened``) step 1 runs over the flat rows as
   they are and program b finds its rows from ``cu_num_draft_tokens``.

Why not one kernel: acceptance is sequential along a sequence's rows and needs every row's
argmax, while the argmax needs parallelism over rows and V.  A single launch would either
give a sequence's whole [K + 1, V] slab to one program (B programs: far too few for B <= 8)
or need a grid-wide "last program finishes" protocol with an atomic counter that must be
zeroed by a launch of its own.  The finishing kernel reads only 8 bytes per (row, split).

argmax semantics equal ``torch.argmax``: the first index of the maximum, NaN counts as the
maximum and the first NaN wins, so an all-NaN row gives 0 and every emitted id is in
[0, V).  Logits are compared in fp32 (fp16/bf16 convert exactly, so the order is kept).
Draft ids are only compared with argmaxes, never used as addresses: an out-of-range id or
a -1 simply does not match, and no load can go out of bounds.

Loops over a runtime count are ``for ... in tl.range(...)`` (software-pipelined when
compiled).  The Triton 3.6 interpreter turns a runtime ``range`` bound into ``int()`` of a
one-element NumPy array, which NumPy >= 2.4 rejects: the test environment pins NumPy 2.3
(``requirements/dev.txt``); the compiled kernels do not depend on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from specdec_kernels import _device
from specdec_kernels._device import cdiv, next_pow2
from specdec_kernels._library import launch
from specdec_kernels.ops._triton._launch import dummy, new_int64
from specdec_kernels.ops._triton._sampling_common import VocabSplit, split_vocab

# Largest vocabulary tile one program loads at a time (16 elements per thread with 8 warps,
# several 16-byte loads in flight per thread).  The vocabulary of a small batch is split
# until there are about PROGRAMS_PER_SM programs per SM (``split_vocab``).  Chosen, not
# measured: no GPU has run it.
MAX_BLOCK_V = 4096


_jit = triton.jit


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------


@_jit
def _argmax_partials_kernel(
    logits_ptr,  # [B, R, V] float, unit stride along V
    part_ptr,  # [2, S, B * R] fp32: [0] the chunk's maximum, [1] its first index (int32 bits)
    R,  # rows per sequence (K + 1 or N)
    V,
    stride_b,
    stride_r,
    TILES_PER_SPLIT,  # vocabulary tiles per program
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    num_rows = tl.num_programs(0)
    b = row // R
    r = row % R
    base = logits_ptr + b.to(tl.int64) * stride_b + r.to(tl.int64) * stride_r
    offs = tl.arange(0, BLOCK_V)
    start = split * TILES_PER_SPLIT * BLOCK_V

    # Each lane keeps a running (max, index) over the tiles; lanes see increasing indices,
    # so a lane takes a new value only when it is strictly larger, or NaN over a number
    # (ties keep the earlier index).  The first tile initialises the lanes; its masked lanes
    # (only possible when it is the row's last tile) carry (-inf, INT32_MAX) and lose every
    # comparison in the final reduction against a real lane.
    cols = start + offs
    inside = cols < V
    best = tl.load(base + cols, mask=inside, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
    best_idx = tl.where(inside, cols, 2147483647)  # INT32_MAX
    for t in tl.range(1, TILES_PER_SPLIT, num_stages=3):
        cols = start + t * BLOCK_V + offs
        inside = cols < V
        x = tl.load(base + cols, mask=inside, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
        take = (x > best) | ((x != x) & (best == best))
        best = tl.where(take, x, best)
        best_idx = tl.where(take, cols, best_idx)
    # Across lanes, indices are not ordered: if any lane holds a NaN the result is NaN at
    # the lowest such index, else the maximum at the lowest index holding it.  Built from
    # max/min reductions (a custom-combine tl.reduce would also do, but the interpreter runs
    # its combine function once per element in Python).
    is_nan = best != best
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), best), axis=0)
    holds = tl.where(any_nan, is_nan, best == top)
    idx = tl.min(tl.where(holds, best_idx, 2147483647), axis=0)
    val = tl.where(any_nan, float("nan"), top)
    out = split.to(tl.int64) * num_rows + row
    tl.store(part_ptr + out, val)
    tl.store(_partial_indices(part_ptr, num_rows, tl.num_programs(1)) + out, idx)


@_jit
def _partial_indices(part_ptr, num_rows, S):
    """The int32 half of the partials workspace ``part_ptr`` ([2, S, num_rows] fp32, one
    allocation: values, then the indices' bits)."""
    return (part_ptr + S * num_rows).to(tl.pointer_type(tl.int32), bitcast=True)  # S * num_rows < 2**31


@_jit
def _combine_partials(part_ptr, rows, mask, num_rows, S):
    """argmax (int64) of the given rows from the [2, S, num_rows] partials, splits in order."""
    part_val_ptr = part_ptr
    part_idx_ptr = _partial_indices(part_ptr, num_rows, S)
    rows = rows.to(tl.int64)
    best = tl.load(part_val_ptr + rows, mask=mask, other=float("-inf"))
    best_idx = tl.load(part_idx_ptr + rows, mask=mask, other=0)
    for s in tl.range(1, S):
        at = s * num_rows + rows
        x = tl.load(part_val_ptr + at, mask=mask, other=float("-inf"))
        i = tl.load(part_idx_ptr + at, mask=mask, other=0)
        # Later splits hold larger indices: a tie keeps the earlier split's index.
        take = (x > best) | ((x != x) & (best == best))
        best = tl.where(take, x, best)
        best_idx = tl.where(take, i, best_idx)
    return best_idx.to(tl.int64)


@_jit
def _verify_greedy_accept_kernel(
    part_ptr,  # [2, S, num_rows] fp32: maxima, then their indices (int32 bits)
    draft_ptr,  # padded: [B, K] int32/int64 (strided); FLAT: [T] (stride stride_dk)
    stride_db,
    stride_dk,
    num_draft_ptr,  # padded: [B] int64 counts; FLAT: cu_num_draft_tokens [B] int32/int64
    bonus_ptr,  # FLAT and BONUS_IDS: [B] int32/int64 bonus tokens (else unused)
    out_ptr,  # [B, K + 1] int64, contiguous
    num_accepted_ptr,  # [B] int64
    K,  # padded width (FLAT: max_spec_len)
    S,
    num_rows,  # rows of the partials: B * (K + 1), or the flat target's rows
    T,  # FLAT: number of draft tokens (spans are clamped into [0, T])
    FLAT: tl.constexpr,  # the flattened (vLLM v1) layout
    BONUS_IDS: tl.constexpr,  # FLAT with [T, V] targets and the bonus tokens given
    BLOCK_K: tl.constexpr,  # power of two >= K + 1
):
    b = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    if FLAT:
        # request b's span, clamped as in specdec_kernels/_flattened.py: its rows stay inside
        end = tl.minimum(tl.maximum(tl.load(num_draft_ptr + b).to(tl.int64), 0), T)
        prev = tl.load(num_draft_ptr + tl.maximum(b - 1, 0)).to(tl.int64)
        start = tl.where(b > 0, tl.minimum(tl.maximum(prev, 0), T), 0)
        n = tl.maximum(tl.minimum(end - start, K), 0)
        if BONUS_IDS:
            row0 = start
            is_row = k < n
        else:
            row0 = start + b
            is_row = k <= n
        d0 = start * stride_dk
    else:
        n = tl.load(num_draft_ptr + b)
        row0 = b.to(tl.int64) * (K + 1)
        is_row = k <= K
        d0 = b.to(tl.int64) * stride_db
    target = _combine_partials(part_ptr, row0 + k, is_row, num_rows, S)

    counted = (k < K) & (k < n)
    draft = tl.load(draft_ptr + d0 + k * stride_dk, mask=counted, other=-1).to(tl.int64)
    match = counted & (draft == target)
    # Leading run of matches = index of the first non-matching lane (lanes >= K never match).
    num_accepted = tl.min(tl.where(match, BLOCK_K, k), axis=0)
    if BONUS_IDS:  # the caller's bonus token stands where the bonus row's argmax would
        bonus = tl.load(bonus_ptr + b).to(tl.int64)
        target = tl.where(k == n, bonus, target)
    out = tl.where(k < num_accepted, draft, tl.where(k == num_accepted, target, -1))
    tl.store(out_ptr + b.to(tl.int64) * (K + 1) + k, out, mask=k <= K)
    tl.store(num_accepted_ptr + b, num_accepted.to(tl.int64))


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------


def argmax_num_warps(block_v: int) -> int:
    """Warps of ``_argmax_partials_kernel`` for a vocabulary tile of ``block_v`` columns."""
    return 8 if block_v >= 2048 else 4 if block_v >= 512 else 2 if block_v >= 128 else 1


@dataclass(frozen=True)
class ArgmaxLaunch(VocabSplit):
    """``_argmax_partials_kernel`` on ``grid`` (rows, chunks): a vocabulary split with one row a
    program (``block_b`` 1, ``row_blocks`` = ``rows``), tiles of ``BLOCK_V`` columns, ``splits``
    chunks of ``tiles_per_split`` tiles per row, ``num_warps`` warps."""

    num_warps: int

    @functools.cached_property  # computed once per (cached) configuration
    def rows(self) -> int:
        return self.row_blocks


@_device.cached_launch_config
def argmax_launch_config(
    rows: int, vocab: int, sm_count: Optional[int], *, block_v: Optional[int] = None, num_splits: Optional[int] = None
) -> ArgmaxLaunch:
    """The split argmax over ``rows`` rows of ``vocab`` logits on a GPU of ``sm_count`` SMs
    (None: the interpreter).

    Args:
        block_v: vocabulary tile (a power of two); default ``min(MAX_BLOCK_V, next_pow2(vocab))``.
        num_splits: chunks per row (clamped to 1..number of tiles).  Default: on a GPU, enough
            to give about ``PROGRAMS_PER_SM`` programs per SM; in the interpreter, 1.

    Raises:
        ValueError: block_v not a power of two.
    """
    block = block_v if block_v else min(MAX_BLOCK_V, max(16, next_pow2(vocab)))
    if block & (block - 1):
        raise ValueError(f"block_v must be a power of two, got {block}")
    # Every split gets at least one tile, so each program starts on a real column.
    splits, tiles_per_split = split_vocab(cdiv(vocab, block), rows, sm_count, num_splits)
    return ArgmaxLaunch(1, block, rows, splits, tiles_per_split, argmax_num_warps(block))


@dataclass(frozen=True)
class VerifyGreedyLaunch:
    """The split argmax (``argmax``), then ``_verify_greedy_accept_kernel`` on ``grid`` (one
    program per sequence, ``BLOCK_K`` lanes, ``num_warps`` warps)."""

    argmax: ArgmaxLaunch
    grid: Tuple[int]
    block_k: int
    num_warps: int = 1


@_device.cached_launch_config
def launch_config(
    batch: int,
    rows: int,
    num_drafts: int,
    vocab: int,
    sm_count: Optional[int],
    *,
    block_v: Optional[int] = None,
    num_splits: Optional[int] = None,
) -> VerifyGreedyLaunch:
    """The launch configuration for ``batch`` sequences of up to ``num_drafts`` (K) drafts whose
    ``rows`` logit rows of ``vocab`` entries are scanned (B * (K + 1) padded; the flat rows in
    the flattened layout), on a GPU of ``sm_count`` SMs (None: the interpreter).  ``block_v``
    and ``num_splits``: see ``argmax_launch_config``."""
    argmax = argmax_launch_config(rows, vocab, sm_count, block_v=block_v, num_splits=num_splits)
    return VerifyGreedyLaunch(argmax, (batch,), next_pow2(num_drafts + 1))


def argmax_partials(logits: torch.Tensor, cfg: ArgmaxLaunch) -> torch.Tensor:
    """Launch ``_argmax_partials_kernel``: per-chunk (max, argmax) of every row of ``logits``.

    Shared by ``verify_greedy`` and ``verify_tree_greedy``.

    Parameters
    ----------
    logits : torch.Tensor
        Shape (batch, rows, vocab), float32/float16/bfloat16, CUDA (or CPU under
        TRITON_INTERPRET=1).  Any batch and row strides are passed to the kernel; a tensor
        whose last dimension is not unit-stride is copied to contiguous first.
    cfg : ArgmaxLaunch
        ``argmax_launch_config(batch * rows, vocab, ...)``.

    Returns
    -------
    partials : torch.Tensor
        Shape (2, S, batch * rows), float32, one allocation (one fewer on the host than two):
        ``[0]`` each chunk's maximum (NaN when it holds a NaN); ``[1]`` the bits of the int32
        first index of that maximum, in [0, vocab) (``partials[1].view(torch.int32)``).
        S = ``cfg.splits`` chunks per row; chunk s covers lower indices than chunk s + 1.
    """
    B, R, V = logits.shape
    stride = logits.stride()  # one call: stride(i) costs as much as all of them
    if stride[2] != 1:
        logits = logits.contiguous()
        stride = logits.stride()
    partials = torch.empty(2, cfg.splits, cfg.rows, dtype=torch.float32, device=logits.device)
    if cfg.rows:
        launch(_argmax_partials_kernel)[cfg.grid](
            logits,
            partials,
            R,
            V,
            stride[0],
            stride[1],
            cfg.tiles_per_split,
            BLOCK_V=cfg.block_v,
            num_warps=cfg.num_warps,
        )
    return partials


def _split_argmax(
    logits: torch.Tensor, batch: int, num_drafts: int, block_v: int, num_splits: int
) -> Tuple[VerifyGreedyLaunch, torch.Tensor]:
    """``launch_config`` for ``batch`` sequences of up to ``num_drafts`` drafts whose logit rows
    are those of ``logits`` [b, rows, V] (0 for ``block_v`` or ``num_splits``: the default),
    then the split argmax of those rows (``argmax_partials``): (cfg, partials)."""
    b, rows, V = logits.shape
    sm_count = _device.sm_count(logits.device)
    if block_v or num_splits:
        cfg = launch_config(
            batch, b * rows, num_drafts, V, sm_count, block_v=block_v or None, num_splits=num_splits or None
        )
    else:  # the default tiling: a cache key without keywords (cheaper to build)
        cfg = launch_config(batch, b * rows, num_drafts, V, sm_count)
    return cfg, argmax_partials(logits, cfg.argmax)


def _verify_greedy_triton_impl(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    block_v: int = 0,
    num_splits: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    B, K1, _ = target_logits.shape
    K = K1 - 1
    output_tokens = target_logits.new_empty(B, K1, dtype=torch.int64)
    num_accepted = target_logits.new_empty(B, dtype=torch.int64)
    if B == 0:
        return output_tokens, num_accepted
    cfg, partials = _split_argmax(target_logits, B, K, block_v, num_splits)
    counts = num_draft_tokens if num_draft_tokens.dtype == torch.int64 else num_draft_tokens.to(torch.int64)
    launch(_verify_greedy_accept_kernel)[cfg.grid](
        partials,
        draft_tokens,
        *draft_tokens.stride(),
        counts,
        counts,
        output_tokens,
        num_accepted,
        K,
        cfg.argmax.splits,
        B * K1,
        0,  # bonus_ptr: unused without BONUS_IDS
        FLAT=False,
        BONUS_IDS=False,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
    )
    return output_tokens, num_accepted


def verify_greedy_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    *,
    block_v: Optional[int] = None,
    num_splits: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain verification with the Triton kernels (the launcher of ``verify_greedy``'s
    "triton" backend).

    Inputs are assumed validated (``check_verify_greedy_args``); the public
    ``verify_greedy(..., backend="triton")`` does that and calls this.

    Parameters
    ----------
    target_logits : torch.Tensor
        Shape (batch, K + 1, vocab), float32/float16/bfloat16, CUDA (or CPU under
        TRITON_INTERPRET=1).  Batch and row strides are passed to the kernel; a last
        dimension that is not unit-stride is made contiguous (one copy).
    draft_tokens : torch.Tensor
        Shape (batch, K), int32/int64, any strides.  Ids outside [0, vocab) and -1 never
        match; entries at or past a row's count are not read.
    num_draft_tokens : torch.Tensor
        Shape (batch,), int32/int64, values in 0..K (larger values act as K).
    block_v, num_splits : int, optional
        Tiling of the argmax (see ``argmax_launch_config``); for tests and tuning.

    Returns
    -------
    output_tokens : torch.Tensor
        Shape (batch, K + 1), int64: accepted drafts, the correction or bonus token, -1.
    num_accepted : torch.Tensor
        Shape (batch,), int64.

    Two launches: the split argmax over V, then one program per sequence for acceptance
    (none when batch is 0).
    """
    return _verify_greedy_triton_impl(target_logits, draft_tokens, num_draft_tokens, block_v or 0, num_splits or 0)


def _verify_greedy_flattened_triton_impl(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor],
    max_spec_len: int,
    block_v: int = 0,
    num_splits: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    B = cu_num_draft_tokens.shape[0]
    output_tokens, num_accepted = new_int64(target_logits, (B, max_spec_len + 1), (B,))
    if B == 0:
        return output_tokens, num_accepted
    # every flat row's argmax, read in place (the rows as one [1, rows, V] batch)
    cfg, partials = _split_argmax(target_logits[None], B, max_spec_len, block_v, num_splits)
    T = draft_token_ids.shape[0]
    drafts = draft_token_ids if T else dummy(target_logits, torch.int64)  # never read when T = 0
    bonus = bonus_token_ids if bonus_token_ids is not None else cu_num_draft_tokens  # unused without BONUS_IDS
    launch(_verify_greedy_accept_kernel)[cfg.grid](
        partials,
        drafts,
        0,
        drafts.stride(0),
        cu_num_draft_tokens,
        bonus,
        output_tokens,
        num_accepted,
        max_spec_len,
        cfg.argmax.splits,
        cfg.argmax.rows,
        T,
        FLAT=True,
        BONUS_IDS=bonus_token_ids is not None,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
    )
    return output_tokens, num_accepted


def verify_greedy_flattened_triton(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor],
    max_spec_len: int,
    *,
    block_v: Optional[int] = None,
    num_splits: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification in the flattened (vLLM v1) layout with the Triton kernels (the
    launcher of ``verify_greedy_flattened``'s "triton" backend).

    Inputs are assumed checked (``specdec_kernels._flattened.check_flattened_args``); the public
    ``verify_greedy_flattened(..., backend="triton")`` does that and calls this.

    Parameters
    ----------
    target_logits : torch.Tensor
        Shape (T + B, vocab) (each request's draft rows then its bonus row) or (T, vocab) with
        ``bonus_token_ids``; float32/float16/bfloat16, any row stride (a last dimension that is
        not unit-stride is made contiguous).
    draft_token_ids : torch.Tensor
        Shape (T,), int32/int64, any stride.
    cu_num_draft_tokens : torch.Tensor
        Shape (B,), int32/int64: inclusive cumsum of the draft counts (clamped into [0, T]).
    bonus_token_ids : torch.Tensor, optional
        Shape (B,), int32/int64: the bonus tokens when target_logits has T rows.
    max_spec_len : int
        Padded width of the output minus 1 (counts above it are clamped to it).
    block_v, num_splits : int, optional
        Tiling of the argmax (see ``argmax_launch_config``).

    Returns
    -------
    (output_tokens (B, max_spec_len + 1) int64 with -1 padding, num_accepted (B,) int64).

    The same two launches as ``verify_greedy_triton``: the split argmax over every flat row,
    then ``_verify_greedy_accept_kernel`` with ``FLAT=True`` (one program per request, its
    rows found from cu_num_draft_tokens).
    """
    return _verify_greedy_flattened_triton_impl(
        target_logits,
        draft_token_ids,
        cu_num_draft_tokens,
        bonus_token_ids,
        max_spec_len,
        block_v or 0,
        num_splits or 0,
    )
