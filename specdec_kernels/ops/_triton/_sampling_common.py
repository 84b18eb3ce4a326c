"""Triton helpers shared by the sampling kernels (rejection_sample, tree_rejection_sample,
sampling_probs), and the vocabulary tiling and split their launchers share (``vocab_split``).

Every kernel here handles ``BLOCK_B`` rows (sequences) per program and walks the vocabulary
in tiles of ``BLOCK_V`` columns, so per-row state is a ``[BLOCK_B]`` vector and a tile is a
``[BLOCK_B, BLOCK_V]`` block.  On CUDA the launchers use one row per program for large
vocabularies; the Triton interpreter (CPU tensors) gets many rows per program, which keeps its
Python-level loop over programs short.

Inverse-CDF sampling without a materialised distribution: a first launch sums each
vocabulary chunk's weights in float64 and notes its last index with mass
(``_store_chunk_partials``); the sampling kernel finds the chunk that holds ``u * total``
from those sums (``_find_chunk``), then walks that chunk's tiles with a running float64 CDF
(``_cdf_search_tile``: the carry of the previous tiles plus the tile's own ``tl.cumsum``) and
stops at the first index whose CDF exceeds ``u * total`` and that has mass.  The summation
order differs from the reference's sequential ``cumsum``, so kernel and reference agree
except when ``u * total`` lies within float64 rounding of a CDF boundary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import triton
import triton.language as tl
from triton.language.extra import libdevice

from specdec_kernels._device import cdiv, next_pow2
from specdec_kernels.ops._triton._uniforms import _final_uniform

NOT_FOUND = tl.constexpr(2147483647)  # int32 max: "no index found yet"

# Compiled kernels (not the interpreter, which has no libdevice) round a product that feeds an
# add or subtract on its own (``_mul_rn``): Triton's CUDA backend contracts a * b - c into one
# FMA by default (``enable_fp_fusion``; LLVM and ptxas ``--fmad``), which rounds once where
# the reference rounds twice.  A launch option would not do: torch.compile's Inductor drops it
# from user kernels.
ROUNDED_MUL = tl.constexpr(not triton.knobs.runtime.interpret)

# Programs per SM that a vocabulary split aims for on CUDA (enough to hide memory latency).
PROGRAMS_PER_SM = 8


def split_vocab(
    num_tiles: int, row_programs: int, sm_count: Optional[int], num_splits: Optional[int] = None
) -> Tuple[int, int]:
    """(S, tiles_per_split): how many chunks each row's ``num_tiles`` vocabulary tiles are
    cut into, so that ``row_programs * S`` programs fill a GPU of ``sm_count`` SMs (about
    ``PROGRAMS_PER_SM`` per SM) even at batch 1.  Every chunk gets at least one tile; chunk s
    covers lower columns than chunk s + 1.  ``num_splits`` overrides the choice; in the
    interpreter (``sm_count`` None) the default is 1."""
    wanted = num_splits
    if not wanted:
        wanted = cdiv(PROGRAMS_PER_SM * sm_count, max(row_programs, 1)) if sm_count is not None else 1
    num_tiles = max(int(num_tiles), 1)
    tiles_per_split = cdiv(num_tiles, max(1, min(int(wanted), num_tiles)))
    return cdiv(num_tiles, tiles_per_split), tiles_per_split


def tile_sizes(vocab: int, rows: int, gpu: bool, max_tile_cuda: int = 1024) -> Tuple[int, int]:
    """(BLOCK_B, BLOCK_V) for a launch over ``rows`` rows of ``vocab`` entries.

    GPU: up to ``max_tile_cuda`` elements per tile, one row per program unless the vocabulary
    is small.  Interpreter: up to 4096 columns and 2**17 elements per tile (numpy-vectorised),
    so that a batch of 20,000 rows runs in a few dozen programs.
    """
    if gpu:
        block_v = max(16, min(next_pow2(vocab), max_tile_cuda))
        block_b = max(1, min(next_pow2(max(rows, 1)), max_tile_cuda // block_v, 16))
    else:
        block_v = max(16, min(next_pow2(vocab), 4096))
        block_b = max(1, min(next_pow2(max(rows, 1)), (1 << 17) // block_v))
    return block_b, block_v


@dataclass(frozen=True)
class VocabSplit:
    """A launch over (row blocks, vocabulary chunks): ``BLOCK_B`` rows and ``BLOCK_V`` columns
    a tile, ``splits`` chunks of ``tiles_per_split`` tiles per row."""

    block_b: int
    block_v: int
    row_blocks: int
    splits: int
    tiles_per_split: int

    @functools.cached_property  # computed once per (cached) configuration
    def grid(self) -> Tuple[int, int]:
        return self.row_blocks, self.splits

    @functools.cached_property  # computed once per (cached) configuration
    def block_s(self) -> int:
        """BLOCK_S of a kernel that reads the chunks' partials as one vector: a power of two >= 2."""
        return max(2, next_pow2(self.splits))


