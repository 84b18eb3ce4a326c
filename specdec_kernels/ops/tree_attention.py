"""tree_attention: draft-tree queries attend to the cached prefix and to their ancestors.

Backends
--------
``"triton"``: one flash-attention-style kernel (Dao et al. 2022; online softmax over key
tiles, fp32 accumulation) computes, for one sequence and one KV head, the attention of all
``G = H / Hkv`` query heads of that KV head at once (GQA: every K/V tile is loaded once per
group, not once per query head).  Query rows are the ``G * N`` pairs (node i, head g) in the
order ``r = i * G + g``, tiled by ``BLOCK_M``.  For each row tile the kernel walks

1. the prefix, keys ``0 .. cache_seqlens[b] - 1``, all visible, tile by tile;
2. the tree part, the ``N`` new keys at ``cache_seqlens[b] + j``, visible through the
   ancestor mask (``tree_mask`` None: the causal chain ``j <= i``; N = 1 is plain decoding).

When ``B * Hkv * row_tiles`` programs cannot fill the GPU, the prefix is split across
``num_splits`` programs (flash-decoding, Dao et al. 2023): each writes its normalised
partial output and log-sum-exp (base 2) in fp32, and a second small kernel combines them.
The last split also walks the tree part.

``"torch"``: ``torch.nn.functional.scaled_dot_product_attention`` over the cache sliced to
``max(cache_seqlens) + N`` slots with the equivalent boolean mask; GQA by viewing q as
``[B, Hkv, N * G, D]`` (the cache is never repeated).  The CPU fast path of the decode engine.

``"reference"``: dense float64 softmax (``specdec_kernels.reference.tree_attention``).

Paged KV cache
--------------
With ``block_table`` the caches are pools of blocks (vLLM / FlashInfer): "NHD"
``[num_blocks, block_size, Hkv, D]`` or "HND" ``[num_blocks, Hkv, block_size, D]``, and
logical slot s of sequence b is slot s % block_size of block ``block_table[b, s // block_size]``.
The registered op is ``torch.ops.specdec.paged_tree_attention``.  Triton runs the same kernel
with ``PAGED``: each key tile looks its block ids up in the table (clamped into the pool) and
addresses the pool through its strides, so both layouts and any block size share one kernel.
The torch backend gathers the blocks that cover ``max(cache_seqlens) + N`` slots (all of the
table off CPU, where reading the lengths would synchronise) into a dense cache view and runs
the SDPA path above.  The paged op also has ``"native"`` (its automatic CPU backend when the
extension has it): ``torch.ops.specdec.paged_tree_attention_native``, a C++ kernel
(csrc/paged_attention_cpu.cpp) that reads K/V through the block table in place, no gather, with
the same online softmax as the Triton kernel (one task per sequence and KV head, fp32
accumulation; fp16/bf16 converted on load).

Bit-packed masks
----------------
Besides the bool ``[N, N]`` / ``[B, N, N]`` mask, every backend accepts the packed form made
by :func:`pack_tree_mask`: int32 ``[N, W]`` / ``[B, N, W]`` with ``W = ceil(N / 32)``, where
bit ``j % 32`` (least significant first) of word ``[i, j // 32]`` is ``mask[i, j]``.  Bits
for ``j >= N`` are ignored.  It is 8x smaller than the bool mask (32x for the bits moved).
"""
from __future__ import annotations

import math
import os
import threading
from typing import Optional

import torch

from specdec_kernels import _backend, _library
from specdec_kernels._device import next_pow2 as _next_pow2
from specdec_kernels.autotune import RuntimeChoice
from specdec_kernels.checks import check_shape, check_tensor
from specdec_kernels.ops._tree_attention_launch import MASK_BOOL, MASK_CAUSAL, MASK_PACKED, MAX_SPLITS, choose_num_splits
from specdec_kernels.reference import tree_attention as _ref
from specdec_kernels.reference.tree_attention import (
    _tree_attention,
    check_kv_layout,
    check_paged_tree_attention_args,
    check_tree_attention_args,
    paged_geometry,
    paged_tree_attention as _paged_reference,
    visible_keys,
)

