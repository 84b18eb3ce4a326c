"""Test harness: device choice, the Triton interpreter on CPU, markers.

Without CUDA the Triton kernels run in the interpreter on CPU tensors; TRITON_INTERPRET
must be set before the kernels are imported, so it is set here, before anything imports
specdec_kernels.  With CUDA the same tests run on the GPU (and SPECDEC_TEST_LARGE=1, set by
scripts/gpu_check.sh, selects larger shapes).
"""

import os
import random

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

LARGE = os.environ.get("SPECDEC_TEST_LARGE") == "1"

# Under pytest-xdist (scripts/run_tests.sh runs one worker per core) each worker gets its
# share of the cores for torch's intra-op threads, so that the workers do not oversubscribe
# the machine.  Tests that set a thread count themselves (the bench CLIs' --threads) still do.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    # the cores this process may run on (as nproc counts them), not all of the machine's
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, _CORES // _WORKERS))


# One fixed state of the global generators for the start of every test, so that a test's random
# weights and inputs depend neither on the process (the global generator's seed can differ from
# one process to the next) nor on which tests ran before it in the same worker (pytest-xdist
# hands them out by load): a test run alone draws what it draws in the full suite.
_GLOBAL_SEED = 67280421310721  # torch's documented default seed


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Reset the global random generators (torch's CPU and CUDA ones, Python's ``random``)
    before each test's fixtures are set up (module-scoped ones included)."""
    torch.manual_seed(_GLOBAL_SEED)
    random.seed(_GLOBAL_SEED)


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_cuda: needs a CUDA device")
    config.addinivalue_line("markers", "requires_native_op(name): needs torch.ops.specdec.<name> on the test device")
    config.addinivalue_line("markers", "requires_sm(major): needs a CUDA device of at least this compute capability")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("requires_cuda") and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        sm = item.get_closest_marker("requires_sm")
        if sm is not None and (not HAS_CUDA or torch.cuda.get_device_capability()[0] < sm.args[0]):
            item.add_marker(pytest.mark.skip(reason=f"needs sm_{sm.args[0]}0 or newer"))


def pytest_runtest_logreport(report):
    """With SPECDEC_FAILURE_LOG=path, append each failure's traceback to that file as it happens
    (scripts/gpu_check.sh: a run cut short by its time limit still leaves the failures behind)."""
    path = os.environ.get("SPECDEC_FAILURE_LOG")
    # under pytest-xdist the controller sees each report again (with .node set): write it once
    if path and report.failed and getattr(report, "node", None) is None:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(autouse=True)
def _native_op_marker(request):
    marker = request.node.get_closest_marker("requires_native_op")
    if marker is not None:
        from specdec_kernels import _native

        device = "cuda" if HAS_CUDA else "cpu"
        if not _native.has_kernel(marker.args[0], device):
            if os.environ.get("SPECDEC_REQUIRE_NATIVE") == "1":
                pytest.fail(
                    f"SPECDEC_REQUIRE_NATIVE=1 but specdec_kernels._C has no {device} kernel for {marker.args[0]}"
                )
            pytest.skip(f"specdec_kernels._C has no {device} kernel for {marker.args[0]} (extension not built)")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel tests run: the GPU when there is one, else CPU (Triton interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="session")
def large() -> bool:
    return LARGE


@pytest.fixture(autouse=True)
def _fresh_backend_choice():
    """The backend choice is made once per process (and SPECDEC_BACKEND read at import): a test
    that changes the environment or the extension's state resets it itself; this puts the
    choice back after every test, so that no change leaks into the next."""
    yield
    import specdec_kernels

    specdec_kernels.reset_backends()
