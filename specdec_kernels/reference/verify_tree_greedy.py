"""Reference greedy verification of a token tree (plain PyTorch)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_counts, check_parents, check_shape, check_tensor


def check_verify_tree_greedy_args(target_logits, tree_tokens, tree_parents, num_nodes, validate=None):
    """Validate the arguments of ``verify_tree_greedy``; return (B, N, V, parents [B, N], num_nodes [B])."""
    check_tensor("target_logits", target_logits, ndim=3, dtypes=FLOAT_DTYPES)
    device = target_logits.device
    B, N, V = target_logits.shape
    if N < 1:
        raise ValueError(f"target_logits must have N >= 1 rows (the root at least), got shape {tuple(target_logits.shape)}")
    if V < 1:
        raise ValueError(f"target_logits must have a vocabulary of at least 1, got shape {tuple(target_logits.shape)}")
    check_tensor("tree_tokens", tree_tokens, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_shape("tree_tokens", tree_tokens, (B, N), "one token per tree node, like target_logits' rows")
    parents = check_parents("tree_parents", tree_parents, B, N, device, validate)
    n = check_counts("num_nodes", num_nodes, B, N, device, validate)
    return B, N, V, parents, n


def _verify_tree_greedy(target_logits, tree_tokens, parents, num_nodes):
    """One pass over the nodes in index order.  Children come after their parent (parents[i] <
    i), so the pass meets a node's children after the node and lowest index first: node j is
    accepted when its parent is the current node and its token is the target's argmax there,
    which is the lowest-index matching child.  With parents out of order (unchecked input) a
    node is only ever accepted after its parent, so the accepted path is always increasing."""
    B, N, _ = target_logits.shape
    device = target_logits.device
    target_argmax = target_logits.argmax(dim=-1)  # [B, N]; NaN counts as the maximum
    tokens = tree_tokens.to(torch.int64)
    current = torch.zeros(B, dtype=torch.int64, device=device)
    want = target_argmax[:, 0].clone()
    num_accepted = torch.zeros(B, dtype=torch.int64, device=device)
    accepted_nodes = torch.full((B, N), -1, dtype=torch.int64, device=device)
    accepted_nodes[:, 0] = 0
    for j in range(1, N):  # tensor ops only: no value is read on the host
        hit = (parents[:, j] == current) & (j < num_nodes) & (tokens[:, j] == want)
        num_accepted += hit.to(torch.int64)
        at = num_accepted[:, None]
        accepted_nodes.scatter_(1, at, torch.where(hit[:, None], j, accepted_nodes.gather(1, at)))
        current = torch.where(hit, j, current)
        want = torch.where(hit, target_argmax[:, j], want)
    output_tokens = torch.full((B, N), -1, dtype=torch.int64, device=device)
    path = accepted_nodes[:, 1:]
    output_tokens[:, : N - 1] = torch.where(path >= 0, tokens.gather(1, path.clamp(min=0)), -1)
    output_tokens.scatter_(1, num_accepted[:, None], want[:, None])
    return output_tokens, accepted_nodes, num_accepted


def verify_tree_greedy(
    target_logits: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    num_nodes: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification of a token tree (reference).

    Tree verification as in SpecInfer (Miao et al. 2024) and Medusa (Cai et al. 2024) at
    temperature 0: starting at the root, move to the first child (lowest node index) whose
    token equals the target's argmax at the current node; stop when no child does.  The
    argmax at the last accepted node is emitted after the accepted drafts.

    Args:
        target_logits: Shape (batch, N, vocab), float32/float16/bfloat16.  Row i scores the
            token after node i.
        tree_tokens: Shape (batch, N), int32/int64.  Node 0 is the root (the last committed
            token, never compared); nodes 1.. are draft tokens in topological order.
        tree_parents: Shape (N,) shared by the batch or (batch, N), int32/int64, with
            parents[0] = -1 and 0 <= parents[i] < i.
        num_nodes: Shape (batch,), int32/int64 in 0..N, or None for all N.  Nodes at or past
            a row's count are ignored.

    Returns:
        output_tokens: Shape (batch, N), int64: accepted drafts, the target's token at the
            last accepted node, then -1.
        accepted_nodes: Shape (batch, N), int64: node indices of the accepted path, starting
            with 0 (the root), then -1.
        num_accepted: Shape (batch,), int64: accepted drafts (the root not counted).

    Raises:
        TypeError: wrong dtype or not a tensor.
        ValueError: wrong rank or shape, parents not in topological order (checked on CPU
            tensors), num_nodes outside 0..N, tensors on different devices.
    """
    _, _, _, parents, n = check_verify_tree_greedy_args(target_logits, tree_tokens, tree_parents, num_nodes)
    return _verify_tree_greedy(target_logits, tree_tokens, parents, n)
