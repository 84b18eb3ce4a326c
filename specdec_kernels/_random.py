"""How the sampling ops get their random numbers.

The kernels use one uniform per acceptance test and one per sampled token, so that the
reference and a kernel given the same numbers return the same tokens.  Per call a sequence
uses C coins (C = K for a chain, N - 1 for a tree: one per draft token / non-root node,
``uniform_samples [B, C]``) and one uniform that draws its one sampled token (the residual
sample at the first rejection or the bonus token, ``sample_uniforms [B]``).  They come in one
of these modes:

1. Explicit: ``uniform_samples`` and/or ``sample_uniforms`` given (float32 or float64 in
   [0, 1); checked against that range only when value checks run).  The kernels read them as
   they are and make each value safe themselves (``checks.clamp_uniforms``: cast to float32,
   NaN as 0, clamped into [0, 1 - 2**-24], so a value never becomes 1.0 by rounding): no torch
   op prepares them.
2. Counter-based (serving-safe, CUDA-graph and torch.compile friendly): ``seeds [B]`` and
   ``offsets [B]`` (integer tensors).  Sequence b's numbers are Philox4x32-10 (Salmon et al.
   2011, "Parallel random numbers: as easy as 1, 2, 3") with key ``seeds[b]`` (low 32 bits,
   high 32 bits) and counter ``(lo32(o), hi32(o), stream, 0)``: coin j is stream 0 at
   ``o = offsets[b] + j``, the sample uniform is stream 1 at ``o = offsets[b]``; the first
   output word w gives ``(w >> 8) * 2**-24``; int32 seeds and offsets are sign-extended to
   64 bits and ``o`` wraps modulo 2**64.  So a sequence's tokens depend only on its seed,
   offset and own inputs: not on the batch, the batch's padded K or the other sequences.  A
   caller that decodes again advances a sequence's offset by at least its count of coins
   (``num_draft_tokens`` or ``num_nodes - 1``) and by at least 1; K_max + 1 per step is always
   enough.  A sequence with zero drafts consumes no coin.  The seeds and offsets go to the
   registered op and the kernels compute the numbers inside (the Triton kernels in
   ``ops/_triton/_uniforms.py``, the C++ CPU kernels in ``csrc/verify_sample_cpu.cpp``): no
   torch op and no host read per call.  ``philox_uniforms`` below is the definition they
   match bit for bit, and the reference backends use it.
3. Generators: one ``torch.Generator`` for the batch draws ``torch.rand(B, C)`` then
   ``torch.rand(B)`` (two torch ops); a list of one generator per sequence, or a dict
   ``{row: generator}`` with gaps (vLLM's form), draws for sequence b ``torch.rand(c_b)`` then
   ``torch.rand(1)`` from its own generator, where c_b is its own count of coins (never the
   padded width), so its tokens do not depend on the batch; rows without a generator in a dict
   draw, in row order, ``torch.rand(C)`` then ``torch.rand(1)`` each from the default
   generator.  The per-sequence modes read the counts on the host (a synchronisation on
   CUDA): use mode 2 under CUDA graphs.  Numbers are drawn on the generator's device and moved
   to the inputs'.

Explicit tensors take precedence: given one of the two and seeds/offsets, the other comes from
Philox.  Coins past a sequence's count are never read; the generator modes fill them with 0.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from specdec_kernels.checks import INDEX_DTYPES, check_shape, check_tensor, check_uniforms, clamp_uniforms

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


def check_random_source(
    batch: int,
    coins_shape: Tuple[int, ...],
    device: torch.device,
    source: RandomSource,
    validate: Optional[bool] = None,
) -> None:
    """Check a front's randomness keywords without drawing or cleaning anything.

    Explicit uniforms: floating tensors of ``coins_shape`` / (batch,) on ``device``, their
    values in [0, 1) checked when ``validate`` allows (``checks.check_uniforms``); seeds and
    offsets: both or neither, (batch,) integer tensors on ``device``, not with a generator;
    the generator's type (its per-sequence forms are checked when drawn).

    Raises:
        TypeError: a generator of the wrong type; uniforms not float32/float64; seeds or
            offsets not int32/int64.
        ValueError: seeds without offsets (or the reverse), a generator together with seeds,
            shapes or devices that do not match, explicit uniforms outside [0, 1) (when
            ``validate`` allows).
    """
    generator, uniform_samples, sample_uniforms, seeds, offsets = source
    if uniform_samples is not None:
        check_uniforms("uniform_samples", uniform_samples, coins_shape, device, validate)
    if sample_uniforms is not None:
        check_uniforms("sample_uniforms", sample_uniforms, (batch,), device, validate)
    if (seeds is None) != (offsets is None):
        raise ValueError("seeds and offsets go together: give both (one per sequence) or neither")
    if seeds is not None and generator is not None:
        raise ValueError("give either seeds/offsets or generator, not both")
    if seeds is not None:
        for name, t in (("seeds", seeds), ("offsets", offsets)):
            check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES, device=device)
            check_shape(name, t, (batch,), "one per sequence")
    elif generator is not None and not isinstance(generator, (torch.Generator, list, tuple, dict)):
        raise TypeError(
            f"generator must be a torch.Generator, a list of them or a dict {{row: generator}}, got {type(generator).__name__}"
        )


def op_random_args(
    batch: int,
    num_coins: int,
    device: torch.device,
    source: RandomSource = RandomSource(),
    *,
    coin_counts: Optional[torch.Tensor] = None,
    validate: Optional[bool] = None,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """What a padded front passes to its registered op: (uniform_samples [B, C] or None,
    sample_uniforms [B] or None, seeds [B] or None, offsets [B] or None).

    Explicit uniforms are checked (``check_random_source``) and passed as given, uncleaned:
    the kernels cast them to float32 and clamp them (NaN as 0).  With seeds/offsets the
    missing uniforms stay None and the kernels compute them (Philox, module docstring): no
    torch op and no host read here.  Otherwise the generator draws them (module docstring:
    one ``torch.Generator`` costs its two ``torch.rand`` calls; the per-sequence forms read
    ``coin_counts`` [B] on the host).

    Raises:
        As ``check_random_source``; ValueError for a list of generators of the wrong length or
        dict keys outside the batch.
    """
    check_random_source(batch, (batch, num_coins), device, source, validate)
    generator, uniform_samples, sample_uniforms, seeds, offsets = source
    if (uniform_samples is not None and sample_uniforms is not None) or seeds is not None:
        return uniform_samples, sample_uniforms, seeds, offsets
    coins, final = generator_uniforms(batch, num_coins, device, generator, coin_counts)
    return (
        uniform_samples if uniform_samples is not None else coins,
        sample_uniforms if sample_uniforms is not None else final,
        None,
        None,
    )


def resolve_uniforms(
    batch: int,
    num_coins: int,
    uniform_samples: Optional[torch.Tensor],
    sample_uniforms: Optional[torch.Tensor],
    seeds: Optional[torch.Tensor],
    offsets: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The numbers a kernel uses, as float32 tensors (the reference's view of a registered
    op's randomness arguments): the explicit ones clamped (``checks.clamp_uniforms``), the
    missing ones computed from seeds/offsets by ``philox_uniforms``.  Costs torch ops: the
    reference backends and the tests use it, the kernels compute the same numbers inside.

    Returns:
        (coins [B, num_coins] or as ``uniform_samples`` is shaped, sample uniforms [B]).
    """
    if uniform_samples is None:
        uniform_samples = philox_uniforms(seeds, offsets, num_coins, 0)
    if sample_uniforms is None:
        sample_uniforms = philox_uniforms(seeds, offsets, 1, 1)[:, 0]
    return clamp_uniforms(uniform_samples), clamp_uniforms(sample_uniforms)


