"""Backend choice for the public ops.

Backends: ``"reference"`` (plain PyTorch, everywhere), ``"triton"`` (Triton kernels on CUDA
tensors, or on CPU tensors in the interpreter when ``TRITON_INTERPRET=1`` was set before
the kernels were imported), ``"native"`` (the C++/CUDA extension) and ``"torch"`` (a fast
path composed of PyTorch's own fused CPU/CUDA kernels, for ops where that beats the
reference on CPU, e.g. attention through ``scaled_dot_product_attention``).

Each public op takes ``backend=None``; ``None`` takes the ``SPECDEC_BACKEND`` environment
variable (read at import and on ``reset()``) and otherwise chooses automatically: Triton or
native on CUDA, native on CPU where the extension has the op, then the "torch" fast path
where the op has one, else the reference.  An explicit ``backend=`` that the op or the device
cannot serve is an error; ``SPECDEC_BACKEND`` names a preference and ops without that backend
choose automatically.  The Triton interpreter is never chosen automatically.  The choice is
made once per (op, device type, explicit backend) and kept for the process.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Optional, Sequence

import torch

from specdec_kernels import _native, autotune

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


def _read_environment() -> None:
    """Read ``SPECDEC_BACKEND`` and ``TRITON_INTERPRET`` (at import, and on ``reset``)."""
    _ENV["preferred"] = os.environ.get(ENV_VAR) or None
    _ENV["interpret"] = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_ENV: dict = {}
_read_environment()
_CHOSEN: dict = {}  # (op, device type, explicit backend or None) -> backend name
_LAUNCHERS: dict = {}  # "module:function" -> the Triton launcher, imported on first use


def triton_launcher(path: str):
    """The Triton launcher ``path`` ("module:function", e.g.
    ``"specdec_kernels.ops._triton.verify_greedy:verify_greedy_triton"``), imported on its first
    call and then served from a dict: the fronts import no Triton module before a Triton
    backend runs (``TRITON_INTERPRET`` must be set first), and pay no import statement per call."""
    fn = _LAUNCHERS.get(path)
    if fn is None:
        module, name = path.split(":")
        fn = _LAUNCHERS[path] = getattr(importlib.import_module(module), name)
    return fn


def reset() -> None:
    """Read the environment variables again and forget every backend chosen so far
    (public as ``specdec_kernels.reset_backends``); the run-time choices
    (``specdec_kernels.autotune.RuntimeChoice``, e.g. ``SPECDEC_DENSE_ATTENTION``) read theirs
    again too.

    The choice of each op's backend is made once per process and device type (the first
    call), and ``SPECDEC_BACKEND`` / ``TRITON_INTERPRET`` are read when the package is
    imported: call this after changing either.
    Triton kernels already imported keep the interpreter setting they were imported with.
    """
    _read_environment()
    _CHOSEN.clear()
    _TRITON.clear()
    for forget in _ON_RESET:  # e.g. tree_attention's launch plans, made for the backends chosen
        forget()
    autotune.read_environment_again()


_ON_RESET: list = []  # callables that forget what was decided for the chosen backends


def interpreter_on() -> bool:
    """Whether ``TRITON_INTERPRET`` was set (non-empty, not "0") when the package was imported
    or last ``reset``."""
    return _ENV["interpret"]


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
    """Pick the backend that runs ``op`` on ``device``: chosen on the first call for each
    (op, device type, explicit backend) and kept for the process (``reset`` forgets it).

    Args:
        op: the op's name.
        device: the device of its tensors.
        backend: the caller's ``backend=`` argument, or None.
        implemented: the backends this op has, e.g. ("reference", "triton").

    Raises:
        ValueError: an explicit ``backend`` unknown, not implemented for ``op``, or unable to
            run on ``device`` (the message says why).
    """
    key = (op, device.type, backend)
    chosen = _CHOSEN.get(key)
    if chosen is None:
        chosen = _CHOSEN[key] = _choose(op, device, backend, implemented)
    return chosen


def _choose(op: str, device: torch.device, backend: Optional[str], implemented: Sequence[str]) -> str:
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend not in implemented:
            raise ValueError(f"backend={backend!r}: {op} has no such backend (it has {tuple(implemented)})")
        reason = _can_run(backend, op, device)
        if reason:
            raise ValueError(f"backend={backend!r} cannot run {op}: {reason}")
        return backend
    preferred = _ENV["preferred"]
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
