"""Lazy loading of the compiled extension ``specdec_kernels._C``.

The extension registers its kernels with torch.library in two namespaces of their own, kept out
of the public one: ``torch.ops.specdec_native.<name>``, the native backends of the public ops
(which are declared in Python, ``specdec_kernels._library``, in ``torch.ops.specdec``, and
dispatch to them), and ``torch.ops.specdec_engine.<name>``, the engine's model kernels (packed
products, RMSNorm, the one-call decoder layer), whose fakes are registered here.  It is loaded on first use
(the first op call that could use it), never at import, and when it is missing the package
says so once and falls back to the reference.  This module imports nothing of the package.
"""

from __future__ import annotations

import warnings

import torch

_state = {"loaded": None, "error": None}
_warned = set()


def load() -> bool:
    """Import the extension once; return whether it loaded."""
    if _state["loaded"] is None:
        try:
            from specdec_kernels import _C  # noqa: F401  (registers torch.ops.specdec.*)

            _state["loaded"] = True
            # fake (meta) kernel, so torch.compile also traces direct calls of the native op
            if hasattr(torch.ops.specdec_native, "compact_kv_cache"):
                torch.library.register_fake("specdec_native::compact_kv_cache")(_compact_kv_cache_native_fake)
            if hasattr(torch.ops.specdec_native, "paged_compact_kv_cache"):
                torch.library.register_fake("specdec_native::paged_compact_kv_cache")(
                    _paged_compact_kv_cache_native_fake
                )
            if hasattr(torch.ops.specdec_native, "paged_tree_attention"):
                torch.library.register_fake("specdec_native::paged_tree_attention")(_paged_tree_attention_native_fake)
            for name, fake in _ENGINE_FAKES.items():  # the engine's kernels (specdec_engine)
                if hasattr(torch.ops.specdec_engine, name):
                    torch.library.register_fake(f"specdec_engine::{name}")(fake)
        except (ImportError, OSError) as e:
            _state["loaded"], _state["error"] = False, e
    return bool(_state["loaded"])


def _check_fake_caches(caches, first_form: str, buffer_form: str):
    """The fakes' checks of a compaction op's ``caches`` list (4-D tensors and/or 6-D
    [L, 2, ...] buffers of one dtype and device, all ending in the same 4 dims); returns those
    4 dims.  ``first_form`` / ``buffer_form`` name the expected layouts in the messages."""
    torch._check(len(caches) > 0, lambda: "caches must hold at least one tensor")
    first = caches[0]
    torch._check(first.dim() in (4, 6), lambda: f"caches[0] must be {first_form}, got {tuple(first.shape)}")
    inner = first.shape[-4:]
    for k, t in enumerate(caches):
        torch._check(t.dim() in (4, 6), lambda: f"caches[{k}] must have 4 or 6 dimensions, got {tuple(t.shape)}")
        torch._check(t.dtype == first.dtype, lambda: f"caches[{k}] must have dtype {first.dtype}, got {t.dtype}")
        torch._check(t.device == first.device, lambda: f"caches[{k}] must be on {first.device}, got {t.device}")
        for d in range(4):
            torch._check(
                t.shape[t.dim() - 4 + d] == inner[d],
                lambda: f"caches[{k}] must end in {tuple(inner)}, got {tuple(t.shape)}",
            )
        if t.dim() == 6:
            torch._check(t.shape[1] == 2, lambda: f"caches[{k}] must be {buffer_form}, got {tuple(t.shape)}")
    return inner


def _check_fake_index_tensors(batch: int, named) -> None:
    """The fakes' checks of a compaction op's index tensors: ``named`` holds (name, tensor,
    ndim) triples, each an int32/int64 tensor of that rank with ``batch`` rows."""
    for name, t, ndim in named:
        torch._check(t.dtype in (torch.int32, torch.int64), lambda: f"{name} must be int32 or int64, got {t.dtype}")
        torch._check(t.dim() == ndim, lambda: f"{name} must have {ndim} dimensions, got {tuple(t.shape)}")
        torch._check(t.shape[0] == batch, lambda: f"{name} must have {batch} rows, got {tuple(t.shape)}")