# "native": the C++ CPU kernel (csrc/paged_attention_cpu.cpp; a dense cache is read as the pool of
# B blocks of S slots), the automatic CPU backend of both ops when the extension has it.
IMPLEMENTED = ("reference", "torch", "triton", "native")
PAGED_IMPLEMENTED = ("reference", "torch", "triton", "native")
# the automatic CPU backends: the C++ kernel or the SDPA path, measured per shape class (see
# specdec_kernels.autotune); the environment variables force one
DENSE_CPU_CHOICE = RuntimeChoice("tree_attention on CPU", ("native", "torch"), trials=3, env="SPECDEC_DENSE_ATTENTION")
PAGED_CPU_CHOICE = RuntimeChoice("paged_tree_attention on CPU", ("native", "torch"), trials=3,
                                 env="SPECDEC_PAGED_ATTENTION")

def packed_mask_words(num_nodes: int) -> int:
    """Number of int32 words per row of a packed mask of ``num_nodes`` nodes: ceil(N / 32)."""
    return (num_nodes + 31) // 32


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool ancestor mask into int32 bit words, the packed ``tree_mask`` form.

    Bit ``j % 32`` (least significant bit first) of word ``[..., i, j // 32]`` is
    ``mask[..., i, j]``; the padding bits of the last word are zero.

    Args:
        mask: bool, shape (N, N) or (batch, N, N), any device.

    Returns:
        int32, shape (N, ceil(N / 32)) or (batch, N, ceil(N / 32)), on mask's device.

    Raises:
        TypeError: mask not a bool tensor.
        ValueError: mask not of shape (N, N) or (batch, N, N).

    Example:
        >>> pack_tree_mask(torch.ones(3, 3, dtype=torch.bool).tril())
        tensor([[1], [3], [7]], dtype=torch.int32)
    """
    check_tensor("mask", mask, ndim=(2, 3), dtypes=(torch.bool,))
    N = mask.shape[-1]
    if mask.shape[-2] != N:
        raise ValueError(f"mask must have shape (N, N) or (batch, N, N), got {tuple(mask.shape)}")
    W = packed_mask_words(N)
    padded = torch.zeros(*mask.shape[:-1], W * 32, dtype=torch.int64, device=mask.device)
    padded[..., :N] = mask
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=mask.device), torch.arange(32, device=mask.device))
    words = (padded.view(*mask.shape[:-1], W, 32) * weights).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement into int32
    return words.to(torch.int32)


def unpack_tree_mask(packed: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Inverse of :func:`pack_tree_mask`: int32 (..., N, ceil(N/32)) -> bool (..., N, N)."""
    check_tensor("packed", packed, ndim=(2, 3), dtypes=(torch.int32,))
    j = torch.arange(num_nodes, device=packed.device)
    words = packed[..., j // 32]  # (..., N, N)
    return torch.bitwise_and(torch.bitwise_right_shift(words, (j % 32).to(torch.int32)), 1).bool()


def _check_packed_mask(tree_mask: torch.Tensor, B: int, N: int, device) -> None:
    check_tensor("tree_mask", tree_mask, ndim=(2, 3), dtypes=(torch.int32,), device=device)
    W = packed_mask_words(N)
    if tree_mask.dim() == 2:
        check_shape("tree_mask", tree_mask, (N, W), "bit-packed ancestor mask for the batch, ceil(N/32) int32 words a row")
    else:
        check_shape("tree_mask", tree_mask, (B, N, W), "bit-packed ancestor mask per sequence, ceil(N/32) int32 words a row")


# --------------------------------------------------------------------------------------
# "torch" backend: scaled_dot_product_attention
# --------------------------------------------------------------------------------------


def _torch_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale):
    """SDPA over the cache sliced to max(cache_seqlens) + N slots; tree_mask bool or None.

    GQA without copying the cache: the G query heads of each KV head become G * N rows of
    one attention problem per KV head (row r = i * G + g), so q is [B, Hkv, N * G, D].  The
    mask is additive (0 / -inf) in q's dtype, which SDPA takes as is (a bool mask costs a
    conversion); with one prefix length for the batch its prefix columns are plain zeros.
    """
    B, N, H, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    if B == 0 or N == 0:
        return torch.empty_like(q)
    S = k_cache.shape[2]
    # Slots past the sequence (cache_seqlens clamped into [0, S - N]) are masked, and their
    # values replaced by zeros, so that garbage there (NaN from torch.empty) never reaches the
    # output.  On CPU the cache is first sliced to max(cache_seqlens) + N slots (reading the
    # lengths is free there); on other devices the whole capacity is used, never synchronising.
    lens_t = cache_seqlens.to(torch.int64).clamp(0, S - N)
    if q.device.type == "cpu":
        lens = lens_t.tolist()
        T, uniform = max(lens) + N, min(lens) == max(lens)
    else:
        T, uniform = S, False
    k = k_cache[:, :, :T]
    v = v_cache[:, :, :T]
    # Keys or values that are not finite reach exactly the queries that see their slot (NaN
    # there), as in the reference: zeroed before SDPA (an additive -inf mask plus inf, or a zero
    # weight times NaN, is NaN), and the queries that see one set to NaN after it.  On CPU one
    # reduction per tensor decides whether any care is needed (free to read there).
    bad = None
    if q.device.type != "cpu" or not (bool(torch.isfinite(k.sum())) and bool(torch.isfinite(v.sum()))):
        bad = ~(k.isfinite().all(-1) & v.isfinite().all(-1))  # [B, Hkv, T]
        k = torch.where(bad[..., None], 0, k)
        v = torch.where(bad[..., None], 0, v)
    qg = q.view(B, N, Hkv, G, D).transpose(1, 2).reshape(B, Hkv, N * G, D)
    if uniform:  # one prefix length and T = length + N: every slot belongs to the sequence
        if tree_mask is None and N == 1:
            attn_mask = None
        else:
            tm = torch.ones(N, N, dtype=torch.bool, device=q.device).tril_() if tree_mask is None else tree_mask
            Bm = tm.shape[0] if tm.dim() == 3 else 1
            attn_mask = torch.zeros(Bm, N, G, T, dtype=q.dtype, device=q.device)
            tree_add = torch.zeros(tm.shape, dtype=q.dtype, device=q.device).masked_fill_(~tm, float("-inf"))
            attn_mask[..., T - N:] = tree_add.view(Bm, N, 1, N)
            attn_mask = attn_mask.view(Bm, 1, N * G, T)
    else:
        vis = visible_keys(lens_t, tree_mask, N, T)  # [B, N, T]
        attn_mask = torch.zeros(B, N, G, T, dtype=q.dtype, device=q.device)
        attn_mask.masked_fill_(~vis[:, :, None, :], float("-inf"))
        attn_mask = attn_mask.view(B, 1, N * G, T)
    out = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=attn_mask, scale=sm_scale)
    out = out.view(B, Hkv, N, G, D).transpose(1, 2).reshape(B, N, H, D)
    if bad is not None:
        vis = visible_keys(lens_t, tree_mask, N, T)  # [B, N, T]
        sees_bad = (vis[:, None, :, :] & bad[:, :, None, :]).any(-1)  # [B, Hkv, N]
        sees_bad = sees_bad.transpose(1, 2).repeat_interleave(G, dim=2)  # [B, N, H]
        out = torch.where(sees_bad[..., None], float("nan"), out)
    return out


