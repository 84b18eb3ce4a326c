"""The C++ CPU fast paths (csrc/verify_sample_cpu.cpp, backend="native") against the
reference: the same cases, shapes and dtypes as the Triton kernel tests (vocabularies that are
not powers of two, batch 1 and uneven batches, K 0..16, ragged counts, shared and per-sequence
trees), token-exact for the same randoms, plus distribution tests on the native path itself."""
import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _native, reference
from tests import test_rejection_sample_kernel as chain_tests
from tests import test_sampling_probs_kernel as sampling_tests
from tests import test_tree_rejection_sample_kernel as tree_tests
from tests import test_verify_greedy_kernel as verify_tests
from tests import test_verify_tree_greedy_kernel as tree_verify_tests
from tests.utils import DTYPE_IDS, DTYPES, TOLERANCES, chi_square_pvalue, gen

CPU = "cpu"
pytestmark = pytest.mark.requires_native_op("verify_greedy")


def _same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == torch.int64
        assert torch.equal(g, w), f"native {g.tolist()} != reference {w.tolist()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", verify_tests.SHAPES, ids=[f"B{b}-K{k}-V{v}" for b, k, v in verify_tests.SHAPES])
def test_verify_greedy_matches_reference(shape, dtype):
    for seed, id_dtype in enumerate((torch.int32, torch.int64)):
        logits, drafts, counts = verify_tests.make_case(*shape, dtype=dtype, id_dtype=id_dtype, seed=seed)
        _same(sk.verify_greedy(logits, drafts, counts, backend="native"), reference.verify_greedy(logits, drafts, counts))


def test_verify_greedy_nan_rows_and_strided_logits():
    logits = torch.randn(3, 4, 9, generator=gen(1))
    logits[0, 1] = float("nan")
    logits[1, 2, 5] = float("nan")
    drafts = logits.argmax(-1)[:, :3]
    wide = torch.randn(3, 4, 20, generator=gen(2))[..., ::2].clone()[..., :9]
    for lg in (logits, logits.transpose(0, 1).contiguous().transpose(0, 1), wide):
        d = lg.argmax(-1)[:, :3]
        _same(sk.verify_greedy(lg, d, backend="native"), reference.verify_greedy(lg, d))
    _same(sk.verify_greedy(logits, drafts, backend="native"), reference.verify_greedy(logits, drafts))


@pytest.mark.parametrize("shared", [True, False], ids=["shared_tree", "per_sequence_tree"])
@pytest.mark.parametrize("shape", tree_verify_tests.SHAPES, ids=[f"B{b}-N{n}-V{v}" for b, n, v in tree_verify_tests.SHAPES])
def test_verify_tree_greedy_matches_reference(shape, shared):
    for seed, id_dtype in enumerate((torch.int32, torch.int64)):
        logits, tokens, parents, n = tree_verify_tests.make_case(*shape, shared=shared, id_dtype=id_dtype, seed=seed)
        _same(sk.verify_tree_greedy(logits, tokens, parents, n, backend="native"),
              reference.verify_tree_greedy(logits, tokens, parents, n))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
@pytest.mark.parametrize("B,K,V", chain_tests.SHAPES, ids=[f"B{b}-K{k}-V{v}" for b, k, v in chain_tests.SHAPES])
def test_rejection_sample_matches_reference(B, K, V, sampled, dtype):
    for seed in range(3):
        c = chain_tests.chain_case(B, K, V, sampled=sampled, seed=seed, dtype=dtype,
                                   index_dtype=torch.int32 if seed % 2 else torch.int64)
        got = sk.rejection_sample(c["target_probs"], c["draft_probs"], c["draft_tokens"], c["num_draft_tokens"],
                                  uniform_samples=c["uniform_samples"], sample_uniforms=c["sample_uniforms"], backend="native")
        want = reference.rejection_sample(c["target_probs"], c["draft_probs"], c["draft_tokens"], c["num_draft_tokens"],
                                          uniform_samples=c["uniform_samples"], sample_uniforms=c["sample_uniforms"])
        _same(got, want)


def test_rejection_sample_mixed_dtypes_compute_in_float32():
    c = chain_tests.chain_case(3, 4, 111, sampled=True, seed=4)
    p, q = c["target_probs"].to(torch.bfloat16), c["draft_probs"]
    kw = dict(uniform_samples=c["uniform_samples"], sample_uniforms=c["sample_uniforms"])
    _same(sk.rejection_sample(p, q, c["draft_tokens"], c["num_draft_tokens"], backend="native", **kw),
          reference.rejection_sample(p, q, c["draft_tokens"], c["num_draft_tokens"], **kw))


