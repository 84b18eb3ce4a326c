"""One registration mechanism for the public ops: ``torch.ops.specdec.<name>``.

Every public op is a torch custom op in the ``specdec`` namespace (``torch.library.Library``
with a schema inferred from the annotated signature), registered when ``specdec_kernels`` is
imported.  Its backends are kernels of that one op, chosen by dispatch
key: the CPU kernel runs the C++ extension, the ``torch`` fast path or the reference, the CUDA
kernel runs Triton or the CUDA extension, and the fake (Meta / FakeTensor) kernel computes
shapes only.  Inside a device kernel the ``backend`` string argument ("" = automatic,
``SPECDEC_BACKEND``, or an explicit name, see ``specdec_kernels._backend``) picks among the
backends of that device; it is a plain string, so torch.compile treats it as a constant.

Triton kernels live in ``specdec_kernels.ops._triton`` and are imported on first use only.
Their launchers are plain functions, not ops: the namespace holds the public ops (and the
extension's ``<name>_native`` kernels), no backend internals.  A launcher launches through
``launch(kernel)``: the kernel itself on the eager path, ``torch.library.wrap_triton(kernel)``
while a public op is decomposed for ``torch.compile``.  With real Triton (not the interpreter),
a public op on CUDA tensors whose backend resolves to Triton is decomposed under
functionalization (torch.compile's AOT dispatcher) into its kernel body, as
``torch.library.triton_op`` does, so that Inductor sees the Triton kernels; ``torch.export``
keeps the public op whole (as it keeps a ``triton_op``).

One dispatch layer per call: on the eager path (``_eager.direct_call``: no compilation, no dispatch
mode, plain tensors) a front checks its arguments once and calls its backend directly, with
the same code the op's kernel runs after its own checks; everything else (torch.compile,
export, fake tensors, ``torch.library.opcheck``, inputs that require grad while grad mode is
on) goes through the registered op, which checks shapes again for its direct callers.

Autograd: the ops are inference-only (no backward).  Each has a kernel at the Autograd key:
with grad mode on and an input that requires grad, the ops with floating-point outputs
(``tree_attention``, ``paged_tree_attention``, ``sampling_probs``) and the in-place
``compact_kv_cache`` ops raise ValueError naming the op and the argument; the ops whose
outputs are token ids, counts or flags run as ``torch.argmax`` does (their outputs never
require grad).  Otherwise the kernel runs the op below autograd, as torch asks of
non-differentiable ops (no silent "no autograd kernel" fallback).

The public ops never read tensor values (no ``.item()``, ``.tolist()``, no branching on
values) on the paths that CUDA graphs and ``torch.compile`` use: value checks are the Python
fronts' business and run only with ``validate=True`` (the default on CPU tensors).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable, Optional, Sequence

import torch

from specdec_kernels import _backend
from specdec_kernels._eager import direct_call, filled  # noqa: F401  (the fronts' eager path)

NAMESPACE = "specdec"
OPS = {}  # public op name -> torch.ops.specdec.<name> (an OpOverloadPacket)

# The public ops are defined with the low-level torch.library.Library API (schema inferred from
# the annotated Python signature): the first call of such an op costs microseconds, whereas a
# torch.library.custom_op imports torch._dynamo (about 1.4 s) on its first call.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def check_backend_name(backend: str) -> None:
    """The ``backend`` string argument of a registered op (fake kernels check it too)."""
    if backend and backend not in _backend.BACKENDS:
        raise ValueError(f"backend must be one of {_backend.BACKENDS} or '' (automatic), got {backend!r}")


def define(
    name: str,
    schema_fn: Callable,
    *,
    fake: Callable,
    cpu: Optional[Callable] = None,
    cuda: Optional[Callable] = None,
    mutates_args: Iterable[str] = (),
    implemented: Sequence[str] = (),
    decompose_to_triton: bool = False,
    grad_inputs: str = "error",
):
    """Register ``specdec::<name>``; return ``torch.ops.specdec.<name>``.

    Args:
        name: the op's name in the ``specdec`` namespace.
        schema_fn: a type-annotated function whose signature is the op's schema; it is also
            the kernel for devices other than CPU and CUDA (it should run the reference).
        fake: the fake kernel (shapes, dtypes and devices of the outputs, no data; the same
            argument checks as the eager op that need no values).
        cpu, cuda: the kernels for CPU and CUDA tensors (same signature); None: ``schema_fn``,
            which then picks the backend of the tensors' device itself.
        mutates_args: names of the arguments written in place.
        implemented: the op's backends (``_backend.resolve``); needed with
            ``decompose_to_triton``.
        decompose_to_triton: under functionalization (torch.compile's AOT dispatcher) with
            real Triton kernels, when the op's backend resolves to "triton" on the device of
            its first argument, replace the opaque op by ``schema_fn`` run on the functional
            tensors: its shape checks, then its Triton branch, whose launches go through
            ``wrap_triton`` there (Inductor sees the kernels).  ``torch.export`` keeps the op
            whole, as it keeps a ``torch.library.triton_op``.
        grad_inputs: what the op's Autograd kernel does with an input that requires grad
            while grad mode is on: "error" (ValueError: the op is inference-only; for ops with
            floating-point outputs or in-place writes) or "ignore" (outputs are token ids,
            counts or flags, which never require grad, as ``torch.argmax``'s).
    """
    if grad_inputs not in ("error", "ignore"):
        raise ValueError(f"grad_inputs must be 'error' or 'ignore', got {grad_inputs!r}")
    schema = torch.library.infer_schema(schema_fn, mutates_args=tuple(mutates_args))
    _LIB.define(f"{name}{schema}")
    _LIB.impl(name, schema_fn, "CompositeExplicitAutograd")
    _LIB.impl(name, cpu or schema_fn, "CPU")
    _LIB.impl(name, cuda or schema_fn, "CUDA")
    if grad_inputs == "error":
        _LIB.impl(name, _autograd_kernel(name, schema_fn), "Autograd", with_keyset=True)
    else:  # outputs that never require grad: autograd has nothing to record (no cost, no warning)
        _LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")
    qualname = f"{NAMESPACE}::{name}"
    torch.library.register_fake(qualname, fake, lib=_LIB)
    if decompose_to_triton and not _backend.interpreter_on():
        from torch._subclasses.functional_tensor import FunctionalTensorMode

        def decompose(mode, func, types, args, kwargs):
            if not _export_keeps_triton_ops():
                with mode:
                    x = triton_arguments(name, schema_fn, implemented, args, kwargs)
                    if x is not None:
                        with _tracing_launches():
                            return schema_fn(**x)
            # another backend, or torch.export: keep the op opaque, functionalised as usual
            return mode.__torch_dispatch__(func, types, args, kwargs)

        torch.library.register_torch_dispatch(qualname, FunctionalTensorMode, decompose, lib=_LIB)
    packet = getattr(torch.ops.specdec, name)
    OPS[name] = packet
    return packet


def triton_arguments(name: str, schema_fn: Callable, implemented: Sequence[str], args, kwargs) -> Optional[dict]:
    """The op's arguments by name (``bound_arguments``) when its backend (the ``backend``
    argument, resolved for the device of its first argument) is "triton"; else None."""
    x = bound_arguments(schema_fn, args, kwargs)
    device = next(iter(x.values())).device
    if _backend.resolve(name, device, x["backend"] or None, implemented) != "triton":
        return None
    return x


def _autograd_kernel(name: str, schema_fn: Callable) -> Callable:
    """The op's kernel at the Autograd key: the op is inference-only (see the module docstring).
    Without an input requiring grad (or with grad mode off) it costs one check and a redispatch
    below autograd; inside ``torch.inference_mode`` it is not called at all."""
    after_autograd = torch._C._after_autograd_keyset
    any_requires_grad = torch._C._any_requires_grad
    grad_enabled = torch.is_grad_enabled
    redispatch = []  # the op overload's redispatch, bound at the first call (the op exists then)

    def autograd_kernel(keyset, *args, **kwargs):
        if grad_enabled() and any_requires_grad(*args, **kwargs):
            _raise_inference_only(name, schema_fn, args, kwargs)
        if not redispatch:
            redispatch.append(getattr(torch.ops.specdec, name).default.redispatch)
        return redispatch[0](keyset & after_autograd, *args, **kwargs)

    autograd_kernel.__name__ = f"{name}_autograd"
    return autograd_kernel


def _raise_inference_only(name: str, schema_fn: Callable, args, kwargs) -> None:
    """ValueError naming the op and its first argument that requires grad."""
    import inspect

    bound = inspect.signature(schema_fn).bind_partial(*args, **kwargs).arguments
    culprit = "an input"
    for arg, value in bound.items():
        if isinstance(value, (list, tuple)):  # a tensor list (compact_kv_cache's caches)
            hits = [i for i, v in enumerate(value) if isinstance(v, torch.Tensor) and v.requires_grad]
            if hits:
                culprit = f"{arg}[{hits[0]}]"
                break
        elif isinstance(value, torch.Tensor) and value.requires_grad:
            culprit = arg
            break
    public = name.removeprefix("paged_")
    raise ValueError(
        f"specdec_kernels.{public} (torch.ops.specdec.{name}) is inference-only: it has no backward, and "
        f"{culprit} requires grad. Call it under torch.no_grad() or torch.inference_mode(), or pass detached "
        "tensors (.detach())"
    )


def bound_arguments(schema_fn: Callable, args, kwargs) -> dict:
    """The op's arguments by name, defaults filled in (for decompositions)."""
    import inspect

    bound = inspect.signature(schema_fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


_TRACING = threading.local()  # .on: the launches of this thread are being traced (decompose)


@contextlib.contextmanager
def _tracing_launches():
    """While a public op is decomposed for torch.compile, ``launch`` wraps the kernels."""
    before = getattr(_TRACING, "on", False)
    _TRACING.on = True
    try:
        yield
    finally:
        _TRACING.on = before


def _export_keeps_triton_ops() -> bool:
    """Whether ``torch.export`` is tracing with the custom Triton ops kept whole (it keeps
    ``torch.library.triton_op``s so; ours follow)."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:  # an older torch: always decomposed
        return False
    return custom_triton_ops_decomposition_disabled()


def launch(kernel):
    """What a launcher indexes with its grid and calls: ``kernel`` itself on the eager path (no
    wrapper, no dispatch), ``torch.library.wrap_triton(kernel)`` while a public op is
    decomposed for torch.compile (Inductor then sees the launch)."""
    if getattr(_TRACING, "on", False):
        return torch.library.wrap_triton(kernel)
    return kernel
