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

When ``B * Hkv * row_tiles`` programs cannot fill the GPU, the prefix is split across up
to ``num_splits`` programs (flash-decoding, Dao et al. 2023): each writes its normalised
partial output and log-sum-exp (base 2) in fp32, and a second small kernel combines them.
The host bounds ``num_splits`` by the cache's capacity; the kernels use only as many splits
as the sequence's length fills with 256 keys each (``MIN_SPLIT_KEYS``, read from
``cache_seqlens`` on the device), and the splits past those write nothing and are not read.
The last split that holds keys also walks the tree part.

``"torch"``: ``torch.nn.functional.scaled_dot_product_attention`` over the cache sliced to
``max(cache_seqlens) + N`` slots with the equivalent boolean mask; GQA by viewing q as
``[B, Hkv, N * G, D]`` (the cache is never repeated).  The automatic CPU backend only where the
extension lacks the C++ kernel or an environment variable forces it (see "Automatic CPU path").

``"native"``: the C++ CPU kernel (csrc/paged_attention_cpu.cpp), for both ops (a dense cache is
read as a pool of B blocks of S slots).

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
the SDPA path above.  The paged op's ``"native"`` is
``torch.ops.specdec_native.paged_tree_attention``, the C++ kernel (csrc/paged_attention_cpu.cpp)
that reads K/V through the block table in place, no gather, with the same online softmax as the
Triton kernel (one task per sequence and KV head, fp32 accumulation; fp16/bf16 converted on load).

Automatic CPU path
------------------
On CPU both ops take the C++ kernel whenever the extension has it, for every shape: a fixed
rule, never a timing, so identical calls give identical bits from the first call on.  The C++
kernel is also row-independent: a query row's output is bit-identical whether it is computed
alone (N = 1, its ancestors part of the prefix) or inside a pass of any N, chain or tree, and
whatever the other sequences of the batch hold; SDPA is not (its GEMMs and vectorised sums
round a row differently with the number of query rows, the number of key slots and where the
masked slots fall).  SDPA was at most about 1.3x faster, and only for N >= 64 (measured at 1
thread, H=9, Hkv=3, D=64, fp32, prefix 300..1000: native / SDPA ms at N = 1: 0.04 / 0.12,
N = 8: 0.15 / 0.23, N = 64: 1.1 / 0.9 and 3.1 / 2.4, N = 256: 5.6 / 5.1 and 14.6 / 11.6),
not enough to give up either property.  ``SPECDEC_DENSE_ATTENTION`` (dense cache) and
``SPECDEC_PAGED_ATTENTION`` (paged) = ``native`` | ``torch`` | ``auto`` force one path (read at
import and on ``reset_backends()``; see :func:`automatic_cpu_path`); SDPA also serves where the
extension lacks the kernel.

