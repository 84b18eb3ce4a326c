"""rejection_sample_flattened: lossless speculative sampling in the flattened (vLLM v1) layout,
``torch.ops.specdec.rejection_sample_flattened``.

Backends: "reference" (plain PyTorch, every device), "native" (the C++ CPU kernel of
``rejection_sample``, csrc/verify_sample_cpu.cpp, given the request spans) and "triton"
(``_rejection_partials_kernel`` and ``_rejection_sample_kernel`` with ``FLAT=True``,
``specdec_kernels.ops._triton.rejection_sample``).
No backend copies the rows into a padded layout.  The registered op takes explicit uniforms
(coins [T], sample uniforms [B]) or, for the missing ones, per-request seeds and offsets, from
which the kernels compute each request's numbers exactly as the padded op does; the Python front
draws them only for a generator
(``specdec_kernels.reference.rejection_sample_flattened.flattened_random_args``).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from specdec_kernels import _backend, _library, _native
from specdec_kernels._flattened import FlatBatch, check_sampling_flattened_args, positions, take
from specdec_kernels._random import GeneratorArg, RandomSource, check_op_uniforms
from specdec_kernels.checks import check_probability_values
from specdec_kernels.ops.rejection_sample import RejectionSampleDetails, make_details
from specdec_kernels.reference.rejection_sample import accept_tests
from specdec_kernels.reference.rejection_sample_flattened import (
    _rejection_sample_flattened,
    flat_coins_shape,
    flattened_random_args,
    resolve_flattened_uniforms,
)

IMPLEMENTED = ("reference", "native", "triton")
OP = "rejection_sample_flattened"
# the Triton backend's launches: (target, draft, tokens, cu, coins, final_u, K, bonus_ids, seeds, offsets)
_CHAIN = "specdec_kernels.ops._triton.rejection_sample:_launch_chain"


def rejection_details_flattened(
    target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, flat, coins, output_tokens, num_accepted
) -> RejectionSampleDetails:
    """``RejectionSampleDetails`` of a flattened call (``flat``: its checked ``FlatBatch``):
    gathers of B * max_spec_len values and a NaN scan of the rows (run only when asked)."""
    R, V = target_probs.shape
    T, B, K = flat.num_tokens, flat.batch, flat.max_spec_len
    device = target_probs.device
    with_rows = flat.bonus_token_ids is None
    pos = positions(cu_num_draft_tokens, T, K, bonus_rows=with_rows)
    j = torch.arange(K + 1, device=device)
    tokens = take(draft_token_ids.to(torch.int64), pos.flat, pos.counted, -1)
    safe = tokens.clamp(0, V - 1)
    t_rows = pos.row0[:, None] + j[None, :]  # [B, K + 1]
    p = target_probs[t_rows[:, :K].clamp(0, max(R - 1, 0)), safe] if R else torch.zeros(B, K, device=device)
    q = draft_probs[pos.flat, safe] if draft_probs is not None and T else torch.ones_like(p)
    accept = accept_tests(p, q, tokens, pos.counted, take(coins, pos.flat, pos.counted, 1.0), V)
    owns = j[None, :] <= pos.n[:, None] if with_rows else j[None, :] < pos.n[:, None]
    target_nan = take(torch.isnan(target_probs).any(dim=-1), t_rows, owns, False)
    draft_nan = None
    if draft_probs is not None:
        draft_nan = take(torch.isnan(draft_probs).any(dim=-1), pos.flat, pos.counted, False)
    return make_details(output_tokens, num_accepted, accept, target_nan, draft_nan)


def check_rejection_sample_flattened_args(
    target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate=None
) -> FlatBatch:
    """Validate the arguments of ``rejection_sample_flattened`` but the random numbers; return
    their ``FlatBatch``.  With ``validate=True`` also the probabilities (every flat row is some
    request's once ``cu_num_draft_tokens`` is checked)."""
    flat = check_sampling_flattened_args(
        target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate
    )
    if validate:  # a scan of every row: only when asked for
        check_probability_values("target_probs", target_probs, validate)
        if draft_probs is not None:
            check_probability_values("draft_probs", draft_probs, validate)
    return flat


def _op_uniforms(flat: FlatBatch, device, uniform_samples, sample_uniforms, seeds, offsets) -> None:
    """The registered op's random numbers, checked without reading values: coins [T] (or
    [B, max_spec_len]) and sample uniforms [B] where given, seeds and offsets [B] for the
    missing ones."""
    shape = flat_coins_shape(flat, uniform_samples)
    check_op_uniforms(flat.batch, shape, device, uniform_samples, sample_uniforms, seeds, offsets)


def _run(
    backend: str,
    flat: FlatBatch,
    target_probs,
    draft_probs,
    draft_token_ids,
    cu_num_draft_tokens,
    bonus_token_ids,
    uniform_samples,
    sample_uniforms,
    seeds,
    offsets,
):
    """The backend ``backend`` on checked arguments (the randomness as the registered op takes
    it, ``flattened_random_args``: explicit uniforms as given, seeds and offsets for the
    missing ones, which the kernels compute and clamp themselves): the op's kernel after its
    checks, and the front's eager path (one check pass, no dispatcher)."""
    K = flat.max_spec_len
    if backend in ("triton", "native"):
        args = (draft_token_ids, cu_num_draft_tokens, bonus_token_ids, uniform_samples, sample_uniforms, K)
        if backend == "triton":  # the launches themselves, no layer between (host cost)
            return _backend.triton_launcher(_CHAIN)(
                target_probs,
                draft_probs,
                draft_token_ids,
                cu_num_draft_tokens,
                uniform_samples,
                sample_uniforms,
                K,
                bonus_token_ids,
                seeds,
                offsets,
            )
        p, q = _native.probs_operands(target_probs, draft_probs)
        return torch.ops.specdec_native.rejection_sample_flattened(p, q, *args, seeds, offsets)
    coins, final = resolve_flattened_uniforms(
        flat, cu_num_draft_tokens, uniform_samples, sample_uniforms, seeds, offsets
    )
    args = (draft_token_ids, cu_num_draft_tokens, bonus_token_ids, coins, final, K)
    return _rejection_sample_flattened(target_probs, draft_probs, *args)


def _impl(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor],
    uniform_samples: Optional[torch.Tensor],
    sample_uniforms: Optional[torch.Tensor],
    max_spec_len: int,
    backend: str = "",
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    flat = check_rejection_sample_flattened_args(
        target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate=False
    )
    random_args = (uniform_samples, sample_uniforms, seeds, offsets)
    _op_uniforms(flat, target_probs.device, *random_args)
    name = _backend.resolve(OP, target_probs.device, backend or None, IMPLEMENTED)
    return _run(
        name, flat, target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, *random_args
    )


def _fake(
    target_probs,
    draft_probs,
    draft_token_ids,
    cu_num_draft_tokens,
    bonus_token_ids,
    uniform_samples,
    sample_uniforms,
    max_spec_len,
    backend="",
    seeds=None,
    offsets=None,
):
    flat = check_rejection_sample_flattened_args(
        target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate=False
    )
    _op_uniforms(flat, target_probs.device, uniform_samples, sample_uniforms, seeds, offsets)
    _library.check_backend_name(backend)
    new = lambda *shape: target_probs.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return new(flat.batch, max_spec_len + 1), new(flat.batch)


op = _library.define(OP, _impl, fake=_fake, implemented=IMPLEMENTED, decompose_to_triton=True, grad_inputs="ignore")


def rejection_sample_flattened(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_token_ids: Optional[torch.Tensor] = None,
    *,
    max_spec_len: Optional[int] = None,
    generator: GeneratorArg = None,
    uniform_samples: Optional[torch.Tensor] = None,
    sample_uniforms: Optional[torch.Tensor] = None,
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    return_details: bool = False,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> Union[Tuple[torch.Tensor, torch.Tensor], RejectionSampleDetails]:
    """Lossless speculative sampling of draft chains in the flattened (vLLM v1) layout.

    The algorithm of ``rejection_sample`` (Leviathan et al. 2023; Chen et al. 2023: accept
    draft x_j when u_j * q_j(x_j) < p_j(x_j) in float32; at the first rejection sample from
    max(0, p_j - q_j) normalised, from p_j when that has no mass; after the last draft sample
    the bonus token) on vLLM v1's ragged layout (``SpecDecodeMetadata``).  Same tokens as
    ``rejection_sample`` on the same data padded to K = max_spec_len, with the same random
    numbers.

    Args:
        target_probs: Shape (T + B, vocab) without ``bonus_token_ids``: request b's K_b rows
            for its drafts then its bonus row (rows cu[b-1] + b .. cu[b] + b); or (T, vocab)
            with ``bonus_token_ids``.  float32/float16/bfloat16 (computed in float32), rows
            read in place.
        draft_probs: Shape (T, vocab), flat row t the distribution draft t was drawn from, or
            None when the drafts were chosen deterministically (q one-hot at the draft).
        draft_token_ids: Shape (T,), int32/int64.  An id outside [0, vocab) is rejected.
        cu_num_draft_tokens: Shape (B,), int32/int64: the inclusive cumsum of the draft counts
            (request b's drafts are flat positions cu[b-1] .. cu[b] - 1, cu[-1] read as 0);
            zero-draft requests are allowed.
        bonus_token_ids: Shape (B,) (or (B, 1)), int32/int64, or None.  When given (vLLM v1,
            where the caller samples the bonus), a request that accepts all its drafts emits
            bonus_token_ids[b] (copied as given) and uses no sample uniform; a rejection
            samples the residual of the rejected row as usual.
        max_spec_len: the output's padded width minus 1, >= max K_b.  None computes it from
            cu_num_draft_tokens: a host read (a synchronisation on CUDA); pass it to avoid
            that, as vLLM does.
        generator, seeds, offsets: as for ``rejection_sample``: request b draws exactly the
            numbers the padded front draws for it with K = max_spec_len (a zero-draft request
            consumes no coin in the per-request modes).
        uniform_samples: Shape (T,), float32/float64 in [0, 1): coin t is flat draft t's.
        sample_uniforms: Shape (batch,), float32/float64 in [0, 1).
        return_details: return a ``RejectionSampleDetails`` (FlashInfer's counters and a NaN
            flag per request) instead of the pair.

    Returns:
        output_tokens: Shape (batch, max_spec_len + 1), int64: accepted drafts, the sampled
            (or bonus) token, then -1 (vLLM's PLACEHOLDER_TOKEN_ID).
        num_accepted: Shape (batch,), int64; a row emits num_accepted + 1 tokens.
        (With return_details=True, a ``RejectionSampleDetails`` holding these two first.)

    Raises:
        TypeError: wrong dtype, max_spec_len not an int, generator of the wrong type.
        ValueError: wrong ranks; target_probs without T + B rows (or T with
            bonus_token_ids); draft_probs not (T, vocab); uniforms of the wrong shape; with
            value checks, cu_num_draft_tokens negative, decreasing or not ending at T,
            max_spec_len below the largest draft count, uniforms outside [0, 1); with
            validate=True, a negative, NaN or infinite entry of target_probs or draft_probs
            (raw logits are not probabilities; not checked otherwise).

    Registered as ``torch.ops.specdec.rejection_sample_flattened``. backend: None (automatic,
    chosen once per process and device type), "reference", "native" or "triton". validate: None
    (value checks on CPU tensors only), True or False (docs/API.md#backends).

    Triton backend:
        The padded op's two kernels (``_rejection_partials_kernel`` over vocabulary chunks,
        then ``_rejection_sample_kernel``) with ``FLAT=True``: each program reads its requests'
        spans from cu_num_draft_tokens and addresses the flat rows directly; with
        bonus_token_ids, fully accepted requests skip the sampling passes.
    """
    flat = check_rejection_sample_flattened_args(
        target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens, bonus_token_ids, max_spec_len, validate
    )
    device = target_probs.device
    source = RandomSource(generator, uniform_samples, sample_uniforms, seeds, offsets)
    # explicit uniforms as given, seeds/offsets for the kernels; only a generator draws here
    random_args = flattened_random_args(flat, cu_num_draft_tokens, device, source, validate=validate)
    args = (target_probs, draft_probs, draft_token_ids, cu_num_draft_tokens)
    if _library.direct_call(*args, flat.bonus_token_ids, *random_args):  # eager: checked once, no dispatcher
        name = _backend.resolve(OP, device, backend or None, IMPLEMENTED)
        out, acc = _run(name, flat, *args, flat.bonus_token_ids, *random_args)
    else:
        u, s, seeds, offsets = random_args
        out, acc = torch.ops.specdec.rejection_sample_flattened(
            *args, flat.bonus_token_ids, u, s, flat.max_spec_len, backend or "", seeds, offsets
        )
    if return_details:
        coins, _ = resolve_flattened_uniforms(flat, cu_num_draft_tokens, *random_args)
        return rejection_details_flattened(*args, flat, coins, out, acc)
    return out, acc
