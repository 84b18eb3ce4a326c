"""Reference greedy verification of a chain of draft tokens (plain PyTorch, no argument checks)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def verify_greedy(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of a chain of draft tokens (reference of ``specdec_kernels.verify_greedy``:
    Leviathan et al. 2023, greedy case).  Same arguments, shapes, dtypes and results as the op,
    whose docstring has them; no argument checks (``verify_greedy(..., backend="reference")``
    runs this with the op's checks)."""
    B, K1, _ = target_logits.shape
    K = K1 - 1
    if num_draft_tokens is None:
        num_draft_tokens = torch.full((B,), K, dtype=torch.int64, device=target_logits.device)
    target_argmax = target_logits.argmax(dim=-1)  # [B, K+1]; NaN counts as the maximum
    position = torch.arange(K, device=target_logits.device)
    counted = position[None, :] < num_draft_tokens[:, None]  # [B, K]
    match = (draft_tokens.to(torch.int64) == target_argmax[:, :K]) & counted
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # leading run of matches

    output_tokens = torch.full((B, K1), -1, dtype=torch.int64, device=target_logits.device)
    keep = position[None, :] < num_accepted[:, None]
    output_tokens[:, :K] = torch.where(keep, draft_tokens.to(torch.int64), output_tokens[:, :K])
    # The token after the accepted drafts: the correction at the first mismatch, or the bonus.
    last = num_accepted[:, None]
    output_tokens.scatter_(1, last, target_argmax.gather(1, last))
    return output_tokens, num_accepted
