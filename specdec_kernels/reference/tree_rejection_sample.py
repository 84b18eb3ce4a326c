"""Reference multi-candidate rejection sampling over a token tree (plain PyTorch, no argument checks)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels._random import GeneratorArg, RandomSource, draw_uniforms
from specdec_kernels.reference.rejection_sample import mass, sample_from_weights


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
    """Multi-candidate recursive rejection sampling over a token tree (reference of
    ``specdec_kernels.tree_rejection_sample``: SpecInfer, Miao et al. 2024; the multi-draft
    variant of Chen et al. / Sequoia, 2024).

    Same arguments, shapes, dtypes, random numbers and results as the op, whose docstring has
    them (without ``seeds``/``offsets``, ``backend`` and ``validate``); no argument checks
    beyond the uniforms' (``tree_rejection_sample(..., backend="reference")`` runs this with
    the op's checks).
    """
    B, N, _ = target_probs.shape
    parents = tree_parents.to(torch.int64).expand(B, N)
    if num_nodes is None:
        num_nodes = torch.full((B,), N, dtype=torch.int64, device=target_probs.device)
    coins, final_u = draw_uniforms(
        B, N - 1, target_probs.device, RandomSource(generator, uniform_samples, sample_uniforms)
    )
    return _tree_rejection_sample(
        target_probs, tree_tokens, parents, draft_probs, num_nodes.to(torch.int64), coins, final_u
    )
