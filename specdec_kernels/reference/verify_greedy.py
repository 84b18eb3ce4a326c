"""Reference greedy verification of a chain of draft tokens (plain PyTorch)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_counts, check_shape, check_tensor


def check_verify_greedy_args(target_logits, draft_tokens, num_draft_tokens, validate=None):
    """Validate the arguments of ``verify_greedy``; return (B, K, V, num_draft_tokens int64)."""
    check_tensor("target_logits", target_logits, ndim=3, dtypes=FLOAT_DTYPES)
    device = target_logits.device
    check_tensor("draft_tokens", draft_tokens, ndim=2, dtypes=INDEX_DTYPES, device=device)
    B, K1, V = target_logits.shape
    if K1 < 1:
        raise ValueError(f"target_logits must have K+1 >= 1 rows per sequence, got shape {tuple(target_logits.shape)}")
    if V < 1:
        raise ValueError(f"target_logits must have a vocabulary of at least 1, got shape {tuple(target_logits.shape)}")
    K = K1 - 1
    check_shape("draft_tokens", draft_tokens, (B, K), "target_logits needs K+1 rows for K draft tokens")
    n = check_counts("num_draft_tokens", num_draft_tokens, B, K, device, validate)
    return B, K, V, n


def _verify_greedy(target_logits, draft_tokens, num_draft_tokens) -> Tuple[torch.Tensor, torch.Tensor]:
    B, K1, _ = target_logits.shape
    K = K1 - 1
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


def verify_greedy(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of a chain of draft tokens (reference).

    Speculative decoding at temperature 0 (Leviathan et al. 2023, "Fast Inference from
    Transformers via Speculative Decoding", greedy case): a draft token is accepted while it
    equals the target model's argmax at its position; the first mismatch is replaced by the
    target's argmax (the correction token); when every draft is accepted the target's argmax
    after the last draft is the bonus token.

    Args:
        target_logits: Shape (batch, K + 1, vocab), float32/float16/bfloat16.  Row j scores
            the token after draft j - 1; row 0 follows the committed prefix.
        draft_tokens: Shape (batch, K), int32/int64.  Entries at or past a row's count are
            ignored whatever their value; ids outside [0, vocab) never match.
        num_draft_tokens: Shape (batch,), int32/int64 in 0..K, or None for all K.

    Returns:
        output_tokens: Shape (batch, K + 1), int64: the accepted drafts, then the correction
            or bonus token, then -1 padding.
        num_accepted: Shape (batch,), int64: accepted drafts; a row emits num_accepted + 1.

    argmax follows ``torch.argmax`` (first index of the maximum; NaN counts as the maximum),
    so an emitted id is always in [0, vocab).

    Raises:
        TypeError: a tensor argument of the wrong dtype or not a tensor.
        ValueError: wrong rank, mismatched batch, draft_tokens not (batch, K) for K + 1
            logits rows, num_draft_tokens outside 0..K, tensors on different devices.
    """
    _, _, _, n = check_verify_greedy_args(target_logits, draft_tokens, num_draft_tokens)
    return _verify_greedy(target_logits, draft_tokens, n)
