"""Reference lossless rejection sampling of a chain of draft tokens (plain PyTorch, no argument
checks), and the inverse-CDF sampling shared by the references of the sampling ops."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels._random import GeneratorArg, RandomSource, draw_uniforms


def mass(x: torch.Tensor) -> torch.Tensor:
    """Non-negative sampling weights: negative entries and NaN carry no mass."""
    return torch.where(x > 0, x, torch.zeros_like(x))


def sample_from_weights(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row: the first index whose CDF exceeds u * total.

    Args:
        weights: Shape (batch, vocab), any float dtype, not necessarily normalised; negative
            and NaN entries carry no mass.
        u: Shape (batch,), uniforms in [0, 1).

    Returns:
        Shape (batch,), int64.  The CDF is accumulated in float64 (kernels do the same, in
        another order, so they can differ only when u * total lies within float64 rounding
        of a CDF boundary).  A token with no mass is never returned; if rounding puts
        u * total at or past the total, the last index with mass is returned; a row with no
        mass at all returns 0.
    """
    w = mass(weights.to(torch.float64))
    V = w.shape[-1]
    cdf = w.cumsum(dim=-1)
    total = cdf[:, -1]
    threshold = u.to(torch.float64) * total
    token = torch.searchsorted(cdf, threshold[:, None], right=True).squeeze(1)
    last_with_mass = V - 1 - (w.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
    token = torch.where(token >= V, last_with_mass, token)
    return torch.where(total > 0, token, torch.zeros_like(token))


def accept_tests(
    p_x: torch.Tensor, q_x: torch.Tensor, tokens: torch.Tensor, counted: torch.Tensor, coins: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Each draft's own accept test (bool, the shape of ``p_x``): ``u * q(x) < p(x)`` in float32
    for an id inside the vocabulary at a counted position; p(x) = 0 (or NaN) never accepts."""
    in_vocab = (tokens >= 0) & (tokens < vocab)
    return (coins * q_x.float() < p_x.float()) & in_vocab & counted


def _rejection_sample(target_probs, draft_probs, draft_tokens, num_draft_tokens, coins, final_u):
    B, K1, V = target_probs.shape
    K = K1 - 1
    device = target_probs.device
    num_draft_tokens = num_draft_tokens.clamp(0, K)  # counts past K act as K (unchecked input)
    tokens = draft_tokens.to(torch.int64)
    safe = tokens.clamp(0, V - 1)[..., None]
    p = target_probs[:, :K].float().gather(2, safe).squeeze(2)  # p_j(x_j)
    q = draft_probs.float().gather(2, safe).squeeze(2) if draft_probs is not None else torch.ones_like(p)
    counted = torch.arange(K, device=device)[None, :] < num_draft_tokens[:, None]
    # Accept x_j when u_j * q_j(x_j) < p_j(x_j), in float32; p_j(x_j) = 0 is never accepted.
    accept = accept_tests(p, q, tokens, counted, coins, V)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)

    row = num_accepted[:, None, None].expand(B, 1, V)
    p_row = target_probs.float().gather(1, row).squeeze(1)  # [B, V]
    rejected = num_accepted < num_draft_tokens
    if draft_probs is not None:
        q_row = draft_probs.float().gather(1, row.clamp(max=K - 1)).squeeze(1) if K else torch.zeros_like(p_row)
    else:
        at = (
            tokens.gather(1, num_accepted.clamp(max=max(K - 1, 0))[:, None])
            if K
            else torch.full((B, 1), -1, device=device)
        )
        q_row = torch.zeros_like(p_row)
        q_row.scatter_(1, at.clamp(0, V - 1), ((at >= 0) & (at < V)).float())
    residual = mass(p_row - q_row)
    use_residual = rejected & (residual.sum(dim=1) > 0)
    weights = torch.where(use_residual[:, None], residual, p_row)
    sampled = sample_from_weights(weights, final_u)

    output_tokens = torch.full((B, K1), -1, dtype=torch.int64, device=device)
    keep = torch.arange(K, device=device)[None, :] < num_accepted[:, None]
    output_tokens[:, :K] = torch.where(keep, tokens, -1)
    output_tokens.scatter_(1, num_accepted[:, None], sampled[:, None])
    return output_tokens, num_accepted


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_tokens: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
    *,
    generator: GeneratorArg = None,
    uniform_samples: Optional[torch.Tensor] = None,
    sample_uniforms: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling of a chain of draft tokens (reference of
    ``specdec_kernels.rejection_sample``: Leviathan et al. 2023, Chen et al. 2023).

    Same arguments, shapes, dtypes, random numbers and results as the op, whose docstring has
    them (without ``return_details``, ``seeds``/``offsets``, ``backend`` and ``validate``); no
    argument checks beyond the uniforms' (``rejection_sample(..., backend="reference")`` runs
    this with the op's checks).
    """
    B, K1, _ = target_probs.shape
    K = K1 - 1
    if num_draft_tokens is None:
        num_draft_tokens = torch.full((B,), K, dtype=torch.int64, device=target_probs.device)
    coins, final_u = draw_uniforms(B, K, target_probs.device, RandomSource(generator, uniform_samples, sample_uniforms))
    return _rejection_sample(target_probs, draft_probs, draft_tokens, num_draft_tokens.to(torch.int64), coins, final_u)
