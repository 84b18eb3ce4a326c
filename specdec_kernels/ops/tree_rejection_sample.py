"""tree_rejection_sample: multi-candidate rejection sampling over a token tree,
``torch.ops.specdec.tree_rejection_sample``.

Backends: "reference" (``specdec_kernels.reference.tree_rejection_sample``, every device),
"native" (the C++ CPU kernel, ``csrc/verify_sample_cpu.cpp``; the automatic CPU backend) and
"triton" (CUDA, or CPU under ``TRITON_INTERPRET=1``:
``specdec_kernels.ops._triton.tree_rejection_sample``). The tree is passed as tensors; the
registered op takes explicit uniforms or, for the missing ones, per-sequence Philox seeds and
offsets, from which the kernels compute the numbers themselves; the Python front draws them
only for a generator or a dict of generators.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels import _backend, _library, _native
from specdec_kernels._checks import check_tree_args
from specdec_kernels._random import GeneratorArg, RandomSource, check_op_uniforms, op_random_args, resolve_uniforms
from specdec_kernels.checks import check_probability_values
from specdec_kernels.reference.tree_rejection_sample import _tree_rejection_sample

IMPLEMENTED = ("reference", "native", "triton")
OP = "tree_rejection_sample"
_TRITON = "specdec_kernels.ops._triton.tree_rejection_sample:tree_rejection_sample_triton"


def check_tree_rejection_sample_args(target_probs, tree_tokens, tree_parents, draft_probs, num_nodes, validate=None):
    """Validate the arguments of ``tree_rejection_sample``; return (B, N, V, parents int64 [B, N] or,
    for a shared tree, [N], num_nodes int64 [B]).
    With ``validate=True`` also the probabilities of the rows of each sequence's nodes."""
    B, N, V, parents, n = check_tree_args(
        "target_probs", target_probs, tree_tokens, tree_parents, num_nodes, validate, draft_probs, expand_parents=False
    )
    if validate:  # a scan of B * N * V values: only when asked for
        used = torch.arange(N, device=target_probs.device)[None, :] < n[:, None]
        check_probability_values("target_probs", target_probs, validate, used)
        if draft_probs is not None:
            check_probability_values("draft_probs", draft_probs, validate, used)
    return B, N, V, parents, n


def _run(
    backend: str, target_probs, tree_tokens, parents, draft_probs, n, uniform_samples, sample_uniforms, seeds, offsets
):
    """The backend ``backend`` on checked arguments (``parents`` int64 [B, N] or, shared, [N];
    ``n`` int64 [B];
    the randomness as the registered op takes it, ``_random.op_random_args``: explicit
    uniforms as given, seeds and offsets for the missing ones, which the kernels compute and
    clamp themselves): the op's kernel after its checks, and the front's eager path (one
    check pass, no dispatcher)."""
    random_args = (uniform_samples, sample_uniforms, seeds, offsets)
    if backend == "triton":  # reads a shared tree with batch stride 0
        return _backend.triton_launcher(_TRITON)(target_probs, tree_tokens, parents, draft_probs, n, *random_args)
    if parents.dim() == 1:
        parents = parents.expand(tree_tokens.shape)
    if backend == "native":
        p, q = _native.probs_operands(target_probs, draft_probs)
        return torch.ops.specdec_native.tree_rejection_sample(p, tree_tokens, parents, q, n, *random_args)
    B, N = tree_tokens.shape
    coins, final_u = resolve_uniforms(B, N - 1, *random_args)
    return _tree_rejection_sample(target_probs, tree_tokens, parents, draft_probs, n, coins, final_u)


