"""Reference tree attention: dense masked softmax in float64 (plain PyTorch)."""
from __future__ import annotations

from typing import Optional

import torch

from specdec_kernels._checks import FLOAT_DTYPES, check_shape, check_tensor, want_value_checks

SUPPORTED_HEAD_DIMS = tuple(range(16, 257, 16))


def check_tree_attention_args(q, k_cache, v_cache, cache_seqlens, tree_mask, validate=None):
    """Validate the arguments of ``tree_attention``; return (B, N, H, D, Hkv, S)."""
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    device = q.device
    B, N, H, D = q.shape
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(q.dtype,), device=device)
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q's head dim must be one of {SUPPORTED_HEAD_DIMS}, got shape {tuple(q.shape)}")
    _, Hkv, S, _ = k_cache.shape
    check_shape("k_cache", k_cache, (B, Hkv, S, D), "(batch, kv_heads, capacity, head_dim) matching q")
    check_shape("v_cache", v_cache, (B, Hkv, S, D), "like k_cache")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"q's heads ({H}) must be a multiple of k_cache's heads ({Hkv}) (GQA)")
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=(torch.int32, torch.int64), device=device)
    check_shape("cache_seqlens", cache_seqlens, (B,))
    if tree_mask is not None:
        check_tensor("tree_mask", tree_mask, ndim=(2, 3), dtypes=(torch.bool,), device=device)
        if tree_mask.dim() == 2:
            check_shape("tree_mask", tree_mask, (N, N), "one ancestor mask for the batch")
        else:
            check_shape("tree_mask", tree_mask, (B, N, N), "one ancestor mask per sequence")
    if N > S:
        raise ValueError(f"k_cache's capacity S={S} is smaller than the N={N} new keys it must hold (q's dim 1)")
    if want_value_checks(validate, cache_seqlens) and B:
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0 or hi + N > S:
            raise ValueError(
                f"cache_seqlens + N must lie in [N, S={S}] (the N new keys are already in the cache), "
                f"got cache_seqlens in {lo}..{hi} with N={N}"
            )
    return B, N, H, D, Hkv, S


def visible_keys(cache_seqlens: torch.Tensor, tree_mask: Optional[torch.Tensor], num_new: int, capacity: int) -> torch.Tensor:
    """Which cache slots each new query may attend to: bool [B, N, S].

    Slots before cache_seqlens[b] (the prefix) are visible to every query; slot
    cache_seqlens[b] + j is visible to query i iff tree_mask[i, j] (the causal chain when
    tree_mask is None); no other slot is.
    """
    B, N, S = cache_seqlens.shape[0], num_new, capacity
    device = cache_seqlens.device
    slot = torch.arange(S, device=device)[None, :]
    seqlen = cache_seqlens.to(torch.int64)[:, None]
    prefix = (slot < seqlen)[:, None, :].expand(B, N, S)
    j = slot - seqlen  # position of the slot inside the new block
    in_block = (j >= 0) & (j < N)
    if tree_mask is None:
        tree_mask = torch.ones(N, N, dtype=torch.bool, device=device).tril()
    mask = tree_mask.expand(B, N, N)
    tree = mask.gather(2, j.clamp(0, max(N - 1, 0))[:, None, :].expand(B, N, S)) & in_block[:, None, :]
    return prefix | tree


def _tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale):
    B, N, H, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    group = H // Hkv
    # Lengths outside [0, S - N] (unchecked input) act as the nearest valid one, as in the kernels.
    cache_seqlens = cache_seqlens.to(torch.int64).clamp(0, S - N)
    # A key or value that is not finite (NaN from torch.empty, say) must reach exactly the
    # queries that see its slot: those get NaN, and nobody else.  So such slots are zeroed
    # before the products (a zero attention weight times NaN would be NaN) and the queries that
    # see one are set to NaN afterwards.
    k64, v64 = k_cache.to(torch.float64), v_cache.to(torch.float64)
    bad = ~(k64.isfinite().all(-1) & v64.isfinite().all(-1))  # [B, Hkv, S]
    k = torch.where(bad[..., None], 0.0, k64).repeat_interleave(group, dim=1)  # [B, H, S, D]
    v = torch.where(bad[..., None], 0.0, v64).repeat_interleave(group, dim=1)
    scores = torch.einsum("bnhd,bhsd->bhns", q.to(torch.float64), k) * sm_scale
    visible = visible_keys(cache_seqlens, tree_mask, N, S)[:, None]  # [B, 1, N, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("bhns,bhsd->bnhd", torch.softmax(scores, dim=-1), v)
    sees_bad = (visible & bad.repeat_interleave(group, dim=1)[:, :, None, :]).any(-1)  # [B, H, N]
    out = torch.where(sees_bad.transpose(1, 2)[..., None], float("nan"), out)
    return out.to(q.dtype)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: Optional[torch.Tensor] = None,
    *,
    sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention of a draft token tree's queries to the cached prefix and their ancestors (reference).

    Tree attention as in SpecInfer (Miao et al. 2024) and Medusa (Cai et al. 2024): the N new
    tokens' keys and values are already written at cache slots cache_seqlens[b] ..
    cache_seqlens[b] + N - 1; each query sees the whole prefix and the new keys of its own
    ancestors (and itself).  Computed densely in float64 with -inf masking, then cast.

    Args:
        q: Shape (batch, N, heads, head_dim), float32/float16/bfloat16.  head_dim a multiple
            of 16 up to 256.
        k_cache, v_cache: Shape (batch, kv_heads, capacity, head_dim), q's dtype; heads must be
            a multiple of kv_heads (GQA; query head h reads kv head h // (heads / kv_heads)).
        cache_seqlens: Shape (batch,), int32/int64: committed tokens per sequence, with
            cache_seqlens + N <= capacity.
        tree_mask: bool, shape (N, N) or (batch, N, N); mask[i, j] is true when node j is node
            i or one of its ancestors.  None means the causal chain.
        sm_scale: softmax scale, default head_dim ** -0.5.

    Returns:
        Shape (batch, N, heads, head_dim), q's dtype.

    Raises:
        TypeError: wrong dtypes (k/v must share q's dtype; the mask must be bool).
        ValueError: wrong ranks or shapes, heads not a multiple of kv_heads, unsupported
            head_dim, cache_seqlens + N beyond capacity (checked on CPU tensors).
    """
    check_tree_attention_args(q, k_cache, v_cache, cache_seqlens, tree_mask)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    return _tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, scale)