Bit-packed masks
----------------
Besides the bool ``[N, N]`` / ``[B, N, N]`` mask, every backend accepts the packed form made
by :func:`pack_tree_mask`: int32 ``[N, W]`` / ``[B, N, W]`` with ``W = ceil(N / 32)``, where
bit ``j % 32`` (least significant first) of word ``[i, j // 32]`` is ``mask[i, j]``.  Bits
for ``j >= N`` are ignored.  It is 8x smaller than the bool mask (32x for the bits moved).
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from specdec_kernels import _backend, _library
from specdec_kernels.autotune import RuntimeChoice
from specdec_kernels.checks import (
    FLOAT32_MAX,
    FLOAT_DTYPES,
    INDEX_DTYPES,
    as_real,
    check_kv_layout,
    check_q_layout,
    check_shape,
    check_tensor,
    pool_geometry,
    want_value_checks,
)
from specdec_kernels.ops._torch.tree_attention import sdpa_paged_tree_attention, sdpa_tree_attention
from specdec_kernels.ops._tree_attention_launch import (
    MASK_BOOL,
    MASK_CAUSAL,
    MASK_PACKED,
    MAX_SPLITS,
    choose_num_splits,
)
from specdec_kernels.reference.tree_attention import _tree_attention
from specdec_kernels.reference.tree_attention import paged_tree_attention as _paged_reference

# "native": the C++ CPU kernel (csrc/paged_attention_cpu.cpp; a dense cache is read as the pool of
# B blocks of S slots), the automatic CPU backend of both ops when the extension has it.
IMPLEMENTED = ("reference", "torch", "triton", "native")
PAGED_IMPLEMENTED = ("reference", "torch", "triton", "native")
# The environment variables that force the automatic CPU path of each op ("native" or "torch";
# "auto" or unset: "native").  Only their reading is used (at import and on reset_backends(), a
# ValueError naming the variable for any other value): nothing is measured, see
# automatic_cpu_path and "Automatic CPU path" above.
DENSE_CPU_CHOICE = RuntimeChoice("tree_attention on CPU", ("native", "torch"), env="SPECDEC_DENSE_ATTENTION")
PAGED_CPU_CHOICE = RuntimeChoice("paged_tree_attention on CPU", ("native", "torch"), env="SPECDEC_PAGED_ATTENTION")


def automatic_cpu_path(paged: bool = False) -> str:
    """The path the automatic CPU backend of ``tree_attention`` takes where the extension has
    the C++ kernel: ``"native"``, or ``"torch"`` (SDPA) where ``$SPECDEC_PAGED_ATTENTION``
    (``paged=True``, a paged cache) or ``$SPECDEC_DENSE_ATTENTION`` (a dense cache) says so.

    The same for every shape, batch and call (no timing), so the automatic backend is
    deterministic and row-independent (the module docstring, "Automatic CPU path").  The
    variables are read at import and on ``reset_backends()``.

    Raises:
        ValueError: the variable is set to something other than "auto", "native" or "torch".
    """
    return (PAGED_CPU_CHOICE if paged else DENSE_CPU_CHOICE).forced() or "native"


# head dims every backend takes (multiples of 16 up to 256)
SUPPORTED_HEAD_DIMS = tuple(range(16, 257, 16))


def _check_q_and_caches(q, k_cache, v_cache):
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=q.device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(q.dtype,), device=q.device)
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q's head dim must be one of {SUPPORTED_HEAD_DIMS}, got shape {tuple(q.shape)}")


def _check_heads_seqlens_mask(q, Hkv, cache_seqlens, tree_mask):
    B, N, H, _ = q.shape
    device = q.device
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


def check_tree_attention_args(q, k_cache, v_cache, cache_seqlens, tree_mask, validate=None):
    """Validate the arguments of ``tree_attention`` (dense cache); return (B, N, H, D, Hkv, S)."""
    _check_q_and_caches(q, k_cache, v_cache)
    B, N, H, D = q.shape
    _, Hkv, S, _ = k_cache.shape
    check_shape("k_cache", k_cache, (B, Hkv, S, D), "(batch, kv_heads, capacity, head_dim) matching q")
    check_shape("v_cache", v_cache, (B, Hkv, S, D), "like k_cache")
    _check_heads_seqlens_mask(q, Hkv, cache_seqlens, tree_mask)
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


def blocks_needed(cache_seqlens: torch.Tensor, num_new: int, block_size: int) -> torch.Tensor:
    """Blocks of its table each sequence uses: ceil((cache_seqlens + N) / block_size), int64 [B]."""
    return (cache_seqlens.to(torch.int64) + num_new + block_size - 1) // block_size


