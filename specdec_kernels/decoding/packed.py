"""Lossless block-quantised weights for the CPU matrix products of the engine.

SmolLM2's GGUF stores the linear layers in ggml's Q4_1 form (blocks of 32 inputs of one output
row: ``w = q * d + m``, 4-bit ``q``, fp16 ``d`` and ``m``) and the tied embedding / LM head in
Q8_0 (``w = q * d``, int8 ``q``).  transformers de-quantises them into float32, and the engine
runs that float32 model.  Every float32 weight is therefore exactly ``q * d + m`` (or ``q * d``)
for some codes: ``pack_weight`` finds them, checks that they give back every element bit for
bit, and keeps them.  A one-row product on a CPU is bound by streaming the weight from memory;
the packed form moves 0.75 (affine4) or 1.125 (scaled8) bytes per element instead of 4.

The product itself (``packed_linear``, the C++ kernel ``torch.ops.specdec_engine.packed_linear``)
decodes each weight row into float32 and accumulates in float32, so it is the same weight's
matrix product; only the order of the float32 additions differs from ``F.linear``'s.  It is
the path ``decoding.model.linear`` takes for such a weight in passes of up to 64 rows (its
summation order does not depend on the number of rows, so every row is independent of the
others).  ``packed_linear_int8`` is the other numerics: 8-bit activations, the GGUF's own
arithmetic (``Transformer.numerics = "int8"``).

A weight that is not exactly representable (any other checkpoint, a fine-tuned weight) is left
alone: ``pack_weight`` returns None and the product stays ``F.linear``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

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


def _check_x(who: str, x, I: int) -> None:
    """TypeError / ValueError naming ``x`` unless it is a float32 CPU tensor [..., I]."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: x must be a tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1 or x.shape[-1] != I:
        raise ValueError(f"{who}: x must be float32 [..., {I}] on CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")


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
    if not _packable(weight, "pack_weight") or not has_kernel():
        return None
    O, I = weight.shape
    kind, codes, scales, mins = torch.ops.specdec_engine.packed_weight(weight.detach())
    if kind < 0:
        return None
    return PackedWeight(int(kind), codes, scales, mins if kind == AFFINE4 else None, (O, I))


