"""Reference greedy verification of draft chains in the flattened (vLLM v1) layout (plain PyTorch,
no value checks)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels._flattened import check_greedy_flattened_args, positions, take


def _verify_greedy_flattened(
    target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len
) -> Tuple[torch.Tensor, torch.Tensor]:
    T, B, K = draft_token_ids.shape[0], cu_num_draft_tokens.shape[0], max_spec_len
    device = target_logits.device
    with_rows = bonus_token_ids is None
    pos = positions(cu_num_draft_tokens, T, K, bonus_rows=with_rows)
    drafts = take(draft_token_ids.to(torch.int64), pos.flat, pos.counted, -1)  # [B, K]

    # argmax of every target row, read in place; then request b's rows row0_b + j, j = 0..K
    target_argmax = target_logits.argmax(dim=-1)  # [R]; NaN counts as the maximum
    j = torch.arange(K + 1, device=device)
    has_row = j[None, :] <= pos.n[:, None] if with_rows else j[None, :] < pos.n[:, None]
    argmax = take(target_argmax, pos.row0[:, None] + j[None, :], has_row, -1)  # [B, K + 1]
    if not with_rows:  # the caller's bonus token stands where the bonus row's argmax would
        argmax = torch.where(j[None, :] == pos.n[:, None], bonus_token_ids.to(torch.int64)[:, None], argmax)

    match = (drafts == argmax[:, :K]) & pos.counted
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    output_tokens = torch.full((B, K + 1), -1, dtype=torch.int64, device=device)
    keep = j[None, :K] < num_accepted[:, None]
    output_tokens[:, :K] = torch.where(keep, drafts, -1)
    last = num_accepted[:, None]
    output_tokens.scatter_(1, last, argmax.gather(1, last))
    return output_tokens, num_accepted


def verify_greedy_flattened(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor] = None,
    *,
    max_spec_len: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of draft chains in the flattened (vLLM v1) layout (reference of
    ``specdec_kernels.verify_greedy_flattened``: the algorithm of ``verify_greedy``, Leviathan
    et al. 2023, greedy case, on vLLM v1's ragged layout).

    Same arguments, shapes, dtypes and results as the op, whose docstring has them (without
    ``backend`` and ``validate``); the arguments are normalised as the op does, without value
    checks (``verify_greedy_flattened(..., backend="reference")`` runs this with the op's checks).
    """
    flat = check_greedy_flattened_args(
        target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate=False
    )
    return _verify_greedy_flattened(
        target_logits, draft_token_ids, cu_num_draft_tokens, flat.bonus_token_ids, flat.max_spec_len
    )
