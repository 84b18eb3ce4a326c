"""Reference multi-candidate rejection sampling over a token tree (plain PyTorch)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels.checks import INDEX_DTYPES, check_counts, check_parents, check_probs, check_shape, check_tensor
from specdec_kernels._random import GeneratorArg, draw_uniforms
from specdec_kernels.reference.rejection_sample import mass, sample_from_weights


def check_tree_rejection_sample_args(target_probs, tree_tokens, tree_parents, draft_probs, num_nodes, validate=None):
    """Validate the arguments of ``tree_rejection_sample``; return (B, N, V, parents [B, N], num_nodes [B])."""
    check_probs("target_probs", target_probs, 3)
    device = target_probs.device
    B, N, V = target_probs.shape
    if N < 1:
        raise ValueError(f"target_probs must have N >= 1 rows (the root at least), got shape {tuple(target_probs.shape)}")
    if V < 1:
        raise ValueError(f"target_probs must have a vocabulary of at least 1, got shape {tuple(target_probs.shape)}")
    check_tensor("tree_tokens", tree_tokens, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_shape("tree_tokens", tree_tokens, (B, N), "one token per tree node, like target_probs' rows")
    parents = check_parents("tree_parents", tree_parents, B, N, device, validate)
    if draft_probs is not None:
        check_probs("draft_probs", draft_probs, 3, device)
        check_shape("draft_probs", draft_probs, (B, N, V), "row i: the distribution node i's children were drawn from")
    n = check_counts("num_nodes", num_nodes, B, N, device, validate)
    return B, N, V, parents, n


def _tree_rejection_sample(target_probs, tree_tokens, parents, draft_probs, num_nodes, coins, final_u):
    B, N, V = target_probs.shape
    device = target_probs.device
    rows = torch.arange(B, device=device)
    tokens = tree_tokens.to(torch.int64)

    def target_row(node):  # float64 weights of the target's distribution after `node`
        return mass(target_probs[rows, node].to(torch.float64))

    host_shortcuts = device.type == "cpu"  # elsewhere no value is read on the host
    current = torch.zeros(B, dtype=torch.int64, device=device)
    residual = target_row(current)  # p' unnormalised; its mass is `total`
    total = residual.sum(dim=1)
    accepted_nodes = torch.full((B, N), -1, dtype=torch.int64, device=device)
    accepted_nodes[:, 0] = 0
    num_accepted = torch.zeros(B, dtype=torch.int64, device=device)

    # One pass in node order visits every node's children in index order: children come
    # after their parent, and once a child is accepted only its own children can follow.
    for j in range(1, N):
        is_child = (parents[:, j] == current) & (j < num_nodes)
        if host_shortcuts and not is_child.any():  # a shortcut only where reading is free
            continue
        x = tokens[:, j]
        in_vocab = (x >= 0) & (x < V)
        xs = x.clamp(0, V - 1)[:, None]
        r_x = residual.gather(1, xs).squeeze(1)
        u = coins[:, j - 1].to(torch.float64)
        if draft_probs is not None:
            q = mass(draft_probs[rows, current].to(torch.float64))
            # accept with probability min(1, p'(x) / q(x)), p' = residual / total
            accept = is_child & in_vocab & (u * q.gather(1, xs).squeeze(1) * total < r_x)
            reject = is_child & ~accept
            # p' <- norm(max(0, p' - q)), p' scaled by the reciprocal of its total: one division
            # per row, the arithmetic the Triton and CPU kernels repeat element by element
            inv_total = 1.0 / torch.where(total > 0, total, torch.ones_like(total))
            new_residual = mass(residual * inv_total[:, None] - q)
            new_total = new_residual.sum(dim=1)
            update = reject & (new_total > 0)  # a residual with no mass leaves p' as it was
            residual = torch.where(update[:, None], new_residual, residual)
            total = torch.where(update, new_total, total)
        else:
            # a deterministic child x is accepted with probability p'(x); on rejection x is
            # removed from p' (its weight zeroed, the total reduced by it).
            accept = is_child & in_vocab & (u * total < r_x)
            reject = is_child & ~accept & in_vocab
            total = torch.where(reject, total - r_x, total)
            residual = residual.scatter(1, xs, torch.where(reject, 0.0, r_x)[:, None])
        if not host_shortcuts or accept.any():
            num_accepted += accept.to(torch.int64)
            at = num_accepted[:, None]  # scatter, not boolean indexing: no host read
            accepted_nodes.scatter_(1, at, torch.where(accept[:, None], j, accepted_nodes.gather(1, at)))
            current = torch.where(accept, j, current)
            fresh = target_row(current)
            residual = torch.where(accept[:, None], fresh, residual)
            total = torch.where(accept, fresh.sum(dim=1), total)

    no_mass = ~(residual.sum(dim=1) > 0)
    weights = torch.where(no_mass[:, None], target_row(current), residual)
    sampled = sample_from_weights(weights, final_u)

    output_tokens = torch.full((B, N), -1, dtype=torch.int64, device=device)
    path = accepted_nodes[:, 1:]
    output_tokens[:, : N - 1] = torch.where(path >= 0, tokens.gather(1, path.clamp(min=0)), -1)
    output_tokens.scatter_(1, num_accepted[:, None], sampled[:, None])
    return output_tokens, accepted_nodes, num_accepted


def tree_rejection_sample(
    target_probs: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    num_nodes: Optional[torch.Tensor] = None,
    *,
    generator: GeneratorArg = None,
    uniform_samples: Optional[torch.Tensor] = None,
    sample_uniforms: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-candidate recursive rejection sampling over a token tree (reference).

    SpecInfer (Miao et al. 2024, "SpecInfer: Accelerating Generative LLM Serving with
    Tree-based Speculative Inference and Verification"), with the deterministic-children
    variant of Chen et al. / Sequoia (2024).  At the current node with residual p' (starting
    as the target's distribution there), try its children in index order:

    * ``draft_probs`` given (children drawn from q = draft_probs[node]): accept child x with
      probability min(1, p'(x) / q(x)), tested as u * q(x) * total < r(x) in float64 with
      p' = r / total; on rejection p' <- norm(max(0, p' - q)) (unchanged if that has no mass),
      computed as r <- mass(r * (1 / total) - q).
    * ``draft_probs`` None (distinct deterministic children, e.g. top-k): accept x with
      probability p'(x), tested as u * total < r(x); on rejection r(x) <- 0 and total -= r(x).

    On acceptance move to the child (p' restarts from the target's row there); when every
    child is rejected (or there are none) sample from p' (from the target's row if p' has no
    mass) by inverse CDF.  Both keep the target distribution exactly.

    Args:
        target_probs: Shape (batch, N, vocab), float32/float16/bfloat16; row i is the target's
            distribution after node i.  NaN and negative entries carry no mass.
        tree_tokens: Shape (batch, N), int32/int64; node 0 is the root (never tested).
        tree_parents: Shape (N,) or (batch, N), int32/int64, parents[0] = -1, 0 <= parents[i] < i.
        draft_probs: Shape (batch, N, vocab) or None; row i is the distribution node i's
            children were drawn from.
        num_nodes: Shape (batch,), int in 0..N, or None for all N.
        generator: a torch.Generator or one per sequence (see ``specdec_kernels._random``).
        uniform_samples: Shape (batch, N - 1), float32 in [0, 1); column c - 1 is node c's coin.
        sample_uniforms: Shape (batch,), float32 in [0, 1): the final sample's uniform.

    Returns:
        output_tokens: Shape (batch, N), int64: accepted drafts, the sampled token, then -1.
        accepted_nodes: Shape (batch, N), int64: the accepted path from node 0, then -1.
        num_accepted: Shape (batch,), int64: accepted drafts (root not counted).

    Raises:
        TypeError: wrong dtype or generator type.
        ValueError: wrong rank or shape, parents not topological (CPU), num_nodes out of
            range, uniforms of the wrong shape or outside [0, 1).
    """
    B, N, _, parents, n = check_tree_rejection_sample_args(target_probs, tree_tokens, tree_parents, draft_probs, num_nodes)
    coins, final_u = draw_uniforms(B, N - 1, target_probs.device, generator, uniform_samples, sample_uniforms)
    return _tree_rejection_sample(target_probs, tree_tokens, parents, draft_probs, n, coins, final_u)
