"""rejection_sample: the C++ CPU fast path (csrc/verify_sample_cpu.cpp, backend="native") against
the reference, on the cases, shapes and dtypes of the Triton kernel tests (test_triton.py),
token-exact for the same randoms, plus a distribution test on the native path itself."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.ops.rejection_sample import test_triton as chain_tests
from tests.utils import DRAWS, P_THRESHOLD, assert_follows, assert_same, chi_square_pvalue, each_dtype, gen

pytestmark = pytest.mark.requires_native_op("rejection_sample")


@each_dtype
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
@pytest.mark.parametrize("B,K,V", chain_tests.SHAPES, ids=[f"B{b}-K{k}-V{v}" for b, k, v in chain_tests.SHAPES])
def test_rejection_sample_matches_reference(B, K, V, sampled, dtype):
    for seed in range(3):
        c = chain_tests.chain_case(
            B, K, V, sampled=sampled, seed=seed, dtype=dtype, index_dtype=torch.int32 if seed % 2 else torch.int64
        )
        got = chain_tests.call_case(sk.rejection_sample, c, backend="native")
        want = chain_tests.call_case(reference.rejection_sample, c)
        assert_same(got, want)


def test_rejection_sample_mixed_dtypes_compute_in_float32():
    c = chain_tests.chain_case(3, 4, 111, sampled=True, seed=4)
    p, q = c["target_probs"].to(torch.bfloat16), c["draft_probs"]
    kw = dict(uniform_samples=c["uniform_samples"], sample_uniforms=c["sample_uniforms"])
    assert_same(
        sk.rejection_sample(p, q, c["draft_tokens"], c["num_draft_tokens"], backend="native", **kw),
        reference.rejection_sample(p, q, c["draft_tokens"], c["num_draft_tokens"], **kw),
    )


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
def test_native_rejection_sample_distribution(sampled):
    """20,000 draws through the native path: the first emitted token follows the target (p >
    1e-3: a correct sampler fails for 0.1% of seed sets) and the draft distribution as a
    negative control is rejected (the test has power at this size)."""
    V, R = 12, DRAWS
    g = gen(31)
    p = torch.softmax(torch.randn(V, generator=g), -1)
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    if sampled:
        drafts = torch.multinomial(q, R, replacement=True, generator=g)[:, None]
        qb = q.expand(R, 1, V).contiguous()
    else:
        drafts = torch.full((R, 1), int(q.argmax()))
        qb = None
    out, _ = sk.rejection_sample(p.expand(R, 2, V).contiguous(), qb, drafts, generator=g, backend="native")
    assert_follows(out[:, 0], p)
    assert chi_square_pvalue(out[:, 0], q) < P_THRESHOLD
