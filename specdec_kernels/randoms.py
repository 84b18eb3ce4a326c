"""The counter-based random numbers of the sampling ops, for callers that draw them themselves.

``rejection_sample``, ``rejection_sample_flattened`` and ``tree_rejection_sample`` given
``seeds`` and ``offsets`` compute their coins and sample uniforms inside the kernels (Triton
on CUDA, C++ on CPU) from Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as
easy as 1, 2, 3"); ``philox_uniforms`` here is the same definition as a few torch ops, for a
loop that needs one of those numbers outside an op (Medusa's typical acceptance, say) or
wants to see what an op used.  It reads nothing from the device: CUDA-graph safe.

Given a list of per-sequence generators instead, the ops draw each sequence's numbers from
its own generator; ``sequence_uniforms`` is that draw, for a loop that draws them itself
(on the host, from host counts, then hands them to the op as explicit uniforms).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from specdec_kernels import _random
from specdec_kernels.checks import INDEX_DTYPES, as_int, as_int_list, check_tensor

__all__ = ["philox_uniforms", "sequence_uniforms"]


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


def sequence_uniforms(
    generators: Sequence[Optional[torch.Generator]], coin_counts: Sequence[int], num_coins: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The numbers the sampling ops draw given one generator per sequence: sequence b draws
    ``torch.rand(c_b)`` (its coins, c_b = coin_counts[b], one per draft token) then
    ``torch.rand(1)`` (the uniform of its sampled token) from generators[b], so its numbers do
    not depend on the batch.  A None generator draws nothing (its row is zeros: a finished
    sequence).  Draws on each generator's device, returns the numbers on the host's.

    Args:
        generators: B ``torch.Generator`` (CPU generators for host draws) or None.
        coin_counts: B ints in 0..num_coins.
        num_coins: C, the coins' width (the batch's widest count), an int >= 0.

    Returns:
        float32 (coins (B, C), zeros past each count; sample uniforms (B,)), on the CPU.

    Raises:
        TypeError: a generator that is not a ``torch.Generator`` or None; counts not ints.
        ValueError: counts not one per generator or outside 0..num_coins; num_coins < 0.
    """
    counts = as_int_list("coin_counts", coin_counts)
    if as_int("num_coins", num_coins) < 0:
        raise ValueError(f"num_coins must be >= 0, got {num_coins}")
    if len(counts) != len(generators) or any(not 0 <= c <= num_coins for c in counts):
        raise ValueError(f"coin_counts must be one int in 0..{num_coins} per generator, got {counts}")
    for b, g in enumerate(generators):
        if g is not None and not isinstance(g, torch.Generator):
            raise TypeError(f"generators[{b}] must be a torch.Generator or None, got {type(g).__name__}")
    return _random.sequence_uniforms(generators, counts, int(num_coins), torch.device("cpu"))