def vocab_split(
    vocab: int,
    rows: int,
    sm_count: Optional[int],
    *,
    max_tile_cuda: int = 1024,
    tile: Optional[Tuple[int, int]] = None,
    num_splits: Optional[int] = None,
) -> VocabSplit:
    """The tiles (``tile_sizes``) and chunks (``split_vocab``) of a launch over ``rows`` rows of
    ``vocab`` entries on a GPU of ``sm_count`` SMs (None: the interpreter).

    ``tile`` = (BLOCK_B, BLOCK_V) (powers of two, BLOCK_V >= 16) and ``num_splits`` override
    the choice: how the tests drive the multi-row, multi-tile and multi-chunk paths on small
    inputs.
    """
    if tile is None:
        block_b, block_v = tile_sizes(vocab, rows, sm_count is not None, max_tile_cuda)
    else:
        block_b, block_v = tile
        if block_b & (block_b - 1) or block_v & (block_v - 1) or block_b < 1 or block_v < 16:
            raise ValueError(f"tile must be two powers of two (BLOCK_V >= 16), got {tile}")
    row_blocks = cdiv(rows, block_b)
    splits, tiles_per_split = split_vocab(cdiv(vocab, block_v), row_blocks, sm_count, num_splits)
    return VocabSplit(block_b, block_v, row_blocks, splits, tiles_per_split)


@triton.jit
def _mul_rn(a, b):
    """a * b rounded to nearest as one IEEE multiplication (``mul.rn``), never fused with a
    following add or subtract into an FMA, so that ``_mul_rn(a, b) - c`` rounds twice, as
    PyTorch's separate ops do.  Same dtype (float32 or float64), broadcast shapes."""
    if ROUNDED_MUL:
        a, b = tl.broadcast(a, b)
        return libdevice.mul_rn(a, b)
    else:
        return a * b


@triton.jit
def _mass64(x):
    """Sampling weight in float64: negative entries and NaN carry no mass."""
    x = x.to(tl.float64)
    return tl.where(x > 0, x, 0.0)


@triton.jit
def _last_with_mass(w, offs, last):
    """Running maximum of the column index that has mass; ``w`` [BB, BV], ``last`` [BB] int32."""
    return tl.maximum(last, tl.max(tl.where(w > 0, offs[None, :], -1), axis=1))


@triton.jit
def _cdf_search_tile(w, cols, carry, threshold, found):
    """One tile of the inverse-CDF search.

    Args:
        w: [BB, BV] float64 weights (0 outside the range searched).
        cols: [BB, BV] int32 column indices of the tile (each row's own).
        carry: [BB] float64 CDF before this tile.
        threshold: [BB] float64, u * total.
        found: [BB] int32, the first index found so far or NOT_FOUND.

    Returns:
        (carry after this tile, found): the first index with mass whose CDF exceeds the
        threshold (a zero-mass index is never chosen, even where rounding of the tile scan
        would put it past the threshold).
    """
    cdf = carry[:, None] + tl.cumsum(w, axis=1)
    hit = (cdf > threshold[:, None]) & (w > 0)
    found = tl.minimum(found, tl.min(tl.where(hit, cols, NOT_FOUND), axis=1))
    return carry + tl.sum(w, axis=1), found


@triton.jit
def _pick_token(found, last, total):
    """The sampled token: the found index, else (rounding overshoot) the last index with mass,
    and 0 for a row without mass.  Returns int64."""
    tok = tl.where(found != NOT_FOUND, found, last)
    return tl.where(total > 0, tok, 0).to(tl.int64)


@triton.jit
def _no_chunk_partials(BLOCK_B: tl.constexpr):
    """The running partials of a chunk of two weight rows before its first tile: (mass0, mass1)
    [BB] float64 zeros and (last0, last1) [BB] int32 -1 (no index with mass yet)."""
    mass0 = tl.zeros([BLOCK_B], dtype=tl.float64)
    mass1 = tl.zeros([BLOCK_B], dtype=tl.float64)
    last0 = tl.full([BLOCK_B], -1, tl.int32)
    last1 = tl.full([BLOCK_B], -1, tl.int32)
    return mass0, mass1, last0, last1


@triton.jit
def _add_chunk_partials(partials, w0, w1, offs):
    """``partials`` (``_no_chunk_partials``) after one tile of the two weight rows ``w0`` and
    ``w1`` [BB, BV] (float64) at the columns ``offs`` [BV]: masses summed, tile by tile."""
    mass0, mass1, last0, last1 = partials
    mass0 += tl.sum(w0, axis=1)
    mass1 += tl.sum(w1, axis=1)
    last0 = _last_with_mass(w0, offs, last0)
    last1 = _last_with_mass(w1, offs, last1)
    return mass0, mass1, last0, last1


@triton.jit
def _chunk_lasts(part_ptr, S, B):
    """The int32 [2, S, B] table of last indices inside the chunk partials ``part_ptr`` (one
    float64 [3, S, B] workspace: the [2, S, B] masses, then the indices' bits)."""
    return (part_ptr + 2 * S * B).to(tl.pointer_type(tl.int32), bitcast=True)  # 3 * S * B < 2**31