# Per-thread CPU buffer that the torch backend gathers paged K/V into.  A fresh multi-MB
# tensor per call comes from fresh pages (glibc returns large freed chunks to the OS), and
# the page faults cost more than the gather itself (measured: 480 faults, 2.3 ms on top of a
# 0.5 ms call); CUDA's caching allocator needs no such help.  Buffers above the cap are not kept.
_WORKSPACE = threading.local()
WORKSPACE_MAX_BYTES = 256 << 20


def _workspace(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``numel`` elements (uninitialised), reused by later calls on this thread.

    Only a plain tensor made outside every mode is kept: under a FakeTensorMode, a tracer or a
    dispatch mode a fresh one is returned; the kept buffer is made with inference mode off, so
    that a buffer first needed inside ``torch.inference_mode`` (the engine) can still be written
    outside it (an inference tensor could not)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return torch.empty(numel, dtype=dtype)
    key = str(dtype)
    buf = getattr(_WORKSPACE, key, None)
    if buf is not None and buf.numel() >= numel:
        return buf[:numel]
    with torch.inference_mode(False):
        buf = torch.empty(numel, dtype=dtype)
    if type(buf) is torch.Tensor and numel * buf.element_size() <= WORKSPACE_MAX_BYTES:
        setattr(_WORKSPACE, key, buf)
    return buf


def _gather_paged(cache, block_ids, kv_layout, out):
    """The blocks ``block_ids`` [B, M] (ids in the pool) of a paged pool as a dense cache
    [B, Hkv, M * block_size, D], copied into ``out`` (B * M * block_size * Hkv * D elements).

    NHD: one ``index_select`` of whole blocks, viewed as [B, Hkv, slots, D] through strides
    (SDPA reads that view about as fast as a contiguous cache, and a second, head-major copy
    would cost more).  HND: one ``index_select`` of the (block, head) rows of block_size * D
    elements, which lands head-major at once; a pool whose (block, head) rows are not one
    stride apart is first selected by block, then rearranged.
    """
    num_blocks, block_size, Hkv, D = paged_geometry(cache, kv_layout)
    B, M = block_ids.shape
    if kv_layout == "NHD":
        blocks = torch.index_select(cache, 0, block_ids.reshape(-1), out=out.view(B * M, block_size, Hkv, D))
        return blocks.view(B, M * block_size, Hkv, D).transpose(1, 2)
    try:
        rows = cache.view(num_blocks * Hkv, block_size * D)
    except RuntimeError:
        blocks = cache.index_select(0, block_ids.reshape(-1)).view(B, M, Hkv, block_size, D)
        return out.view(B, Hkv, M, block_size, D).copy_(blocks.transpose(1, 2)).view(B, Hkv, M * block_size, D)
    index = block_ids.to(torch.int64).mul_(Hkv).view(B, 1, M) + torch.arange(Hkv, device=cache.device).view(1, Hkv, 1)
    torch.index_select(rows, 0, index.view(-1), out=out.view(B * Hkv * M, block_size * D))
    return out.view(B, Hkv, M * block_size, D)


def _torch_paged_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, sm_scale):
    """The SDPA path on the blocks that cover max(cache_seqlens) + N slots, gathered.

    Lengths act as clamped to [0, capacity - N] as in the reference (the dense path clamps
    them to its gathered capacity, which is the table's whenever a length reaches past it);
    block ids are clamped into the pool, so unused or hostile table entries gather some block
    of the pool (invisible slots) and never memory outside it.  Off CPU the whole table is
    gathered (no host read of the lengths).
    """
    B, N = q.shape[0], q.shape[1]
    num_blocks, block_size, Hkv, D = paged_geometry(k_cache, kv_layout)
    max_blocks = block_table.shape[1]
    if B == 0 or N == 0:
        return torch.empty_like(q)
    if q.device.type == "cpu":
        longest = min(max(int(cache_seqlens.max()), 0), max_blocks * block_size - N)
        used = -(-(longest + N) // block_size)
        kv = _workspace(2 * B * used * block_size * Hkv * D, q.dtype).view(2, -1)
    else:
        used = max_blocks
        kv = torch.empty(2, B * used * block_size * Hkv * D, dtype=q.dtype, device=q.device)
    ids = block_table[:, :used].clamp(0, num_blocks - 1)
    k = _gather_paged(k_cache, ids, kv_layout, kv[0])
    v = _gather_paged(v_cache, ids, kv_layout, kv[1])
    return _torch_tree_attention(q, k, v, cache_seqlens, tree_mask, sm_scale)


# --------------------------------------------------------------------------------------
# The registered op: torch.ops.specdec.tree_attention
# --------------------------------------------------------------------------------------


def _check_num_splits(num_splits: int) -> None:
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must lie in 1..{MAX_SPLITS} (0: automatic), got {num_splits}")


def _impl(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: Optional[torch.Tensor],
    sm_scale: float,
    num_splits: int = 0,
    backend: str = "",
) -> torch.Tensor:
    packed = tree_mask is not None and tree_mask.dtype == torch.int32
    B, N, H, D, Hkv, S = check_tree_attention_args(q, k_cache, v_cache, cache_seqlens, None if packed else tree_mask, validate=False)
    if packed:
        _check_packed_mask(tree_mask, B, N, q.device)
    _check_num_splits(num_splits)
    name = _backend.resolve("tree_attention", q.device, backend or None, IMPLEMENTED)
    if name == "triton":
        from specdec_kernels.ops._triton.tree_attention import tree_attention_triton

        kind = MASK_CAUSAL if tree_mask is None else (MASK_PACKED if packed else MASK_BOOL)
        splits = num_splits or choose_num_splits(B, Hkv, N, H // Hkv, S, D, q.device, q.dtype == torch.float32)
        return tree_attention_triton(q, k_cache, v_cache, cache_seqlens, tree_mask, kind, sm_scale, splits)
    mask = unpack_tree_mask(tree_mask, N) if packed else tree_mask

    if name == "native" and not backend:
        return _dense_cpu_auto(q, k_cache, v_cache, cache_seqlens, mask, sm_scale)
    return _dense_run(name, q, k_cache, v_cache, cache_seqlens, mask, sm_scale)


def _dense_run(name, q, k_cache, v_cache, cache_seqlens, mask, sm_scale):
    if name == "native":
        return torch.ops.specdec.tree_attention_native(q, k_cache, v_cache, cache_seqlens, mask, sm_scale)
    if name == "torch":
        return _torch_tree_attention(q, k_cache, v_cache, cache_seqlens, mask, sm_scale).contiguous()
    return _tree_attention(q, k_cache, v_cache, cache_seqlens, mask, sm_scale).contiguous()


def _dense_cpu_auto(q, k_cache, v_cache, cache_seqlens, mask, sm_scale):
    """The automatic CPU backend of the dense op: the C++ kernel (fastest for few queries) or
    SDPA (its GEMMs win for many tree nodes), whichever runs faster here, measured on the first
    real calls of each shape class, thread count included ($SPECDEC_DENSE_ATTENTION forces one)."""
    B, N, H, D = q.shape
    key = (_next_pow2(N), _next_pow2(B), _next_pow2(k_cache.shape[2]), H, k_cache.shape[1], D, q.dtype,
           torch.get_num_threads())
    return DENSE_CPU_CHOICE(key, lambda name: _dense_run(name, q, k_cache, v_cache, cache_seqlens, mask, sm_scale))


def engine_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                          tree_mask: Optional[torch.Tensor], backend: Optional[str] = None) -> torch.Tensor:
    """``tree_attention`` over a dense cache for a caller that built every tensor itself and
    checked their shapes once (the bundled engine, 30 calls per forward): on CPU with the
    automatic backend and the extension built, the automatic CPU path without the per-call
    argument checks and op dispatch (about 0.1 ms a call); otherwise the public op with
    ``validate=False``.  Same results as ``tree_attention``.

    Args: as ``tree_attention`` (tree_mask bool [N, N] / [B, N, N] or None; cache_seqlens int32).
    """
    if (backend is None and q.device.type == "cpu" and _NATIVE_DENSE_CPU.get("ok") is not False
            and not os.environ.get(_backend.ENV_VAR)):
        if "ok" not in _NATIVE_DENSE_CPU:
            _NATIVE_DENSE_CPU["ok"] = _backend._can_run("native", "tree_attention", q.device) is None
        if _NATIVE_DENSE_CPU["ok"] and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0:
            return _dense_cpu_auto(q, k_cache, v_cache, cache_seqlens, tree_mask, q.shape[-1] ** -0.5)
    return tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, backend=backend, validate=False)


