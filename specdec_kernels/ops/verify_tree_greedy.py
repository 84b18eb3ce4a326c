"""verify_tree_greedy: greedy acceptance of the longest matching path of a token tree."""
from __future__ import annotations

from specdec_kernels import _backend
from specdec_kernels.reference import verify_tree_greedy as _ref
from specdec_kernels.reference.verify_tree_greedy import _verify_tree_greedy, check_verify_tree_greedy_args

IMPLEMENTED = ("reference",)


def verify_tree_greedy(target_logits, tree_tokens, tree_parents, num_nodes=None, *, backend=None, validate=None):
    _, _, _, parents, n = check_verify_tree_greedy_args(target_logits, tree_tokens, tree_parents, num_nodes, validate)
    _backend.resolve("verify_tree_greedy", target_logits.device, backend, IMPLEMENTED)
    return _verify_tree_greedy(target_logits, tree_tokens, parents, n)


verify_tree_greedy.__doc__ = _backend.public_doc(_ref)
