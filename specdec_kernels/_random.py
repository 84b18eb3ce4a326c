"""How the sampling ops get their random numbers.

The kernels take their randomness as explicit uniforms, so that the reference and a kernel
given the same numbers return the same tokens.  Per call a sequence uses C coins (C = K for a
chain, N - 1 for a tree: one per draft token / non-root node, ``uniform_samples [B, C]``) and
one uniform that draws its one sampled token (the residual sample at the first rejection or
the bonus token, ``sample_uniforms [B]``).  The Python fronts make them in one of these modes:

1. Explicit: ``uniform_samples`` and/or ``sample_uniforms`` given (float32 or float64 in
   [0, 1); after the cast to float32 a value is kept below 1).
2. Counter-based (serving-safe, CUDA-graph and torch.compile friendly): ``seeds [B]`` and
   ``offsets [B]`` (integer tensors).  Sequence b's numbers are Philox4x32-10 (Salmon et al.
   2011, "Parallel random numbers: as easy as 1, 2, 3") with key ``seeds[b]`` (low 32 bits,
   high 32 bits) and counter ``(lo32(o), hi32(o), stream, 0)``: coin j is stream 0 at
   ``o = offsets[b] + j``, the sample uniform is stream 1 at ``o = offsets[b]``; the first
   output word w gives ``(w >> 8) * 2**-24``.  So a sequence's tokens depend only on its seed,
   offset and own inputs: not on the batch, the batch's padded K or the other sequences.  A
   caller that decodes again advances a sequence's offset by at least its count of coins
   (``num_draft_tokens`` or ``num_nodes - 1``) and by at least 1; K_max + 1 per step is always
   enough.  A sequence with zero drafts consumes no coin.  Computed with tensor ops on the
   inputs' device, no host synchronisation.
3. Generators: one ``torch.Generator`` for the batch draws ``torch.rand(B, C)`` then
   ``torch.rand(B)``; a list of one generator per sequence, or a dict ``{row: generator}``
   with gaps (vLLM's form), draws for sequence b ``torch.rand(c_b)`` then ``torch.rand(1)``
   from its own generator, where c_b is its own count of coins (never the padded width), so
   its tokens do not depend on the batch; rows without a generator in a dict draw, in row
   order, ``torch.rand(C)`` then ``torch.rand(1)`` each from the default generator.  The
   per-sequence modes read the counts on the host (a synchronisation on CUDA): use mode 2
   under CUDA graphs.  Numbers are drawn on the generator's device and moved to the inputs'.

Coins past a sequence's count are never read; the fronts fill them with 0.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from specdec_kernels.checks import INDEX_DTYPES, check_shape, check_tensor, check_uniforms

GeneratorArg = Union[None, torch.Generator, Sequence[torch.Generator], Dict[int, torch.Generator]]


class RandomSource(NamedTuple):
    """Where a sampling op's random numbers come from: the sampling fronts' five randomness
    keywords (``rejection_sample``'s docstring has their shapes and dtypes) as one value that
    the fronts hand to ``draw_uniforms``.  Unset fields are None: the default generator.
    """

    generator: GeneratorArg = None
    uniform_samples: Optional[torch.Tensor] = None
    sample_uniforms: Optional[torch.Tensor] = None
    seeds: Optional[torch.Tensor] = None
    offsets: Optional[torch.Tensor] = None


_MASK32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo32(a: torch.Tensor, m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * m for int64 ``a`` in [0, 2**32) and a 32-bit constant,
    in int64 arithmetic without overflow (m split into 16-bit halves)."""
    m_hi, m_lo = m >> 16, m & 0xFFFF
    lo_part = a * m_lo  # < 2**48
    hi_part = a * m_hi  # < 2**48
    low = lo_part + ((hi_part & 0xFFFF) << 16)  # < 2**49
    return (hi_part >> 16) + (low >> 32), low & _MASK32


def philox4x32(
    counter: Sequence[torch.Tensor], key: Sequence[torch.Tensor], rounds: int = 10
) -> Tuple[torch.Tensor, ...]:
    """Philox4x32 (Salmon et al. 2011) on int64 tensors holding 32-bit words.

    Args:
        counter: four int64 tensors (broadcastable), each word in [0, 2**32).
        key: two int64 tensors (broadcastable), each word in [0, 2**32).
        rounds: 10 for Philox4x32-10.

    Returns:
        The four output words, int64 tensors in [0, 2**32).
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo32(c0, _PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, _PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_uniforms(seeds: torch.Tensor, offsets: torch.Tensor, width: int, stream: int) -> torch.Tensor:
    """Counter-based uniforms: float32 [B, width] in [0, 1), entry [b, j] from Philox4x32-10 with
    key seeds[b] and counter (lo32(offsets[b] + j), hi32(offsets[b] + j), stream, 0).

    Args:
        seeds, offsets: int tensors of shape (B,) on the output device (int64 bit patterns).
        width: numbers per sequence (>= 0).
        stream: 0 for acceptance coins, 1 for the sample uniform.
    """
    s = seeds.to(torch.int64)
    pos = offsets.to(torch.int64)[:, None] + torch.arange(width, device=offsets.device, dtype=torch.int64)[None, :]
    k0, k1 = (s & _MASK32)[:, None], ((s >> 32) & _MASK32)[:, None]
    zero = torch.zeros_like(pos)
    w = philox4x32((pos & _MASK32, (pos >> 32) & _MASK32, zero + stream, zero), (k0, k1))[0]
    return (w >> 8).to(torch.float32) * (2.0**-24)


def _rand(shape, generator: Optional[torch.Generator], device) -> torch.Tensor:
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device, dtype=torch.float32).to(device)


def _per_sequence_generators(generator, batch: int):
    """A list of length ``batch`` (None where the default generator serves) from a list or dict."""
    if isinstance(generator, dict):
        gens = [None] * batch
        for row, g in generator.items():
            if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < batch:
                raise ValueError(f"generator dict keys must be row indices in 0..{batch - 1}, got {row!r}")
            gens[row] = g
    else:
        if len(generator) != batch:
            raise ValueError(f"generator must be one torch.Generator per sequence ({batch}), got {len(generator)}")
        gens = list(generator)
    for g in gens:
        if g is not None and not isinstance(g, torch.Generator):
            raise TypeError(f"generator list/dict must hold torch.Generator objects, got {type(g).__name__}")
    return gens


def check_modes(source: RandomSource) -> None:
    """The randomness keywords that cannot go together.

    Raises:
        ValueError: seeds without offsets (or the reverse); a generator together with seeds.
    """
    if (source.seeds is None) != (source.offsets is None):
        raise ValueError("seeds and offsets go together: give both (one per sequence) or neither")
    if source.seeds is not None and source.generator is not None:
        raise ValueError("give either seeds/offsets or generator, not both")


def draw_uniforms(
    batch: int,
    num_coins: int,
    device: torch.device,
    source: RandomSource = RandomSource(),
    *,
    coin_counts: Optional[torch.Tensor] = None,
    validate: Optional[bool] = None,
    clean: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return (uniform_samples [B, C], sample_uniforms [B]) as float32 on ``device``.

    ``source``'s explicit tensors are checked and used as they are; missing ones come from its
    ``seeds`` and ``offsets`` when given, else from its ``generator``, in the order of the
    module docstring.
    ``coin_counts [B]`` (int64) is each sequence's own number of coins, used by the
    per-sequence modes only.  ``clean``: explicit uniforms as ``check_uniforms`` returns them
    (False for the Triton kernels, which clean them as they load them).

    Raises:
        TypeError: ``generator`` of the wrong type; seeds/offsets not integer tensors.
        ValueError: a list of generators of the wrong length, dict keys outside the batch,
            seeds without offsets (or the reverse), a generator together with seeds, shapes
            or devices that do not match, explicit uniforms outside [0, 1) (checked when
            ``validate`` allows).
    """
    generator, uniform_samples, sample_uniforms, seeds, offsets = source
    if uniform_samples is not None:
        uniform_samples = check_uniforms(
            "uniform_samples", uniform_samples, (batch, num_coins), device, validate, clean
        )
    if sample_uniforms is not None:
        sample_uniforms = check_uniforms("sample_uniforms", sample_uniforms, (batch,), device, validate, clean)
    check_modes(source)
    if uniform_samples is not None and sample_uniforms is not None:
        return uniform_samples, sample_uniforms

    if seeds is not None:
        for name, t in (("seeds", seeds), ("offsets", offsets)):
            check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES, device=device)
            check_shape(name, t, (batch,), "one per sequence")
        coins = philox_uniforms(seeds, offsets, num_coins, 0)
        final = philox_uniforms(seeds, offsets, 1, 1)[:, 0]
    elif generator is None or isinstance(generator, torch.Generator):
        coins = _rand((batch, num_coins), generator, device)
        final = _rand((batch,), generator, device)
    elif isinstance(generator, (list, tuple, dict)):
        gens = _per_sequence_generators(generator, batch)
        counts = coin_counts.tolist() if coin_counts is not None else [num_coins] * batch
        coins = torch.zeros((batch, num_coins), dtype=torch.float32, device=device)
        final = torch.zeros((batch,), dtype=torch.float32, device=device)
        for b, g in enumerate(gens):
            if g is None:
                continue
            c = max(0, min(int(counts[b]), num_coins))
            if c:
                coins[b, :c] = _rand((c,), g, device)
            final[b] = _rand((1,), g, device)[0]
        rest = [b for b, g in enumerate(gens) if g is None]
        for b in rest:  # the default generator, row order
            coins[b] = _rand((num_coins,), None, device)
            final[b] = _rand((1,), None, device)[0]
    else:
        raise TypeError(
            f"generator must be a torch.Generator, a list of them or a dict {{row: generator}}, got {type(generator).__name__}"
        )
    return (
        uniform_samples if uniform_samples is not None else coins,
        sample_uniforms if sample_uniforms is not None else final,
    )
