"""rejection_sample: lossless speculative sampling of a chain, ``torch.ops.specdec.rejection_sample``.

Backends: "reference" (``specdec_kernels.reference.rejection_sample``, every device), "native"
(the C++ CPU kernel, ``csrc/verify_sample_cpu.cpp``; the automatic CPU backend) and "triton"
(CUDA, or CPU under ``TRITON_INTERPRET=1``: ``specdec_kernels.ops._triton.rejection_sample``).
The registered op takes explicit uniforms or, for the missing ones, per-sequence Philox seeds
and offsets, from which the kernels compute the numbers themselves; the Python front draws them
only for a generator or a dict of generators (``specdec_kernels._random``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch

from specdec_kernels import _backend, _library, _native
from specdec_kernels._checks import check_chain_args
from specdec_kernels._random import GeneratorArg, RandomSource, check_op_uniforms, op_random_args, resolve_uniforms
from specdec_kernels.checks import check_probability_values
from specdec_kernels.reference.rejection_sample import _rejection_sample, accept_tests

IMPLEMENTED = ("reference", "native", "triton")
OP = "rejection_sample"
# the Triton backend's launches: (target, draft, tokens, counts, coins, final_u, K, bonus_ids, seeds, offsets)
_CHAIN = "specdec_kernels.ops._triton.rejection_sample:_launch_chain"


class RejectionSampleDetails(NamedTuple):
    """What ``rejection_sample(..., return_details=True)`` (and its flattened form) returns:
    the two usual outputs and FlashInfer's optional counters (``chain_speculative_sampling``'s
    ``output_accepted_token_num`` and ``output_emitted_draft_token_num``), plus a NaN flag.

    Fields:
        output_tokens: Shape (batch, K + 1), int64: as without details.
        num_accepted: Shape (batch,), int64: as without details.
        accepted_counts: Shape (batch,), int64: how many of the request's counted drafts pass
            their own accept test ``u_j * q_j(x_j) < p_j(x_j)`` (the same coins), counted over
            all of them, also after the first rejection (FlashInfer's accepted count: a
            measure of draft/target agreement; >= num_accepted).
        emitted_counts: Shape (batch,), int64: equal to num_accepted (FlashInfer's emitted
            draft count; the request emits emitted_counts + 1 tokens).
        valid: Shape (batch,), bool: False where a probability row the request owns held a
            NaN: a target row of one of its counted drafts, its bonus row (when given as a
            row) or a draft row of one of its counted drafts.  Rows of the padding are not
            the request's.

    Unlike FlashInfer the counters are returned fresh, not accumulated in place.
    """

    output_tokens: torch.Tensor
    num_accepted: torch.Tensor
    accepted_counts: torch.Tensor
    emitted_counts: torch.Tensor
    valid: torch.Tensor


def make_details(output_tokens, num_accepted, accept, target_nan, draft_nan) -> RejectionSampleDetails:
    """``RejectionSampleDetails`` from the outputs, the accept tests [B, K] and per-request
    masks of used rows holding NaN (target [B, K + 1], draft [B, K] or None)."""
    bad = target_nan.any(dim=1)
    if draft_nan is not None:
        bad = bad | draft_nan.any(dim=1)
    accepted_counts = accept.to(torch.int64).sum(dim=1)
    return RejectionSampleDetails(output_tokens, num_accepted, accepted_counts, num_accepted.clone(), ~bad)


def rejection_details(target_probs, draft_probs, draft_tokens, num_draft_tokens, coins, output_tokens, num_accepted):
    """The details of a padded call (cheap gathers of B * K values and, since asked for, a
    NaN scan of the rows)."""
    B, K1, V = target_probs.shape
    K = K1 - 1
    device = target_probs.device
    n = num_draft_tokens.clamp(0, K)
    tokens = draft_tokens.to(torch.int64)
    safe = tokens.clamp(0, V - 1)[..., None]
    p_x = target_probs[:, :K].gather(2, safe).squeeze(2)
    q_x = draft_probs.gather(2, safe).squeeze(2) if draft_probs is not None else torch.ones_like(p_x)
    j = torch.arange(K1, device=device)
    counted = j[None, :K] < n[:, None]
    accept = accept_tests(p_x, q_x, tokens, counted, coins, V)  # coins as the kernels use them (clamped)
    target_nan = torch.isnan(target_probs).any(dim=-1) & (j[None, :] <= n[:, None])
    draft_nan = torch.isnan(draft_probs).any(dim=-1) & counted if draft_probs is not None else None
    return make_details(output_tokens, num_accepted, accept, target_nan, draft_nan)


def check_rejection_sample_args(target_probs, draft_probs, draft_tokens, num_draft_tokens, validate=None):
    """Validate the arguments of ``rejection_sample``; return (B, K, V, num_draft_tokens int64).
    With ``validate=True`` also the probabilities of the rows each sequence uses."""
    B, K, V, n = check_chain_args("target_probs", target_probs, draft_tokens, num_draft_tokens, validate, draft_probs)
    if validate:  # a scan of B * (K + 1) * V values: only when asked for
        j = torch.arange(K + 1, device=target_probs.device)[None, :]
        check_probability_values("target_probs", target_probs, validate, j <= n[:, None])
        if draft_probs is not None:
            check_probability_values("draft_probs", draft_probs, validate, j[:, :K] < n[:, None])
    return B, K, V, n


def _run(
    backend: str, target_probs, draft_probs, draft_tokens, n, uniform_samples, sample_uniforms, seeds, offsets
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The backend ``backend`` on checked arguments (``n`` int64 counts; the randomness as the
    registered op takes it, ``_random.op_random_args``: explicit uniforms as given, seeds and
    offsets for the missing ones, which the kernels compute and clamp themselves): the op's
    kernel after its checks, and the front's eager path (one check pass, no dispatcher)."""
    random_args = (uniform_samples, sample_uniforms, seeds, offsets)
    if backend == "triton":  # the launches themselves, no layer between (host cost)
        K = draft_tokens.shape[1]
        return _backend.triton_launcher(_CHAIN)(
            target_probs, draft_probs, draft_tokens, n, uniform_samples, sample_uniforms, K, None, seeds, offsets
        )
    if backend == "native":
        p, q = _native.probs_operands(target_probs, draft_probs)
        return torch.ops.specdec_native.rejection_sample(p, q, draft_tokens, n, *random_args)
    B, K = draft_tokens.shape
    coins, final_u = resolve_uniforms(B, K, *random_args)
    return _rejection_sample(target_probs, draft_probs, draft_tokens, n, coins, final_u)


