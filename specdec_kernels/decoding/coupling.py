"""Position-keyed Gumbel coupling: sampled tokens that do not depend on the drafts.

With rejection sampling (Leviathan et al. 2023; Chen et al. 2023) a sequence's tokens are
exact samples of the target, but *which* samples depends on how many coins each step drew,
so on the draft length K, the drafter, and anything that chose them (an adaptive policy
reading the batch's acceptance or the machine's timing).

The Gumbel coupling removes that dependence.  The token at index t of sequence b (t counts
prompt and generated tokens from 0) is

    x_t = argmax_v ( log p_t(v) + G_b,t(v) ),   G_b,t(v) i.i.d. Gumbel(0, 1),

an exact sample of the target's distribution p_t (the Gumbel-max trick), where the noise
``G_b,t`` is a function of the sequence's seed and of t only.  Verifying a draft is then
greedy verification of the perturbed log-probabilities (``verify_greedy`` /
``verify_tree_greedy`` on ``log p + G``): a draft token is accepted exactly when it is the
token the target samples, and the bonus token is the target's own sample.  So a seeded
request yields the same tokens with any drafter, any K, chain or tree, alone or in any batch,
whatever an adaptive policy chose, and the same as plain sampling without drafts.  This is
the "drafter-invariant speculative decoding" of Daliri, Musco and Suresh (2024), "Coupling
without communication and drafter-invariant speculative decoding".

Acceptance: a deterministic draft token y (n-gram, EAGLE / Medusa top-k, greedy drafts) is
accepted with probability p(y), and deterministic siblings with the sum of their p: the same
as rejection sampling with one-hot q.  A drafter that samples draws its tokens with the same
noise (``argmax log q + G``, or the Gumbel-top-k for w children), which accepts with
probability at least (1 - TV) / (1 + TV) against 1 - TV for rejection sampling (TV: the total
variation between p and q; Daliri et al., Theorem 1).

The noise of (seed, t) is ``torch.rand(V)`` (float32) from a CPU ``torch.Generator`` seeded
with a 64-bit mix (SplitMix64, Steele et al. 2014) of the seed and t, mapped to
``-log(-log(u))`` by ``uniform_to_gumbel``, which first clamps u to [the smallest normal
float32, the largest float32 below 1]: a uniform of 0 (``torch.rand`` returns one about once
in 2**24 draws) would give -inf, and when the target's nucleus is a single token (top_k=1, a
tiny temperature, a peaked softmax) every score ``log p + G`` would then be -inf and argmax
would return token 0, of probability 0.  With the clamp the noise is finite, within
[-4.47, 16.64], so a token of probability 0 (score -inf) is never chosen while one of
positive probability exists; every other uniform ``torch.rand`` returns is left unchanged,
so its noise is bit-identical.  The noise is computed once per (sequence, index) and kept
until the sequence commits past t.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

COUPLINGS = ("gumbel", "rejection")

_MASK64 = (1 << 64) - 1

#: The uniforms ``uniform_to_gumbel`` accepts, after clamping: the smallest normal float32
#: (2**-126) and the largest float32 below 1 (1 - 2**-24).  Both give finite noise.
UNIFORM_MIN = torch.finfo(torch.float32).tiny
UNIFORM_MAX = 1.0 - 2.0**-24


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_to_gumbel(u: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise ``-log(-log(u))`` of uniforms u, always finite.

    u is first clamped to [``UNIFORM_MIN``, ``UNIFORM_MAX``] (the smallest normal float32 and
    the largest float32 below 1), so u = 0 (which ``torch.rand`` can return) and u = 1 give
    finite noise instead of -inf and +inf: a token of probability 0 (log p = -inf) can then
    never win an argmax of ``log p + G`` against one of positive probability, and no score is
    NaN.  Every float32 uniform ``torch.rand`` returns other than 0 lies in the range already
    (its smallest positive value is 2**-24), so its noise is unchanged, bit for bit.

    Args:
        u: a float tensor of any shape, values in [0, 1] (NaN stays NaN).

    Returns:
        float32 tensor of u's shape and device, each value in [-4.47, 16.64].

    Raises:
        TypeError: u is not a floating-point tensor.
    """
    if not isinstance(u, torch.Tensor) or not u.is_floating_point():
        raise TypeError(f"u must be a floating-point tensor, got {getattr(u, 'dtype', type(u).__name__)}")
    u = u.float().clamp(UNIFORM_MIN, UNIFORM_MAX)
    return torch.log(-torch.log(u)).neg_()


