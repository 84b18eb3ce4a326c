"""The flattened (vLLM v1) layout of a batch of draft chains: argument checks and index helpers.

vLLM v1 (``vllm/v1/spec_decode/metadata.py``, ``SpecDecodeMetadata``) concatenates the drafts
of all requests instead of padding them to a common K:

- ``draft_token_ids`` [T]: every request's drafts, request after request.
- ``cu_num_draft_tokens`` [B]: the INCLUSIVE cumulative sum of the draft counts, without a
  leading zero.  Request b's drafts are the flat positions ``start_b .. end_b - 1`` with
  ``start_b = cu[b - 1]`` (``cu[-1]`` taken as 0) and ``end_b = cu[b]``; ``K_b = end_b - start_b``
  may be 0.  (FlashInfer's ``indptr`` convention has B + 1 entries starting at 0; this is not it.)
- target rows either ``[T + B, V]``, request b's K_b draft rows followed by its bonus row
  (rows ``start_b + b .. end_b + b``: vLLM's ``logits`` before ``target_logits_indices`` /
  ``bonus_logits_indices`` split them), or ``[T, V]`` with the bonus tokens sampled by the
  caller and passed as ``bonus_token_ids`` [B] (what vLLM's ``rejection_sample`` receives).
- draft rows ``[T, V]``: flat row t is the distribution draft t was drawn from.

The ops return the padded ``[B, max_spec_len + 1]`` tensor with -1 padding, as vLLM does.

Every kernel derives a request's rows from ``cu`` with the same clamping rule, so that no read
leaves the tensors whatever ``cu`` holds (``validate=False`` skips the value checks):
``start_b = clamp(cu[b - 1], 0, T)`` (0 for b = 0), ``end_b = clamp(cu[b], 0, T)`` and
``n_b = clamp(end_b - start_b, 0, max_spec_len)``; the request then uses flat drafts
``start_b .. start_b + n_b - 1`` and, with bonus rows, target rows ``start_b + b .. start_b +
b + n_b`` (all inside ``[0, T + B)`` because ``start_b + n_b <= end_b <= T``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from specdec_kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    as_int,
    check_probs,
    check_shape,
    check_tensor,
    want_value_checks,
)


class FlatBatch(NamedTuple):
    """What the checks learn about a flattened batch (no tensor values unless validated)."""

    batch: int  # B
    num_tokens: int  # T
    vocab: int  # V
    max_spec_len: int  # the padded width of the output minus 1
    bonus_token_ids: Optional[torch.Tensor]  # [B] as given (a [B, 1] input is viewed as [B]), or None


def check_flattened_args(
    target_name: str,
    target: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor],
    max_spec_len,
    validate: Optional[bool] = None,
    probs: bool = False,
) -> FlatBatch:
    """Check the arguments of a flattened verification op; return a ``FlatBatch``.

    Shapes, dtypes and devices are always checked; the values of ``cu_num_draft_tokens``
    (non-negative, non-decreasing, last entry T) and ``max_spec_len >= max K_b`` only when
    ``validate`` allows (default: on CPU tensors).  ``max_spec_len=None`` is computed as the
    largest draft count, which reads ``cu_num_draft_tokens`` on the host (a synchronisation on
    CUDA): pass it to avoid that, as vLLM does.

    Raises:
        TypeError: a tensor of the wrong dtype or not a tensor; max_spec_len not an int.
        ValueError: wrong ranks, a row count of ``target`` other than T + B (no
            bonus_token_ids) or T (with them), draft_probs not [T, V], bonus_token_ids not
            [B], mismatched devices, a negative max_spec_len; with value checks, a bad
            cu_num_draft_tokens or max_spec_len below the largest draft count.
    """
    if probs:
        check_probs(target_name, target, 2)
    else:
        check_tensor(target_name, target, ndim=2, dtypes=FLOAT_DTYPES)
    device = target.device
    check_tensor("draft_token_ids", draft_token_ids, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    T, B = draft_token_ids.shape[0], cu_num_draft_tokens.shape[0]
    R, V = target.shape
    if V < 1:
        raise ValueError(f"{target_name} must have a vocabulary of at least 1, got shape {tuple(target.shape)}")
    if B == 0 and T != 0:
        raise ValueError(f"cu_num_draft_tokens is empty (batch 0) but draft_token_ids holds {T} draft tokens")
    if bonus_token_ids is not None:
        check_tensor("bonus_token_ids", bonus_token_ids, ndim=(1, 2), dtypes=INDEX_DTYPES, device=device)
        if bonus_token_ids.dim() == 2:
            check_shape("bonus_token_ids", bonus_token_ids, (B, 1), "one bonus token per request")
            bonus_token_ids = bonus_token_ids.reshape(B)
        check_shape("bonus_token_ids", bonus_token_ids, (B,), "one bonus token per request")
        if R != T:
            raise ValueError(
                f"{target_name} must have T = {T} rows (one per draft token; the bonus tokens are given "
                f"as bonus_token_ids), got shape {tuple(target.shape)}"
            )
    elif R != T + B:
        raise ValueError(
            f"{target_name} must have T + B = {T} + {B} = {T + B} rows (each request's draft rows, then its "
            f"bonus row), or T rows together with bonus_token_ids; got shape {tuple(target.shape)}"
        )
    if draft_probs is not None:
        check_probs("draft_probs", draft_probs, 2, device)
        check_shape("draft_probs", draft_probs, (T, V), "one draft distribution per draft token")
    if max_spec_len is not None:
        max_spec_len = as_int("max_spec_len", max_spec_len)
        if max_spec_len < 0:
            raise ValueError(f"max_spec_len must be >= 0, got {max_spec_len}")
    checked = want_value_checks(validate, cu_num_draft_tokens)
    if checked and B > 0:
        cu = cu_num_draft_tokens.to(torch.int64)
        first, last = int(cu[0]), int(cu[-1])
        if first < 0:
            raise ValueError(
                f"cu_num_draft_tokens must be non-negative (an inclusive cumsum of draft counts), got cu[0] = {first}"
            )
        if B > 1:
            steps = cu[1:] - cu[:-1]
            if bool((steps < 0).any()):
                b = int((steps < 0).nonzero()[0, 0]) + 1
                raise ValueError(
                    f"cu_num_draft_tokens must be non-decreasing (an inclusive cumsum of draft counts), got "
                    f"cu[{b - 1}] = {int(cu[b - 1])} > cu[{b}] = {int(cu[b])}"
                )
        if last != T:
            raise ValueError(
                f"cu_num_draft_tokens[-1] must equal the number of draft tokens "
                f"T = draft_token_ids.numel() = {T}, got {last}"
            )
    if max_spec_len is None and B > 0 and not _has_values(cu_num_draft_tokens):
        raise ValueError(
            "max_spec_len=None is computed from the values of cu_num_draft_tokens, which this call cannot "
            "read (a fake or meta tensor): pass max_spec_len"
        )
    if max_spec_len is None or checked:
        largest = int(draft_counts(cu_num_draft_tokens, T).max()) if B > 0 else 0
        if max_spec_len is None:
            max_spec_len = largest
        elif largest > max_spec_len:
            raise ValueError(
                f"max_spec_len must be at least the largest draft count max(K_b) = {largest}, got {max_spec_len}"
            )
    return FlatBatch(B, T, V, max_spec_len, bonus_token_ids)


def check_greedy_flattened_args(
    target_logits, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate=None
) -> FlatBatch:
    """``check_flattened_args`` for greedy verification: scores ``target_logits``, no draft
    probabilities (``verify_greedy_flattened``'s checks and its reference's normalisation)."""
    return check_flattened_args(
        "target_logits",
        target_logits,
        None,
        draft_token_ids,
        cu_num_draft_tokens,
        bonus_token_ids,
        max_spec_len,
        validate,
    )


def check_sampling_flattened_args(
    target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate=None
) -> FlatBatch:
    """``check_flattened_args`` for rejection sampling: probabilities ``target_probs`` and
    ``draft_probs`` (``rejection_sample_flattened``'s checks but the random numbers, and its
    reference's normalisation)."""
    return check_flattened_args(
        "target_probs",
        target_probs,
        draft_probs,
        draft_token_ids,
        cu_num_draft_tokens,
        bonus_token_ids,
        max_spec_len,
        validate,
        probs=True,
    )


def _has_values(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read on the host: not a meta or fake tensor."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def spans(cu_num_draft_tokens: torch.Tensor, num_tokens: int, max_spec_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(start [B], n [B]) int64 per request, with the kernels' clamping rule (module docstring)."""
    cu = cu_num_draft_tokens.to(torch.int64).clamp(0, num_tokens)
    start = torch.cat([cu.new_zeros(1), cu[:-1]]) if cu.numel() else cu
    return start, (cu - start).clamp(0, max_spec_len)


def draft_counts(cu_num_draft_tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Per-request draft counts K_b [B] int64 (clamped as the kernels do, without the max)."""
    start, n = spans(cu_num_draft_tokens, num_tokens, num_tokens)
    return n


class Positions(NamedTuple):
    """Request b's position j (j < max_spec_len) in flat arrays; [B, max_spec_len] tensors."""

    start: torch.Tensor  # [B] int64, first flat draft
    n: torch.Tensor  # [B] int64, draft count (clamped)
    flat: torch.Tensor  # [B, K] int64, start + j clamped into [0, T) (meaningful where counted)
    counted: torch.Tensor  # [B, K] bool, j < n
    row0: torch.Tensor  # [B] int64, the target row of the request's first draft


def positions(cu_num_draft_tokens: torch.Tensor, num_tokens: int, max_spec_len: int, bonus_rows: bool) -> Positions:
    start, n = spans(cu_num_draft_tokens, num_tokens, max_spec_len)
    device = start.device
    j = torch.arange(max_spec_len, device=device)
    flat = (start[:, None] + j[None, :]).clamp(0, max(num_tokens - 1, 0))
    counted = j[None, :] < n[:, None]
    row0 = start + torch.arange(start.numel(), device=device) if bonus_rows else start
    return Positions(start, n, flat, counted, row0)


def take(values: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, fill) -> torch.Tensor:
    """``values[index]`` where ``keep``, ``fill`` elsewhere; ``index`` is clamped into range and an
    empty ``values`` gives ``fill`` everywhere (so any index is safe)."""
    if values.shape[0] == 0:
        return torch.full(index.shape + values.shape[1:], fill, dtype=values.dtype, device=values.device)
    got = values[index.clamp(0, values.shape[0] - 1)]
    k = keep.reshape(keep.shape + (1,) * (got.dim() - keep.dim()))
    return torch.where(k, got, torch.full((), fill, dtype=values.dtype, device=values.device))


def flatten_coins(coins: torch.Tensor, cu_num_draft_tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Padded coins [B, K] -> flat coins [T]: flat draft t of request b at position j gets
    coins[b, j] (t's request from a search in ``cu``; no host read)."""
    B, K = coins.shape
    if num_tokens == 0 or B * K == 0:
        return coins.new_zeros((num_tokens,))
    cu = cu_num_draft_tokens.to(torch.int64)
    t = torch.arange(num_tokens, device=coins.device)
    req = torch.searchsorted(cu, t, right=True).clamp(max=B - 1)
    start, _ = spans(cu, num_tokens, K)
    j = (t - start[req]).clamp(0, K - 1)
    return coins.reshape(-1)[req * K + j]
