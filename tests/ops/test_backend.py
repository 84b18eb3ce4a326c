"""Backend choice: explicit choices, the environment variable, fallback with one warning."""

import warnings

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _backend, _native
from tests.utils import ROOT

CPU = torch.device("cpu")


def test_reference_is_always_available():
    assert _backend.resolve("verify_greedy", CPU, "reference", ("reference",)) == "reference"


def test_explicit_backend_the_op_lacks_is_an_error():
    with pytest.raises(ValueError, match="no such backend"):
        _backend.resolve("verify_greedy", CPU, "native", ("reference", "triton"))


def test_unknown_backend_name_is_an_error():
    with pytest.raises(ValueError, match="backend must be one of"):
        _backend.resolve("verify_greedy", CPU, "fast", ("reference",))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    sk.reset_backends()  # the environment is read at import and on reset
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        _backend.resolve("verify_greedy", CPU, "triton", ("reference", "triton"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sk.reset_backends()
    assert _backend.resolve("verify_greedy", CPU, "triton", ("reference", "triton")) == "triton"


def test_interpreter_is_never_chosen_automatically(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("SPECDEC_BACKEND", raising=False)
    sk.reset_backends()  # the choice is made once per process
    assert _backend.resolve("verify_greedy", CPU, None, ("reference", "triton")) == "reference"


def test_environment_variable_is_a_preference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    sk.reset_backends()  # the choice is made once per process
    assert _backend.resolve("verify_greedy", CPU, None, ("reference", "triton")) == "triton"
    assert _backend.resolve("other_op", CPU, None, ("reference",)) == "reference"  # op without it
    monkeypatch.setenv("SPECDEC_BACKEND", "bogus")
    sk.reset_backends()  # the choice is made once per process
    with pytest.raises(ValueError, match="SPECDEC_BACKEND"):
        _backend.resolve("verify_greedy", CPU, None, ("reference",))


def test_torch_fast_path_is_chosen_on_cpu(monkeypatch):
    monkeypatch.delenv("SPECDEC_BACKEND", raising=False)
    sk.reset_backends()  # the choice is made once per process
    assert _backend.resolve("tree_attention", CPU, None, ("reference", "torch")) == "torch"


def test_missing_native_op_falls_back_with_one_warning(monkeypatch):
    monkeypatch.delenv("SPECDEC_BACKEND", raising=False)
    sk.reset_backends()  # the choice is made once per process
    monkeypatch.setitem(_native._state, "loaded", False)
    monkeypatch.setitem(_native._state, "error", ImportError("no compiler"))
    sk.reset_backends()  # the choice is made once per process
    monkeypatch.setattr(_native, "_warned", set())
    with pytest.warns(RuntimeWarning, match="falling back to the PyTorch reference"):
        assert _backend.resolve("compact_kv_cache", CPU, None, ("reference", "native")) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        assert _backend.resolve("compact_kv_cache", CPU, None, ("reference", "native")) == "reference"
    cache = torch.arange(16.0).reshape(1, 2, 1, 1, 8, 1)
    sk.compact_kv_cache(cache, torch.tensor([0]), torch.tensor([[1]]), torch.tensor([1]))
    assert cache[0, 0, 0, 0, 0, 0] == 1.0
    with pytest.raises(ValueError, match="extension"):
        _backend.resolve("compact_kv_cache", CPU, "native", ("reference", "native"))


def test_importing_the_package_touches_no_gpu_and_no_extension():
    import subprocess
    import sys

    code = (
        "import sys, specdec_kernels; "
        "assert 'specdec_kernels._C' not in sys.modules, 'extension loaded at import'; "
        "import torch; assert not torch.cuda.is_initialized(), 'CUDA initialised at import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _without(module: str) -> str:
    """Python source that makes every later import of ``module`` (or a submodule) fail, as if it
    were not installed: the prelude of a subprocess's code."""
    return f"""
import builtins
real = builtins.__import__
def blocked(name, *a, **k):
    if name == "{module}" or name.startswith("{module}."):
        raise ImportError("{module} blocked for this test")
    return real(name, *a, **k)
builtins.__import__ = blocked
"""


def test_package_works_without_triton():
    """triton is optional: with it unimportable the ops run on the reference / torch paths."""
    import subprocess
    import sys

    code = (
        _without("triton")
        + """
import torch, specdec_kernels as sk
out, acc = sk.verify_greedy(torch.tensor([[[0.0, 1.0], [1.0, 0.0]]]), torch.tensor([[1]]))
assert out.tolist() == [[1, 0]], out
attn = sk.tree_attention(torch.zeros(1, 1, 2, 16), torch.zeros(1, 1, 4, 16), torch.ones(1, 1, 4, 16),
                         torch.tensor([1], dtype=torch.int32))
assert torch.allclose(attn, torch.ones_like(attn))
try:
    sk.verify_greedy(torch.zeros(1, 2, 3), torch.zeros(1, 1, dtype=torch.long), backend="triton")
except ValueError as e:
    assert "triton is not installed" in str(e)
else:
    raise AssertionError("backend='triton' without triton did not raise")
"""
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_build_without_torch_stops_with_a_clear_error():
    """In pip's isolated build environment torch is missing: setup.py says what to do instead
    of silently producing a wheel without the extension."""
    import subprocess
    import sys

    root = ROOT
    code = (
        _without("torch")
        + """
import sys
sys.argv = ["setup.py", "--name"]
exec(compile(open("setup.py").read(), "setup.py", "exec"), {"__file__": "setup.py", "__name__": "__main__"})
"""
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "SPECDEC_SKIP_EXTENSION"}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "--no-build-isolation" in out.stderr and "SPECDEC_SKIP_EXTENSION=1" in out.stderr


def test_first_use_warning_says_why_the_extension_is_missing(monkeypatch):
    monkeypatch.setitem(_native._state, "loaded", False)
    monkeypatch.setitem(_native._state, "error", ImportError("no _C"))
    sk.reset_backends()  # the choice is made once per process
    monkeypatch.setattr(_native, "_warned", set())
    monkeypatch.setattr(
        _native, "build_info", lambda: {"extension": False, "reason": "the C++/CUDA build failed: no g++"}
    )
    with pytest.warns(RuntimeWarning, match="at install: the C\\+\\+/CUDA build failed: no g\\+\\+"):
        _native.warn_fallback("compact_kv_cache", "cpu")


def test_installed_torch_requirement_matches_the_build():
    import importlib.metadata

    info = _native.build_info()
    try:
        reqs = importlib.metadata.requires("specdec-kernels") or []
    except importlib.metadata.PackageNotFoundError:
        # a checkout used in place (setup.py build_ext --inplace, as scripts/gpu_check.sh does)
        # has no installed metadata to compare; CI installs the package
        pytest.skip("specdec-kernels is not installed: no metadata to compare with the build")
    torch_req = [r for r in reqs if r.startswith("torch")]
    if info.get("extension"):
        major, minor = torch.__version__.split("+")[0].split(".")[:2]
        assert torch_req == [f"torch=={major}.{minor}.*"], reqs
    else:
        assert torch_req == ["torch>=2.4"], reqs


@pytest.mark.requires_native_op("verify_greedy")
def test_automatic_backend_on_cpu_is_native():
    from specdec_kernels import _backend

    for op in ("verify_greedy", "verify_tree_greedy", "rejection_sample", "tree_rejection_sample", "sampling_probs"):
        assert _native.has_kernel(op, "cpu")
        assert _backend.resolve(op, torch.device("cpu"), None, ("reference", "native", "triton")) == "native"
