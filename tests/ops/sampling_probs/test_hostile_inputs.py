"""sampling_probs: hostile inputs with value checks off (validate=False, the CUDA default); the
guard buffers and the rule they check are described in tests/ops/hostile.py."""

import pytest
import torch

import specdec_kernels as sk
from tests.utils import runnable_backends


@pytest.mark.parametrize("backend", runnable_backends("sampling_probs", "cpu"))
def test_sampling_probs_infinite_logit_and_tiny_temperature_give_one_hot(backend):
    logits = torch.tensor([[0.0, float("inf"), 1.0, 2.0], [0.5, 3.0, 1.0, -1.0], [1.0, 1.0, 0.0, 0.0]])
    for t in (1.0, 1e-38, 0.0):
        p = sk.sampling_probs(logits, temperature=t, backend=backend)
        assert not p.isnan().any(), t
        torch.testing.assert_close(p.sum(-1), torch.ones(3))
        assert p[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    p = sk.sampling_probs(logits[1:2], temperature=1e-38, backend=backend)
    assert p[0].tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("backend", runnable_backends("sampling_probs", "cpu"))
def test_nan_top_p_acts_as_one(backend):
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    got = sk.sampling_probs(logits, top_p=torch.tensor([float("nan")]), backend=backend, validate=False)
    torch.testing.assert_close(got, torch.softmax(logits, -1))