def _compact_kv_cache_native_fake(caches, cache_seqlens, accepted_indices, num_accepted, validate=False):
    """Fake (meta) implementation of specdec_native::compact_kv_cache: shape checks, no output."""
    inner = _check_fake_caches(caches, "[B, Hkv, S, D] or [L, 2, B, Hkv, S, D]", "[L, 2, B, Hkv, S, D]")
    _check_fake_index_tensors(
        inner[0],
        (
            ("cache_seqlens", cache_seqlens, 1),
            ("accepted_indices", accepted_indices, 2),
            ("num_accepted", num_accepted, 1),
        ),
    )
    return None


def _paged_compact_kv_cache_native_fake(
    caches, cache_seqlens, accepted_indices, num_accepted, block_table, kv_layout="NHD", validate=False
):
    """Fake (meta) implementation of specdec_native::paged_compact_kv_cache: shape checks, no
    output.  ``caches``: [num_blocks, block_size, Hkv, D] ("NHD") or [num_blocks, Hkv,
    block_size, D] ("HND") pools and/or [L, 2, ...] buffers of them."""
    torch._check(kv_layout in ("NHD", "HND"), lambda: f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    _check_fake_caches(caches, "a 4-D pool or a 6-D [L, 2, ...] buffer", "[L, 2, ...] (keys and values)")
    B = cache_seqlens.shape[0] if cache_seqlens.dim() == 1 else -1
    _check_fake_index_tensors(
        B,
        (
            ("cache_seqlens", cache_seqlens, 1),
            ("accepted_indices", accepted_indices, 2),
            ("num_accepted", num_accepted, 1),
            ("block_table", block_table, 2),
        ),
    )
    return None


# ---------------------------------------------------------------- the engine's kernels' fakes
# Shapes and dtypes only (FakeTensor / torch.compile tracing of the engine's model); the checks
# are the kernels' own.  specdec_engine::packed_weight has none: its outputs' shapes (and whether
# there is a packed form at all) depend on the weight's values, and it runs once at load time.


def _rows_by(x, out_features):
    torch._check(x.dim() == 2, lambda: f"x must be [R, I], got {tuple(x.shape)}")
    return x.new_empty((x.shape[0], out_features), dtype=torch.float32)


def _packed_linear_fake(x, codes, scales, mins, kind, portable=False):
    """specdec_engine::packed_linear: float32 [R, O], O the codes' rows."""
    return _rows_by(x, codes.shape[0])


def _packed_linear_int8_fake(x, qw, dw, mw, kind, out_features, isa=0):
    """specdec_engine::packed_linear_int8: float32 [R, out_features]."""
    return _rows_by(x, out_features)


def _rms_norm_fake(x, weight, eps):
    """specdec_engine::rms_norm: like x (float32, contiguous)."""
    return x.new_empty(x.shape)


def _silu_mul_fake(gate_up):
    """specdec_engine::silu_mul: float32 [..., I] from gate_up [..., 2 I] (contiguous)."""
    torch._check(gate_up.shape[-1] % 2 == 0, lambda: "gate_up's last dimension must be even")
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def _decoder_layer_fake(
    x,
    attn_norm,
    ffn_norm,
    eps,
    cos,
    sin,
    k_cache,
    v_cache,
    cache_seqlens,
    tree_mask,
    qkv_bias,
    weights,
    kinds,
    out_features,
    num_heads,
    num_kv_heads,
    isa=0,
):
    """specdec_engine::decoder_layer: the layer's output, like x [B, N, hidden] (the caches are
    written in place)."""
    return _layers_output("decoder_layer", x, k_cache, v_cache)


def _layers_output(op: str, x, *caches):
    """The output of ``op``, a run of decoder layers: like x [B, N, hidden].  A cache on another
    device than x (a meta tensor among real ones sends the call here, not to the kernel) is
    refused, as the kernel refuses caches off the CPU."""
    torch._check(x.dim() == 3, lambda: f"x must be [B, N, hidden], got {tuple(x.shape)}")
    if any(c.device != x.device for c in caches):
        raise ValueError(f"{op}: the caches must be CPU tensors on x's device ({x.device})")
    return x.new_empty(x.shape)


def _decoder_stack_fake(
    x,
    norms,
    eps,
    cos,
    sin,
    kv_cache,
    cache_seqlens,
    tree_mask,
    qkv_biases,
    weights,
    kinds,
    out_features,
    num_heads,
    num_kv_heads,
    isa=0,
):
    """specdec_engine::decoder_stack: the last layer's output, like x [B, N, hidden] (the caches
    of the layers run are written in place)."""
    return _layers_output("decoder_stack", x, kv_cache)


_ENGINE_FAKES = {
    "packed_linear": _packed_linear_fake,
    "packed_linear_int8": _packed_linear_int8_fake,
    "rms_norm": _rms_norm_fake,
    "silu_mul": _silu_mul_fake,
    "decoder_layer": _decoder_layer_fake,
    "decoder_stack": _decoder_stack_fake,
}


def _paged_tree_attention_native_fake(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, kv_layout, sm_scale):
    """Fake (meta) implementation of specdec_native::paged_tree_attention: shape checks, an
    output like q (contiguous).  Pools [num_blocks, block_size, Hkv, D] ("NHD") or
    [num_blocks, Hkv, block_size, D] ("HND"); tree_mask None or bool [N, N] / [B, N, N]."""
    torch._check(kv_layout in ("NHD", "HND"), lambda: f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    torch._check(q.dim() == 4, lambda: f"q must be [B, N, H, D], got {tuple(q.shape)}")
    torch._check(
        k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
        lambda: (
            f"k_cache and v_cache must be 4-D pools of one shape, got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        ),
    )
    torch._check(
        k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, lambda: "k_cache and v_cache must have q's dtype"
    )
    torch._check(k_cache.shape[3] == q.shape[3], lambda: "k_cache's head dim must match q's")
    Hkv = k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]
    torch._check(q.shape[2] % Hkv == 0, lambda: "q's heads must be a multiple of k_cache's heads")
    torch._check(
        block_table.dim() == 2 and block_table.shape[0] == q.shape[0] and block_table.dtype == torch.int32,
        lambda: "block_table must be int32 [B, max_blocks_per_seq]",
    )
    torch._check(cache_seqlens.dim() == 1 and cache_seqlens.shape[0] == q.shape[0], lambda: "cache_seqlens must be [B]")
    if tree_mask is not None:
        torch._check(
            tree_mask.dtype == torch.bool and tree_mask.dim() in (2, 3),
            lambda: "tree_mask must be bool [N, N] or [B, N, N]",
        )
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def cast_in_place_layout(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` without materialising its expanded dimensions: the distinct elements
    (size 1 along every stride-0 dimension) are converted, then expanded back to ``t``'s shape,
    so an expanded [B, K, V] input costs the memory of its one stored row, not of B * K rows.
    ``t`` itself when it already has ``dtype``."""
    if t.dtype == dtype:
        return t
    core = t[tuple(slice(0, 1) if st == 0 and n > 0 else slice(None) for st, n in zip(t.stride(), t.shape))]
    return core.to(dtype).expand(t.shape)


def probs_operands(target: torch.Tensor, draft):
    """Target and draft probabilities as the C++ kernels take them: of one dtype (mixed dtypes
    both in float32, as the references compute; converted without materialising expanded
    dimensions), in their own layout (the kernels read any strides in place); ``draft`` may be
    None."""
    p, q = target, draft
    if q is not None and q.dtype != p.dtype:
        p, q = cast_in_place_layout(p, torch.float32), cast_in_place_layout(q, torch.float32)
    return p, q


NAMESPACES = ("specdec_native", "specdec_engine")  # the ops' backends, the engine's kernels


def has_kernel(name: str, device_type: str) -> bool:
    """Whether the extension has a ``device_type`` ('cpu' or 'cuda') kernel for op ``name``
    (``torch.ops.specdec_native.<name>``, an op's backend, or ``torch.ops.specdec_engine.<name>``,
    an engine kernel)."""
    if not load():
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    for namespace in NAMESPACES:
        try:
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::{name}", key):
                return True
        except RuntimeError:  # no such op in this namespace
            continue
    return False


def build_info() -> dict:
    """What ``setup.py`` recorded about the extension's build (``_build_info.json``), or {}."""
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build_info.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def warn_fallback(name: str, device_type: str) -> None:
    """Warn once per (op, device) that the native op is missing and the reference runs instead."""
    if (name, device_type) in _warned:
        return
    _warned.add((name, device_type))
    why = (
        f"the extension failed to load ({_state['error']})"
        if _state["loaded"] is False
        else f"it has no {device_type} kernel"
    )
    build = build_info()
    if build and not build.get("extension"):
        why += f"; at install: {build.get('reason')}"
    warnings.warn(
        f"specdec_kernels: native op specdec_native::{name} is unavailable ({why}); "
        f"falling back to the PyTorch reference. Build it with `pip install --no-build-isolation -e .`.",
        RuntimeWarning,
        stacklevel=3,
    )
