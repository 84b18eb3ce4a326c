"""The argument checks that several public ops share (private; the public definitions they
build on are in ``specdec_kernels.checks``).  Each op's front and registered kernel call them
through the op's own ``check_<op>_args``, so one check sequence is written once."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from specdec_kernels.checks import (
    INDEX_DTYPES,
    check_counts,
    check_probs,
    check_scores,
    check_shape,
    check_tensor,
    check_tree,
)


def check_draft_probs(draft_probs: Optional[torch.Tensor], expected: Sequence[int], what: str, device) -> None:
    """``draft_probs``: None, or a float tensor of shape ``expected`` on ``device`` (``what``
    says what a row is, in the message)."""
    if draft_probs is not None:
        check_probs("draft_probs", draft_probs, len(expected), device)
        check_shape("draft_probs", draft_probs, expected, what)


def check_chain_args(
    rows_name: str,
    rows,
    draft_tokens,
    num_draft_tokens,
    validate: Optional[bool],
    draft_probs: Optional[torch.Tensor] = None,
) -> Tuple[int, int, int, torch.Tensor]:
    """A chain of K drafts: ``rows`` (batch, K + 1, vocab) target scores or probabilities,
    ``draft_tokens`` (batch, K), ``draft_probs`` None or (batch, K, vocab) and
    ``num_draft_tokens`` None or (batch,) in 0..K; return (B, K, V, num_draft_tokens int64)."""
    B, K1, V = check_scores(rows_name, rows, "K+1 >= 1 rows per sequence")
    device = rows.device
    K = K1 - 1
    check_tensor("draft_tokens", draft_tokens, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_shape("draft_tokens", draft_tokens, (B, K), f"{rows_name} needs K+1 rows for K draft tokens")
    check_draft_probs(draft_probs, (B, K, V), "one draft distribution per draft token", device)
    n = check_counts("num_draft_tokens", num_draft_tokens, B, K, device, validate)
    return B, K, V, n


def check_tree_args(
    rows_name: str,
    rows,
    tree_tokens,
    tree_parents,
    num_nodes,
    validate: Optional[bool],
    draft_probs: Optional[torch.Tensor] = None,
    expand_parents: bool = True,
) -> Tuple[int, int, int, torch.Tensor, torch.Tensor]:
    """A token tree of N nodes: ``rows`` (batch, N, vocab) target scores or probabilities,
    ``tree_tokens`` (batch, N), ``tree_parents`` (N,) or (batch, N), ``draft_probs`` None or
    (batch, N, vocab) and ``num_nodes`` None or (batch,) in 0..N; return (B, N, V, parents
    int64 [B, N] (``expand_parents=False``: a shared tree stays [N]), num_nodes int64 [B])."""
    B, N, V = check_scores(rows_name, rows, "N >= 1 rows (the root at least)")
    device = rows.device
    parents = check_tree(rows_name, tree_tokens, tree_parents, B, N, device, validate, expand_parents)
    check_draft_probs(draft_probs, (B, N, V), "row i: the distribution node i's children were drawn from", device)
    n = check_counts("num_nodes", num_nodes, B, N, device, validate)
    return B, N, V, parents, n