@pytest.mark.parametrize("shared", [True, False], ids=["shared_tree", "per_sequence_trees"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
@pytest.mark.parametrize("B,N,V", tree_tests.SHAPES, ids=[f"B{b}-N{n}-V{v}" for b, n, v in tree_tests.SHAPES])
def test_tree_rejection_sample_matches_reference(B, N, V, sampled, shared):
    c = tree_tests.tree_case(B, N, V, sampled=sampled, shared=shared, seed=N * V)
    args = [c[a] for a in tree_tests.ARGS]
    kw = dict(uniform_samples=c["uniform_samples"], sample_uniforms=c["sample_uniforms"])
    _same(sk.tree_rejection_sample(*args, backend="native", **kw), reference.tree_rejection_sample(*args, **kw))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_tree_rejection_sample_dtypes(dtype):
    c = tree_tests.tree_case(3, 9, 111, sampled=True, seed=5, dtype=dtype)
    args = [c[a] for a in tree_tests.ARGS]
    kw = dict(uniform_samples=c["uniform_samples"], sample_uniforms=c["sample_uniforms"])
    _same(sk.tree_rejection_sample(*args, backend="native", **kw), reference.tree_rejection_sample(*args, **kw))


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


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sampling_probs_low_precision_and_per_sequence_parameters(dtype):
    logits = (torch.randn(4, 3, 300, generator=gen(7)) * 4).to(dtype)
    kw = dict(temperature=torch.tensor([0.5, 1.0, 0.0, 2.0]), top_k=torch.tensor([0, 7, 3, 300]),
              top_p=torch.tensor([0.8, 1.0, 0.5, 0.3]))
    got, want = sk.sampling_probs(logits, backend="native", **kw), reference.sampling_probs(logits, **kw)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_sampling_probs_golden_boundaries():
    """Hand-made rows: ties at the top-k boundary kept, -0.0 ties +0.0, the top-p mass-before
    test is strict (mass before a token exactly top_p excludes it)."""
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [2.0, 1.0, 0.0, 0.0, -5.0, -0.0]])
    got = sk.sampling_probs(logits, top_k=4, backend="native")
    assert (got[0] > 0).tolist() == [True, True, True, True, False, False]
    assert (got[1] > 0).all()
    assert (got[2] > 0).tolist() == [True, True, True, True, False, True]
    probs = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.125, 0.125]]))
    assert (sk.sampling_probs(probs, top_p=0.5, backend="native")[1] > 0).tolist() == [True, False, False, False]
    assert (sk.sampling_probs(probs, top_p=0.51, backend="native")[1] > 0).tolist() == [True, True, False, False]


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
def test_native_rejection_sample_distribution(sampled):
    """20,000 draws through the native path: the first emitted token follows the target (p >
    1e-3: a correct sampler fails for 0.1% of seed sets) and the draft distribution as a
    negative control is rejected (the test has power at this size)."""
    V, R = 12, 20000
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
    assert chi_square_pvalue(out[:, 0], p) > 1e-3
    assert chi_square_pvalue(out[:, 0], q) < 1e-3


@pytest.mark.slow
def test_native_tree_rejection_sample_distribution():
    V, R, N = 10, 20000, 4
    g = gen(32)
    p = torch.softmax(torch.randn(V, generator=g), -1)
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    parents = torch.tensor([-1, 0, 0, 0])
    tokens = torch.cat([torch.zeros(R, 1, dtype=torch.long), torch.multinomial(q, 3 * R, replacement=True, generator=g).view(R, 3)], 1)
    out, _, _ = sk.tree_rejection_sample(p.expand(R, N, V).contiguous(), tokens, parents, q.expand(R, N, V).contiguous(),
                                         generator=g, backend="native")
    assert chi_square_pvalue(out[:, 0], p) > 1e-3
    top = torch.topk(q, 3).indices
    det = torch.cat([torch.zeros(R, 1, dtype=torch.long), top.expand(R, 3)], 1)
    out, _, _ = sk.tree_rejection_sample(p.expand(R, N, V).contiguous(), det, parents, None, generator=g, backend="native")
    assert chi_square_pvalue(out[:, 0], p) > 1e-3


def test_automatic_backend_on_cpu_is_native():
    from specdec_kernels import _backend

    for op in ("verify_greedy", "verify_tree_greedy", "rejection_sample", "tree_rejection_sample", "sampling_probs"):
        assert _native.has_kernel(op, "cpu")
        assert _backend.resolve(op, torch.device("cpu"), None, ("reference", "native", "triton")) == "native"


def test_native_argmax_rule_on_special_rows():
    """torch.argmax's rule on rows the fast float32 path hands to the exact loop (NaN, +-inf)
    and on rows it keeps (ties: the first maximum), wider than one 64-element block."""
    V = 200
    rows = torch.randn(9, V, generator=gen(9))
    rows[0, 150] = rows[0, 70] = 50.0  # a tie in different blocks: the first wins
    rows[1, 3] = float("inf")
    rows[2, 190] = float("nan")
    rows[3, 10] = float("-inf")
    rows[4] = float("-inf")
    rows[5, 7] = rows[5, 9] = float("nan")
    rows[6, 100] = float("inf")
    rows[6, 120] = float("nan")
    rows[7, 199] = 99.0  # the tail element after the last full block
    rows[8] = 0.0
    logits = rows[:, None, :]  # K = 0: output is the argmax
    out, _ = sk.verify_greedy(logits, torch.empty(9, 0, dtype=torch.long), backend="native")
    assert out[:, 0].tolist() == rows.argmax(-1).tolist() == [70, 3, 190, int(rows[3].argmax()), 0, 7, 120, 199, 0]


@pytest.mark.parametrize("V", [1, 2, 5, 15, 16, 17, 31, 32, 33, 47, 200, 49152])
def test_native_argmax_first_maximum_with_many_ties(V):
    """The one-pass AVX2 argmax keeps each lane's first maximum and then takes the smallest index
    among the lanes and the tail: rows of few distinct values (ties within a lane, across lanes,
    between the lanes and the tail; -0.0 beside 0.0), and rows shorter than one 16-lane group."""
    g = gen(V)
    rows = torch.randint(-3, 3, (64, V), generator=g).float()
    rows[::7] = 0.0
    rows[1::7] = -0.0
    if V > 1:
        rows[2::7, -1] = 5.0  # the maximum in the tail only
        rows[3::7, 0] = rows[3::7, -1] = 5.0  # the first element ties the last
    rows[4::7] = torch.where(torch.rand(rows[4::7].shape, generator=g) < 0.5, -0.0, 0.0)
    out, _ = sk.verify_greedy(rows[:, None, :], torch.empty(64, 0, dtype=torch.long), backend="native")
    assert out[:, 0].tolist() == rows.argmax(-1).tolist()
