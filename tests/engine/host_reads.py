"""Counting a decode step's host reads of device tensors, on a CPU run.

On a GPU every read of a device tensor by the host (``.item()``, ``int()``, ``bool()``,
``.tolist()``, ``.cpu()``, ``.numpy()``, and the ops whose output size depends on values:
``nonzero``, ``unique``, ``masked_select``, boolean indexing) waits for the device and breaks
CUDA-graph capture.  On CPU nothing tells a host tensor from a "device" one, so this module
tracks them: the tensors that would live on the target's device are marked (the KV cache,
``cache_seqlens``, the model's weights, whatever the loop moves with ``.to(device)``), every op
whose inputs include a marked tensor marks its outputs, and each read of a marked tensor is
counted while ``counting`` is on.

``count_step_reads(decoder, state, k)`` runs one ``SpeculativeDecoder.step`` so, counting the
step's own reads: the drafter's calls (``propose``, ``observe``, and the optional
``draft_sources`` / ``chain_*``) run with counting off (a
drafter's own reads are the drafter's business, issue #55 counts the verification step).
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import weakref
from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops whose output size depends on the values of a device input: a host read on a GPU
_SIZE_FROM_VALUES = {
    "aten::nonzero",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::masked_select",
    "aten::repeat_interleave",
    "aten::_local_scalar_dense",  # .item(), int(), float(), bool()
}


class DeviceReads(TorchDispatchMode):
    """Marks the tensors derived from device-resident ones and counts the host reads of them
    (``reads``: one stack summary per read) while ``counting`` is True."""

    def __init__(self):
        super().__init__()
        self.marked: Dict[int, weakref.ref] = {}  # id -> weak reference (tensors compare by value)
        self.counting = False
        self.reads: List[str] = []

    def mark(self, *tensors) -> None:
        for t in tree_flatten(list(tensors))[0]:
            if isinstance(t, torch.Tensor):
                self.marked[id(t)] = weakref.ref(t)

    def unmark(self, t) -> None:
        self.marked.pop(id(t), None)

    def is_marked(self, t) -> bool:
        ref = self.marked.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def read(self, what: str) -> None:
        if self.counting:
            frames = [f for f in traceback.extract_stack() if "/specdec_kernels/" in f.filename]
            where = frames[-1] if frames else None
            if where is not None and _CPU_ONLY in (where.line or ""):
                return  # a read in an expression that runs only on CPU tensors
            self.reads.append(f"{what} at {where.filename}:{where.lineno}" if where else what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        marked = any(self.is_marked(t) for t in inputs)
        name = func._schema.name
        if marked and name in _SIZE_FROM_VALUES:
            self.read(name)
        if marked and name == "aten::index" and any(t.dtype == torch.bool for t in inputs[1:]):
            self.read("boolean indexing")
        out = func(*args, **kwargs)
        if marked:
            self.mark(out)
        return out


_ACTIVE: List[DeviceReads] = []
_CPU_ONLY = 'device.type == "cpu"'
_TARGET_SIDE = (
    "/specdec_kernels/decoding/engine/",
    "/specdec_kernels/decoding/model.py",
    "/specdec_kernels/decoding/paged.py",
)


def _patched(name: str):
    """``Tensor.<name>`` seeing marked tensors: ``tolist`` / ``numpy`` / ``cpu`` of one is a
    read (``cpu`` returns an unmarked copy, as a device-to-host copy would); ``.to(device)``
    marks its result (an alias of its own where CPU returns the tensor itself), and is no read
    (``.cpu()`` is the loop's way to the host)."""
    original = getattr(torch.Tensor, name)

    def method(self, *args, **kwargs):
        mode = _ACTIVE[-1] if _ACTIVE else None
        if mode is None:
            return original(self, *args, **kwargs)
        marked = mode.is_marked(self)
        if name == "to":
            out = original(self, *args, **kwargs)
            to_device = any(isinstance(a, (torch.device, str)) for a in args) or kwargs.get("device") is not None
            # on CPU "the device" and the host are one: a move counts as one to the device where
            # the target's side makes it (the loop, the model), not where a drafter builds its
            # host draft
            caller = sys._getframe(1).f_code.co_filename
            if to_device and isinstance(out, torch.Tensor) and any(p in caller for p in _TARGET_SIDE):
                if out is self:
                    out = self.view_as(self)
                mode.mark(out)
            return out
        if marked:
            mode.read(f"Tensor.{name}")
        if name == "cpu" and marked:
            out = self.clone()
            mode.unmark(out)
            return out
        return original(self, *args, **kwargs)

    return original, method


@contextlib.contextmanager
def device_reads(*resident):
    """A ``DeviceReads`` active in the block, with ``resident`` (tensors, modules, lists)
    marked; ``.tolist()``, ``.cpu()``, ``.numpy()`` and ``.to(device)`` patched to see marked
    tensors (they reach no dispatch on CPU)."""
    mode = DeviceReads()
    for r in resident:
        if isinstance(r, torch.nn.Module):
            mode.mark(*r.parameters(), *r.buffers())
        elif isinstance(r, (list, tuple)):
            mode.mark(*r)
        else:
            mode.mark(r)
    patches = {n: _patched(n) for n in ("tolist", "cpu", "numpy", "to")}
    for n, (_, m) in patches.items():
        setattr(torch.Tensor, n, m)
    _ACTIVE.append(mode)
    try:
        with mode:
            yield mode
    finally:
        _ACTIVE.pop()
        for n, (o, _) in patches.items():
            setattr(torch.Tensor, n, o)


_DRAFTER_CALLS = (
    "propose",
    "observe",
    "draft_sources",
    "chain_begin",
    "chain_extend",
)


def count_step_reads(decoder, state, num_draft_tokens) -> List[str]:
    """The host reads of device tensors that one ``decoder.step(state, num_draft_tokens)``
    makes outside its drafter's calls (see the module docstring)."""
    drafter = decoder.drafter
    model = decoder.model
    target = model if isinstance(model, torch.nn.Module) else getattr(model, "hf", None)  # HFCausalLM's
    cache = state.kv_cache  # a PagedKVCache: its pool and block table
    kv = [cache.pool, cache.block_table] if hasattr(cache, "pool") else [cache]
    with device_reads(*kv, state.cache_seqlens, *([target] if target is not None else [])) as mode:
        saved = {}
        for name in _DRAFTER_CALLS:
            fn = getattr(drafter, name, None)
            if fn is None or not callable(fn):
                continue
            saved[name] = drafter.__dict__.get(name)

            def quiet(*a, _fn=fn, **kw):
                was, mode.counting = mode.counting, False
                try:
                    return _fn(*a, **kw)
                finally:
                    mode.counting = was

            setattr(drafter, name, quiet)
        try:
            mode.counting = True
            decoder.step(state, num_draft_tokens)
            mode.counting = False
        finally:
            for name, old in saved.items():
                if old is None:
                    delattr(drafter, name)
                else:
                    setattr(drafter, name, old)
    return mode.reads
