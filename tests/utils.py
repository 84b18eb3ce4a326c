"""Shared test helpers: the repository root, the distribution tests' threshold, draw count and
fit check, one tolerance table per dtype (and the dtype parametrization), seeded generators,
statistics, the backends that run here, the bad-input tests of the ops, CUDA graph replay."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

ROOT = Path(__file__).resolve().parent.parent  # the repository root

# Distribution tests: fixed seeds make each outcome deterministic.  Under a correct sampler the
# p-value is uniform on [0, 1], so a threshold of 1e-3 fails a correct implementation with
# probability 0.1% per (seed set, case).  At n = DRAWS = 20,000 draws over ~12 to 20 tokens an
# error of a few percent in total variation (a wrong or unnormalised residual, a reused coin, a
# biased CDF) is detected with near certainty: p-values below 1e-20 in the kernel tests' cases,
# and the negative controls of the distribution tests show that power.
P_THRESHOLD = 1e-3
DRAWS = 20_000

NAN = float("nan")

# Tolerances of a kernel against the float64 reference, per input dtype.  The bounds follow
# flash-attention's rule of thumb: a few times the error of the same computation done by
# PyTorch at the kernel's precision (fp16 has 11 mantissa bits, bf16 8, fp32 24).
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
DTYPES = list(TOLERANCES)
DTYPE_IDS = ["fp32", "fp16", "bf16"]
each_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)  # a test's ``dtype``: every dtype above


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.double().cpu(), expected.double().cpu(), atol=tol["atol"] * scale, rtol=tol["rtol"] * scale
    )


def gen(seed: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of integer samples to ``probs`` (scipy.stats).

    Tokens with expected count below 5 are pooled into one bin, as the test requires; a
    sample on a zero-probability token makes the p-value 0.
    """
    probs = probs.double().cpu()
    probs = probs / probs.sum()
    n = samples.numel()
    observed = torch.bincount(samples.cpu(), minlength=probs.numel()).double()
    if (observed[probs == 0] > 0).any():
        return 0.0
    support = probs > 0
    observed, probs = observed[support], probs[support]
    expected = probs * n
    big = expected >= 5
    obs = observed[big].tolist()
    exp = expected[big].tolist()
    if (~big).any():
        obs.append(float(observed[~big].sum()))
        exp.append(float(expected[~big].sum()))
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(np.array(obs), np.array(exp)).pvalue)


def assert_follows(samples: torch.Tensor, probs: torch.Tensor, label=None) -> None:
    """``samples`` pass the chi-square test of fit to ``probs``: p-value above P_THRESHOLD
    (``label``, e.g. the backend, named in the failure)."""
    pvalue = chi_square_pvalue(samples, probs)
    assert pvalue > P_THRESHOLD, (label, pvalue)


def runnable_backends(op_name: str, device=None):
    """The backends of an op (``specdec_kernels.ops.<op>.IMPLEMENTED``) that can run here.

    Tests parametrise over these, so every golden case and invariant runs on every fast path
    (Triton in the interpreter on CPU, the native extension when built).  ``device`` defaults
    to CUDA when present, else CPU.
    """
    import importlib

    from specdec_kernels import _backend

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    module = importlib.import_module(f"specdec_kernels.ops.{op_name}")
    return [b for b in module.IMPLEMENTED if _backend._can_run(b, op_name, torch.device(device)) is None]


def assert_docstring_is_the_fronts_own(op_name: str) -> None:
    """``specdec_kernels.<op_name>`` carries the front's own docstring (arguments, returns,
    errors, its torch.ops name, backend, validate), not the reference's; the reference names the
    op whose docstring it shares, and checks nothing itself."""
    import specdec_kernels
    from specdec_kernels import reference

    doc = getattr(specdec_kernels, op_name).__doc__
    for part in ("Args:", "Returns:", "Raises:", f"torch.ops.specdec.{op_name}", "backend", "validate"):
        assert part in doc, part
    assert "(reference)" not in doc.splitlines()[0]
    assert f"specdec_kernels.{op_name}" in getattr(reference, op_name).__doc__


def to_device(case: dict, device) -> dict:
    """A dict of inputs with its tensors moved to ``device``."""
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def assert_same(got, want) -> None:
    """The integer outputs of a fast path equal the reference's exactly, as int64."""
    for g, w in zip(got, want):
        assert g.dtype == torch.int64
        assert torch.equal(g, w), f"fast path {g.tolist()} != reference {w.tolist()}"


def over_bad_inputs(op, bad: dict):
    """Parametrize a bad-input test over ``case``, the ids of the table ``bad`` (id ->
    (arguments, error type, message)), and ``fn``: ``op`` on its reference backend and ``op``
    as users call it (the default backend)."""
    by_case = pytest.mark.parametrize("case", list(bad), ids=list(bad))
    by_fn = pytest.mark.parametrize("fn", [partial(op, backend="reference"), op], ids=["reference", "public"])
    return lambda test: by_case(by_fn(test))


def bad_input_test(op, bad: dict, good):
    """A test that ``op``, on its reference backend and as users call it, rejects every case of
    the table ``bad``: id -> (arguments that replace those of ``good()``, the error type, a
    message the error contains)."""

    @over_bad_inputs(op, bad)
    def test_bad_input(fn, case):
        override, err, message = bad[case]
        with pytest.raises(err, match=re.escape(message)):
            fn(**{**good(), **override})

    return test_bad_input


def requires_triton(op_name: str):
    """Skip a module's tests where the Triton kernel of ``op_name`` cannot run (triton not
    installed, or CPU tensors without TRITON_INTERPRET=1); use as its ``pytestmark``."""
    return pytest.mark.skipif(
        "triton" not in runnable_backends(op_name),
        reason="Triton cannot run here (not installed, or CPU tensors without TRITON_INTERPRET=1)",
    )


def capture_and_replay(launch, out: torch.Tensor, initial: torch.Tensor) -> None:
    """Capture ``launch()`` in a CUDA graph on a side stream, put ``initial`` back into ``out``
    (which the capture may have written), then replay the graph and wait for it.  The launch is
    captured under torch's sync debug mode "error": a synchronising call in it fails naming
    itself (capture would fail anyway, less clearly)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            torch.cuda.set_sync_debug_mode("error")
            try:
                launch()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(stream)
    out.copy_(initial)
    graph.replay()
    torch.cuda.synchronize()


def on_device(fn, device, **fixed):
    """Wrap an op so tensor arguments go to ``device`` and tensor results come back to CPU.

    Lets one hand-worked test run on the interpreter (CPU) and on CUDA alike.
    """

    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, (list, tuple)):
            return type(x)(move(v) for v in x)
        return x

    def back(x):
        if isinstance(x, torch.Tensor):
            return x.cpu()
        if isinstance(x, tuple):
            return tuple(back(v) for v in x)
        return x

    def wrapped(*args, **kwargs):
        kwargs = {k: move(v) for k, v in kwargs.items()}
        return back(fn(*(move(a) for a in args), **fixed, **kwargs))

    return wrapped


def on_each_backend(op, backends):
    """A fixture (assign it to the fixture's name in a test module): ``op`` on the test device
    (``on_device``), once per backend in ``backends``."""

    @pytest.fixture(params=backends)
    def fixture(request, device):
        return on_device(op, device, backend=request.param)

    return fixture


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread in every test module that imports this fixture (autouse applies
    where the name is imported): the decoding tests multiply small matrices, where OpenMP
    synchronisation on a shared 2-core CPU costs more than it gains."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def restore_threads():
    """Put torch's intra-op thread count back after a test that sets it (a benchmark's --threads)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
