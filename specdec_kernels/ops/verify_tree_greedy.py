"""verify_tree_greedy: greedy acceptance along a token tree, ``torch.ops.specdec.verify_tree_greedy``.

Backends: "reference" (``specdec_kernels.reference.verify_tree_greedy``, every device), "native"
(the C++ CPU kernel, ``csrc/verify_sample_cpu.cpp``; the automatic CPU backend) and "triton"
(CUDA, or CPU under ``TRITON_INTERPRET=1``: ``specdec_kernels.ops._triton.verify_tree_greedy``,
the split argmax of ``verify_greedy`` then one program per sequence walking the nodes once in
index order). The tree is passed as tensors (parents [N] or [B, N]); no backend walks it on the
host.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdec_kernels import _backend, _library, reference
from specdec_kernels._checks import check_tree_args

IMPLEMENTED = ("reference", "native", "triton")
OP = "verify_tree_greedy"
# the launcher with its tiling at the defaults (verify_tree_greedy_triton without its keyword layer)
_TRITON = "specdec_kernels.ops._triton.verify_tree_greedy:_verify_tree_greedy_triton_impl"


def check_verify_tree_greedy_args(target_logits, tree_tokens, tree_parents, num_nodes, validate=None):
    """Validate the arguments of ``verify_tree_greedy``; return (B, N, V, parents int64 [B, N] or,
    for a shared tree, [N], num_nodes int64 [B])."""
    return check_tree_args(
        "target_logits", target_logits, tree_tokens, tree_parents, num_nodes, validate, expand_parents=False
    )


def _run(backend: str, target_logits, tree_tokens, parents, n) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backend ``backend`` on checked arguments (``parents`` int64 [B, N] or, shared, [N];
    ``n`` int64 [B]): the op's kernel after its checks, and the front's eager path (one check
    pass)."""
    if backend == "triton":  # reads a shared tree with batch stride 0
        return _backend.triton_launcher(_TRITON)(target_logits, tree_tokens, parents, n)
    if parents.dim() == 1:
        parents = parents.expand(tree_tokens.shape)
    if backend == "native":
        return torch.ops.specdec_native.verify_tree_greedy(target_logits, tree_tokens, parents, n)
    return reference.verify_tree_greedy(target_logits, tree_tokens, parents, n)


def _impl(
    target_logits: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    num_nodes: Optional[torch.Tensor] = None,
    backend: str = "",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, _, _, parents, n = check_verify_tree_greedy_args(
        target_logits, tree_tokens, tree_parents, num_nodes, validate=False
    )
    name = _backend.resolve(OP, target_logits.device, backend or None, IMPLEMENTED)
    return _run(name, target_logits, tree_tokens, parents, n)


def _fake(target_logits, tree_tokens, tree_parents, num_nodes=None, backend=""):
    check_verify_tree_greedy_args(target_logits, tree_tokens, tree_parents, num_nodes, validate=False)
    _library.check_backend_name(backend)
    B, N, _ = target_logits.shape
    torch._check(tree_tokens.shape == (B, N), lambda: "tree_tokens must have shape (B, N)")
    torch._check(tree_parents.shape in ((N,), (B, N)), lambda: "tree_parents must have shape (N,) or (B, N)")
    torch._check(num_nodes is None or num_nodes.shape == (B,), lambda: "num_nodes must have shape (B,)")
    new = lambda *shape: target_logits.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return new(B, N), new(B, N), new(B)


op = _library.define(OP, _impl, fake=_fake, implemented=IMPLEMENTED, decompose_to_triton=True, grad_inputs="ignore")


def verify_tree_greedy(
    target_logits: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    num_nodes: Optional[torch.Tensor] = None,
    *,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification of a token tree.

    Tree verification as in SpecInfer (Miao et al. 2024) and Medusa (Cai et al. 2024) at
    temperature 0: starting at the root, move to the first child (lowest node index) whose
    token equals the target's argmax at the current node; stop when no child does.  The
    argmax at the last accepted node is emitted after the accepted drafts.

    Args:
        target_logits: Shape (batch, N, vocab), float32/float16/bfloat16.  Row i scores the
            token after node i.
        tree_tokens: Shape (batch, N), int32/int64.  Node 0 is the root (the last committed
            token, never compared); nodes 1.. are draft tokens in topological order.
        tree_parents: Shape (N,) shared by the batch or (batch, N), int32/int64, with
            parents[0] = -1 and 0 <= parents[i] < i.
        num_nodes: Shape (batch,), int32/int64 in 0..N, or None for all N.  Nodes at or past
            a row's count are ignored.

    Returns:
        output_tokens: Shape (batch, N), int64: accepted drafts, the target's token at the
            last accepted node, then -1.
        accepted_nodes: Shape (batch, N), int64: node indices of the accepted path, starting
            with 0 (the root), then -1.
        num_accepted: Shape (batch,), int64: accepted drafts (the root not counted); the
            sequence keeps num_accepted + 1 cache slots.  Both go to ``compact_kv_cache`` as
            they are: ``compact_kv_cache(kv, cache_seqlens, accepted_nodes,
            num_accepted=num_accepted)``.

    Raises:
        TypeError: wrong dtype or not a tensor.
        ValueError: wrong rank or shape, parents not in topological order (checked on CPU
            tensors), num_nodes outside 0..N, tensors on different devices.

    Registered as ``torch.ops.specdec.verify_tree_greedy``. backend: None (automatic, chosen
    once per process and device type), "reference", "native" or "triton". validate: None (value
    checks on CPU tensors only), True or False (docs/API.md#backends).
    """
    _, _, _, parents, n = check_verify_tree_greedy_args(target_logits, tree_tokens, tree_parents, num_nodes, validate)
    if _library.direct_call(target_logits, tree_tokens, tree_parents, n):  # eager: checked once, no dispatcher
        name = _backend.resolve(OP, target_logits.device, backend or None, IMPLEMENTED)
        return _run(name, target_logits, tree_tokens, parents, n)
    return torch.ops.specdec.verify_tree_greedy(target_logits, tree_tokens, tree_parents, n, backend or "")
