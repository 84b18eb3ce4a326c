"""Shared test helpers: one tolerance table per dtype, seeded generators, statistics."""
from __future__ import annotations

import numpy as np
import torch
from scipy import stats

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


def runnable_backends(op_module, op_name: str, device: torch.device):
    """The backends of an op (its module's IMPLEMENTED) that can run on ``device`` here.

    Tests parametrise over these, so every golden case and invariant runs on every fast path
    (Triton in the interpreter on CPU, the native extension when built).
    """
    from specdec_kernels import _backend

    return [b for b in op_module.IMPLEMENTED if _backend._can_run(b, op_name, device) is None]
