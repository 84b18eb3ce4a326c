"""specdec_kernels: fused kernels for speculative decoding.

Public ops (contract: docs/API.md): ``verify_greedy``, ``verify_tree_greedy``,
``rejection_sample``, ``tree_rejection_sample``, ``sampling_probs``, ``tree_attention``,
``compact_kv_cache`` (and the flattened forms ``verify_greedy_flattened``,
``rejection_sample_flattened``); token-tree helpers in ``specdec_kernels.tree``; plain-PyTorch
references in ``specdec_kernels.reference``; argument checks in ``specdec_kernels.checks`` and
run-time choices in ``specdec_kernels.autotune``, public for engines built on the ops.

Importing the package registers each op as a torch custom op, ``torch.ops.specdec.<name>``
(``specdec_kernels._library``); the functions here are their friendly fronts (defaults,
argument normalisation, checks, random numbers).  Nothing here touches a GPU at import, and
triton is imported only when a Triton kernel is first needed.
"""
from specdec_kernels import reference, tree
from specdec_kernels._backend import reset as reset_backends
from specdec_kernels.ops.compact_kv_cache import compact_kv_cache
from specdec_kernels.ops.rejection_sample import RejectionSampleDetails, rejection_sample
from specdec_kernels.ops.rejection_sample_flattened import rejection_sample_flattened
from specdec_kernels.ops.sampling_probs import sampling_probs
from specdec_kernels.ops.tree_attention import SUPPORTED_HEAD_DIMS, tree_attention
from specdec_kernels.ops.tree_rejection_sample import tree_rejection_sample
from specdec_kernels.ops.verify_greedy import verify_greedy
from specdec_kernels.ops.verify_greedy_flattened import verify_greedy_flattened
from specdec_kernels.ops.verify_tree_greedy import verify_tree_greedy

__version__ = "0.1.0"

__all__ = [
    "RejectionSampleDetails",
    "SUPPORTED_HEAD_DIMS",
    "compact_kv_cache",
    "reference",
    "reset_backends",
    "rejection_sample",
    "rejection_sample_flattened",
    "sampling_probs",
    "tree",
    "tree_attention",
    "tree_rejection_sample",
    "verify_greedy",
    "verify_greedy_flattened",
    "verify_tree_greedy",
]
