"""Reference lossless rejection sampling of a chain of draft tokens (plain PyTorch)."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch

from specdec_kernels.checks import INDEX_DTYPES, check_counts, check_probs, check_shape, check_tensor
from specdec_kernels._random import GeneratorArg, draw_uniforms


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


class RejectionSampleDetails(NamedTuple):
    """What ``rejection_sample(..., return_details=True)`` (and its flattened form) returns:
    the two usual outputs and FlashInfer's optional counters (``chain_speculative_sampling``'s
    ``output_accepted_token_num`` and ``output_emitted_draft_token_num``), plus a NaN flag.

    Fields:
        output_tokens: Shape (batch, K + 1), int64: as without details.
        num_accepted: Shape (batch,), int64: as without details.
        accepted_counts: Shape (batch,), int64: how many of the request's counted drafts pass
            their own accept test ``u_j * q_j(x_j) < p_j(x_j)`` (the same coins), counted over
            all of them, also after the first rejection (FlashInfer's accepted count: a
            measure of draft/target agreement; >= num_accepted).
        emitted_counts: Shape (batch,), int64: equal to num_accepted (FlashInfer's emitted
            draft count; the request emits emitted_counts + 1 tokens).
        valid: Shape (batch,), bool: False where a probability row the request owns held a
            NaN: a target row of one of its counted drafts, its bonus row (when given as a
            row) or a draft row of one of its counted drafts.  Rows of the padding are not
            the request's.

    Unlike FlashInfer the counters are returned fresh, not accumulated in place.
    """

    output_tokens: torch.Tensor
    num_accepted: torch.Tensor
    accepted_counts: torch.Tensor
    emitted_counts: torch.Tensor
    valid: torch.Tensor


def accept_tests(p_x: torch.Tensor, q_x: torch.Tensor, tokens: torch.Tensor, counted: torch.Tensor,
                 coins: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each draft's own accept test (bool, the shape of ``p_x``): ``u * q(x) < p(x)`` in float32
    for an id inside the vocabulary at a counted position; p(x) = 0 (or NaN) never accepts."""
    in_vocab = (tokens >= 0) & (tokens < vocab)
    return (coins * q_x.float() < p_x.float()) & in_vocab & counted


def make_details(output_tokens, num_accepted, accept, target_nan, draft_nan) -> RejectionSampleDetails:
    """``RejectionSampleDetails`` from the outputs, the accept tests [B, K] and per-request
    masks of used rows holding NaN (target [B, K + 1], draft [B, K] or None)."""
    bad = target_nan.any(dim=1)
    if draft_nan is not None:
        bad = bad | draft_nan.any(dim=1)
    accepted_counts = accept.to(torch.int64).sum(dim=1)
    return RejectionSampleDetails(output_tokens, num_accepted, accepted_counts, num_accepted.clone(), ~bad)


def rejection_details(target_probs, draft_probs, draft_tokens, num_draft_tokens, coins, output_tokens, num_accepted):
    """The details of a padded call (cheap gathers of B * K values and, since asked for, a
    NaN scan of the rows)."""
    B, K1, V = target_probs.shape
    K = K1 - 1
    device = target_probs.device
    n = num_draft_tokens.clamp(0, K)
    tokens = draft_tokens.to(torch.int64)
    safe = tokens.clamp(0, V - 1)[..., None]
    p_x = target_probs[:, :K].gather(2, safe).squeeze(2)
    q_x = draft_probs.gather(2, safe).squeeze(2) if draft_probs is not None else torch.ones_like(p_x)
    j = torch.arange(K1, device=device)
    counted = j[None, :K] < n[:, None]
    accept = accept_tests(p_x, q_x, tokens, counted, coins, V)
    target_nan = torch.isnan(target_probs).any(dim=-1) & (j[None, :] <= n[:, None])
    draft_nan = torch.isnan(draft_probs).any(dim=-1) & counted if draft_probs is not None else None
    return make_details(output_tokens, num_accepted, accept, target_nan, draft_nan)


