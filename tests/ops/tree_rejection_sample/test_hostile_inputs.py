"""tree_rejection_sample: hostile inputs with value checks off (validate=False, the CUDA default); the
guard buffers and the rule they check are described in tests/ops/hostile.py."""

import pytest
import torch

import specdec_kernels as sk
from tests.ops.hostile import COUNTS, HOSTILE_PARENTS, TREE, in_guard
from tests.utils import gen, runnable_backends


@pytest.mark.parametrize("backend", runnable_backends("tree_rejection_sample", "cpu"))
@pytest.mark.parametrize("parents", HOSTILE_PARENTS)
@pytest.mark.parametrize("with_q", [True, False])
def test_tree_rejection_sample_hostile_parents_and_counts(backend, parents, with_q):
    B, N, V = 2, len(TREE), 7
    g = gen(5)
    p = torch.softmax(torch.randn(B, N, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, N, V, generator=g), -1)
    tokens = torch.randint(-2, V + 2, (B, N), generator=g)  # ids outside the vocabulary too
    coins = torch.rand(B, N - 1, generator=g)
    final = torch.rand(B, generator=g)
    par = torch.tensor(parents)
    for count in COUNTS:
        n = torch.tensor([count, N])
        kw = dict(uniform_samples=coins, sample_uniforms=final, validate=False)
        ref = sk.tree_rejection_sample(p, tokens, par, q if with_q else None, n, backend="reference", **kw)
        got = sk.tree_rejection_sample(
            in_guard(p, float("nan")),
            in_guard(tokens, 1),
            in_guard(par, 0),
            in_guard(q, float("nan")) if with_q else None,
            in_guard(n, 2**40),
            uniform_samples=in_guard(coins, 0.5),
            sample_uniforms=in_guard(final, 0.5),
            backend=backend,
            validate=False,
        )
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (parents, count)
        assert ((got[0] >= -1) & (got[0] < V)).all()
