"""The kernel tests' harness: every Triton launcher module imported before any test runs.

The public fronts import ``specdec_kernels.ops._triton`` modules lazily, on a first Triton call.
Importing them all first makes a worker's behaviour independent of the order in which it
happens to run the tests (the launchers are plain functions, not ops: importing registers
nothing in ``torch.ops.specdec``; ``tests/ops/test_custom_ops.py`` checks that).
"""

import importlib
import pkgutil

try:
    import triton  # noqa: F401
except ImportError:  # no Triton: the launchers cannot import, and their tests skip
    pass
else:
    import specdec_kernels.ops._triton as _triton_pkg

    for _mod in pkgutil.iter_modules(_triton_pkg.__path__):
        importlib.import_module(f"{_triton_pkg.__name__}.{_mod.name}")
