"""The sampling kernels' random numbers, inside the kernels.

A kernel reads each uniform it needs either from an explicit tensor (``uniform_samples`` /
``sample_uniforms``) or computes it from the request's ``seeds[b]`` and ``offsets[b]`` with
Philox4x32-10, the stream that ``specdec_kernels._random.philox_uniforms`` defines (key
(lo32(seed), hi32(seed)), counter (lo32(o), hi32(o), stream, 0), first word w ->
``(w >> 8) * 2**-24``), bit for bit.  Either way the value is then made safe as
``specdec_kernels.checks.clamp_uniforms`` does on the host: cast to float32, NaN read as 0,
clamped into [0, 1 - 2**-24], so no uniform (validated or not) makes a kernel emit a token
without mass or address outside its tensors.

``philox_uniforms_triton`` runs the same helper in a kernel of its own: the tests compare it
with the reference bit for bit (a debug path; the ops never call it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels._library import launch

# Philox4x32's round multipliers and key increments (Salmon et al. 2011), as in _random.py
_M0 = tl.constexpr(0xD2511F53)
_M1 = tl.constexpr(0xCD9E8D57)
_W0 = tl.constexpr(0x9E3779B9)
_W1 = tl.constexpr(0xBB67AE85)
# the largest float32 below 1 (checks.FLOAT32_BELOW_ONE)
_BELOW_ONE = tl.constexpr(1.0 - 2.0**-24)


@triton.jit
def _philox_uniform(seed, pos, STREAM: tl.constexpr):
    """float32 uniforms in [0, 1) of Philox4x32-10 with key ``seed`` (int64: low word, high
    word) and counter (lo32(pos), hi32(pos), STREAM, 0); ``seed`` and ``pos`` int64 tensors of
    one shape (int64 wraps as torch's does).  The first output word w gives (w >> 8) * 2**-24."""
    c0 = pos.to(tl.uint32)  # int -> narrower int: the low bits
    c1 = (pos >> 32).to(tl.uint32)
    c2 = tl.full(c0.shape, STREAM, tl.uint32)
    c3 = tl.zeros(c0.shape, tl.uint32)
    k0 = seed.to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    m0 = tl.full(c0.shape, _M0, tl.uint32)
    m1 = tl.full(c0.shape, _M1, tl.uint32)
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + _W0
            k1 = k1 + _W1
        hi0 = tl.umulhi(c0, m0)
        lo0 = c0 * m0
        hi1 = tl.umulhi(c2, m1)
        lo1 = c2 * m1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return (c0 >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def _clamp_uniform(u):
    """``u`` as float32 in [0, 1 - 2**-24], NaN as 0 (``checks.clamp_uniforms``)."""
    u = u.to(tl.float32)
    return tl.where(u >= 0.0, tl.minimum(u, _BELOW_ONE), 0.0)  # NaN fails the test


@triton.jit
def _request_key(seeds_ptr, offsets_ptr, rows64, rmask, USE: tl.constexpr):
    """(seed, offset) int64 [BB] of the requests ``rows64`` (int32 tensors sign-extended, as
    ``Tensor.to(torch.int64)``); 0 for masked rows, and for every row without ``USE`` (the
    pointers are then never read)."""
    if USE:
        seed = tl.load(seeds_ptr + rows64, mask=rmask, other=0).to(tl.int64)
        offset = tl.load(offsets_ptr + rows64, mask=rmask, other=0).to(tl.int64)
    else:
        seed = tl.zeros(rows64.shape, tl.int64)
        offset = tl.zeros(rows64.shape, tl.int64)
    return seed, offset


@triton.jit
def _coin(coins_ptr, index, seed, offset, j, mask, PHILOX: tl.constexpr):
    """Acceptance coin j of each request, float32 [BB], safe: with PHILOX stream 0 at
    ``offset + j`` from (``seed``, ``offset``), else read at ``coins_ptr + index`` (float32 or
    float64) where ``mask``."""
    if PHILOX:
        u = _philox_uniform(seed, offset + j, 0)
    else:
        u = tl.load(coins_ptr + index, mask=mask, other=0.0)
    return _clamp_uniform(u)


@triton.jit
def _final_uniform(final_u_ptr, rows64, seed, offset, mask, PHILOX: tl.constexpr):
    """The uniform of each request's sampled token, float32 [BB], safe: with PHILOX stream 1
    at ``offset``, else read at ``final_u_ptr + rows64`` where ``mask``."""
    if PHILOX:
        u = _philox_uniform(seed, offset, 1)
    else:
        u = tl.load(final_u_ptr + rows64, mask=mask, other=0.0)
    return _clamp_uniform(u)


@triton.jit
def _philox_debug_kernel(
    seeds_ptr, offsets_ptr, out_ptr, B, W, STREAM: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr
):
    """out[b, j] = the Philox uniform of request b at offsets[b] + j on STREAM (as the ops
    compute it), for b < B, j < W."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    seed, offset = _request_key(seeds_ptr, offsets_ptr, rows64, rmask, True)
    u = _philox_uniform(seed[:, None] + cols[None, :] * 0, offset[:, None] + cols[None, :], STREAM)
    mask = rmask[:, None] & (cols < W)[None, :]
    tl.store(out_ptr + rows64[:, None] * W + cols[None, :], _clamp_uniform(u), mask=mask)


def philox_uniforms_triton(seeds: torch.Tensor, offsets: torch.Tensor, width: int, stream: int) -> torch.Tensor:
    """The in-kernel Philox uniforms as a tensor (a debug path for the tests).

    Args:
        seeds, offsets: Shape (B,), int32/int64, contiguous, on the kernels' device.
        width: numbers per request (>= 0).
        stream: 0 (acceptance coins) or 1 (the sample uniform).

    Returns:
        float32 (B, width): entry [b, j] as the ops compute it for request b at offset
        offsets[b] + j; equal bit for bit to ``specdec_kernels._random.philox_uniforms``.
    """
    B = seeds.shape[0]
    out = torch.empty(B, width, dtype=torch.float32, device=seeds.device)
    if B == 0 or width == 0:
        return out
    block_w = min(64, triton.next_power_of_2(width))
    grid = (triton.cdiv(B, 16), triton.cdiv(width, block_w))
    launch(_philox_debug_kernel)[grid](
        seeds.contiguous(), offsets.contiguous(), out, B, width, STREAM=stream, BLOCK_B=16, BLOCK_W=block_w
    )
    return out
