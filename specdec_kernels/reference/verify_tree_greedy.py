"""Reference greedy verification of a token tree (plain PyTorch, no argument checks)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def verify_tree_greedy(
    target_logits: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    num_nodes: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification of a token tree (reference of ``specdec_kernels.verify_tree_greedy``:
    SpecInfer / Medusa tree verification at temperature 0).  Same arguments, shapes, dtypes and
    results as the op, whose docstring has them; no argument checks
    (``verify_tree_greedy(..., backend="reference")`` runs this with the op's checks).

    One pass over the nodes in index order.  Children come after their parent (parents[i] <
    i), so the pass meets a node's children after the node and lowest index first: node j is
    accepted when its parent is the current node and its token is the target's argmax there,
    which is the lowest-index matching child.  With parents out of order (unchecked input) a
    node is only ever accepted after its parent, so the accepted path is always increasing."""
    B, N, _ = target_logits.shape
    parents = tree_parents.to(torch.int64).expand(B, N)
    if num_nodes is None:
        num_nodes = torch.full((B,), N, dtype=torch.int64, device=target_logits.device)
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
