"""The counter-based random numbers of the sampling ops, for callers that draw them themselves.

``rejection_sample``, ``rejection_sample_flattened`` and ``tree_rejection_sample`` given
``seeds`` and ``offsets`` compute their coins and sample uniforms inside the kernels (Triton
on CUDA, C++ on CPU) from Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as
easy as 1, 2, 3"); ``philox_uniforms`` here is the same definition as a few torch ops, for a
loop that needs one of those numbers outside an op (Medusa's typical acceptance, say) or
wants to see what an op used.  It reads nothing from the device: CUDA-graph safe.
"""

from __future__ import annotations

import torch

from specdec_kernels import _random
from specdec_kernels.checks import INDEX_DTYPES, as_int, check_tensor

__all__ = ["philox_uniforms"]


def philox_uniforms(seeds: torch.Tensor, offsets: torch.Tensor, width: int, stream: int = 0) -> torch.Tensor:
    """The uniforms the sampling ops draw with ``seeds``/``offsets`` (Philox4x32-10).

    Entry [b, j] comes from key ``seeds[b]`` (low 32 bits, high 32 bits) and counter
    ``(lo32(o), hi32(o), stream, 0)`` with ``o = offsets[b] + j`` (modulo 2**64): the first
    output word w gives ``(w >> 8) * 2**-24``.  The ops' acceptance coin j of sequence b is
    stream 0, column j; the uniform of its sampled token (residual or bonus) is stream 1,
    column 0.  Row b depends on ``seeds[b]`` and ``offsets[b]`` only.

    Args:
        seeds: (B,) int32 or int64 tensor (int32 is sign-extended), any device.
        offsets: (B,) int32 or int64 tensor on seeds' device: each sequence's first counter.
        width: numbers per sequence, an int >= 0.
        stream: 0 (acceptance coins) or 1 (sample uniforms); other values in [0, 2**32) give
            other independent streams.

    Returns:
        float32 tensor (B, width) on seeds' device, values in [0, 1 - 2**-24], multiples of 2**-24.

    Raises:
        TypeError: seeds or offsets not an integer tensor; width or stream not an int.
        ValueError: seeds or offsets not 1-D, of different lengths or devices; width < 0;
            stream outside [0, 2**32).
    """
    seeds = check_tensor("seeds", seeds, ndim=1, dtypes=INDEX_DTYPES)
    offsets = check_tensor("offsets", offsets, ndim=1, dtypes=INDEX_DTYPES, device=seeds.device)
    if offsets.shape != seeds.shape:
        raise ValueError(f"offsets must have the shape of seeds {tuple(seeds.shape)}, got {tuple(offsets.shape)}")
    if as_int("width", width) < 0:
        raise ValueError(f"width must be >= 0, got {width}")
    if not 0 <= as_int("stream", stream) < 2**32:
        raise ValueError(f"stream must lie in [0, 2**32), got {stream}")
    return _random.philox_uniforms(seeds, offsets, int(width), int(stream))
