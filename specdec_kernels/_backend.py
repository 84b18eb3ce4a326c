"""Backend choice for the public ops.

Backends: ``"reference"`` (plain PyTorch, everywhere), ``"triton"`` (Triton kernels on CUDA
tensors, or on CPU tensors in the interpreter when ``TRITON_INTERPRET=1`` was set before
the kernels were imported), ``"native"`` (the C++/CUDA extension) and ``"torch"`` (a fast
path composed of PyTorch's own fused CPU/CUDA kernels, for ops where that beats the
reference on CPU, e.g. attention through ``scaled_dot_product_attention``).

Each public op takes ``backend=None``; ``None`` reads the ``SPECDEC_BACKEND`` environment
variable and otherwise chooses automatically: Triton or native on CUDA, native on CPU where
the extension has the op, then the "torch" fast path where the op has one, else the reference.  An explicit ``backend=`` that the op or the
device cannot serve is an error; ``SPECDEC_BACKEND`` names a preference and ops without that
backend choose automatically.  The Triton interpreter is never chosen automatically.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional, Sequence

import torch

from specdec_kernels import _native

BACKENDS = ("reference", "triton", "native", "torch")
ENV_VAR = "SPECDEC_BACKEND"


_TRITON = {}


def triton_available() -> bool:
    """Whether triton imports.  Asked only when a Triton kernel could run (a CUDA tensor, or
    an explicit / preferred ``"triton"``), so the import (about a second) is paid then, not
    when the package is imported."""
    if "ok" not in _TRITON:
        if importlib.util.find_spec("triton") is None:
            _TRITON["ok"] = False
        else:
            try:
                import triton  # noqa: F401
            except ImportError:
                _TRITON["ok"] = False
            else:
                _TRITON["ok"] = True
    return _TRITON["ok"]


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _can_run(backend: str, op: str, device: torch.device) -> Optional[str]:
    """None when ``backend`` can run ``op`` on ``device``; otherwise the reason it cannot."""
    if backend in ("reference", "torch"):
        return None
    if backend == "triton":
        if not triton_available():
            return "triton is not installed"
        if device.type == "cuda" or (device.type == "cpu" and interpreter_on()):
            return None
        return f"Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors (got {device.type})"
    if backend == "native":
        if _native.has_kernel(op, device.type):
            return None
        return f"the extension specdec_kernels._C has no {device.type} kernel for {op}"
    return f"unknown backend (choose from {BACKENDS})"


def resolve(op: str, device: torch.device, backend: Optional[str], implemented: Sequence[str]) -> str:
    """Pick the backend that runs ``op`` on ``device``.

    Args:
        op: the op's name.
        device: the device of its tensors.
        backend: the caller's ``backend=`` argument, or None.
        implemented: the backends this op has, e.g. ("reference", "triton").

    Raises:
        ValueError: an explicit ``backend`` unknown, not implemented for ``op``, or unable to
            run on ``device`` (the message says why).
    """
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend not in implemented:
            raise ValueError(f"backend={backend!r}: {op} has no such backend (it has {tuple(implemented)})")
        reason = _can_run(backend, op, device)
        if reason:
            raise ValueError(f"backend={backend!r} cannot run {op}: {reason}")
        return backend
    preferred = os.environ.get(ENV_VAR)
    if preferred:
        if preferred not in BACKENDS:
            raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {preferred!r}")
        if preferred in implemented and _can_run(preferred, op, device) is None:
            return preferred
    if device.type == "cuda":
        for fast in ("native", "triton"):
            if fast in implemented and _can_run(fast, op, device) is None:
                return fast
    else:
        if "native" in implemented:
            if _can_run("native", op, device) is None:
                return "native"
            if "torch" not in implemented:
                _native.warn_fallback(op, device.type)
        if "torch" in implemented:
            return "torch"
    return "reference"


BACKEND_DOC = """
    Backend and checks (the Python front):
        backend: None (automatic; see ``specdec_kernels._backend``), "reference", "triton",
            "native" or "torch".  ValueError if the op or device cannot serve an explicit choice.
        validate: run the value checks (index ranges, parent order, probabilities in range)
            that read tensor contents; None means on for CPU tensors and off on CUDA (they
            would synchronise).  With validate=False nothing reads tensor values on the host,
            so the call can be captured in a CUDA graph and compiled with
            ``torch.compile(fullgraph=True)``; the kernels still never read or write outside
            their tensors (counts and indices are clamped).
"""


def public_doc(reference_fn, op_name: str) -> str:
    """The public op's docstring: the reference's (without its "(reference)" tag), the
    registered op's name, and the backend arguments."""
    doc = (reference_fn.__doc__ or "").rstrip().replace(" (reference).", ".", 1)
    return (
        doc
        + f"\n\n    Registered as ``torch.ops.specdec.{op_name}`` (tensor arguments only; this front adds\n"
        + "    defaults, argument normalisation and the checks).\n"
        + BACKEND_DOC
    )
