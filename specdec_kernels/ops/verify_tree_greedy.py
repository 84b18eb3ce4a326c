"""verify_tree_greedy: greedy acceptance along a token tree, ``torch.ops.specdec.verify_tree_greedy``.

Backends: "reference" (plain PyTorch, every device) and "triton" (CUDA, or CPU under
``TRITON_INTERPRET=1``: ``specdec_kernels.ops._triton.verify_tree_greedy``, the split argmax
of ``verify_greedy`` then one program per sequence walking the nodes once in index order).
The tree is passed as tensors (parents [N] or [B, N]); no backend walks it on the host.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels import _backend, _library
from specdec_kernels.reference import verify_tree_greedy as _ref
from specdec_kernels.reference.verify_tree_greedy import _verify_tree_greedy, check_verify_tree_greedy_args

IMPLEMENTED = ("reference", "native", "triton")


def _impl(
    target_logits: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    num_nodes: Optional[torch.Tensor] = None,
    backend: str = "",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, _, _, parents, n = check_verify_tree_greedy_args(target_logits, tree_tokens, tree_parents, num_nodes, validate=False)
    name = _backend.resolve("verify_tree_greedy", target_logits.device, backend or None, IMPLEMENTED)
    if name == "triton":
        from specdec_kernels.ops._triton.verify_tree_greedy import verify_tree_greedy_triton

        return verify_tree_greedy_triton(target_logits, tree_tokens, parents, n)
    if name == "native":
        return torch.ops.specdec.verify_tree_greedy_native(target_logits, tree_tokens, parents, n)
    return _verify_tree_greedy(target_logits, tree_tokens, parents, n)


def _fake(target_logits, tree_tokens, tree_parents, num_nodes=None, backend=""):
    check_verify_tree_greedy_args(target_logits, tree_tokens, tree_parents, num_nodes, validate=False)
    _library.check_backend_name(backend)
    B, N, _ = target_logits.shape
    torch._check(tree_tokens.shape == (B, N), lambda: "tree_tokens must have shape (B, N)")
    torch._check(tree_parents.shape in ((N,), (B, N)), lambda: "tree_parents must have shape (N,) or (B, N)")
    torch._check(num_nodes is None or num_nodes.shape == (B,), lambda: "num_nodes must have shape (B,)")
    new = lambda *shape: target_logits.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return new(B, N), new(B, N), new(B)


def _triton_decomposition(args, kwargs):
    x = _library.bound_arguments(_impl, args, kwargs)
    logits = x["target_logits"]
    if _backend.resolve("verify_tree_greedy", logits.device, x["backend"] or None, IMPLEMENTED) != "triton":
        return None
    B, N, _ = logits.shape
    n = x["num_nodes"]
    n = torch.full((B,), N, dtype=torch.int64, device=logits.device) if n is None else n.to(torch.int64)
    return torch.ops.specdec.verify_tree_greedy_triton(logits, x["tree_tokens"], x["tree_parents"].to(torch.int64), n, 0, 0)


op = _library.define(
    "verify_tree_greedy", _impl, cpu=_impl, cuda=_impl, fake=_fake, triton_decomposition=_triton_decomposition
)


def verify_tree_greedy(
    target_logits: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    num_nodes: Optional[torch.Tensor] = None,
    *,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, _, _, _, n = check_verify_tree_greedy_args(target_logits, tree_tokens, tree_parents, num_nodes, validate)
    return torch.ops.specdec.verify_tree_greedy(target_logits, tree_tokens, tree_parents, n, backend or "")


verify_tree_greedy.__doc__ = _backend.public_doc(_ref, "verify_tree_greedy")


# the Triton launchers and kernels (verify_greedy_triton, AOT_SPECS, ...), loaded on first access
__getattr__ = _library.lazy_attributes(__name__, "specdec_kernels.ops._triton.verify_tree_greedy")
