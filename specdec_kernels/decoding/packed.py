"""Lossless block-quantised weights for the CPU matrix products of the engine.

SmolLM2's GGUF stores the linear layers in ggml's Q4_1 form (blocks of 32 inputs of one output
row: ``w = q * d + m``, 4-bit ``q``, fp16 ``d`` and ``m``) and the tied embedding / LM head in
Q8_0 (``w = q * d``, int8 ``q``).  transformers de-quantises them into float32, and the engine
runs that float32 model.  Every float32 weight is therefore exactly ``q * d + m`` (or ``q * d``)
for some codes: ``pack_weight`` finds them, checks that they give back every element bit for
bit, and keeps them.  A one-row product on a CPU is bound by streaming the weight from memory;
the packed form moves 0.75 (affine4) or 1.125 (scaled8) bytes per element instead of 4.

The product itself (``packed_linear``, the C++ kernel ``torch.ops.specdec.packed_linear_native``)
decodes each weight row into float32 and accumulates in float32, so it is the same weight's
matrix product; only the order of the float32 additions differs from ``F.linear``'s.  It is
one of the paths that ``decoding.model.linear`` measures at run time (``linear_choice``), taken
only where it is measured faster on the machine at hand.

A weight that is not exactly representable (any other checkpoint, a fine-tuned weight) is left
alone: ``pack_weight`` returns None and the product stays ``F.linear``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

BLOCK = 32  # inputs per block, as ggml's Q4_1 and Q8_0
AFFINE4, SCALED8 = 0, 1
KIND_NAMES = {AFFINE4: "affine4", SCALED8: "scaled8"}


@dataclass(frozen=True)
class PackedWeight:
    """A float32 weight [O, I] stored as codes and per-block float32 scales (and mins).

    kind AFFINE4: ``codes`` uint8 [O, I / 2], byte ``16 j + i`` of a row holding the code of
    input ``32 j + i`` in its low and of ``32 j + i + 16`` in its high nibble; ``mins`` [O, I / 32].
    kind SCALED8: ``codes`` int8 [O, I] viewed as uint8; ``mins`` None.
    ``scales`` float32 [O, I / 32].  Element ``[o, 32 j + i]`` is ``q * scales[o, j] (+ mins[o, j])``.
    """

    kind: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor]
    shape: Tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [O, I] the codes stand for (bit-exact for a weight ``pack_weight`` packed)."""
        O, I = self.shape
        if self.kind == AFFINE4:
            c = self.codes.view(O, I // BLOCK, BLOCK // 2)
            q = torch.cat([c & 0x0F, c >> 4], dim=-1).float()
            w = q * self.scales[..., None] + self.mins[..., None]
        else:
            q = self.codes.view(torch.int8).view(O, I // BLOCK, BLOCK).float()
            w = q * self.scales[..., None]
        return w.reshape(O, I)

    @property
    def nbytes(self) -> int:
        """Bytes a product streams: codes, scales and mins."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)


def _fp16_scale(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest fp16 value, as float32 (ggml stores d and m in fp16)."""
    return x.to(torch.float16).to(torch.float32)


def _try_affine4(blocks: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    lo = blocks.amin(-1, keepdim=True)  # the code-0 element of the block, if it is Q4_1
    d = _fp16_scale((blocks.amax(-1, keepdim=True) - lo) / 15)
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.where(d > 0, ((blocks - lo) / safe).round(), torch.zeros_like(blocks)).clamp_(0, 15)
    if not torch.equal(q * d + lo, blocks):  # q * d is exact (11 x 4 bits): one rounding, as the kernel's FMA
        return None
    return q.to(torch.uint8), d[..., 0], lo[..., 0]


def _try_scaled8(blocks: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    d = _fp16_scale(blocks.abs().amax(-1, keepdim=True) / 127)
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.where(d > 0, (blocks / safe).round(), torch.zeros_like(blocks)).clamp_(-128, 127)
    if not torch.equal(q * d, blocks):  # exact product (11 x 8 bits)
        return None
    return q.to(torch.int8), d[..., 0]


def _packable(weight: torch.Tensor, who: str) -> bool:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{who}: weight must be a tensor, got {type(weight).__name__}")
    return (
        weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.shape[1] % BLOCK == 0
        and weight.numel() > 0
    )


def pack_weight_reference(weight: torch.Tensor) -> Optional[PackedWeight]:
    """``pack_weight`` in plain PyTorch (the reference the C++ packer is tested against)."""
    if not _packable(weight, "pack_weight_reference") or not bool(torch.isfinite(weight).all()):
        return None
    O, I = weight.shape
    with torch.no_grad():
        blocks = weight.detach().reshape(O, I // BLOCK, BLOCK)
        found = _try_affine4(blocks)
        if found is not None:
            q, d, m = found
            codes = (q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)).reshape(O, I // 2).contiguous()
            return PackedWeight(AFFINE4, codes, d.contiguous(), m.contiguous(), (O, I))
        found8 = _try_scaled8(blocks)
        if found8 is None:
            return None
        q, d = found8
        return PackedWeight(SCALED8, q.reshape(O, I).view(torch.uint8).contiguous(), d.contiguous(), None, (O, I))


def pack_weight(weight: torch.Tensor) -> Optional[PackedWeight]:
    """The packed form of ``weight`` if it is exactly block-quantised, else None.

    The blocks are 32 consecutive inputs of one output row, as ggml's.  The affine4 form (ggml
    Q4_1) is taken when every block is ``q * d + m`` with 4-bit codes ``q``, ``d`` an fp16 value
    and ``m`` the block's minimum; else the scaled8 form (ggml Q8_0) when every block is
    ``q * d`` with int8 codes and fp16 ``d``.  Each element is checked: ``dequantize()`` of the
    result equals ``weight`` element for element (as float32 values; -0.0 may come back as 0.0).

    Args:
        weight: float32 [O, I] on CPU, I a multiple of 32.  Any other weight gives None, and so
            does any weight when the C++ extension is missing (there is no packed product then).

    Returns:
        A ``PackedWeight``, or None.  One pass over the weight in C++ (about 0.1 s for SmolLM2).

    Raises:
        TypeError: weight is not a tensor.
    """
    if not _packable(weight, "pack_weight") or not _have_kernel():
        return None
    O, I = weight.shape
    kind, codes, scales, mins = torch.ops.specdec.packed_weight_native(weight.detach())
    if kind < 0:
        return None
    return PackedWeight(int(kind), codes, scales, mins if kind == AFFINE4 else None, (O, I))


def packed_linear(x: torch.Tensor, packed: PackedWeight, *, portable: bool = False) -> torch.Tensor:
    """``x @ W.T`` for the weight ``W`` that ``packed`` stands for, float32 accumulation.

    Args:
        x: float32 [..., I] on CPU.
        packed: from ``pack_weight``.
        portable: use the kernel's portable path, not its AVX2 one (for tests).

    Returns:
        float32 [..., O].  Each output row depends only on its own input row (the kernel's
        summation order does not change with the number of rows).  Without the C++ extension:
        ``F.linear`` with the decoded weight.

    Raises:
        ValueError / TypeError: x is not float32 on CPU with I inputs.
    """
    O, I = packed.shape
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"packed_linear: x must be a tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1 or x.shape[-1] != I:
        raise ValueError(
            f"packed_linear: x must be float32 [..., {I}] on CPU, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    flat = x.reshape(-1, I)
    if _have_kernel():
        out = torch.ops.specdec.packed_linear_native(
            flat, packed.codes, packed.scales, packed.mins, packed.kind, portable
        )
    else:
        out = F.linear(flat, packed.dequantize())
    return out.view(*x.shape[:-1], O)


_HAVE_KERNEL = []


def _have_kernel() -> bool:
    if not _HAVE_KERNEL:
        from specdec_kernels import has_native_kernel

        _HAVE_KERNEL.append(has_native_kernel("packed_linear", "cpu"))
    return _HAVE_KERNEL[0]


# weight (by identity) -> (weak reference, weight version at packing, packed form)
_PACKED: Dict[int, Tuple[weakref.ref, int, PackedWeight]] = {}


def _stamp(weight: torch.Tensor) -> tuple:
    return (weight._version, weight.dtype, weight.device, tuple(weight.shape), weight.data_ptr())


def register(weight: torch.Tensor, packed: PackedWeight) -> None:
    """Make ``packed`` the packed form of ``weight`` for ``packed_form`` (dropped with the weight).

    Raises:
        ValueError: ``packed`` is not the form of a float32 CPU weight of ``weight``'s shape.
    """
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or tuple(weight.shape) != tuple(packed.shape):
        raise ValueError(
            f"register: a packed form of shape {packed.shape} does not fit a {weight.dtype} weight "
            f"{tuple(weight.shape)} on {weight.device}"
        )
    key = id(weight)
    _PACKED[key] = (weakref.ref(weight, lambda _r, k=key: _PACKED.pop(k, None)), _stamp(weight), packed)


def packed_form(weight: torch.Tensor) -> Optional[PackedWeight]:
    """The registered packed form of ``weight``, or None.

    None also once the weight changed since it was registered: written in place (its version),
    converted (``module.half()`` keeps the Parameter but changes its dtype and storage), resized
    or moved.  A write through ``weight.data`` is not seen by torch's version counter: after one,
    call ``Transformer.pack_weights()`` again (or ``unregister``)."""
    entry = _PACKED.get(id(weight))
    if entry is None or entry[0]() is not weight:
        return None
    if entry[1] != _stamp(weight):  # the codes are stale
        _PACKED.pop(id(weight), None)
        return None
    return entry[2]


def unregister(weight: torch.Tensor) -> None:
    """Forget the packed form of ``weight`` (if any): ``linear`` then uses ``F.linear`` for it."""
    entry = _PACKED.get(id(weight))
    if entry is not None and entry[0]() is weight:
        del _PACKED[id(weight)]
