"""tree_attention's launch configuration and mask kinds, without importing triton.

The front (``ops/tree_attention.py``) needs the mask kinds, the split bound and the
flash-decoding split heuristic at import or on every call, and must not import triton; the
Triton launcher (``ops/_triton/tree_attention.py``) launches with ``launch_config``, and
``specdec_kernels/bench/static.py`` asks it for the configurations of a GPU that is not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from specdec_kernels import _device
from specdec_kernels._device import cdiv, next_pow2

# how the kernel reads tree_mask: the causal chain (no mask), bool [.., N, N], bit-packed int32
MASK_CAUSAL, MASK_BOOL, MASK_PACKED = 0, 1, 2
MAX_SPLITS = 256
# keys of the prefix a split holds at least: a shorter prefix runs fewer splits (in the kernel,
# from cache_seqlens, no host read), so that partials cost at most a fraction of the KV read
MIN_SPLIT_KEYS = 256


def block_sizes(M: int, D: int, gpu: bool, ieee: bool = False) -> Tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) of the forward kernel for G * N = M query rows and
    head dim D, on a GPU or (``gpu`` False) in the interpreter; ``ieee``: float32 inputs with
    full-precision dots (no tensor cores)."""
    block_d = max(16, next_pow2(D))
    if gpu:
        # chosen with the static report (python -m specdec_kernels.bench.kernels --static): 32-key tiles, and
        # 8 warps for 32 rows or more (16 rows and 8 warps at D = 256), so that no bf16/fp16
        # configuration spills registers on sm_80 / sm_90 (64-key tiles spilled at D = 64 and D = 128); the
        # float32 IEEE dots hold much more per thread: 16 x 16 tiles (at D = 256
        # they still spill, about 450 bytes per thread: an exactness path, not a fast one)
        if ieee:
            return 16, 16, block_d, 4
        if block_d > 128:
            return 16, 32, block_d, 8
        block_m = min(64, max(16, next_pow2(M)))
        block_n = 32
        num_warps = 8 if block_m >= 32 else 4
    else:  # interpreter: fewer, larger tiles run faster
        block_m = min(128, max(16, next_pow2(M)))
        block_n = 64
        num_warps = 4
    return block_m, block_n, block_d, num_warps


@dataclass(frozen=True)
class TreeAttentionLaunch:
    """The launches of one call: ``_tree_attention_fwd_kernel`` on ``grid`` (sequence x KV
    head, row tiles, splits) and, when ``num_splits`` > 1, ``_tree_attention_combine_kernel``
    on ``combine_grid`` (``BLOCK_R`` rows a program).

    ``num_splits`` is the most splits a sequence uses: the kernels give a sequence of prefix
    length L ``active_splits(L, num_splits, block_n, min_split_keys)`` of them, and the
    splits past those write nothing (``split_layout``)."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_splits: int
    grid: Tuple[int, int, int]
    combine_block_r: int
    combine_grid: Optional[Tuple[int]]
    combine_num_warps: int = 4
    min_split_keys: int = MIN_SPLIT_KEYS


@_device.cached_launch_config
def launch_config(
    batch: int,
    kv_heads: int,
    num_queries: int,
    group: int,
    head_dim: int,
    sm_count: Optional[int],
    *,
    capacity: int = 0,
    ieee: bool = False,
    num_splits: Optional[int] = None,
    min_split_keys: int = MIN_SPLIT_KEYS,
) -> TreeAttentionLaunch:
    """The launch configuration of tree attention.

    Args:
        batch, kv_heads, num_queries, group, head_dim: B, Hkv, N, G = H / Hkv and D.
        sm_count: the GPU's SM count, or None for the interpreter (``specdec_kernels._device``).
        capacity: cache slots per sequence (bounds the automatic split).
        ieee: float32 inputs (full-precision dots).
        num_splits: the prefix split (1..MAX_SPLITS), the most splits a sequence uses;
            None chooses it.
        min_split_keys: prefix keys per split at least (>= 1): a sequence of prefix length L
            uses ``active_splits`` of the ``num_splits`` splits, chosen in the kernels from
            ``cache_seqlens`` (the tests lower it to drive several splits on short prefixes).

    The automatic split (flash-decoding): on a GPU, when ``batch * kv_heads * row_tiles``
    programs are fewer than the SMs, split the prefix so that about two programs run per SM,
    keeping at least 256 cache slots of capacity per split.  The capacity bounds the split
    (the real lengths would need a device sync); the kernels then use only as many splits as
    the sequence's length fills with ``min_split_keys`` keys each, and the others write
    nothing.  In the interpreter 1.
    """
    gpu = sm_count is not None
    M = group * num_queries
    block_m, block_n, block_d, num_warps = block_sizes(M, head_dim, gpu, ieee)
    row_tiles = cdiv(M, block_m)
    if num_splits is None:
        num_splits = 1
        programs = max(1, batch * kv_heads * row_tiles)
        if gpu and programs < sm_count:
            num_splits = max(1, min(cdiv(2 * sm_count, programs), capacity // 256, 64))
    block_r = 16 if gpu else 64
    combine_grid = (cdiv(batch * kv_heads * M, block_r),) if num_splits > 1 else None
    grid = (batch * kv_heads, row_tiles, num_splits)
    return TreeAttentionLaunch(
        block_m,
        block_n,
        block_d,
        num_warps,
        num_splits,
        grid,
        block_r,
        combine_grid,
        min_split_keys=max(1, min_split_keys),
    )


def split_layout(seqlen: int, num_splits: int, block_n: int, min_split_keys: int = MIN_SPLIT_KEYS) -> Tuple[int, int]:
    """(chunk, active): how the kernels cut a prefix of ``seqlen`` keys (the host-side mirror of
    ``_split_layout`` in ``ops/_triton/tree_attention.py``).

    The prefix is cut into ``n = clamp(seqlen // min_split_keys, 1, num_splits)`` parts of
    ``chunk`` keys (``ceil(seqlen / n)`` rounded up to ``block_n``); the first ``active`` splits
    (at least 1) hold keys, the last of them also the tree's own keys; the splits from
    ``active`` on write no partials, and the combine reads only the first ``active``.  When
    ``seqlen >= num_splits * min_split_keys`` the cut is the one of a split by ``num_splits``
    alone (the layout before the split count followed the lengths).
    """
    seqlen = max(int(seqlen), 0)
    n = min(max(seqlen // max(int(min_split_keys), 1), 1), int(num_splits))
    chunk = cdiv(cdiv(seqlen, n), block_n) * block_n
    active = max(cdiv(seqlen, chunk), 1) if chunk else 1
    return chunk, active


def active_splits(seqlen: int, num_splits: int, block_n: int, min_split_keys: int = MIN_SPLIT_KEYS) -> int:
    """The splits that a sequence of prefix length ``seqlen`` uses (see ``split_layout``)."""
    return split_layout(seqlen, num_splits, block_n, min_split_keys)[1]


def choose_num_splits(
    batch: int,
    kv_heads: int,
    num_queries: int,
    group: int,
    capacity: int,
    head_dim: int,
    device: torch.device,
    ieee: bool = False,
) -> int:
    """The automatic prefix split of ``launch_config`` on ``device`` (1 off CUDA)."""
    return launch_config(
        batch, kv_heads, num_queries, group, head_dim, _device.sm_count(device), capacity=capacity, ieee=ieee
    ).num_splits