def check_paged_tree_attention_args(
    q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, validate=None
):
    """Validate the arguments of ``tree_attention`` over a paged cache.

    Returns (B, N, H, D, Hkv, capacity, block_size, num_blocks), capacity =
    max_blocks_per_seq * block_size.  Shapes, dtypes and devices are always checked; with
    value checks (``validate``, default on for CPU tensors) also cache_seqlens + N <= capacity
    and every block id a sequence uses (its first ceil((cache_seqlens + N) / block_size)
    table entries) in [0, num_blocks).  Entries past those are never read and may hold anything.
    """
    check_kv_layout(kv_layout)
    _check_q_and_caches(q, k_cache, v_cache)
    B, N, H, D = q.shape
    num_blocks, block_size, Hkv, _ = pool_geometry(k_cache, kv_layout)
    what = {
        "NHD": "(num_blocks, block_size, kv_heads, head_dim) for kv_layout='NHD'",
        "HND": "(num_blocks, kv_heads, block_size, head_dim) for kv_layout='HND'",
    }[kv_layout]
    check_shape("k_cache", k_cache, k_cache.shape[:3] + (D,), what + ", head_dim matching q")
    check_shape("v_cache", v_cache, tuple(k_cache.shape), "like k_cache")
    if num_blocks < 1 or block_size < 1:
        raise ValueError(
            f"k_cache must hold at least one block of at least one slot, got shape {tuple(k_cache.shape)} ({what})"
        )
    _check_heads_seqlens_mask(q, Hkv, cache_seqlens, tree_mask)
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, device=q.device)
    max_blocks = block_table.shape[1]
    check_shape(
        "block_table", block_table, (B, max_blocks), "(batch, max_blocks_per_seq): one row of block ids per sequence"
    )
    capacity = max_blocks * block_size
    if N > capacity:
        raise ValueError(
            f"block_table's capacity {max_blocks} blocks x {block_size} slots = {capacity} is smaller than "
            f"the N={N} new keys it must hold (q's dim 1)"
        )
    if want_value_checks(validate, cache_seqlens, block_table) and B:
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0 or hi + N > capacity:
            raise ValueError(
                f"cache_seqlens + N must lie in [N, capacity={capacity}] (block_table has {max_blocks} blocks of "
                f"{block_size} slots; the N new keys are already in the cache), got cache_seqlens in {lo}..{hi} with N={N}"
            )
        used = (
            torch.arange(max_blocks, device=block_table.device)[None, :]
            < blocks_needed(cache_seqlens, N, block_size)[:, None]
        )
        wrong = used & ((block_table < 0) | (block_table >= num_blocks))
        if bool(wrong.any()):
            b, j = (int(x) for x in wrong.nonzero()[0])
            raise ValueError(
                f"block_table entries a sequence uses must lie in [0, num_blocks={num_blocks}); "
                f"block_table[{b}, {j}] = {int(block_table[b, j])}"
            )
    return B, N, H, D, Hkv, capacity, block_size, num_blocks


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
    weights = torch.bitwise_left_shift(
        torch.ones(32, dtype=torch.int64, device=mask.device), torch.arange(32, device=mask.device)
    )
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
        check_shape(
            "tree_mask", tree_mask, (N, W), "bit-packed ancestor mask for the batch, ceil(N/32) int32 words a row"
        )
    else:
        check_shape(
            "tree_mask", tree_mask, (B, N, W), "bit-packed ancestor mask per sequence, ceil(N/32) int32 words a row"
        )


# --------------------------------------------------------------------------------------
# The registered op: torch.ops.specdec.tree_attention
# --------------------------------------------------------------------------------------


def _check_num_splits(num_splits: int) -> None:
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must lie in 1..{MAX_SPLITS} (0: automatic), got {num_splits}")


def _is_packed(tree_mask) -> bool:
    """Whether ``tree_mask`` is the bit-packed int32 form of ``pack_tree_mask``."""
    return isinstance(tree_mask, torch.Tensor) and tree_mask.dtype == torch.int32


def _mask_kind(tree_mask) -> int:
    return MASK_CAUSAL if tree_mask is None else (MASK_PACKED if _is_packed(tree_mask) else MASK_BOOL)


