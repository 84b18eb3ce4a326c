"""rejection_sample: hostile inputs with value checks off (validate=False, the CUDA default); the
guard buffers and the rule they check are described in tests/ops/hostile.py."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.ops.hostile import COUNTS, in_guard
from tests.utils import gen, runnable_backends


@pytest.mark.parametrize("backend", runnable_backends("rejection_sample", "cpu"))
@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sample_counts_beyond_k_act_as_k(backend, with_q):
    B, K, V = 3, 4, 11
    g = gen(0)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    drafts = p[:, :K].argmax(-1)  # likely accepted, so the walk reaches the end of the row
    coins = torch.full((B, K), 1e-6)
    final = torch.rand(B, generator=g)
    for count in COUNTS:
        n = torch.tensor([count, min(count, K), 2])
        want = reference.rejection_sample(
            p, q if with_q else None, drafts, n.clamp(0, K), uniform_samples=coins, sample_uniforms=final
        )
        for sentinel in (3, 7):  # the token after the row would change the answer
            got = sk.rejection_sample(
                in_guard(p, float("nan")),
                in_guard(q, float("nan")) if with_q else None,
                in_guard(drafts, sentinel),
                in_guard(n, 2**40),
                uniform_samples=in_guard(coins, 0.5),
                sample_uniforms=in_guard(final, 0.5),
                backend=backend,
                validate=False,
            )
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (count, sentinel)


@pytest.mark.parametrize("backend", runnable_backends("rejection_sample", "cpu"))
def test_rejection_sample_k0_with_counts_reads_nothing_before_the_tensors(backend):
    """K = 0, draft_probs [2, 0, 8] and num_draft_tokens [1, 1]: once a segfault."""
    p = torch.softmax(torch.randn(2, 1, 8, generator=gen(1)), -1)
    q = torch.empty(2, 0, 8)
    out, acc = sk.rejection_sample(
        p,
        q,
        torch.empty(2, 0, dtype=torch.long),
        torch.tensor([1, 1]),
        uniform_samples=torch.empty(2, 0),
        sample_uniforms=torch.tensor([0.3, 0.9]),
        backend=backend,
        validate=False,
    )
    want = reference.rejection_sample(
        p,
        q,
        torch.empty(2, 0, dtype=torch.long),
        torch.tensor([0, 0]),
        uniform_samples=torch.empty(2, 0),
        sample_uniforms=torch.tensor([0.3, 0.9]),
    )
    assert torch.equal(out, want[0]) and acc.tolist() == [0, 0]


@pytest.mark.parametrize("backend", runnable_backends("rejection_sample", "cpu"))
def test_negative_and_nan_uniforms_act_as_zero(backend):
    p = torch.tensor([[[0.0, 0.0, 0.5, 0.5]]])
    for u in (-0.25, float("nan")):
        out, _ = sk.rejection_sample(
            p,
            None,
            torch.empty(1, 0, dtype=torch.long),
            sample_uniforms=torch.tensor([u]),
            uniform_samples=torch.empty(1, 0),
            backend=backend,
            validate=False,
        )
        assert int(out[0, 0]) == 2  # never a token without mass