def check_op_uniforms(
    batch: int,
    coins_shape: Tuple[int, ...],
    device: torch.device,
    uniform_samples: Optional[torch.Tensor],
    sample_uniforms: Optional[torch.Tensor],
    seeds: Optional[torch.Tensor],
    offsets: Optional[torch.Tensor],
) -> None:
    """A registered op's randomness arguments, checked without reading values (its kernels and
    fake kernels): explicit uniforms of the right shape, and seeds and offsets wherever one is
    missing.

    Raises:
        TypeError, ValueError: as ``check_random_source``; ValueError when a uniform tensor is
            missing and seeds/offsets are not given.
    """
    check_random_source(
        batch, coins_shape, device, RandomSource(None, uniform_samples, sample_uniforms, seeds, offsets), False
    )
    if (uniform_samples is None or sample_uniforms is None) and seeds is None:
        raise ValueError(
            "uniform_samples and sample_uniforms must be given, or seeds and offsets to compute the missing ones"
        )


def draw_uniforms(
    batch: int,
    num_coins: int,
    device: torch.device,
    source: RandomSource = RandomSource(),
    *,
    coin_counts: Optional[torch.Tensor] = None,
    validate: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return (uniform_samples [B, C], sample_uniforms [B]) as float32 on ``device``: the
    numbers the kernels use (the references' randomness).

    ``source``'s explicit tensors are checked and clamped (``checks.clamp_uniforms``); missing
    ones come from its ``seeds`` and ``offsets`` when given, else from its ``generator``, in
    the order of the module docstring.  ``coin_counts [B]`` (int64) is each sequence's own
    number of coins, used by the per-sequence modes.

    Raises:
        TypeError: ``generator`` of the wrong type; seeds/offsets not integer tensors.
        ValueError: a list of generators of the wrong length, dict keys outside the batch,
            seeds without offsets (or the reverse), a generator together with seeds, shapes
            or devices that do not match, explicit uniforms outside [0, 1) (checked when
            ``validate`` allows).
    """
    args = op_random_args(batch, num_coins, device, source, coin_counts=coin_counts, validate=validate)
    return resolve_uniforms(batch, num_coins, *args)


def sequence_uniforms(
    generators: Sequence[Optional[torch.Generator]], coin_counts: Sequence[int], num_coins: int, device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence draws (unchecked; ``randoms.sequence_uniforms`` is the checked front):
    sequence b draws ``torch.rand(c_b)`` (c_b = its count clamped into 0..num_coins) then
    ``torch.rand(1)`` from generators[b]; a None generator draws nothing (zeros).  Returns
    float32 (coins [B, num_coins], sample uniforms [B]) on ``device``."""
    coins = torch.zeros((len(generators), num_coins), dtype=torch.float32, device=device)
    final = torch.zeros((len(generators),), dtype=torch.float32, device=device)
    for b, g in enumerate(generators):
        if g is None:
            continue
        c = max(0, min(int(coin_counts[b]), num_coins))
        if c:
            coins[b, :c] = _rand((c,), g, device)
        final[b] = _rand((1,), g, device)[0]
    return coins, final


def generator_uniforms(
    batch: int, num_coins: int, device: torch.device, generator: GeneratorArg, coin_counts: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(coins [B, C], sample uniforms [B]) float32 drawn from ``generator`` (module docstring)."""
    if generator is None or isinstance(generator, torch.Generator):
        return _rand((batch, num_coins), generator, device), _rand((batch,), generator, device)
    gens = _per_sequence_generators(generator, batch)
    counts = coin_counts.tolist() if coin_counts is not None else [num_coins] * batch
    coins, final = sequence_uniforms(gens, counts, num_coins, device)
    rest = [b for b, g in enumerate(gens) if g is None]
    for b in rest:  # the default generator, row order
        coins[b] = _rand((num_coins,), None, device)
        final[b] = _rand((1,), None, device)[0]
    return coins, final