def _bool_mask(tree_mask):
    """``tree_mask`` for the argument checks of the bool form: None when it is packed (checked
    apart, ``_check_packed_and_splits``)."""
    return None if _is_packed(tree_mask) else tree_mask


def _check_packed_and_splits(tree_mask, dims, device, num_splits: int) -> None:
    """The checks both ops add to their cache checks (``dims`` starts with B, N): a packed
    ``tree_mask``'s shape and ``num_splits``."""
    if _is_packed(tree_mask):
        _check_packed_mask(tree_mask, dims[0], dims[1], device)
    _check_num_splits(num_splits)


# --------------------------------------------------------------------------------------
# Launch plans: the eager front's Triton calls, kept per metadata signature
# --------------------------------------------------------------------------------------

_PLANS: dict = {}  # plan key -> the Triton backend's LaunchPlan (metadata only, no tensors)
MAX_PLANS = 256  # signatures kept (a serving loop has a few per layer shape); past them none are added
_backend._ON_RESET.append(_PLANS.clear)  # a plan holds the backend chosen when it was made


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _plan_key(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    tree_mask,
    block_table,
    kv_layout,
    q_layout,
    sm_scale,
    num_splits,
    backend,
    validate,
):
    """The key under which the eager front keeps a call's Triton launch plan, or None when the
    call may not use one: everything the checks and the launch configuration read from the
    arguments (each tensor's shape, strides, dtype and device; the layouts, scale, split count
    and backend), for plain tensors and numbers only and without value checks (``validate``
    False, or None on a device other than the CPU): those read values, which no key holds.
    A call whose key was planned skips the checks it passed before (FlashInfer's plan/run,
    kept by the front)."""
    if torch.compiler.is_compiling():  # traced: the registered op, no plans
        return None
    T = torch.Tensor
    if not (type(q) is T and type(k_cache) is T and type(v_cache) is T and type(cache_seqlens) is T):
        return None
    if (tree_mask is not None and type(tree_mask) is not T) or (block_table is not None and type(block_table) is not T):
        return None
    if q.is_cpu and not _backend.interpreter_on():  # no Triton backend on the CPU: nothing to plan
        return None
    if not (validate is False or (validate is None and not q.is_cpu)):
        return None
    if type(kv_layout) is not str or type(q_layout) is not str or (backend is not None and type(backend) is not str):
        return None
    if (sm_scale is not None and type(sm_scale) not in (float, int)) or (
        num_splits is not None and type(num_splits) is not int
    ):
        return None
    return (
        q_layout,
        kv_layout,
        sm_scale,
        num_splits,
        backend,
        _meta(q),
        _meta(k_cache),
        _meta(v_cache),
        _meta(cache_seqlens),
        _meta(tree_mask),
        _meta(block_table),
    )


def _run_plan(plan_key, q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, sm_scale, splits):
    """The Triton backend on checked arguments: its ``LaunchPlan``, kept under ``plan_key``
    (None: not kept), then run."""
    plan = _backend.triton_launcher("specdec_kernels.ops._triton.tree_attention:plan")(
        q, k_cache, v_cache, cache_seqlens, tree_mask, _mask_kind(tree_mask), sm_scale, splits, block_table, kv_layout
    )
    if plan_key is not None and len(_PLANS) < MAX_PLANS:
        _PLANS[plan_key] = plan
    return plan.run(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table)


def _check_dense(q, k_cache, v_cache, cache_seqlens, tree_mask, num_splits, validate):
    """The checks of the dense op (values with ``validate``); returns (B, N, H, D, Hkv, S)."""
    dims = check_tree_attention_args(q, k_cache, v_cache, cache_seqlens, _bool_mask(tree_mask), validate)
    _check_packed_and_splits(tree_mask, dims, q.device, num_splits)
    return dims


