"""tree_rejection_sample: the C++ CPU fast path (csrc/verify_sample_cpu.cpp, backend="native")
against the reference, on the trees, shapes and dtypes of the Triton kernel tests (test_triton.py),
token-exact for the same randoms, plus a distribution test on the native path itself."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.ops.tree_rejection_sample import test_triton as tree_tests
from tests.utils import DRAWS, assert_follows, assert_same, each_dtype, gen

pytestmark = pytest.mark.requires_native_op("tree_rejection_sample")


@pytest.mark.parametrize("shared", [True, False], ids=["shared_tree", "per_sequence_trees"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
@pytest.mark.parametrize("B,N,V", tree_tests.SHAPES, ids=[f"B{b}-N{n}-V{v}" for b, n, v in tree_tests.SHAPES])
def test_tree_rejection_sample_matches_reference(B, N, V, sampled, shared):
    c = tree_tests.tree_case(B, N, V, sampled=sampled, shared=shared, seed=N * V)
    args = [c[a] for a in tree_tests.ARGS]
    kw = dict(uniform_samples=c["uniform_samples"], sample_uniforms=c["sample_uniforms"])
    assert_same(sk.tree_rejection_sample(*args, backend="native", **kw), reference.tree_rejection_sample(*args, **kw))


@each_dtype
def test_tree_rejection_sample_dtypes(dtype):
    c = tree_tests.tree_case(3, 9, 111, sampled=True, seed=5, dtype=dtype)
    args = [c[a] for a in tree_tests.ARGS]
    kw = dict(uniform_samples=c["uniform_samples"], sample_uniforms=c["sample_uniforms"])
    assert_same(sk.tree_rejection_sample(*args, backend="native", **kw), reference.tree_rejection_sample(*args, **kw))


@pytest.mark.slow
def test_native_tree_rejection_sample_distribution():
    V, R, N = 10, DRAWS, 4
    g = gen(32)
    p = torch.softmax(torch.randn(V, generator=g), -1)
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    parents = torch.tensor([-1, 0, 0, 0])
    tokens = torch.cat(
        [torch.zeros(R, 1, dtype=torch.long), torch.multinomial(q, 3 * R, replacement=True, generator=g).view(R, 3)], 1
    )
    out, _, _ = sk.tree_rejection_sample(
        p.expand(R, N, V).contiguous(), tokens, parents, q.expand(R, N, V).contiguous(), generator=g, backend="native"
    )
    assert_follows(out[:, 0], p)
    top = torch.topk(q, 3).indices
    det = torch.cat([torch.zeros(R, 1, dtype=torch.long), top.expand(R, 3)], 1)
    out, _, _ = sk.tree_rejection_sample(
        p.expand(R, N, V).contiguous(), det, parents, None, generator=g, backend="native"
    )
    assert_follows(out[:, 0], p)
