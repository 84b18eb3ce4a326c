"""verify_tree_greedy: greedy acceptance of the longest matching path of a token tree.

The "triton" backend of ``ops/verify_tree_greedy.py`` (the op's other backends are listed
there): two launches, below, as ``launch_config`` says.

Triton design:

1. The per-node argmax reuses ``verify_greedy``'s split argmax
   (``verify_greedy.argmax_partials``): grid (B * N, S), each program scans one chunk of a
   node's vocabulary row and writes the chunk's (max, argmax); the split over V keeps a GPU
   busy when B * N is small.  Same ``torch.argmax`` semantics (first index of the maximum,
   NaN counts as the maximum), so every emitted id is in [0, V).
2. ``_verify_tree_greedy_walk_kernel``, grid (B,): program b first combines the partials of
   its N nodes into a vector of argmaxes held in registers (BLOCK_N lanes), then walks the
   nodes once in index order.  Because parents[i] < i, a single pass in index order meets
   every child of a node after the node itself and in increasing index: when node i is a
   child of the current node and its token equals the argmax at the current node, it is
   the lowest-index matching child, so it becomes the current node (later siblings then no
   longer have the current node as parent).  That is exactly the reference's rule, in
   O(N) scalar steps plus O(BLOCK_N) vector work per step (a lane select to read the argmax
   at node i).  The accepted path and the output tokens are built in registers and stored
   once at the end (no read-after-write through global memory inside the program).

Tree tokens and parents are only compared, never used as addresses, so out-of-range ids or
parents cannot cause out-of-bounds accesses; num_nodes is clamped to N in the kernel.
Runtime-count loops are ``tl.range`` loops (see ``verify_greedy``'s module docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton.language as tl

from specdec_kernels import _device
from specdec_kernels._device import next_pow2
from specdec_kernels._library import launch
from specdec_kernels.ops._triton.verify_greedy import (
    ArgmaxLaunch,
    _combine_partials,
    _jit,
    argmax_launch_config,
    argmax_partials,
)


@_jit
def _verify_tree_greedy_walk_kernel(
    part_ptr,  # [2, S, B * N] fp32: per-chunk maxima, then their first indices' int32 bits
    #            (verify_greedy.argmax_partials)
    tokens_ptr,  # [B, N] int32/int64 (strided)
    stride_tb,
    stride_tn,
    parents_ptr,  # [B, N] int64 (strided; batch stride 0 for one shared tree)
    stride_pb,
    stride_pn,
    num_nodes_ptr,  # [B] int64
    out_tokens_ptr,  # [B, N] int64, contiguous
    accepted_nodes_ptr,  # [B, N] int64, contiguous
    num_accepted_ptr,  # [B] int64
    N,
    S,
    BLOCK_N: tl.constexpr,  # power of two >= N
):
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    lane = tl.arange(0, BLOCK_N)
    is_node = lane < N
    target = _combine_partials(part_ptr, b * N + lane, is_node, tl.num_programs(0) * N, S)

    n = tl.minimum(tl.load(num_nodes_ptr + b), N)  # nodes at or past n do not exist
    current = tl.zeros([], dtype=tl.int64)  # the root
    want = tl.sum(tl.where(lane == 0, target, 0), axis=0)  # argmax at the current node
    depth = tl.zeros([], dtype=tl.int64)  # accepted drafts so far
    path = tl.where(lane == 0, 0, -1).to(tl.int64)  # accepted_nodes row
    out = tl.full([BLOCK_N], -1, dtype=tl.int64)  # output_tokens row
    for i in tl.range(1, n):
        parent = tl.load(parents_ptr + b64 * stride_pb + i * stride_pn).to(tl.int64)
        token = tl.load(tokens_ptr + b64 * stride_tb + i * stride_tn).to(tl.int64)
        hit = (parent == current) & (token == want)
        out = tl.where(hit & (lane == depth), token, out)
        depth += hit.to(tl.int64)
        path = tl.where(hit & (lane == depth), i, path)
        current = tl.where(hit, i, current)
        want = tl.where(hit, tl.sum(tl.where(lane == i, target, 0), axis=0), want)
    out = tl.where(lane == depth, want, out)  # the target's token after the last accepted node
    row = b64 * N + lane
    tl.store(out_tokens_ptr + row, out, mask=is_node)
    tl.store(accepted_nodes_ptr + row, path, mask=is_node)
    tl.store(num_accepted_ptr + b, depth)


@dataclass(frozen=True)
class VerifyTreeGreedyLaunch:
    """The split argmax over the B * N node rows (``argmax``), then
    ``_verify_tree_greedy_walk_kernel`` on ``grid`` (one program per sequence, ``BLOCK_N``
    node lanes, ``num_warps`` warps)."""

    argmax: ArgmaxLaunch
    grid: Tuple[int]
    block_n: int
    num_warps: int


@_device.cached_launch_config
def launch_config(
    batch: int,
    num_nodes: int,
    vocab: int,
    sm_count: Optional[int],
    *,
    block_v: Optional[int] = None,
    num_splits: Optional[int] = None,
) -> VerifyTreeGreedyLaunch:
    """The launch configuration for ``batch`` trees of ``num_nodes`` (N) nodes over ``vocab``
    entries on a GPU of ``sm_count`` SMs (None: the interpreter); ``block_v`` and
    ``num_splits``: see ``verify_greedy.argmax_launch_config``."""
    argmax = argmax_launch_config(batch * num_nodes, vocab, sm_count, block_v=block_v, num_splits=num_splits)
    return VerifyTreeGreedyLaunch(argmax, (batch,), next_pow2(num_nodes), 1 if num_nodes <= 128 else 4)


def _verify_tree_greedy_triton_impl(
    target_logits: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    num_nodes: torch.Tensor,
    block_v: int = 0,
    num_splits: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N, V = target_logits.shape
    device = target_logits.device
    output_tokens = target_logits.new_empty(B, N, dtype=torch.int64)
    accepted_nodes = target_logits.new_empty(B, N, dtype=torch.int64)
    num_accepted = target_logits.new_empty(B, dtype=torch.int64)
    if B == 0:
        return output_tokens, accepted_nodes, num_accepted
    parents = tree_parents if tree_parents.dtype == torch.int64 else tree_parents.to(torch.int64)
    parent_strides = parents.stride()
    if len(parent_strides) == 1:  # one shared tree: batch stride 0, no copy nor view
        parent_strides = (0, parent_strides[0])
    sms = _device.sm_count(device)
    if block_v or num_splits:
        cfg = launch_config(B, N, V, sms, block_v=block_v or None, num_splits=num_splits or None)
    else:  # the default tiling: a cache key without keywords (cheaper to build)
        cfg = launch_config(B, N, V, sms)
    partials = argmax_partials(target_logits, cfg.argmax)
    launch(_verify_tree_greedy_walk_kernel)[cfg.grid](
        partials,
        tree_tokens,
        *tree_tokens.stride(),
        parents,
        *parent_strides,
        num_nodes if num_nodes.dtype == torch.int64 else num_nodes.to(torch.int64),
        output_tokens,
        accepted_nodes,
        num_accepted,
        N,
        cfg.argmax.splits,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
    )
    return output_tokens, accepted_nodes, num_accepted


def verify_tree_greedy_triton(
    target_logits: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    num_nodes: torch.Tensor,
    *,
    block_v: Optional[int] = None,
    num_splits: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy token-tree verification with Triton (the launcher of ``verify_tree_greedy``'s
    "triton" backend).

    Inputs are assumed validated (``check_verify_tree_greedy_args``); the public
    ``verify_tree_greedy(..., backend="triton")`` does that and calls this.

    Parameters
    ----------
    target_logits : torch.Tensor
        Shape (batch, N, vocab), float32/float16/bfloat16, CUDA (or CPU under
        TRITON_INTERPRET=1).  Batch and row strides are passed to the kernel; a last
        dimension that is not unit-stride is made contiguous (one copy).
    tree_tokens : torch.Tensor
        Shape (batch, N), int32/int64, any strides.  Node 0 (the root) is never compared.
    tree_parents : torch.Tensor
        Shape (N,) shared by the batch or (batch, N), int32/int64, parents[0] = -1 and
        0 <= parents[i] < i (not checked here; a parent outside that range only fails to
        match).  A shared tree is read with batch stride 0, not copied.
    num_nodes : torch.Tensor
        Shape (batch,), int32/int64: nodes at or past a row's count are ignored (values
        above N act as N).  The root is always present, as in the reference.
    block_v, num_splits : int, optional
        Tiling of the argmax (see ``verify_greedy.argmax_launch_config``); for tests and tuning.

    Returns
    -------
    output_tokens : torch.Tensor
        Shape (batch, N), int64: accepted drafts, the argmax at the last accepted node, -1.
    accepted_nodes : torch.Tensor
        Shape (batch, N), int64: the accepted path's node indices from 0 (the root), -1.
    num_accepted : torch.Tensor
        Shape (batch,), int64: accepted drafts (the root not counted).

    Two launches (split argmax, then the walk with one program per sequence); none when
    batch is 0.
    """
    return _verify_tree_greedy_triton_impl(
        target_logits, tree_tokens, tree_parents, num_nodes, block_v or 0, num_splits or 0
    )