def _triton_splits(num_splits: int, q: torch.Tensor, Hkv: int, capacity: int) -> int:
    """``num_splits``, or for 0 the automatic choice (``choose_num_splits``) for q and a cache of
    ``capacity`` slots a sequence."""
    B, N, H, D = q.shape
    return num_splits or choose_num_splits(B, Hkv, N, H // Hkv, capacity, D, q.device, q.dtype == torch.float32)


def _dense(
    name: str, backend: str, q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale, num_splits, Hkv, S, plan_key=None
):
    """Backend ``name`` (chosen for the explicit ``backend``, "" automatic) of the dense op on
    checked arguments: the op's kernel after its checks, and the front's eager path (which
    passes ``plan_key`` to keep the Triton launch plan, ``_run_plan``)."""
    if name == "triton":
        splits = _triton_splits(num_splits, q, Hkv, S)
        return _run_plan(plan_key, q, k_cache, v_cache, cache_seqlens, tree_mask, None, "NHD", sm_scale, splits)
    mask = unpack_tree_mask(tree_mask, q.shape[1]) if _is_packed(tree_mask) else tree_mask

    if name == "native" and not backend:
        name = automatic_cpu_path(paged=False)  # the C++ kernel unless $SPECDEC_DENSE_ATTENTION=torch
    return _dense_run(name, q, k_cache, v_cache, cache_seqlens, mask, sm_scale)


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
    _, _, _, _, Hkv, S = _check_dense(q, k_cache, v_cache, cache_seqlens, tree_mask, num_splits, validate=False)
    name = _backend.resolve("tree_attention", q.device, backend or None, IMPLEMENTED)
    return _dense(name, backend, q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale, num_splits, Hkv, S)


def _dense_run(name, q, k_cache, v_cache, cache_seqlens, mask, sm_scale):
    if name == "native":
        return torch.ops.specdec_native.tree_attention(q, k_cache, v_cache, cache_seqlens, mask, sm_scale)
    if name == "torch":
        return sdpa_tree_attention(q, k_cache, v_cache, cache_seqlens, mask, sm_scale).contiguous()
    return _tree_attention(q, k_cache, v_cache, cache_seqlens, mask, sm_scale).contiguous()


def _fake(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale, num_splits=0, backend=""):
    _check_dense(q, k_cache, v_cache, cache_seqlens, tree_mask, num_splits, validate=False)
    _library.check_backend_name(backend)
    torch._check(q.dim() == 4 and k_cache.dim() == 4, lambda: "q and k_cache must have 4 dimensions")
    torch._check(q.shape[2] % k_cache.shape[1] == 0, lambda: "q's heads must be a multiple of k_cache's heads")
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


op = _library.define("tree_attention", _impl, fake=_fake, implemented=IMPLEMENTED, decompose_to_triton=True)


# --------------------------------------------------------------------------------------
# The registered op over a paged cache: torch.ops.specdec.paged_tree_attention
# --------------------------------------------------------------------------------------


def _check_paged(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, num_splits, validate):
    """The checks of the paged op (values with ``validate``); returns the paged geometry."""
    dims = check_paged_tree_attention_args(
        q, k_cache, v_cache, cache_seqlens, _bool_mask(tree_mask), block_table, kv_layout, validate=validate
    )
    _check_packed_and_splits(tree_mask, dims, q.device, num_splits)
    return dims


def _paged(
    name: str,
    backend: str,
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    tree_mask,
    block_table,
    kv_layout,
    sm_scale,
    num_splits,
    Hkv,
    capacity,
    plan_key=None,
):
    """Backend ``name`` (chosen for the explicit ``backend``, "" automatic) of the paged op on
    checked arguments: the op's kernel after its checks, and the front's eager path (which
    passes ``plan_key`` to keep the Triton launch plan, ``_run_plan``)."""
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)  # the kernels read int32 ids (vLLM's); int64 tables are converted
    if name == "triton":
        splits = _triton_splits(num_splits, q, Hkv, capacity)
        return _run_plan(
            plan_key, q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, sm_scale, splits
        )
    mask = unpack_tree_mask(tree_mask, q.shape[1]) if _is_packed(tree_mask) else tree_mask

    if name == "native" and not backend:
        name = automatic_cpu_path(paged=True)  # the C++ kernel unless $SPECDEC_PAGED_ATTENTION=torch
    if name == "native":
        return torch.ops.specdec_native.paged_tree_attention(
            q, k_cache, v_cache, cache_seqlens, mask, block_table, kv_layout, sm_scale
        )
    if name == "torch":
        return sdpa_paged_tree_attention(
            q, k_cache, v_cache, cache_seqlens, mask, block_table, kv_layout, sm_scale
        ).contiguous()
    return _paged_reference(q, k_cache, v_cache, cache_seqlens, mask, block_table, kv_layout, sm_scale).contiguous()


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
    _, _, _, _, Hkv, capacity, _, _ = _check_paged(
        q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, num_splits, validate=False
    )
    name = _backend.resolve("paged_tree_attention", q.device, backend or None, PAGED_IMPLEMENTED)
    args = (q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, sm_scale, num_splits)
    return _paged(name, backend, *args, Hkv, capacity)


