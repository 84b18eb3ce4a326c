"""A paged KV cache with prefix sharing for the decode engine (target model and model drafters).

Layout (vLLM's and FlashInfer's NHD pages): one pool ``[L, 2, num_blocks, block_size, Hkv,
D]`` and a block table ``[B, max_blocks_per_seq]`` int32; logical slot ``s`` of sequence
``b`` lives in block ``block_table[b, s // block_size]`` at offset ``s % block_size``.  The
model writes new keys and values through the table and attends with
``tree_attention(..., block_table=...)``; accepted tree paths are compacted with
``compact_kv_cache(..., block_table=...)``.  Block 0 is the null block (as in vLLM): table
entries past a sequence's capacity point at it, and writes there (prefill padding) are never
read as visible keys.

Prefix sharing (as SGLang's RadixAttention and vLLM's automatic prefix caching do across
requests, here within one batch): :func:`plan_prefix_sharing` gives every prompt either no
source (a *leader*, prefilled from position 0) or a leader whose prompt shares its first
``shared[b]`` tokens.  A follower's table starts with the leader's full blocks of that prefix
(the same physical blocks, computed once); the block in which the shared prefix ends, if it
ends mid-block, is copied into the follower's own block once the leader has been prefilled
(copy-on-write: the follower is about to write its own tokens there).  Blocks a sequence
writes after its prefill (draft trees, compaction) are always its own: shared blocks hold
only slots below ``shared[b] <= cache_seqlens[b]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from specdec_kernels import compact_kv_cache

NULL_BLOCK = 0
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class CacheLayout:
    """How the engine and its model drafters lay out their KV caches.

    Attributes:
        paged: a block pool and block tables (True) or one dense ``[L, 2, B, Hkv, S, D]``
            tensor (False).
        block_size: slots per block (paged only), 1..256.
        share_prefix: prompts of a batch that start with the same tokens share the KV blocks
            of that prefix, computed once (paged only).
        min_shared_tokens: the shortest common prefix worth sharing (default one block).
    """

    paged: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE
    share_prefix: bool = False
    min_shared_tokens: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be an int in 1..256, got {self.block_size!r}")
        if self.share_prefix and not self.paged:
            raise ValueError("share_prefix needs the paged KV cache (paged=True)")
        if self.min_shared_tokens is not None and self.min_shared_tokens < 1:
            raise ValueError(f"min_shared_tokens must be >= 1 or None, got {self.min_shared_tokens}")


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens two token lists share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def plan_prefix_sharing(prefixes: Sequence[Sequence[int]], min_shared: int) -> Tuple[List[int], List[int]]:
    """Which sequence takes which prefix from which leader.

    Greedy, in batch order: a sequence becomes a follower of the earlier leader with which
    it shares the longest prefix, when that prefix has at least ``min_shared`` tokens; else
    it is a leader itself.  (Followers never serve as sources, so two prefill phases suffice:
    leaders, then followers.)

    Args:
        prefixes: per sequence, the tokens its cache will hold after the prefill.
        min_shared: the shortest prefix worth sharing, >= 1.

    Returns:
        (source, shared): per sequence, the leader's index (-1 for a leader) and the number
        of leading tokens whose K/V come from it (0 for a leader).
    """
    source, shared, leaders = [], [], []
    for b, p in enumerate(prefixes):
        best, best_len = -1, 0
        for a in leaders:
            n = common_prefix_length(prefixes[a], p)
            if n > best_len:
                best, best_len = a, n
        if best >= 0 and best_len >= min_shared:
            source.append(best)
            shared.append(best_len)
        else:
            source.append(-1)
            shared.append(0)
            leaders.append(b)
    return source, shared


def length_groups(rows: Sequence[int], lengths: Sequence[int], slack: float = 1.25, spare: int = 16) -> List[List[int]]:
    """Split ``rows`` into groups fed together, so that padding every row of a group to the
    group's longest wastes little: longest first, a row joins the current group while the
    group's longest is at most ``slack * length + spare``.  Rows of length 0 are left out.

    Args:
        rows: sequence indices.
        lengths: tokens to feed, indexed by sequence.
        slack, spare: the padding tolerated (a ratio and a number of tokens).

    Returns:
        Groups of sequence indices, each in descending length order.
    """
    groups: List[List[int]] = []
    for b in sorted((b for b in rows if lengths[b] > 0), key=lambda b: -lengths[b]):
        if groups and lengths[groups[-1][0]] <= slack * lengths[b] + spare:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


class PagedKVCache:
    """A block pool, block tables and the prefix-sharing plan of one batch (see the module doc).

    Attributes:
        pool: ``[L, 2, num_blocks, block_size, Hkv, D]``, the model's dtype and device
            (keys at ``[:, 0]``, values at ``[:, 1]``); block 0 is the null block.
        block_table: ``[B, max_blocks_per_seq]`` int32 on the pool's device.
        block_size: slots per block.
        source, shared: the prefix-sharing plan (``plan_prefix_sharing``); all -1 / 0 without
            sharing.
        blocks: per sequence, its physical blocks in logical order (a list of ints).
    """

    def __init__(
        self,
        pool: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        source: List[int],
        shared: List[int],
        blocks: List[List[int]],
    ):
        self.pool = pool
        self.block_table = block_table
        self.block_size = block_size
        self.source = source
        self.shared = shared
        self.blocks = blocks

    @classmethod
    def allocate(
        cls,
        model,
        prefixes: Sequence[Sequence[int]],
        capacity: int,
        layout: CacheLayout,
        num_layers: Optional[int] = None,
    ) -> "PagedKVCache":
        """Pool and block tables for ``len(prefixes)`` sequences of ``capacity`` slots each.

        Every sequence gets ``ceil(capacity / block_size)`` logical blocks; with
        ``layout.share_prefix``, a follower's first ``shared // block_size`` of them are its
        leader's (allocated once).  The pool is zeroed.

        Args:
            model: the ``Transformer`` whose dtype, device, heads and head dim are used.
            prefixes: per sequence, the tokens its cache will hold after the prefill.
            capacity: logical slots per sequence.
            layout: a paged ``CacheLayout``.
            num_layers: layers to hold (default all of the model's).
        """
        bs = layout.block_size
        B = len(prefixes)
        per_seq = -(-capacity // bs)
        if layout.share_prefix:
            source, shared = plan_prefix_sharing(prefixes, layout.min_shared_tokens or bs)
        else:
            source, shared = [-1] * B, [0] * B
        blocks: List[List[int]] = []
        next_block = 1  # 0 is the null block
        for b in range(B):
            own_from = shared[b] // bs if source[b] >= 0 else 0
            row = list(blocks[source[b]][:own_from]) if own_from else []
            row += list(range(next_block, next_block + per_seq - own_from))
            next_block += per_seq - own_from
            blocks.append(row)
        a = model.args
        L = a.num_layers if num_layers is None else num_layers
        pool = torch.zeros(L, 2, next_block, bs, a.num_kv_heads, a.head_dim, dtype=model.dtype, device=model.device)
        table = torch.tensor(blocks, dtype=torch.int32).reshape(B, per_seq).to(model.device)
        return cls(pool, table, bs, source, shared, blocks)

    # ------------------------------------------------------------------ views
    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def capacity(self) -> int:
        """Logical slots per sequence."""
        return self.block_table.shape[1] * self.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (allocated once: also the peak)."""
        return self.pool.numel() * self.pool.element_size()

    @property
    def leaders(self) -> List[int]:
        return [b for b, s in enumerate(self.source) if s < 0]

    @property
    def followers(self) -> List[int]:
        return [b for b, s in enumerate(self.source) if s >= 0]

    def rows(self, index: Sequence[int]) -> "PagedKVCache":
        """The same pool with the block tables of the sequences ``index`` only (a sub-batch)."""
        idx = list(index)
        return PagedKVCache(
            self.pool,
            self.block_table[torch.tensor(idx, dtype=torch.int64, device=self.block_table.device)],
            self.block_size,
            [self.source[b] for b in idx],
            [self.shared[b] for b in idx],
            [self.blocks[b] for b in idx],
        )

    def physical_slots(self, cache_seqlens: torch.Tensor, num_new: int) -> torch.Tensor:
        """Flat pool slots ``block * block_size + offset`` of the logical slots
        ``cache_seqlens[b] .. + num_new - 1``: int64 ``[B * num_new]``.  Slots past a
        sequence's capacity map into the null block (written, never read as visible)."""
        bs = self.block_size
        width = self.block_table.shape[1]
        slots = cache_seqlens.to(torch.int64)[:, None] + torch.arange(num_new, device=cache_seqlens.device)
        col = slots // bs
        inside = col < width
        block = self.block_table.to(torch.int64).gather(1, col.clamp(max=width - 1))
        block = torch.where(inside, block, NULL_BLOCK)
        return (block * bs + torch.where(inside, slots % bs, 0)).reshape(-1)

    # ------------------------------------------------------------------ sharing
    def copy_shared_tails(self) -> int:
        """Copy-on-write of every follower's partly shared block: the leader's block in which
        the shared prefix ends mid-block becomes the follower's own copy.  Call once, after
        the leaders' prefill and before the followers'.  Returns the blocks copied."""
        copied = 0
        bs = self.block_size
        for b, src in enumerate(self.source):
            if src < 0 or self.shared[b] % bs == 0:
                continue
            j = self.shared[b] // bs
            self.pool[:, :, self.blocks[b][j]] = self.pool[:, :, self.blocks[src][j]]
            copied += 1
        return copied

    def prefill_starts(self) -> List[int]:
        """Per sequence, the first position its own prefill computes (0 for leaders)."""
        return list(self.shared)

    # ------------------------------------------------------------------ after verification
    def compact(self, cache_seqlens: torch.Tensor, accepted_indices: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Move the accepted tree nodes' K/V into place (``compact_kv_cache`` through the block
        table, every layer in one call)."""
        compact_kv_cache(
            self.pool,
            cache_seqlens,
            accepted_indices,
            num_accepted,
            block_table=self.block_table,
            kv_layout="NHD",
            validate=False,
        )  # the engine keeps its writes in private blocks (copy-on-write)