@triton.jit
def _store_chunk_partials(part_ptr, split, S, B, rows, rmask, partials):
    """Store chunk ``split``'s ``partials`` (``_add_chunk_partials``: the masses and last indices
    with mass of two weight rows), for the [BB] rows ``rows``, into the workspace ``part_ptr``
    (float64 [3, S, B]: [2, S, B] masses, then [2, S, B] int32 indices, ``_chunk_lasts``)."""
    mass0, mass1, last0, last1 = partials
    part_mass_ptr = part_ptr
    part_last_ptr = _chunk_lasts(part_ptr, S, B)
    at = split.to(tl.int64) * B + rows.to(tl.int64)
    tl.store(part_mass_ptr + at, mass0, mask=rmask)
    tl.store(part_mass_ptr + S * B + at, mass1, mask=rmask)
    tl.store(part_last_ptr + at, last0, mask=rmask)
    tl.store(part_last_ptr + S * B + at, last1, mask=rmask)


@triton.jit
def _load_chunk_partials(part_ptr, S, B, rows64, rmask, BLOCK_S: tl.constexpr):
    """The workspace of ``_store_chunk_partials`` for the [BB] rows: (mass0, mass1)
    [BB, BLOCK_S] float64 in chunk order (0 past S), and (last0, last1) [BB] int32, the rows'
    last indices with mass (-1: none)."""
    part_mass_ptr = part_ptr
    part_last_ptr = _chunk_lasts(part_ptr, S, B)
    cs = tl.arange(0, BLOCK_S)
    at = cs[None, :] * B + rows64[:, None]
    m2 = rmask[:, None] & (cs < S)[None, :]
    # the indices first: reduced at once, they hold few registers while the masses load
    last0 = tl.max(tl.load(part_last_ptr + at, mask=m2, other=-1), axis=1)
    last1 = tl.max(tl.load(part_last_ptr + S * B + at, mask=m2, other=-1), axis=1)
    mass0 = tl.load(part_mass_ptr + at, mask=m2, other=0.0)
    mass1 = tl.load(part_mass_ptr + S * B + at, mask=m2, other=0.0)
    return mass0, mass1, last0, last1


@triton.jit
def _find_chunk(w_s, cum, threshold, searching, BLOCK_S: tl.constexpr):
    """The chunk that holds the inverse-CDF threshold: the first chunk with mass whose running
    sum ``cum`` (inclusive cumsum of the chunk masses ``w_s`` [BB, BLOCK_S]) exceeds
    ``threshold`` [BB].  Returns (chunk [BB] int32, -1 if none; the mass before it [BB];
    ``searching`` narrowed to the rows that have a chunk)."""
    cs = tl.arange(0, BLOCK_S)
    hit_s = (w_s > 0) & (cum > threshold[:, None]) & searching[:, None]
    chunk = tl.min(tl.where(hit_s, cs[None, :], NOT_FOUND), axis=1)
    base = tl.sum(tl.where(cs[None, :] < chunk[:, None], w_s, 0.0), axis=1)
    chunk = tl.where(chunk == NOT_FOUND, -1, chunk)
    return chunk, base, searching & (chunk >= 0)


@triton.jit
def _start_search(
    use0,
    partials,
    final_u_ptr,
    rows64,
    key,
    live,
    TILES_PER_SPLIT,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PHILOX_FINAL: tl.constexpr,
):
    """The start of the inverse-CDF search of the [BB] rows over their weight row 0 (the
    residual) where ``use0``, else row 1 (the target row), from the chunks' ``partials``
    (``_load_chunk_partials``): ``u * total`` with the ``live`` rows' uniforms
    (``_uniforms._final_uniform``: read from ``final_u_ptr``, or with PHILOX_FINAL computed
    from ``key`` = (seed, offset); clamped into [0, 1)), then the chunk that holds it
    (``_find_chunk``).

    Returns (total, last, threshold, searching, lo, carry, found): the row's mass and last
    index with mass, the threshold, the rows that have a chunk to search, the first column of
    that chunk (of ``TILES_PER_SPLIT`` tiles of ``BLOCK_V``), and the state of
    ``_cdf_search_tile`` before its first tile."""
    mass0, mass1, last0, last1 = partials
    w_s = tl.where(use0[:, None], mass0, mass1)  # [BB, BLOCK_S]: the sampled row's chunk masses
    cum = tl.cumsum(w_s, axis=1)  # inclusive, in chunk order
    total = tl.max(cum, axis=1)  # the last chunk's running sum (masses are >= 0)
    last = tl.where(use0, last0, last1)
    # the first chunk where the running CDF exceeds u * total (and that has mass)
    u_final = _final_uniform(final_u_ptr, rows64, key[0], key[1], live, PHILOX_FINAL)
    threshold = u_final.to(tl.float64) * total
    chunk, base, searching = _find_chunk(w_s, cum, threshold, live & (total > 0), BLOCK_S)
    found = tl.full(total.shape, NOT_FOUND, tl.int32)
    lo = tl.maximum(chunk, 0) * (TILES_PER_SPLIT * BLOCK_V)
    return total, last, threshold, searching, lo, base, found
