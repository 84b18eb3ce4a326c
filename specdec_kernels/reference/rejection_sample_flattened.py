"""Reference lossless rejection sampling of draft chains in the flattened (vLLM v1) layout
(plain PyTorch, no value checks)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels._flattened import (
    FlatBatch,
    check_sampling_flattened_args,
    draft_counts,
    flatten_coins,
    positions,
    take,
)
from specdec_kernels._random import GeneratorArg, RandomSource, check_random_source, generator_uniforms, philox_uniforms
from specdec_kernels.checks import clamp_uniforms
from specdec_kernels.reference.rejection_sample import accept_tests, mass, sample_from_weights


def _rejection_sample_flattened(
    target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, coins, final_u, max_spec_len
) -> Tuple[torch.Tensor, torch.Tensor]:
    R, V = target_probs.shape
    T, B, K = draft_token_ids.shape[0], cu_num_draft_tokens.shape[0], max_spec_len
    device = target_probs.device
    with_rows = bonus_token_ids is None
    pos = positions(cu_num_draft_tokens, T, K, bonus_rows=with_rows)
    j = torch.arange(K, device=device)
    tokens = take(draft_token_ids.to(torch.int64), pos.flat, pos.counted, -1)  # [B, K]
    safe = tokens.clamp(0, V - 1)
    # p_j(x_j) and q_j(x_j) at the request's own rows: B * K values, no row copied
    t_rows = (pos.row0[:, None] + j[None, :]).clamp(0, max(R - 1, 0))
    p = target_probs[t_rows, safe].float() if R else torch.zeros(B, K, device=device)
    if draft_probs is not None:
        q = draft_probs[pos.flat, safe].float() if T else torch.zeros(B, K, device=device)
    else:
        q = torch.ones_like(p)
    u = take(coins, pos.flat, pos.counted, 1.0)
    accept = accept_tests(p, q, tokens, pos.counted, u, V)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    rejected = num_accepted < pos.n

    # The row to sample from: the rejected draft's row (residual max(0, p - q), or p when that
    # has no mass), else the bonus row; with bonus_token_ids a fully accepted request has no
    # row to sample and emits its bonus token.
    s_row = pos.row0 + num_accepted
    p_row = take(target_probs, s_row, torch.ones_like(rejected), 0).float()  # [B, V]
    d_row = pos.start + num_accepted  # the rejected draft's flat position (where rejected)
    if draft_probs is not None:
        q_row = take(draft_probs, d_row, rejected, 0).float()
    else:
        at = take(draft_token_ids.to(torch.int64), d_row, rejected, -1)
        q_row = torch.zeros_like(p_row)
        inside = (at >= 0) & (at < V)
        q_row.scatter_(1, at.clamp(0, V - 1)[:, None], inside.float()[:, None])
    residual = mass(p_row - q_row)
    use_residual = rejected & (residual.sum(dim=1) > 0)
    weights = torch.where(use_residual[:, None], residual, p_row)
    sampled = sample_from_weights(weights, final_u)
    if not with_rows:
        sampled = torch.where(rejected, sampled, bonus_token_ids.to(torch.int64))

    output_tokens = torch.full((B, K + 1), -1, dtype=torch.int64, device=device)
    keep = j[None, :] < num_accepted[:, None]
    output_tokens[:, :K] = torch.where(keep, tokens, -1)
    output_tokens.scatter_(1, num_accepted[:, None], sampled[:, None])
    return output_tokens, num_accepted


def flattened_random_args(
    flat: FlatBatch,
    cu_num_draft_tokens: torch.Tensor,
    device: torch.device,
    source: RandomSource = RandomSource(),
    *,
    validate: Optional[bool] = None,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """What the flattened front passes to its registered op: (uniform_samples [T] or
    [B, max_spec_len] or None, sample_uniforms [B] or None, seeds or None, offsets or None).

    Explicit uniforms (coins [T], coin t is flat draft t's) are checked and passed as given;
    with seeds/offsets the missing ones stay None and the kernels compute them (request b's
    coin j at offsets[b] + j, the padded front's numbers); otherwise the generator draws the
    padded [B, max_spec_len] coins and sample uniforms as the padded front does, passed to the
    op padded (flat draft t of request b at position j takes coin [b, j]: no flattening op).
    As in the padded front, a generator still draws the coins it would have drawn when only
    ``sample_uniforms`` is missing.
    """
    B, K = flat.batch, flat.max_spec_len
    check_random_source(B, (flat.num_tokens,), device, source, validate)
    generator, uniform_samples, sample_uniforms, seeds, offsets = source
    if (uniform_samples is not None and sample_uniforms is not None) or seeds is not None:
        return uniform_samples, sample_uniforms, seeds, offsets
    per_sequence = isinstance(generator, (list, tuple, dict))
    counts = draft_counts(cu_num_draft_tokens, flat.num_tokens).clamp(max=K) if per_sequence else None
    coins, final = generator_uniforms(B, K, device, generator, counts)
    return (
        uniform_samples if uniform_samples is not None else coins,
        sample_uniforms if sample_uniforms is not None else final,
        None,
        None,
    )


def flat_coins_shape(flat: FlatBatch, uniform_samples: Optional[torch.Tensor]) -> Tuple[int, ...]:
    """The expected shape of the registered flattened op's coins: (B, max_spec_len) when given
    as a 2-D tensor (the padded layout the generator modes draw), else (T,)."""
    if isinstance(uniform_samples, torch.Tensor) and uniform_samples.dim() == 2:
        return (flat.batch, flat.max_spec_len)
    return (flat.num_tokens,)


def resolve_flattened_uniforms(
    flat: FlatBatch,
    cu_num_draft_tokens: torch.Tensor,
    uniform_samples: Optional[torch.Tensor],
    sample_uniforms: Optional[torch.Tensor],
    seeds: Optional[torch.Tensor],
    offsets: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(coins [T], sample uniforms [B]) float32 as the kernels use them: explicit ones clamped
    (``checks.clamp_uniforms``; padded [B, max_spec_len] coins flattened), missing ones from
    seeds/offsets (the padded [B, max_spec_len] Philox coins, flattened)."""
    T, K = flat.num_tokens, flat.max_spec_len
    if uniform_samples is None:
        uniform_samples = philox_uniforms(seeds, offsets, K, 0)
    if uniform_samples.dim() == 2:
        uniform_samples = flatten_coins(uniform_samples, cu_num_draft_tokens, T)
    if sample_uniforms is None:
        sample_uniforms = philox_uniforms(seeds, offsets, 1, 1)[:, 0]
    return clamp_uniforms(uniform_samples), clamp_uniforms(sample_uniforms)


def flattened_uniforms(
    flat: FlatBatch,
    cu_num_draft_tokens: torch.Tensor,
    device: torch.device,
    source: RandomSource = RandomSource(),
    *,
    validate: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(coins [T], sample uniforms [B]) float32 for a flattened call: the numbers the kernels
    use (``flattened_random_args`` resolved by ``resolve_flattened_uniforms``).

    A request gets exactly the numbers the padded front draws for it with K = max_spec_len
    (``specdec_kernels._random``, same ``source``: generator state, seeds and offsets): the padded
    [B, max_spec_len] coins are drawn (or computed from seeds/offsets) and flat draft t of
    request b at position j takes coin [b, j].  Explicit ``uniform_samples`` are [T] (coin t is
    flat draft t's); as in the padded front, a generator still draws the coins it would have
    drawn when only ``sample_uniforms`` is missing.
    """
    args = flattened_random_args(flat, cu_num_draft_tokens, device, source, validate=validate)
    return resolve_flattened_uniforms(flat, cu_num_draft_tokens, *args)


def rejection_sample_flattened(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor] = None,
    *,
    max_spec_len: Optional[int] = None,
    generator: GeneratorArg = None,
    uniform_samples: Optional[torch.Tensor] = None,
    sample_uniforms: Optional[torch.Tensor] = None,
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling of draft chains in the flattened (vLLM v1) layout
    (reference of ``specdec_kernels.rejection_sample_flattened``: the algorithm of
    ``rejection_sample``, Leviathan et al. 2023, on vLLM v1's ragged layout).

    Same arguments, shapes, dtypes, random numbers and results as the op, whose docstring has
    them (without ``return_details``, ``backend`` and ``validate``); the arguments are
    normalised as the op does, without value checks
    (``rejection_sample_flattened(..., backend="reference")`` runs this with the op's checks).
    """
    flat = check_sampling_flattened_args(
        target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate=False
    )
    source = RandomSource(generator, uniform_samples, sample_uniforms, seeds, offsets)
    coins, final_u = flattened_uniforms(flat, cu_num_draft_tokens, target_probs.device, source)
    return _rejection_sample_flattened(
        target_probs,
        draft_probs,
        draft_token_ids,
        cu_num_draft_tokens,
        flat.bonus_token_ids,
        coins,
        final_u,
        flat.max_spec_len,
    )