def _impl(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_tokens: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor],
    uniform_samples: Optional[torch.Tensor],
    sample_uniforms: Optional[torch.Tensor],
    backend: str = "",
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    B, K, _, n = check_rejection_sample_args(target_probs, draft_probs, draft_tokens, num_draft_tokens, validate=False)
    random_args = (uniform_samples, sample_uniforms, seeds, offsets)
    check_op_uniforms(B, (B, K), target_probs.device, *random_args)
    name = _backend.resolve(OP, target_probs.device, backend or None, IMPLEMENTED)
    return _run(name, target_probs, draft_probs, draft_tokens, n, *random_args)


def _fake(
    target_probs,
    draft_probs,
    draft_tokens,
    num_draft_tokens,
    uniform_samples,
    sample_uniforms,
    backend="",
    seeds=None,
    offsets=None,
):
    B, K, _, _ = check_rejection_sample_args(target_probs, draft_probs, draft_tokens, num_draft_tokens, validate=False)
    check_op_uniforms(B, (B, K), target_probs.device, uniform_samples, sample_uniforms, seeds, offsets)
    _library.check_backend_name(backend)
    B, K1, _ = target_probs.shape
    torch._check(draft_tokens.shape == (B, K1 - 1), lambda: "draft_tokens must have shape (B, K)")
    return target_probs.new_empty((B, K1), dtype=torch.int64), target_probs.new_empty((B,), dtype=torch.int64)


