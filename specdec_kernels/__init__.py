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

# cli first: under ``python -m specdec_kernels.<tool>`` a Ctrl-C while the rest of the
# package imports exits with status 130 and one line, not a traceback (nothing otherwise)
from specdec_kernels import cli, reference, tree  # noqa: F401  (cli: imported first, for that)
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
from specdec_kernels.randoms import philox_uniforms, sequence_uniforms

__version__ = "0.1.0"


def load_native() -> bool:
    """Load the compiled extension ``specdec_kernels._C`` (once; later calls are free) and
    return whether it loaded.  The ops load it themselves on first use; engines call this to
    report a missing build.  Never raises: a failed load is reported by the ops' fallback
    warning, which names the cause."""
    from specdec_kernels import _native

    return _native.load()


def has_native_kernel(name: str, device_type: str) -> bool:
    """Whether the extension has a kernel ``torch.ops.specdec_native.<name>`` for
    ``device_type`` ("cpu" or "cuda"); False when it is not built or failed to load."""
    from specdec_kernels import _native

    return _native.has_kernel(name, device_type)


__all__ = [
    "RejectionSampleDetails",
    "SUPPORTED_HEAD_DIMS",
    "compact_kv_cache",
    "has_native_kernel",
    "load_native",
    "philox_uniforms",
    "reference",
    "reset_backends",
    "rejection_sample",
    "rejection_sample_flattened",
    "sampling_probs",
    "sequence_uniforms",
    "tree",
    "tree_attention",
    "tree_rejection_sample",
    "verify_greedy",
    "verify_greedy_flattened",
    "verify_tree_greedy",
]