def quantize_scaled8(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` rounded to ggml's Q8_0 form: per block of 32 inputs of one output row, the
    scale ``d`` = amax / 127 rounded to fp16 (up to the next fp16 value where rounding to
    nearest would give amax a code past 127, so that no code clamps) and codes ``q`` = round(w / d) in
    [-127, 127]; the result ``q * d`` as float32.  ``pack_weight`` finds it exact (the scaled8
    form) wherever the largest code is 127, which holds unless amax / 127 lies below fp16's
    normal range (6.1e-5), where fp16 scales are coarse.

    Used for weights we choose to store in 8 bits (an EAGLE head drafting on CPU:
    ``EagleHead.quantized``), never for the target's: the rounding changes the products.  An
    element moves by at most half a code step, d / 2: 1/254 of its block's largest magnitude up
    to d's fp16 rounding (2^-11 relative) in fp16's normal range, more below it.

    Args:
        weight: float32 [O, I], I a multiple of 32, finite, every block's largest magnitude
            at most 127 x 65504 (fp16's largest scale).

    Returns:
        float32 [O, I] on ``weight``'s device, without gradient.

    Raises:
        TypeError: weight is not a tensor.
        ValueError: not float32 [O, I] with I a multiple of 32, non-finite elements, or a
            block too large for an fp16 scale.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"quantize_scaled8: weight must be a tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK:
        raise ValueError(
            f"quantize_scaled8: weight must be float32 [O, I] with I a multiple of {BLOCK}, got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    with torch.no_grad():
        w = weight.detach()
        if not bool(torch.isfinite(w).all()):
            raise ValueError("quantize_scaled8: weight has non-finite elements")
        O, I = w.shape
        blocks = w.reshape(O, I // BLOCK, BLOCK)
        amax = blocks.abs().amax(-1, keepdim=True)
        d16 = (amax / 127).to(torch.float16)
        low = amax >= d16.float() * 127.5  # amax's code would round past 127: the next fp16 scale up
        d = torch.where(low, torch.nextafter(d16, torch.full_like(d16, float("inf"))), d16).float()
        if not bool(torch.isfinite(d).all()):
            raise ValueError("quantize_scaled8: a block of weight is too large for an fp16 scale (|w| > 127 x 65504)")
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.where(d > 0, (blocks / safe).round(), torch.zeros_like(blocks)).clamp_(-127, 127)
        return (q * d).reshape(O, I)


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
    _check_x("packed_linear", x, I)
    flat = x.reshape(-1, I)
    if has_kernel():
        out = torch.ops.specdec_engine.packed_linear(
            flat, packed.codes, packed.scales, packed.mins, packed.kind, portable
        )
    else:
        out = F.linear(flat, packed.dequantize())
    return out.view(*x.shape[:-1], O)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, *, portable: bool = False) -> torch.Tensor:
    """``x @ weight.T`` for a float32 weight with no packed form, in the fixed summation order of
    ``packed_linear`` (the C++ kernel's kind "float32"): each output row depends only on its own
    input row, whatever the number of rows (``F.linear``'s BLAS picks other orders for other
    shapes).

    Args:
        x: float32 [..., I] on CPU.
        weight: float32 [O, I] on CPU, I a multiple of 32.
        portable: use the kernel's portable path, not its AVX2 one (for tests).

    Returns:
        float32 [..., O].

    Raises:
        ValueError / TypeError: x or weight is not a float32 CPU tensor of those shapes, or the
            C++ extension is missing.
    """
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rowwise_linear: {name} must be a tensor, got {type(t).__name__}")
    if not _packable(weight, "rowwise_linear"):
        raise ValueError(
            f"rowwise_linear: weight must be float32 [O, I] on CPU with I a multiple of {BLOCK}, got "
            f"{weight.dtype} {tuple(weight.shape)} on {weight.device}"
        )
    O, I = weight.shape
    _check_x("rowwise_linear", x, I)
    if not has_kernel():
        raise ValueError("rowwise_linear needs the C++ extension (specdec_kernels.load_native())")
    empty = torch.empty(0)
    out = torch.ops.specdec_engine.packed_linear(x.reshape(-1, I), weight.detach(), empty, None, 2, portable)
    return out.view(*x.shape[:-1], O)


# ---------------------------------------------------------------- 8-bit activations
GROUP = 8  # output rows per interleaved group of the int8 product
ISA_NAMES = {1: "portable", 2: "avx2", 3: "avx512-vnni", 4: "amx"}


@dataclass(frozen=True)
class Int8Weight:
    """A packed weight laid out for ``packed_linear_int8``: groups of 8 output rows, interleaved.

    ``qw`` uint8 [G, I / 32, 128] (AFFINE4: per block, four 32-byte chunks c whose byte
    ``4 o + k`` holds the code of input ``32 j + 4 c + k`` of output ``8 g + o`` in its low nibble
    and of input ``32 j + 16 + 4 c + k`` in its high nibble) or [G, I / 32, 256] (SCALED8: eight
    chunks t, byte ``4 o + k`` the int8 code of input ``32 j + 4 t + k``); ``dw`` (and ``mw`` for
    AFFINE4) float16 [G, I / 32, 8]: ggml's fp16 scales and mins (half the bytes of float32, the
    same values; the kernels convert them exactly).  G = ceil(O / 8); the last group is padded with zero rows.
    """

    kind: int
    qw: torch.Tensor
    dw: torch.Tensor
    mw: Optional[torch.Tensor]
    shape: Tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Bytes a product streams: codes, scales and mins."""
        return sum(t.numel() * t.element_size() for t in (self.qw, self.dw, self.mw) if t is not None)


def interleave(packed: PackedWeight) -> Int8Weight:
    """The ``Int8Weight`` layout of a ``PackedWeight`` (the same codes, scales and mins, reordered;
    one pass in PyTorch, about 0.1 s for SmolLM2).

    Raises:
        TypeError: ``packed`` is not a PackedWeight.
        ValueError: scales or mins that are not fp16 values (a ``PackedWeight`` made by this
            module always has fp16 ones).
    """
    if not isinstance(packed, PackedWeight):
        raise TypeError(f"interleave: packed must be a PackedWeight, got {type(packed).__name__}")
    O, I = packed.shape
    nb, G = I // BLOCK, -(-O // GROUP)
    pad = G * GROUP - O
    if packed.kind == AFFINE4:
        c = packed.codes.view(O, nb, BLOCK // 2)
        q = torch.cat([c & 0x0F, c >> 4], dim=-1)  # [O, nb, 32] codes in input order
    else:
        q = packed.codes.view(O, nb, BLOCK)  # int8 codes as bytes
    q = F.pad(q, (0, 0, 0, 0, 0, pad)).view(G, GROUP, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [G, nb, t, o, k]
    if packed.kind == AFFINE4:
        q = q[:, :, :4] | (q[:, :, 4:] << 4)
    qw = q.reshape(G, nb, -1).contiguous()

    def by_group(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        grouped = F.pad(t, (0, 0, 0, pad)).view(G, GROUP, nb).permute(0, 2, 1)
        half = grouped.to(torch.float16).contiguous()  # ggml's fp16 scales: exact
        if not torch.equal(half.float(), grouped):
            raise ValueError("interleave: the packed weight's scales or mins are not fp16 values")
        return half

    return Int8Weight(packed.kind, qw, by_group(packed.scales), by_group(packed.mins), (O, I))


def isa_code(isa: Optional[str]) -> int:
    """The kernels' number of an instruction-set path name (0 for None: the best one)."""
    if isa is None:
        return 0
    codes = {name: i for i, name in ISA_NAMES.items()}
    if isa not in codes:
        raise ValueError(f"isa must be None or one of {tuple(codes)}, got {isa!r}")
    return codes[isa]


def int8_isas() -> Tuple[str, ...]:
    """The instruction-set paths of ``packed_linear_int8`` this CPU runs, by name ("portable",
    "avx2", "avx512-vnni", "amx": Intel's tile unit, where the CPU and the OS allow it), asked of the
    CPU at run time (once per process: the CPU and the OS's permissions do not change); () without
    the C++ extension."""
    if not _INT8_ISAS:
        if not has_kernel("packed_linear_int8"):
            return ()
        _INT8_ISAS.append(tuple(ISA_NAMES[i] for i in torch.ops.specdec_engine.packed_linear_int8_isas()))
    return _INT8_ISAS[0]


_INT8_ISAS: List[Tuple[str, ...]] = []


def quantize_activations(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 8-bit activations of ``packed_linear_int8``, in PyTorch: blocks of 32 inputs,
    ``q = round_half_even(x * (1 / d))`` with ``d = max|x| / 127``, clamped to -127..127.

    Args:
        x: float32 [R, I], I a multiple of 32.

    Returns:
        (q int8 [R, I], d float32 [R, I / 32], s float32 [R, I / 32] the exact block sums of x,
        here summed in float64).  A block with inf or nan gets d = nan.
    """
    R, I = x.shape
    blocks = x.view(R, I // BLOCK, BLOCK)
    finite = torch.isfinite(blocks).all(-1)
    d = blocks.abs().amax(-1) / 127
    d = torch.where(finite, d, torch.full_like(d, float("nan")))
    inv = torch.where(finite & (d > 0), 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(R, I), d, blocks.double().sum(-1).float()


def packed_linear_int8_reference(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``packed_linear_int8`` in plain PyTorch (float64 over the same integer block sums): the
    reference the kernel is tested against, within float32 summation-order error.

    Args:
        x: float32 [R, I] on CPU.  weight: a ``PackedWeight`` of shape [O, I].

    Returns:
        float64 [R, O]: ``sum_j (d_j(o) * dx_j) * isum_j(o) + m_j(o) * sx_j``.
    """
    O, I = weight.shape
    nb = I // BLOCK
    q, dx, sx = quantize_activations(x.reshape(-1, I))
    if weight.kind == AFFINE4:
        c = weight.codes.view(O, nb, BLOCK // 2)
        qw = torch.cat([c & 0x0F, c >> 4], dim=-1).long()
    else:
        qw = weight.codes.view(torch.int8).view(O, nb, BLOCK).long()
    isum = torch.einsum("ojk,rjk->roj", qw, q.view(-1, nb, BLOCK).long()).double()  # exact integers
    y = (isum * (weight.scales.double()[None] * dx.double()[:, None])).sum(-1)
    if weight.kind == AFFINE4:
        y = y + (weight.mins.double()[None] * sx.double()[:, None]).sum(-1)
    return y


def packed_linear_int8(x: torch.Tensor, weight: Int8Weight, *, isa: Optional[str] = None) -> torch.Tensor:
    """``x @ W.T`` with 8-bit activations: ggml's Q4_1 x Q8_1 / Q8_0 x Q8_0 arithmetic.

    Each block of 32 inputs of each row of ``x`` is quantised to int8 (``quantize_activations``);
    its integer dot product with the weight's codes is exact, scaled by both blocks' scales and
    accumulated in float32 with fused multiply-adds (the affine4 minimum term uses the exact
    input sums).  This is an approximation of the float32 product (the activation rounding, at
    most half a step of ``max|x| / 127`` per input), the one llama.cpp computes.  Every ISA path
    gives the same bits, and a row's output does not depend on the other rows (see
    csrc/packed_linear_int8_cpu.cpp).

    Args:
        x: float32 [..., I] on CPU.
        weight: from ``interleave``.
        isa: None (the best path this CPU runs) or one of ``int8_isas()`` (forced, for tests and
            benchmarks).

    Returns:
        float32 [..., O].

    Raises:
        TypeError / ValueError: x is not a float32 CPU tensor with I inputs; an isa this CPU cannot
            run (or any isa without the C++ extension).
    """
    O, I = weight.shape
    _check_x("packed_linear_int8", x, I)
    if isa is not None and isa not in int8_isas():
        raise ValueError(f"packed_linear_int8: isa must be None or one of {int8_isas()} on this CPU, got {isa!r}")
    if not has_kernel("packed_linear_int8"):
        raise ValueError("packed_linear_int8 needs the C++ extension (specdec_kernels.load_native())")
    flat = x.reshape(-1, I)
    out = torch.ops.specdec_engine.packed_linear_int8(
        flat, weight.qw, weight.dw, weight.mw, weight.kind, O, isa_code(isa)
    )
    return out.view(*x.shape[:-1], O)


_HAVE_KERNEL: Dict[str, bool] = {}


def has_kernel(name: str = "packed_linear") -> bool:
    """Whether the extension has the CPU kernel ``name`` of this module ("packed_linear",
    "packed_linear_int8") or of the engine ("decoder_layer", "decoder_stack", "rms_norm", "silu_mul"):
    asked once per process."""
    if name not in _HAVE_KERNEL:
        from specdec_kernels import has_native_kernel

        _HAVE_KERNEL[name] = has_native_kernel(name, "cpu")
    return _HAVE_KERNEL[name]


_GENERATION = [0]  # counts the changes of the registry below (register, unregister, stale entries)


def generation() -> int:
    """A number that changes whenever a packed form is registered, dropped or found stale (for
    callers that cache what ``packed_form`` returned)."""
    return _GENERATION[0]


# weight (by identity) -> [weak reference, stamp at packing, packed form, its Int8Weight or None]
_PACKED: Dict[int, list] = {}


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
    _GENERATION[0] += 1
    _PACKED[key] = [weakref.ref(weight, lambda _r, k=key: _PACKED.pop(k, None)), _stamp(weight), packed, None]


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
        _GENERATION[0] += 1
        return None
    return entry[2]


def int8_form(weight: torch.Tensor) -> Optional[Int8Weight]:
    """The ``Int8Weight`` of ``weight``'s registered packed form (made on first use and kept with
    it: about as many bytes again as the packed form), or None when it has none (see
    ``packed_form``)."""
    p = packed_form(weight)
    if p is None:
        return None
    entry = _PACKED[id(weight)]
    if entry[3] is None:
        entry[3] = interleave(p)
    return entry[3]


def unregister(weight: torch.Tensor) -> None:
    """Forget the packed form of ``weight`` (if any): ``linear`` then uses ``F.linear`` for it."""
    entry = _PACKED.get(id(weight))
    if entry is not None and entry[0]() is weight:
        del _PACKED[id(weight)]
        _GENERATION[0] += 1