op = _library.define(OP, _impl, fake=_fake, implemented=IMPLEMENTED, decompose_to_triton=True, grad_inputs="ignore")


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_tokens: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
    *,
    generator: GeneratorArg = None,
    uniform_samples: Optional[torch.Tensor] = None,
    sample_uniforms: Optional[torch.Tensor] = None,
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    return_details: bool = False,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> Union[Tuple[torch.Tensor, torch.Tensor], RejectionSampleDetails]:
    """Lossless speculative sampling of a chain of draft tokens.

    Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and
    Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling"): accept draft
    x_j when u_j * q_j(x_j) < p_j(x_j) (float32), so with probability min(1, p/q); a token with
    p_j(x_j) = 0 is never accepted.  At the first rejection sample from max(0, p_j - q_j)
    normalised (from p_j when that residual has no mass); when all drafts are accepted sample
    the bonus token from the row after the last draft.  The emitted tokens follow the target
    distribution exactly whatever q is.

    Args:
        target_probs: Shape (batch, K + 1, vocab), float32/float16/bfloat16 (computed in
            float32).  Rows are used as given: the accept test compares raw values and the
            sampled token is drawn proportionally to its weights, so an unnormalised row acts
            as its normalisation, except in the accept test.
        draft_probs: Shape (batch, K, vocab), the distributions the drafts were sampled from,
            or None when the drafts were chosen deterministically (q one-hot at the draft).
        draft_tokens: Shape (batch, K), int32/int64.  An id outside [0, vocab) is rejected.
        num_draft_tokens: Shape (batch,), int in 0..K, or None for all K.
        generator: a torch.Generator, or a list of one per sequence; see
            ``specdec_kernels._random`` for the order in which numbers are drawn.
        uniform_samples: Shape (batch, K), float32/float64 in [0, 1): the acceptance coins.
        sample_uniforms: Shape (batch,), float32/float64 in [0, 1): the uniform that draws each
            sequence's one sampled token (residual or bonus) by inverse CDF.
        return_details: return a ``RejectionSampleDetails`` (FlashInfer's accepted and
            emitted draft counts and a per-request NaN flag) instead of the pair; costs a
            gather of B * K values and a NaN scan of the rows, only when asked.

    Returns:
        output_tokens: Shape (batch, K + 1), int64: accepted drafts, the sampled token, -1.
        num_accepted: Shape (batch,), int64; a row emits num_accepted + 1 tokens.
        (With return_details=True, a ``RejectionSampleDetails`` holding these two first.)

    Raises:
        TypeError: wrong dtype, generator of the wrong type.
        ValueError: wrong rank, mismatched shapes or devices, num_draft_tokens outside 0..K,
            uniforms of the wrong shape or outside [0, 1); with validate=True, a negative,
            NaN or infinite entry in a used row (target rows 0..num_draft_tokens, draft rows
            below it) of target_probs or draft_probs (raw logits are not probabilities; not
            checked otherwise).

    Registered as ``torch.ops.specdec.rejection_sample``. backend: None (automatic, chosen once
    per process and device type), "reference", "native" or "triton". validate: None (value
    checks on CPU tensors only), True or False (docs/API.md#backends).

    Randomness (the registered op takes ``uniform_samples``, ``sample_uniforms``, ``seeds`` and
    ``offsets``; the front draws numbers only for a generator):
        seeds, offsets: Shape (batch,), int32/int64: counter-based Philox numbers, sequence b's
            depending only on (seeds[b], offsets[b]); see ``specdec_kernels._random``.  The
            kernels compute them (no torch op, no host read); given uniforms take precedence.
        generator: also a dict {row: torch.Generator} with gaps (rows without one use the
            default generator); per-sequence generators draw only the sequence's own
            num_draft_tokens coins (a host read of the counts).
        Explicit uniforms are used as given (float32 or float64): the kernels cast them to
        float32, read NaN as 0 and clamp into [0, 1 - 2**-24], so an unvalidated value never
        emits a token without mass; with value checks one outside [0, 1) raises.

    Triton backend:
        Two launches.  ``_rejection_partials_kernel`` over (request blocks, vocabulary chunks):
        each program walks the chain's accept/reject (a few loads), then sums the float64 mass
        of p and of the residual max(0, p - q) over its chunk; on CUDA the chunks give about 8
        programs per SM even at batch 1.  ``_rejection_sample_kernel`` over request blocks:
        the chunk masses in chunk order give the total and the chunk where the running CDF
        first exceeds u * total, and the inverse-CDF search reads that chunk only.  The residual
        is recomputed, never written to memory.  Same tokens as the reference for the same
        uniforms, except when u * total lies within float64 rounding of a CDF boundary (the
        kernel sums in tiles and chunks, the reference sequentially).
    """
    B, K, _, n = check_rejection_sample_args(target_probs, draft_probs, draft_tokens, num_draft_tokens, validate)
    device = target_probs.device
    source = RandomSource(generator, uniform_samples, sample_uniforms, seeds, offsets)
    # explicit uniforms as given, seeds/offsets for the kernels; only a generator draws here
    random_args = op_random_args(B, K, device, source, coin_counts=n, validate=validate)
    if _library.direct_call(target_probs, draft_probs, draft_tokens, n, *random_args):  # eager: checked once
        name = _backend.resolve(OP, device, backend or None, IMPLEMENTED)
        out, acc = _run(name, target_probs, draft_probs, draft_tokens, n, *random_args)
    else:
        u, s, seeds, offsets = random_args
        out, acc = torch.ops.specdec.rejection_sample(
            target_probs, draft_probs, draft_tokens, n, u, s, backend or "", seeds, offsets
        )
    if return_details:  # in the front: B * K gathers and a NaN scan, only when asked
        coins, _ = resolve_uniforms(B, K, *random_args)
        return rejection_details(target_probs, draft_probs, draft_tokens, n, coins, out, acc)
    return out, acc