def _impl(
    target_probs: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    num_nodes: Optional[torch.Tensor],
    uniform_samples: Optional[torch.Tensor],
    sample_uniforms: Optional[torch.Tensor],
    backend: str = "",
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N, _, parents, n = check_tree_rejection_sample_args(
        target_probs, tree_tokens, tree_parents, draft_probs, num_nodes, validate=False
    )
    random_args = (uniform_samples, sample_uniforms, seeds, offsets)
    check_op_uniforms(B, (B, N - 1), target_probs.device, *random_args)
    name = _backend.resolve(OP, target_probs.device, backend or None, IMPLEMENTED)
    return _run(name, target_probs, tree_tokens, parents, draft_probs, n, *random_args)


def _fake(
    target_probs,
    tree_tokens,
    tree_parents,
    draft_probs,
    num_nodes,
    uniform_samples,
    sample_uniforms,
    backend="",
    seeds=None,
    offsets=None,
):
    B, N, _, _, _ = check_tree_rejection_sample_args(
        target_probs, tree_tokens, tree_parents, draft_probs, num_nodes, validate=False
    )
    check_op_uniforms(B, (B, N - 1), target_probs.device, uniform_samples, sample_uniforms, seeds, offsets)
    _library.check_backend_name(backend)
    B, N, _ = target_probs.shape
    torch._check(tree_tokens.shape == (B, N), lambda: "tree_tokens must have shape (B, N)")
    torch._check(tree_parents.shape in ((N,), (B, N)), lambda: "tree_parents must have shape (N,) or (B, N)")
    new = lambda *shape: target_probs.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return new(B, N), new(B, N), new(B)


op = _library.define(OP, _impl, fake=_fake, implemented=IMPLEMENTED, decompose_to_triton=True, grad_inputs="ignore")


def tree_rejection_sample(
    target_probs: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    num_nodes: Optional[torch.Tensor] = None,
    *,
    generator: GeneratorArg = None,
    uniform_samples: Optional[torch.Tensor] = None,
    sample_uniforms: Optional[torch.Tensor] = None,
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-candidate recursive rejection sampling over a token tree.

    SpecInfer (Miao et al. 2024, "SpecInfer: Accelerating Generative LLM Serving with
    Tree-based Speculative Inference and Verification"), with the deterministic-children
    variant of Chen et al. / Sequoia (2024).  At the current node with residual p' (starting
    as the target's distribution there), try its children in index order:

    * ``draft_probs`` given (children drawn from q = draft_probs[node]): accept child x with
      probability min(1, p'(x) / q(x)), tested as u * q(x) * total < r(x) in float64 with
      p' = r / total; on rejection p' <- norm(max(0, p' - q)) (unchanged if that has no mass),
      computed as r <- mass(r * (1 / total) - q).
    * ``draft_probs`` None (distinct deterministic children, e.g. top-k): accept x with
      probability p'(x), tested as u * total < r(x); on rejection r(x) <- 0 and total -= r(x).

    On acceptance move to the child (p' restarts from the target's row there); when every
    child is rejected (or there are none) sample from p' (from the target's row if p' has no
    mass) by inverse CDF.  Both keep the target distribution exactly.

    Args:
        target_probs: Shape (batch, N, vocab), float32/float16/bfloat16; row i is the target's
            distribution after node i.  NaN and negative entries carry no mass.
        tree_tokens: Shape (batch, N), int32/int64; node 0 is the root (never tested).
        tree_parents: Shape (N,) or (batch, N), int32/int64, parents[0] = -1, 0 <= parents[i] < i.
        draft_probs: Shape (batch, N, vocab) or None; row i is the distribution node i's
            children were drawn from.
        num_nodes: Shape (batch,), int in 0..N, or None for all N.
        generator: a torch.Generator or one per sequence (see ``specdec_kernels._random``).
        uniform_samples: Shape (batch, N - 1), float32/float64 in [0, 1); column c - 1 is node c's coin.
        sample_uniforms: Shape (batch,), float32/float64 in [0, 1): the final sample's uniform.

    Returns:
        output_tokens: Shape (batch, N), int64: accepted drafts, the sampled token, then -1.
        accepted_nodes: Shape (batch, N), int64: the accepted path from node 0, then -1.
        num_accepted: Shape (batch,), int64: accepted drafts (root not counted); both go to
            ``compact_kv_cache(kv, cache_seqlens, accepted_nodes, num_accepted=num_accepted)``
            as they are (it fills num_accepted + 1 slots).

    Raises:
        TypeError: wrong dtype or generator type.
        ValueError: wrong rank or shape, parents not topological (CPU), num_nodes out of
            range, uniforms of the wrong shape or outside [0, 1); with validate=True, a
            negative, NaN or infinite entry in a row of a node (< num_nodes) of target_probs
            or draft_probs (raw logits are not probabilities; not checked otherwise).

    Registered as ``torch.ops.specdec.tree_rejection_sample``. backend: None (automatic, chosen
    once per process and device type), "reference", "native" or "triton". validate: None (value
    checks on CPU tensors only), True or False (docs/API.md#backends).

    Randomness (the registered op takes ``uniform_samples``, ``sample_uniforms``, ``seeds`` and
    ``offsets``; the front draws numbers only for a generator):
        seeds, offsets: Shape (batch,), int32/int64: counter-based Philox numbers, node c's
            coin at offsets[b] + c - 1; see ``specdec_kernels._random``.  The kernels compute
            them (no torch op, no host read); given uniforms take precedence.
        generator: also a dict {row: torch.Generator} with gaps; per-sequence generators draw
            only the sequence's own num_nodes - 1 coins (a host read of the counts).
        Explicit uniforms are used as given (float32 or float64): the kernels cast them to
        float32, read NaN as 0 and clamp into [0, 1 - 2**-24]; with value checks one outside
        [0, 1) raises.

    Triton backend:
        Two launches (``ops/_triton/tree_rejection_sample.py``, docs/API.md):
        ``_tree_mass_kernel`` sums every used node's target row over vocabulary chunks (batch
        1 fills the GPU); ``_tree_sample_kernel``, one program per sequence, walks the nodes
        in order, as the reference does, with point loads.  All children of a node are drawn
        from the same draft row, so the residual after the k-th rejection at a node depends
        on k only: each rejection's new total t_k is one pass over the row that rebuilds
        element x from p(x), q(x) and the reciprocals 1 / t_0..1 / t_{k-1}, in the
        reference's float64 operations (nothing of size V is stored).  The last residual
        (with deterministic children: the target row with the rejected tokens zeroed) is
        sampled by inverse CDF, one pass for its total, one for the running CDF.  Same tokens
        as the reference for the same uniforms, except when a test or threshold lies within
        float64 rounding of a boundary (the kernels sum a row in tiles and chunks, the
        reference in PyTorch's order).  Workspaces: see docs/API.md.
    """
    B, N, _, parents, n = check_tree_rejection_sample_args(
        target_probs, tree_tokens, tree_parents, draft_probs, num_nodes, validate
    )
    device = target_probs.device
    source = RandomSource(generator, uniform_samples, sample_uniforms, seeds, offsets)
    # explicit uniforms as given, seeds/offsets for the kernels; only a generator draws here (the
    # per-sequence generators' coin counts: a torch op only in that mode)
    per_sequence = isinstance(generator, (list, tuple, dict)) and seeds is None
    counts = (n - 1).clamp(min=0) if per_sequence else None
    random_args = op_random_args(B, N - 1, device, source, coin_counts=counts, validate=validate)
    if _library.direct_call(target_probs, tree_tokens, tree_parents, draft_probs, n, *random_args):  # eager
        name = _backend.resolve(OP, device, backend or None, IMPLEMENTED)
        return _run(name, target_probs, tree_tokens, parents, draft_probs, n, *random_args)
    u, s, seeds, offsets = random_args
    return torch.ops.specdec.tree_rejection_sample(
        target_probs, tree_tokens, tree_parents, draft_probs, n, u, s, backend or "", seeds, offsets
    )
