"""The fronts' eager path: when a front may skip the dispatcher, and constants without kernels.

A leaf module (torch only), so that ``specdec_kernels.checks`` can use it.  See
``specdec_kernels._library``'s docstring for the one-dispatch-layer rule these serve.
"""

from __future__ import annotations

from typing import Dict, List

import torch


def _only_observers() -> bool:
    """Whether every active ``TorchDispatchMode`` only observes (declares
    ``specdec_observer = True``, as ``specdec_kernels.bench.host_cost.KernelCounter`` does)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return all(getattr(mode, "specdec_observer", False) for mode in _get_current_dispatch_mode_stack())


_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_level = torch._C._functorch.peek_interpreter_stack
_grad_enabled = torch.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad
_Tensor = torch.Tensor


def direct_call(*tensors, grad_check: bool = False) -> bool:
    """Whether a front may call its backend directly (the eager path: one check pass, no
    dispatcher) rather than through its registered op.

    True for plain eager calls: not traced by torch.compile or export, no ``TorchDispatchMode``
    (fake tensors, functionalization, proxy tracing) but observers, no functorch transform,
    every tensor of ``tensors`` (None allowed) a plain ``torch.Tensor`` with data (not on the
    meta device).  With ``grad_check``
    (the inference-only ops with floating-point or in-place outputs) also False when grad mode
    is on and a tensor requires grad, so that the registered op's Autograd kernel raises its
    ValueError.  Anything False here goes through the registered op, which behaves the same.
    """
    if _is_compiling() or _functorch_level() is not None:
        return False
    if _dispatch_modes() and not _only_observers():
        return False
    for t in tensors:  # meta tensors: the registered op's fake kernel computes their shapes
        if t is not None and (type(t) is not _Tensor or t.is_meta):
            return False
    if grad_check and _grad_enabled() and _any_requires_grad(*[t for t in tensors if t is not None]):
        return False
    return True


# --------------------------------------------------------------------------------------
# Constant tensors without a kernel per call
# --------------------------------------------------------------------------------------

_FILLED: Dict[tuple, torch.Tensor] = {}  # (value key, dtype, device) -> [capacity] tensor of the value
_RETIRED: List[torch.Tensor] = []  # outgrown buffers: kept alive, a captured CUDA graph may read them
_VIEWS: Dict[tuple, torch.Tensor] = {}  # (value key, dtype, device, size) -> the buffer's first size entries
MAX_FILLED = 64  # distinct constants cached; past them torch.full serves
MAX_VIEWS = 1024  # (constant, size) pairs whose view is kept; past them a view is made per call


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def filled(size: int, value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of ``size`` copies of ``value`` (a Python number) that the caller only reads
    (counts left out, sampling parameters given as numbers, dummy arguments).

    On the eager path (``direct_call()``) a view of a cached buffer: no kernel and no
    allocation per call.  A buffer that grows leaves the old one alive (a CUDA graph that
    captured a view of it stays valid); none is created during a CUDA-graph capture or inside
    inference mode's tensors (they are normal tensors, usable in and out of it).  Elsewhere
    (torch.compile, fake tensors, dispatch modes) ``torch.full``, which tracing records.

    Args:
        size: the length, >= 0.
        value: an int or a float (checked by the caller; bools are not expected).
        dtype, device: the tensor's.

    Returns:
        A [size] tensor of ``value``; never write into it.
    """
    if not direct_call():
        return torch.full((size,), value, dtype=dtype, device=device)
    vkey = (value.hex() if isinstance(value, float) else value, dtype, device, size)
    view = _VIEWS.get(vkey)
    if view is not None:
        return view
    key = vkey[:3]
    buf = _FILLED.get(key)
    if buf is None or buf.shape[0] < size:
        if (buf is None and len(_FILLED) >= MAX_FILLED) or _capturing(device):
            return torch.full((size,), value, dtype=dtype, device=device)
        if buf is not None:
            _RETIRED.append(buf)
        with torch.inference_mode(False):
            buf = _FILLED[key] = torch.full(
                (max(size, 2 * buf.shape[0] if buf is not None else 8),), value, dtype=dtype, device=device
            )
    with torch.inference_mode(False):
        view = buf[:size]
    if len(_VIEWS) < MAX_VIEWS:
        _VIEWS[vkey] = view
    return view
