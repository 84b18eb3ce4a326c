"""Triton helpers shared by the sampling kernels (rejection_sample, tree_rejection_sample, sampling_probs).

Every kernel here handles ``BLOCK_B`` rows (sequences) per program and walks the vocabulary
in tiles of ``BLOCK_V`` columns, so per-row state is a ``[BLOCK_B]`` vector and a tile is a
``[BLOCK_B, BLOCK_V]`` block.  On CUDA the launchers use one row per program for large
vocabularies; the Triton interpreter (CPU tensors) gets many rows per program, which keeps its
Python-level loop over programs short.

Inverse-CDF sampling without a materialised distribution (``_cdf_search_tile``): pass 1 sums
the row's weights in float64 and notes the last index with mass; pass 2 walks the tiles again
with a running float64 CDF (carry of the previous tiles plus the tile's own ``tl.cumsum``)
and stops at the first index whose CDF exceeds ``u * total`` and that has mass.  The summation
order differs from the reference's sequential ``cumsum``, so kernel and reference agree
except when ``u * total`` lies within float64 rounding of a CDF boundary.
"""
from __future__ import annotations

import triton
import triton.language as tl

NOT_FOUND = tl.constexpr(2147483647)  # int32 max: "no index found yet"


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def tile_sizes(vocab: int, rows: int, on_cuda: bool, max_tile_cuda: int = 1024) -> tuple[int, int]:
    """(BLOCK_B, BLOCK_V) for a launch over ``rows`` rows of ``vocab`` entries.

    CUDA: up to ``max_tile_cuda`` elements per tile, one row per program unless the vocabulary
    is small.  Interpreter: up to 4096 columns and 2**17 elements per tile (numpy-vectorised),
    so that a batch of 20,000 rows runs in a few dozen programs.
    """
    if on_cuda:
        block_v = max(16, min(next_pow2(vocab), max_tile_cuda))
        block_b = max(1, min(next_pow2(max(rows, 1)), max_tile_cuda // block_v, 16))
    else:
        block_v = max(16, min(next_pow2(vocab), 4096))
        block_b = max(1, min(next_pow2(max(rows, 1)), (1 << 17) // block_v))
    return block_b, block_v


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
def _cdf_search_tile(w, offs, carry, threshold, found):
    """One tile of the inverse-CDF search.

    Args:
        w: [BB, BV] float64 weights (0 outside the vocabulary).
        offs: [BV] int32 column indices of the tile.
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
    cand = tl.min(tl.where(hit, offs[None, :], NOT_FOUND), axis=1)
    return carry + tl.sum(w, axis=1), tl.minimum(found, cand)


@triton.jit
def _pick_token(found, last, total):
    """The sampled token: the found index, else (rounding overshoot) the last index with mass,
    and 0 for a row without mass.  Returns int64."""
    tok = tl.where(found != NOT_FOUND, found, last)
    return tl.where(total > 0, tok, 0).to(tl.int64)


@triton.jit
def _row_mass_total(row_ptrs, rmask, V, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    """float64 sum of mass(row) for each of the [BB] rows at ``row_ptrs`` (rows off ``rmask`` give 0)."""
    total = tl.zeros([BLOCK_B], dtype=tl.float64)
    start = tl.program_id(0) * 0
    while start < V:
        offs = start + tl.arange(0, BLOCK_V)
        m2 = rmask[:, None] & (offs < V)[None, :]
        x = tl.load(row_ptrs[:, None] + offs[None, :], mask=m2, other=0.0)
        total += tl.sum(_mass64(x), axis=1)
        start += BLOCK_V
    return total
