"""verify_greedy: greedy acceptance of a chain of draft tokens."""
from __future__ import annotations

from specdec_kernels import _backend
from specdec_kernels.reference import verify_greedy as _ref
from specdec_kernels.reference.verify_greedy import _verify_greedy, check_verify_greedy_args

IMPLEMENTED = ("reference",)


def verify_greedy(target_logits, draft_tokens, num_draft_tokens=None, *, backend=None, validate=None):
    _, _, _, n = check_verify_greedy_args(target_logits, draft_tokens, num_draft_tokens, validate)
    _backend.resolve("verify_greedy", target_logits.device, backend, IMPLEMENTED)
    return _verify_greedy(target_logits, draft_tokens, n)


verify_greedy.__doc__ = _backend.public_doc(_ref)
