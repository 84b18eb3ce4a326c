"""sampling_probs: temperature, top-k and top-p applied once for drafter and verifier."""
from __future__ import annotations

from specdec_kernels import _backend
from specdec_kernels.reference import sampling_probs as _ref
from specdec_kernels.reference.sampling_probs import _sampling_probs, check_sampling_args

IMPLEMENTED = ("reference",)


def sampling_probs(logits, temperature=1.0, top_k=None, top_p=None, *, backend=None):
    t, k, p = check_sampling_args(logits, temperature, top_k, top_p)
    _backend.resolve("sampling_probs", logits.device, backend, IMPLEMENTED)
    return _sampling_probs(logits, t, k, p)


sampling_probs.__doc__ = _backend.public_doc(_ref)
