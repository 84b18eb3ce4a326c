"""Reference greedy verification of draft chains in the flattened (vLLM v1) layout (plain PyTorch)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels._flattened import check_flattened_args, positions, take


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
    """Greedy verification of draft chains in the flattened (vLLM v1) layout (reference).

    The algorithm of ``verify_greedy`` (Leviathan et al. 2023, greedy case: accept drafts
    while they equal the target's argmax, then emit the argmax at the first mismatch, or the
    bonus token) on vLLM v1's ragged layout (``SpecDecodeMetadata``): no padding of the
    inputs, -1 padding of the output.  Same tokens as ``verify_greedy`` on the same data
    padded to K = max_spec_len.

    Args:
        target_logits: Shape (T + B, vocab) without ``bonus_token_ids``: request b's K_b rows
            for its drafts then its bonus row (rows cu[b-1] + b .. cu[b] + b); or (T, vocab)
            with ``bonus_token_ids``.  float32/float16/bfloat16, rows read in place.
        draft_token_ids: Shape (T,), int32/int64: all requests' drafts concatenated.  Ids
            outside [0, vocab) never match.
        cu_num_draft_tokens: Shape (B,), int32/int64: the inclusive cumsum of the draft counts
            (request b's drafts are flat positions cu[b-1] .. cu[b] - 1, cu[-1] read as 0);
            zero-draft requests are allowed.
        bonus_token_ids: Shape (B,) (or (B, 1) as vLLM passes them), int32/int64, or None.
            When given, a request that accepts all its drafts emits bonus_token_ids[b] (copied
            as given, not checked against the vocabulary); at a mismatch the correction
            token is the rejected row's argmax as usual.
        max_spec_len: the output's padded width minus 1, >= max K_b.  None computes it from
            cu_num_draft_tokens: a host read (a synchronisation on CUDA); pass it to avoid
            that, as vLLM does.

    Returns:
        output_tokens: Shape (batch, max_spec_len + 1), int64: accepted drafts, the correction
            or bonus token, then -1 (vLLM's PLACEHOLDER_TOKEN_ID).
        num_accepted: Shape (batch,), int64: accepted drafts; a row emits num_accepted + 1.

    Raises:
        TypeError: a tensor of the wrong dtype or not a tensor; max_spec_len not an int.
        ValueError: wrong ranks; target_logits without T + B rows (or T with
            bonus_token_ids); bonus_token_ids not (B,); devices that differ; with value
            checks, cu_num_draft_tokens negative, decreasing or not ending at T, and
            max_spec_len below the largest draft count.
    """
    flat = check_flattened_args(
        "target_logits", target_logits, None, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len
    )
    return _verify_greedy_flattened(target_logits, draft_token_ids, cu_num_draft_tokens, flat.bonus_token_ids,
                                    flat.max_spec_len)
