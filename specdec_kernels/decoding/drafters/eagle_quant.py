"""Q8_0 quantisation of a draft head: a copy whose matrix-product weights are rounded to
ggml's Q8_0 blocks (32 weights, one fp16 scale, int8 codes; ``packed.quantize_scaled8``) and
read packed by the C++ extension's products (``decoding.model.linear``), so that a CPU draft
step streams about a quarter of the bytes and, with ``numerics = "int8"``, multiplies in
8-bit integers.  ``EagleHead`` takes it from ``QuantizableHead``; ``EagleDrafter`` drafts
with such a copy by default (``quantize_head``).
"""

from __future__ import annotations

import copy
from typing import ClassVar, Tuple, TypeVar

import torch

from specdec_kernels.decoding import packed
from specdec_kernels.decoding.drafters.head_file import HeadFile

Head = TypeVar("Head", bound="QuantizableHead")


class QuantizableHead(HeadFile):
    """A head module that makes Q8_0-rounded copies of itself (``quantized``).

    A subclass names its matrix-product weights (``MATRICES``, 2-D float32 Parameters; a name
    the instance lacks is skipped); norms and biases stay float32.
    """

    MATRICES: ClassVar[Tuple[str, ...]] = ()

    def quantizable(self) -> bool:
        """Whether ``quantized`` can make a copy: a float32 head on CPU, the C++ extension built."""
        p = next(self.parameters())
        return p.dtype == torch.float32 and p.device.type == "cpu" and packed.has_kernel()

    def quantized(self: Head) -> Head:
        """A copy of this head (eval mode) whose matrix-product weights are rounded to ggml's Q8_0
        form (``packed.quantize_scaled8``) and registered with their packed forms, so that a
        draft step on a CPU streams 1.125 bytes per weight instead of 4 and, with
        ``numerics = "int8"``, multiplies in 8-bit integers (``decoding.model.linear``).

        The rounding changes the head's drafts slightly (a weight moves by at most about 1/254
        of its block's largest), never the output: the target verifies every draft.  Norms
        and the bias stay float32; so does a matrix whose rounded form does not pack (one with
        a block whose largest magnitude is below 127 x 6.1e-5, fp16's normal range, where the
        rounded scale may leave its largest code below 127).  ``self`` is not changed.

        Returns:
            The copy, with ``config["quantized"] = "q8_0"`` and the names of the rounded
            matrices in ``quantized_matrices``.

        Raises:
            ValueError: the head is not float32 on CPU, the C++ extension (the packed
                products) is missing, or a weight is not finite (``check_finite``: the
                message names the head and the weight; rounding cannot help).
        """
        self.check_finite()
        if not self.quantizable():
            p = next(self.parameters())
            raise ValueError(
                f"quantized() needs a float32 head on CPU and the C++ extension, got {p.dtype} on {p.device}"
                + ("" if packed.has_kernel() else " without the extension")
            )
        # ordinary tensors even when called under inference mode: the packed registry stamps
        # each weight with its version counter, which inference tensors lack
        with torch.inference_mode(False), torch.no_grad():
            out = copy.deepcopy(self).eval()
            out.config = {**self.config, "quantized": "q8_0"}
            out.quantized_matrices = []
            for name in self.MATRICES:
                w = getattr(out, name, None)
                if w is None:
                    continue
                rounded = packed.quantize_scaled8(w)
                form = packed.pack_weight(rounded)
                if form is None:
                    continue
                w.copy_(rounded)
                packed.register(w, form)
                out.quantized_matrices.append(name)
        return out