_NATIVE_DENSE_CPU: dict = {}


def _fake(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale, num_splits=0, backend=""):
    packed = tree_mask is not None and tree_mask.dtype == torch.int32
    B, N, _, _, _, _ = check_tree_attention_args(q, k_cache, v_cache, cache_seqlens, None if packed else tree_mask, validate=False)
    if packed:
        _check_packed_mask(tree_mask, B, N, q.device)
    _check_num_splits(num_splits)
    _library.check_backend_name(backend)
    torch._check(q.dim() == 4 and k_cache.dim() == 4, lambda: "q and k_cache must have 4 dimensions")
    torch._check(q.shape[2] % k_cache.shape[1] == 0, lambda: "q's heads must be a multiple of k_cache's heads")
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _triton_decomposition(args, kwargs):
    x = _library.bound_arguments(_impl, args, kwargs)
    q, tree_mask = x["q"], x["tree_mask"]
    if _backend.resolve("tree_attention", q.device, x["backend"] or None, IMPLEMENTED) != "triton":
        return None
    B, N, H, D = q.shape
    Hkv, S = x["k_cache"].shape[1], x["k_cache"].shape[2]
    kind = MASK_CAUSAL if tree_mask is None else (MASK_PACKED if tree_mask.dtype == torch.int32 else MASK_BOOL)
    splits = x["num_splits"] or choose_num_splits(B, Hkv, N, H // Hkv, S, D, q.device, q.dtype == torch.float32)
    return torch.ops.specdec.tree_attention_triton(
        q, x["k_cache"], x["v_cache"], x["cache_seqlens"], tree_mask, kind, x["sm_scale"], splits
    )


op = _library.define("tree_attention", _impl, cpu=_impl, cuda=_impl, fake=_fake, triton_decomposition=_triton_decomposition)


# --------------------------------------------------------------------------------------
# The registered op over a paged cache: torch.ops.specdec.paged_tree_attention
# --------------------------------------------------------------------------------------


def _mask_kind(tree_mask) -> int:
    return MASK_CAUSAL if tree_mask is None else (MASK_PACKED if tree_mask.dtype == torch.int32 else MASK_BOOL)


def _check_paged(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, num_splits, validate):
    """The shape checks of the paged op (values with ``validate``); returns the paged geometry."""
    packed = tree_mask is not None and tree_mask.dtype == torch.int32
    dims = check_paged_tree_attention_args(q, k_cache, v_cache, cache_seqlens, None if packed else tree_mask,
                                           block_table, kv_layout, validate=validate)
    if packed:
        _check_packed_mask(tree_mask, dims[0], dims[1], q.device)
    _check_num_splits(num_splits)
    return dims


def _paged_impl(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: Optional[torch.Tensor],
    block_table: torch.Tensor,
    kv_layout: str,
    sm_scale: float,
    num_splits: int = 0,
    backend: str = "",
) -> torch.Tensor:
    B, N, H, D, Hkv, capacity, _, _ = _check_paged(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table,
                                                   kv_layout, num_splits, validate=False)
    name = _backend.resolve("paged_tree_attention", q.device, backend or None, PAGED_IMPLEMENTED)
    if name == "triton":
        from specdec_kernels.ops._triton.tree_attention import paged_tree_attention_triton

        splits = num_splits or choose_num_splits(B, Hkv, N, H // Hkv, capacity, D, q.device, q.dtype == torch.float32)
        return paged_tree_attention_triton(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout,
                                           _mask_kind(tree_mask), sm_scale, splits)
    mask = unpack_tree_mask(tree_mask, N) if _mask_kind(tree_mask) == MASK_PACKED else tree_mask

    def run(name: str) -> torch.Tensor:
        if name == "native":
            return torch.ops.specdec.paged_tree_attention_native(q, k_cache, v_cache, cache_seqlens, mask, block_table,
                                                                 kv_layout, sm_scale)
        if name == "torch":
            return _torch_paged_tree_attention(q, k_cache, v_cache, cache_seqlens, mask, block_table, kv_layout,
                                               sm_scale).contiguous()
        return _paged_reference(q, k_cache, v_cache, cache_seqlens, mask, block_table, kv_layout, sm_scale).contiguous()

    if name == "native" and not backend:
        # automatic on CPU: the C++ kernel (no gather; fastest for few queries) or the gather +
        # SDPA path (its GEMMs win for many tree nodes), whichever runs faster here, measured on
        # the first real calls of each shape class (SPECDEC_PAGED_ATTENTION forces one)
        key = (_next_pow2(N), _next_pow2(B), _next_pow2(capacity), H, Hkv, D, q.dtype, kv_layout, torch.get_num_threads())
        return PAGED_CPU_CHOICE(key, run)
    return run(name)


def _paged_fake(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, sm_scale, num_splits=0, backend=""):
    _check_paged(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, num_splits, validate=False)
    _library.check_backend_name(backend)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _paged_triton_decomposition(args, kwargs):
    x = _library.bound_arguments(_paged_impl, args, kwargs)
    q, tree_mask = x["q"], x["tree_mask"]
    if _backend.resolve("paged_tree_attention", q.device, x["backend"] or None, PAGED_IMPLEMENTED) != "triton":
        return None
    B, N, H, D = q.shape
    _, block_size, Hkv, _ = paged_geometry(x["k_cache"], x["kv_layout"])
    capacity = x["block_table"].shape[1] * block_size
    splits = x["num_splits"] or choose_num_splits(B, Hkv, N, H // Hkv, capacity, D, q.device, q.dtype == torch.float32)
    return torch.ops.specdec.paged_tree_attention_triton(
        q, x["k_cache"], x["v_cache"], x["cache_seqlens"], tree_mask, x["block_table"], x["kv_layout"],
        _mask_kind(tree_mask), x["sm_scale"], splits,
    )


paged_op = _library.define("paged_tree_attention", _paged_impl, cpu=_paged_impl, cuda=_paged_impl, fake=_paged_fake,
                           triton_decomposition=_paged_triton_decomposition)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: Optional[torch.Tensor] = None,
    *,
    block_table: Optional[torch.Tensor] = None,
    kv_layout: str = "NHD",
    sm_scale: Optional[float] = None,
    num_splits: Optional[int] = None,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> torch.Tensor:
    check_kv_layout(kv_layout)
    packed = isinstance(tree_mask, torch.Tensor) and tree_mask.dtype == torch.int32
    if block_table is None:
        B, N, H, D, Hkv, S = check_tree_attention_args(q, k_cache, v_cache, cache_seqlens, None if packed else tree_mask, validate)
    else:
        B, N, H, D = check_paged_tree_attention_args(q, k_cache, v_cache, cache_seqlens, None if packed else tree_mask,
                                                     block_table, kv_layout, validate)[:4]
    if packed:
        _check_packed_mask(tree_mask, B, N, q.device)
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int):
            raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must lie in 1..{MAX_SPLITS}, got {num_splits}")
    scale = D**-0.5 if sm_scale is None else float(sm_scale)
    if block_table is not None:
        return torch.ops.specdec.paged_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout,
                                                      scale, num_splits or 0, backend or "")
    return torch.ops.specdec.tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, scale, num_splits or 0, backend or "")