def _paged_fake(
    q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, sm_scale, num_splits=0, backend=""
):
    _check_paged(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, num_splits, validate=False)
    _library.check_backend_name(backend)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


paged_op = _library.define(
    "paged_tree_attention", _paged_impl, fake=_paged_fake, implemented=PAGED_IMPLEMENTED, decompose_to_triton=True
)


def _split_kv(k_cache, v_cache):
    """(k_cache, v_cache): with v_cache None, k_cache is one layer's keys and values in one
    5-D tensor, keys at [0] and values at [1] (vLLM's per-layer ``kv_cache``), split into views."""
    if v_cache is not None:
        return k_cache, v_cache
    check_tensor("k_cache", k_cache, ndim=5)
    if k_cache.shape[0] != 2:
        raise ValueError(
            "with v_cache None, k_cache must hold one layer's keys and values, shape (2, batch, kv_heads, capacity, "
            "head_dim) or, paged, (2, num_blocks, block_size, kv_heads, head_dim) (vLLM's per-layer kv_cache; HND: "
            f"(2, num_blocks, kv_heads, block_size, head_dim)), got {tuple(k_cache.shape)}"
        )
    return k_cache[0], k_cache[1]


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    cache_seqlens: torch.Tensor,
    tree_mask: Optional[torch.Tensor] = None,
    *,
    block_table: Optional[torch.Tensor] = None,
    kv_layout: str = "NHD",
    q_layout: str = "NHD",
    sm_scale: Optional[float] = None,
    num_splits: Optional[int] = None,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> torch.Tensor:
    """Attention of a draft token tree's queries to the cached prefix and their ancestors.

    Tree attention as in SpecInfer (Miao et al. 2024) and Medusa (Cai et al. 2024): the N new
    tokens' keys and values are already written at cache slots cache_seqlens[b] ..
    cache_seqlens[b] + N - 1; each query sees the whole prefix and the new keys of its own
    ancestors (and itself).  Computed densely in float64 with -inf masking, then cast.  A
    paged cache (``block_table`` given; PagedAttention, Kwon et al. 2023) is first gathered
    into the dense form through the block table (block ids clamped into the pool), then the
    same math runs.

    Args:
        q: Shape (batch, N, heads, head_dim) (``q_layout="NHD"``, the default) or (batch,
            heads, N, head_dim) (``q_layout="HND"``), float32/float16/bfloat16.  head_dim a
            multiple of 16 up to 256.
        k_cache, v_cache: q's dtype.  Dense (block_table None): shape (batch, kv_heads,
            capacity, head_dim).  Paged: pools of blocks, shape (num_blocks, block_size,
            kv_heads, head_dim) for kv_layout "NHD" (vLLM's and FlashInfer's default) or
            (num_blocks, kv_heads, block_size, head_dim) for "HND"; any block_size >= 1.
            heads must be a multiple of kv_heads (GQA; query head h reads kv head
            h // (heads / kv_heads)).  With v_cache None, k_cache holds both: one layer's
            keys and values as one tensor (2, ...) of either form, keys at [0] and values at
            [1] (vLLM's per-layer ``kv_cache``, (2, num_blocks, block_size, kv_heads,
            head_dim)); any strides.
        cache_seqlens: Shape (batch,), int32/int64: committed tokens per sequence, with
            cache_seqlens + N <= capacity.
        tree_mask: bool, shape (N, N) or (batch, N, N); mask[i, j] is true when node j is node
            i or one of its ancestors.  None means the causal chain.
        block_table: None (dense cache) or int32/int64 (vLLM's int32 read in place, int64
            converted), shape (batch, max_blocks_per_seq): logical
            slot s of sequence b lives at offset s % block_size of physical block
            block_table[b, s // block_size]; capacity = max_blocks_per_seq * block_size.
            Blocks may come in any order and be shared between sequences (a common prefix).
            Entries past the ceil((cache_seqlens[b] + N) / block_size) blocks a sequence
            uses are never read and may hold anything (-1 padding).
        kv_layout: "NHD" or "HND", the layout of the paged pools (ignored for a dense cache).
        q_layout: "NHD" (default: q is (batch, N, heads, head_dim)) or "HND" (q is (batch,
            heads, N, head_dim), the layout transformers' attention functions receive), as
            FlashInfer names them; the output comes back in q's layout.  Said, not guessed:
            when N equals heads the shapes cannot tell the two apart.  HND is read through
            a transposed view (no copy; the kernels take strided q) and its output is a
            transposed view of the (batch, N, heads, head_dim) result, so
            ``out.transpose(1, 2)`` is (batch, N, heads, head_dim) and contiguous, what a
            transformers attention function returns.
        sm_scale: softmax scale, a finite real number within float32's range, default
            head_dim ** -0.5.
        tree_mask: also the bit-packed int32 form of ``pack_tree_mask``,
            shape (N, ceil(N/32)) or (batch, N, ceil(N/32)).
        num_splits: Triton backend only (others ignore it): split each sequence's prefix
            across at most this many programs and combine by log-sum-exp (flash-decoding),
            each holding at least 256 keys of the sequence's length (a shorter prefix uses
            fewer, chosen on the device); None chooses from the SM count on CUDA
            (``choose_num_splits``).  1..256.

    Returns:
        q's shape and layout: (batch, N, heads, head_dim), or (batch, heads, N, head_dim)
        with ``q_layout="HND"``; q's dtype.

    Raises:
        TypeError: wrong dtypes (k/v must share q's dtype; the mask must be bool; the block
            table int32 or int64).
        ValueError: wrong ranks or shapes (with v_cache None: k_cache not 5-D (2, ...)),
            heads not a multiple of kv_heads, unsupported head_dim, a kv_layout or q_layout
            other than "NHD"/"HND" (TypeError when not a str), sm_scale NaN, infinite or beyond float32's range, cache_seqlens + N
            beyond capacity,
            a used block id outside [0, num_blocks) (the last two checked on CPU tensors).

    Example:
        >>> pool = torch.randn(8, 16, 3, 64)            # 8 blocks of 16 slots, NHD
        >>> table = torch.tensor([[5, 2, -1]], dtype=torch.int32)  # slots 0..31 of sequence 0
        >>> q = torch.randn(1, 4, 9, 64)                 # 4 new tokens at slots 20..23
        >>> tree_attention(q, pool, pool, torch.tensor([20]), block_table=table).shape
        torch.Size([1, 4, 9, 64])

    Registered as ``torch.ops.specdec.tree_attention``. backend: None (automatic, chosen once
    per process and device type), "reference", "native", "triton" or "torch". validate: None
    (value checks on CPU tensors only), True or False (docs/API.md#backends).

    A query that sees no key at all (cache_seqlens 0 and an empty mask row) has an
    undefined output (NaN from the reference and the Triton kernel).  Cache slots a sequence
    cannot see never affect its output, whatever they hold: for a paged cache that includes
    the rest of its last block, other sequences' blocks and unused blocks of the pool.  With
    ``validate=False`` a used block id outside [0, num_blocks) is clamped into the pool (as
    the reference does): the result is then unspecified, but nothing outside the pool is read.
    With ``block_table`` the call goes to ``torch.ops.specdec.paged_tree_attention``
    ``(q, k_cache, v_cache, cache_seqlens, tree_mask?, block_table, kv_layout, sm_scale,
    num_splits=0, backend)``.  Both registered ops take q as (batch, N, heads, head_dim); the
    front hands them the transposed view of an HND q.
    """
    plan_key = _plan_key(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        tree_mask,
        block_table,
        kv_layout,
        q_layout,
        sm_scale,
        num_splits,
        backend,
        validate,
    )
    if plan_key is not None:
        plan = _PLANS.get(plan_key)  # this signature passed the checks before: the launches only
        if plan is not None and _library.direct_call(
            q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, grad_check=True
        ):
            if q_layout == "HND":
                q = q.transpose(1, 2)
            if block_table is not None and block_table.dtype != torch.int32:
                block_table = block_table.to(torch.int32)  # as ``_paged`` does
            out = plan.run(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table)
            return out.transpose(1, 2) if q_layout == "HND" else out
    check_kv_layout(kv_layout)
    heads_first = check_q_layout(q_layout) == "HND"
    if heads_first and isinstance(q, torch.Tensor) and q.dim() == 4:
        q = q.transpose(1, 2)  # (batch, N, heads, head_dim): a view, checked and computed as such
    k_cache, v_cache = _split_kv(k_cache, v_cache)
    try:
        if block_table is None:
            dims = _check_dense(q, k_cache, v_cache, cache_seqlens, tree_mask, 0, validate)
        else:
            dims = _check_paged(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, 0, validate)
    except ValueError as e:
        if heads_first and re.search(r"\bq\b|q's", str(e)):
            raise ValueError(
                f"{e} (q_layout='HND': q is (batch, heads, N, head_dim), checked as its (batch, N, heads, "
                "head_dim) transpose)"
            ) from None
        raise
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int):
            raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must lie in 1..{MAX_SPLITS}, got {num_splits}")
    scale = dims[3] ** -0.5 if sm_scale is None else float(as_real("sm_scale", sm_scale, finite=True))
    if abs(scale) > FLOAT32_MAX:  # checked as given: the kernels scale in float32, where it would be inf
        raise ValueError(f"sm_scale must fit float32 (|sm_scale| <= {FLOAT32_MAX:.4g}), got {sm_scale}")
    splits = num_splits or 0
    direct = _library.direct_call(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, grad_check=True)
    if block_table is not None:
        args = (q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, scale, splits)
        if direct:  # eager: checked once, no dispatcher
            name = _backend.resolve("paged_tree_attention", q.device, backend or None, PAGED_IMPLEMENTED)
            out = _paged(name, backend or "", *args, dims[4], dims[5], plan_key)
        else:
            out = torch.ops.specdec.paged_tree_attention(*args, backend or "")
    else:
        args = (q, k_cache, v_cache, cache_seqlens, tree_mask, scale, splits)
        if direct:
            name = _backend.resolve("tree_attention", q.device, backend or None, IMPLEMENTED)
            out = _dense(name, backend or "", *args, dims[4], dims[5], plan_key)
        else:
            out = torch.ops.specdec.tree_attention(*args, backend or "")
    return out.transpose(1, 2) if heads_first else out
