"""Plain-PyTorch references of every op: the ground truth that every fast path is tested against.

Readable first: each takes the public op's arguments (without ``backend`` and ``validate``)
and returns its results, with no argument checks; the op's docstring documents them and the
paper or algorithm.  ``op(..., backend="reference")`` runs a reference behind the op's
checks.  ``mass`` and ``sample_from_weights`` are the inverse-CDF sampling shared by the
sampling references (and by engines that sample the same way).
"""

from specdec_kernels.reference.compact_kv_cache import compact_kv_cache
from specdec_kernels.reference.rejection_sample import mass, rejection_sample, sample_from_weights
from specdec_kernels.reference.rejection_sample_flattened import rejection_sample_flattened
from specdec_kernels.reference.sampling_probs import sampling_probs
from specdec_kernels.reference.tree_attention import tree_attention
from specdec_kernels.reference.tree_rejection_sample import tree_rejection_sample
from specdec_kernels.reference.verify_greedy import verify_greedy
from specdec_kernels.reference.verify_greedy_flattened import verify_greedy_flattened
from specdec_kernels.reference.verify_tree_greedy import verify_tree_greedy

__all__ = [
    "compact_kv_cache",
    "mass",
    "rejection_sample",
    "rejection_sample_flattened",
    "sample_from_weights",
    "sampling_probs",
    "tree_attention",
    "tree_rejection_sample",
    "verify_greedy",
    "verify_greedy_flattened",
    "verify_tree_greedy",
]