def check_rejection_sample_args(target_probs, draft_probs, draft_tokens, num_draft_tokens, validate=None):
    """Validate the arguments of ``rejection_sample``; return (B, K, V, num_draft_tokens int64)."""
    check_probs("target_probs", target_probs, 3)
    device = target_probs.device
    B, K1, V = target_probs.shape
    if K1 < 1:
        raise ValueError(f"target_probs must have K+1 >= 1 rows per sequence, got shape {tuple(target_probs.shape)}")
    if V < 1:
        raise ValueError(f"target_probs must have a vocabulary of at least 1, got shape {tuple(target_probs.shape)}")
    K = K1 - 1
    check_tensor("draft_tokens", draft_tokens, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_shape("draft_tokens", draft_tokens, (B, K), "target_probs needs K+1 rows for K draft tokens")
    if draft_probs is not None:
        check_probs("draft_probs", draft_probs, 3, device)
        check_shape("draft_probs", draft_probs, (B, K, V), "one draft distribution per draft token")
    n = check_counts("num_draft_tokens", num_draft_tokens, B, K, device, validate)
    return B, K, V, n


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
        at = tokens.gather(1, num_accepted.clamp(max=max(K - 1, 0))[:, None]) if K else torch.full((B, 1), -1, device=device)
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
    return_details: bool = False,
) -> Union[Tuple[torch.Tensor, torch.Tensor], RejectionSampleDetails]:
    """Lossless speculative sampling of a chain of draft tokens (reference).

    Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and
    Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling"): accept draft
    x_j when u_j * q_j(x_j) < p_j(x_j) (float32), so with probability min(1, p/q); a token with
    p_j(x_j) = 0 is never accepted.  At the first rejection sample from max(0, p_j - q_j)
    normalised (from p_j when that residual has no mass); when all drafts are accepted sample
    the bonus token from the row after the last draft.  The emitted tokens follow the target
    distribution exactly whatever q is.

    Args:
        target_probs: Shape (batch, K + 1, vocab), float32/float16/bfloat16 (computed in
            float32).  Rows are used as given: the accept test compares raw values and the
            sampled token is drawn proportionally to its weights, so an unnormalised row acts
            as its normalisation, except in the accept test.
        draft_probs: Shape (batch, K, vocab), the distributions the drafts were sampled from,
            or None when the drafts were chosen deterministically (q one-hot at the draft).
        draft_tokens: Shape (batch, K), int32/int64.  An id outside [0, vocab) is rejected.
        num_draft_tokens: Shape (batch,), int in 0..K, or None for all K.
        generator: a torch.Generator, or a list of one per sequence; see
            ``specdec_kernels._random`` for the order in which numbers are drawn.
        uniform_samples: Shape (batch, K), float32 in [0, 1): the acceptance coins.
        sample_uniforms: Shape (batch,), float32 in [0, 1): the uniform that draws each
            sequence's one sampled token (residual or bonus) by inverse CDF.
        return_details: return a ``RejectionSampleDetails`` (FlashInfer's accepted and
            emitted draft counts and a per-request NaN flag) instead of the pair; costs a
            gather of B * K values and a NaN scan of the rows, only when asked.

    Returns:
        output_tokens: Shape (batch, K + 1), int64: accepted drafts, the sampled token, -1.
        num_accepted: Shape (batch,), int64; a row emits num_accepted + 1 tokens.
        (With return_details=True, a ``RejectionSampleDetails`` holding these two first.)

    Raises:
        TypeError: wrong dtype, generator of the wrong type.
        ValueError: wrong rank, mismatched shapes or devices, num_draft_tokens outside 0..K,
            uniforms of the wrong shape or outside [0, 1).
    """
    B, K, _, n = check_rejection_sample_args(target_probs, draft_probs, draft_tokens, num_draft_tokens)
    coins, final_u = draw_uniforms(B, K, target_probs.device, generator, uniform_samples, sample_uniforms)
    out, acc = _rejection_sample(target_probs, draft_probs, draft_tokens, n, coins, final_u)
    if return_details:
        return rejection_details(target_probs, draft_probs, draft_tokens, n, coins, out, acc)
    return out, acc