def gumbel_noise(seed: int, index: int, vocab_size: int) -> torch.Tensor:
    """The Gumbel(0, 1) noise of token index ``index`` of a sequence seeded with ``seed``.

    Args:
        seed: the sequence's seed (any int; taken modulo 2**64).
        index: the token's index in the sequence (prompt tokens included), >= 0.
        vocab_size: V >= 1.

    Returns:
        (V,) float32 on the CPU, finite (``uniform_to_gumbel``); identical for identical
        arguments on every machine (torch's CPU Mersenne Twister), independent across indices
        and seeds.

    Raises:
        ValueError: index < 0 or vocab_size < 1.
    """
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    key = _splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64)) >> 1  # manual_seed takes < 2**63
    u = torch.rand(vocab_size, generator=torch.Generator().manual_seed(key))
    return uniform_to_gumbel(u)


class GumbelCoupling:
    """Per-sequence position-keyed Gumbel noise for a batch (see the module docstring).

    Args:
        seeds: one int seed per sequence.
        vocab_size: V.
    """

    def __init__(self, seeds: Sequence[int], vocab_size: int):
        self.seeds = [int(s) for s in seeds]
        self.vocab_size = int(vocab_size)
        self._cache: List[Dict[int, torch.Tensor]] = [{} for _ in self.seeds]

    def noise(self, b: int, index: int) -> torch.Tensor:
        """(V,) float32 CPU noise of sequence b's token index ``index`` (cached)."""
        cache = self._cache[b]
        g = cache.get(index)
        if g is None:
            g = cache[index] = gumbel_noise(self.seeds[b], index, self.vocab_size)
        return g

    def commit(self, b: int, length: int) -> None:
        """Sequence b now holds ``length`` tokens: drop the noise of indices below it."""
        cache = self._cache[b]
        for t in [t for t in cache if t < length]:
            del cache[t]

    def noise_for(self, indices: torch.Tensor, rows: Sequence[int] = None) -> torch.Tensor:
        """Noise for a (B, N) int64 tensor of token indices (one row per sequence, or per
        ``rows[r]`` when given): (B, N, V) float32 CPU.  Entries < 0 get zeros."""
        idx = indices.tolist()
        rows = list(range(len(idx))) if rows is None else list(rows)
        out = torch.zeros(len(idx), len(idx[0]) if idx else 0, self.vocab_size)
        for r, (b, row) in enumerate(zip(rows, idx)):
            for i, t in enumerate(row):
                if t >= 0:
                    out[r, i] = self.noise(b, t)
        return out

    def perturb(self, log_probs: torch.Tensor, indices: torch.Tensor, rows: Sequence[int] = None) -> torch.Tensor:
        """``log_probs + G``: (B, N, V) log-probabilities (any float dtype, any device) plus the
        noise of the token indices (B, N) they predict; float32, on log_probs' device."""
        return log_probs.float() + self.noise_for(indices, rows).to(log_probs.device)


def gumbel_top_k(log_probs: torch.Tensor, noise: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k largest of ``log_probs + noise`` (..., V): k distinct samples without replacement
    (the Gumbel-top-k trick, Kool et al. 2019), the first being the Gumbel-max sample.

    Args:
        log_probs: (..., V) float log-probabilities; -inf for a token of probability 0.
        noise: (V,) or (..., V) float32 noise from ``gumbel_noise`` / ``GumbelCoupling.noise``
            (finite, so a token of log-probability -inf comes after every token of positive
            probability and is returned only when k exceeds their number).
        k: 1 <= k <= V.

    Returns:
        (values, indices), each (..., k): float32 on log_probs' device, and int64.
    """
    return (log_probs.float() + noise.to(log_probs.device)).topk(k, dim=-1)
