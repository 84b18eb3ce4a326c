"""Lazy loading of the compiled extension ``specdec_kernels._C``.

The extension registers its ops with torch.library under the ``specdec`` namespace
(``torch.ops.specdec.<name>``).  It is loaded on first use, never at import, and when it is
missing the package says so once and falls back to the reference.
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
            # fake (meta) kernels, so torch.compile traces direct calls of the native ops
            from specdec_kernels.ops import compact_kv_cache

            compact_kv_cache.register_fake()
        except (ImportError, OSError) as e:
            _state["loaded"], _state["error"] = False, e
    return bool(_state["loaded"])


def has_kernel(name: str, device_type: str) -> bool:
    """Whether ``torch.ops.specdec.<name>`` has a kernel for ``device_type`` ('cpu' or 'cuda')."""
    if not load():
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"specdec::{name}", key)
    except RuntimeError:
        return False


def warn_fallback(name: str, device_type: str) -> None:
    """Warn once per (op, device) that the native op is missing and the reference runs instead."""
    if (name, device_type) in _warned:
        return
    _warned.add((name, device_type))
    why = f"the extension failed to load ({_state['error']})" if _state["loaded"] is False else f"it has no {device_type} kernel"
    warnings.warn(
        f"specdec_kernels: native op specdec::{name} is unavailable ({why}); "
        f"falling back to the PyTorch reference. Build it with `pip install --no-build-isolation -e .`.",
        RuntimeWarning,
        stacklevel=3,
    )
