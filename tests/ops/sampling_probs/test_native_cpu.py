"""sampling_probs: the C++ CPU fast path (csrc/verify_sample_cpu.cpp, backend="native") against
the reference, on the shapes and settings of the Triton kernel tests (test_triton.py), low
precision and per-sequence parameters, and hand-made rows at the top-k and top-p boundaries."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.ops.sampling_probs import test_triton as sampling_tests
from tests.utils import TOLERANCES, each_dtype, gen

pytestmark = pytest.mark.requires_native_op("sampling_probs")


@pytest.mark.parametrize("setting", list(sampling_tests.SETTINGS), ids=list(sampling_tests.SETTINGS))
@pytest.mark.parametrize("shape", sampling_tests.SHAPES, ids=["x".join(map(str, s)) for s in sampling_tests.SHAPES])
def test_sampling_probs_matches_reference(shape, setting):
    logits = torch.randn(shape, generator=gen(sum(shape))) * 3
    kw = sampling_tests.SETTINGS[setting]
    got = sk.sampling_probs(logits, backend="native", **kw)
    want = reference.sampling_probs(logits, **kw)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got > 0, want > 0), "kept sets differ"
    torch.testing.assert_close(got, want, equal_nan=True, **TOLERANCES[torch.float32])


@each_dtype
def test_sampling_probs_low_precision_and_per_sequence_parameters(dtype):
    logits = (torch.randn(4, 3, 300, generator=gen(7)) * 4).to(dtype)
    kw = dict(
        temperature=torch.tensor([0.5, 1.0, 0.0, 2.0]),
        top_k=torch.tensor([0, 7, 3, 300]),
        top_p=torch.tensor([0.8, 1.0, 0.5, 0.3]),
    )
    got, want = sk.sampling_probs(logits, backend="native", **kw), reference.sampling_probs(logits, **kw)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_sampling_probs_golden_boundaries():
    """Hand-made rows: ties at the top-k boundary kept, -0.0 ties +0.0, the top-p mass-before
    test is strict (mass before a token exactly top_p excludes it)."""
    logits = torch.tensor(
        [[3.0, 1.0, 1.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [2.0, 1.0, 0.0, 0.0, -5.0, -0.0]]
    )
    got = sk.sampling_probs(logits, top_k=4, backend="native")
    assert (got[0] > 0).tolist() == [True, True, True, True, False, False]
    assert (got[1] > 0).all()
    assert (got[2] > 0).tolist() == [True, True, True, True, False, True]
    probs = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.125, 0.125]]))
    assert (sk.sampling_probs(probs, top_p=0.5, backend="native")[1] > 0).tolist() == [True, False, False, False]
    assert (sk.sampling_probs(probs, top_p=0.51, backend="native")[1] > 0).tolist() == [True, True, False, False]
