"""tree_rejection_sample: multi-candidate rejection sampling over a token tree,
``torch.ops.specdec.tree_rejection_sample``.

Backends: "reference" (plain PyTorch, every device) and "triton" (CUDA, or CPU under
``TRITON_INTERPRET=1``: ``specdec_kernels.ops._triton.tree_rejection_sample``).  The tree is
passed as tensors; the registered op takes its random numbers explicitly, made by the Python
front from a generator, a dict of generators or Philox seeds and offsets.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels import _backend, _library, _native
from specdec_kernels._random import GeneratorArg, draw_uniforms
from specdec_kernels.reference import tree_rejection_sample as _ref
from specdec_kernels.reference.tree_rejection_sample import _tree_rejection_sample, check_tree_rejection_sample_args

IMPLEMENTED = ("reference", "native", "triton")


def _impl(
    target_probs: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    num_nodes: Optional[torch.Tensor],
    uniform_samples: torch.Tensor,
    sample_uniforms: torch.Tensor,
    backend: str = "",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N, _, parents, n = check_tree_rejection_sample_args(
        target_probs, tree_tokens, tree_parents, draft_probs, num_nodes, validate=False
    )
    coins, final_u = draw_uniforms(B, N - 1, target_probs.device, None, uniform_samples, sample_uniforms, validate=False)
    name = _backend.resolve("tree_rejection_sample", target_probs.device, backend or None, IMPLEMENTED)
    if name == "triton":
        from specdec_kernels.ops._triton.tree_rejection_sample import tree_rejection_sample_triton

        return tree_rejection_sample_triton(target_probs, tree_tokens, parents, draft_probs, n, coins, final_u)
    if name == "native":
        p, q = _native.probs_operands(target_probs, draft_probs)
        return torch.ops.specdec.tree_rejection_sample_native(p, tree_tokens, parents, q, n, coins, final_u)
    return _tree_rejection_sample(target_probs, tree_tokens, parents, draft_probs, n, coins, final_u)


def _fake(target_probs, tree_tokens, tree_parents, draft_probs, num_nodes, uniform_samples, sample_uniforms, backend=""):
    B, N, _, _, _ = check_tree_rejection_sample_args(target_probs, tree_tokens, tree_parents, draft_probs, num_nodes,
                                                     validate=False)
    draw_uniforms(B, N - 1, target_probs.device, None, uniform_samples, sample_uniforms, validate=False)
    _library.check_backend_name(backend)
    B, N, _ = target_probs.shape
    torch._check(tree_tokens.shape == (B, N), lambda: "tree_tokens must have shape (B, N)")
    torch._check(tree_parents.shape in ((N,), (B, N)), lambda: "tree_parents must have shape (N,) or (B, N)")
    torch._check(uniform_samples.shape == (B, N - 1), lambda: "uniform_samples must have shape (B, N - 1)")
    new = lambda *shape: target_probs.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return new(B, N), new(B, N), new(B)


def _triton_decomposition(args, kwargs):
    x = _library.bound_arguments(_impl, args, kwargs)
    p = x["target_probs"]
    if _backend.resolve("tree_rejection_sample", p.device, x["backend"] or None, IMPLEMENTED) != "triton":
        return None
    B, N, _ = p.shape
    parents = x["tree_parents"].to(torch.int64)
    parents = parents.expand(B, N) if parents.dim() == 1 else parents
    n = x["num_nodes"]
    n = torch.full((B,), N, dtype=torch.int64, device=p.device) if n is None else n.to(torch.int64)
    return torch.ops.specdec.tree_rejection_sample_triton(
        p, x["tree_tokens"], parents, x["draft_probs"], n,
        x["uniform_samples"].to(torch.float32), x["sample_uniforms"].to(torch.float32),
    )


op = _library.define(
    "tree_rejection_sample", _impl, cpu=_impl, cuda=_impl, fake=_fake, triton_decomposition=_triton_decomposition
)


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
    B, N, _, _, n = check_tree_rejection_sample_args(target_probs, tree_tokens, tree_parents, draft_probs, num_nodes, validate)
    coins, final_u = draw_uniforms(
        B, N - 1, target_probs.device, generator, uniform_samples, sample_uniforms,
        coin_counts=(n - 1).clamp(min=0), seeds=seeds, offsets=offsets, validate=validate,
    )
    return torch.ops.specdec.tree_rejection_sample(
        target_probs, tree_tokens, tree_parents, draft_probs, n, coins, final_u, backend or ""
    )


tree_rejection_sample.__doc__ = _backend.public_doc(_ref, "tree_rejection_sample") + """
    Randomness (the front; the registered op takes ``uniform_samples`` and ``sample_uniforms``):
        seeds, offsets: Shape (batch,), int32/int64: counter-based Philox numbers, node c's
            coin at offsets[b] + c - 1; see ``specdec_kernels._random``.
        generator: also a dict {row: torch.Generator} with gaps; per-sequence generators draw
            only the sequence's own num_nodes - 1 coins.

    Triton backend:
        The vocabulary of every row is cut into chunks over the GPU (batch 1 fills it).  All
        children of a node are drawn from the same draft row, so the residual after the k-th
        rejection at a node depends on k only: ``_tree_level_kernel`` precomputes its total
        t_k for every node and k (levels 1..2 over chunks, higher levels serially per row),
        rebuilding element x from p(x), q(x) and the reciprocals 1 / t_0..1 / t_{k-1} in the
        reference's float64 operations (nothing of size V per node is stored);
        ``_tree_walk_kernel`` walks the nodes in order, as the reference does, with point
        loads; ``_tree_final_partials_kernel`` / ``_tree_final_sample_kernel`` sample the last
        residual (with deterministic children: the target row with the rejected tokens
        zeroed) by inverse CDF, searching only the chunk that holds u * total.  Same tokens as
        the reference for the same uniforms, except when a test or threshold lies within
        float64 rounding of a boundary (the kernels sum a row in chunks, the reference in
        PyTorch's order).  Workspaces: see docs/API.md.
"""


# the Triton launchers and kernels (verify_greedy_triton, AOT_SPECS, ...), loaded on first access
__getattr__ = _library.lazy_attributes(__name__, "specdec_kernels.ops._triton.tree_rejection_sample")