tree_attention.__doc__ = (
    _backend.public_doc(_ref, "tree_attention").rstrip()
    + """
        tree_mask (public op): also the bit-packed int32 form of ``pack_tree_mask``,
            shape (N, ceil(N/32)) or (batch, N, ceil(N/32)).
        num_splits: Triton backend only (others ignore it): split each sequence's prefix
            across this many programs and combine by log-sum-exp (flash-decoding); None
            chooses from the SM count on CUDA (``choose_num_splits``).  1..256.

    A query that sees no key at all (cache_seqlens 0 and an empty mask row) has an
    undefined output (NaN from the reference and the Triton kernel).  Cache slots a sequence
    cannot see never affect its output, whatever they hold: for a paged cache that includes
    the rest of its last block, other sequences' blocks and unused blocks of the pool.  With
    ``validate=False`` a used block id outside [0, num_blocks) is clamped into the pool (as
    the reference does): the result is then unspecified, but nothing outside the pool is read.
    With ``block_table`` the call goes to ``torch.ops.specdec.paged_tree_attention``
    ``(q, k_cache, v_cache, cache_seqlens, tree_mask?, block_table, kv_layout, sm_scale,
    num_splits=0, backend)``.
"""
)


# the Triton launchers and kernels (verify_greedy_triton, AOT_SPECS, ...), loaded on first access
__getattr__ = _library.lazy_attributes(__name__, "specdec_kernels.ops._triton.tree_attention")
