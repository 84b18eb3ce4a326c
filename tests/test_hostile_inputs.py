"""Hostile inputs with value checks off (validate=False, the CUDA default): every count and
index at and beyond its range, every tensor a view inside a guard buffer full of sentinels or
NaN.  Each backend must give the reference's answer for the clamped input and never read the
guards (a read would change the answer: the sentinels are chosen to do so)."""
import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.utils import gen, runnable_backends


def in_guard(t: torch.Tensor, fill, pad: int = 64) -> torch.Tensor:
    """A copy of ``t`` as a view in the middle of a larger buffer filled with ``fill``."""
    flat = torch.full((t.numel() + 2 * pad,), fill, dtype=t.dtype)
    flat[pad : pad + t.numel()] = t.reshape(-1)
    return flat[pad : pad + t.numel()].view(t.shape)


COUNTS = [-5, -1, 0, 1, 3, 4, 5, 9, 2**31 - 1]


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
        want = reference.rejection_sample(p, q if with_q else None, drafts, n.clamp(0, K), uniform_samples=coins,
                                          sample_uniforms=final)
        for sentinel in (3, 7):  # the token after the row would change the answer
            got = sk.rejection_sample(in_guard(p, float("nan")), in_guard(q, float("nan")) if with_q else None,
                                      in_guard(drafts, sentinel), in_guard(n, 2**40), uniform_samples=in_guard(coins, 0.5),
                                      sample_uniforms=in_guard(final, 0.5), backend=backend, validate=False)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (count, sentinel)


@pytest.mark.parametrize("backend", runnable_backends("rejection_sample", "cpu"))
def test_rejection_sample_k0_with_counts_reads_nothing_before_the_tensors(backend):
    """K = 0, draft_probs [2, 0, 8] and num_draft_tokens [1, 1]: once a segfault."""
    p = torch.softmax(torch.randn(2, 1, 8, generator=gen(1)), -1)
    q = torch.empty(2, 0, 8)
    out, acc = sk.rejection_sample(p, q, torch.empty(2, 0, dtype=torch.long), torch.tensor([1, 1]),
                                   uniform_samples=torch.empty(2, 0), sample_uniforms=torch.tensor([0.3, 0.9]),
                                   backend=backend, validate=False)
    want = reference.rejection_sample(p, q, torch.empty(2, 0, dtype=torch.long), torch.tensor([0, 0]),
                                      uniform_samples=torch.empty(2, 0), sample_uniforms=torch.tensor([0.3, 0.9]))
    assert torch.equal(out, want[0]) and acc.tolist() == [0, 0]


@pytest.mark.parametrize("backend", runnable_backends("verify_greedy", "cpu"))
def test_verify_greedy_hostile_counts(backend):
    B, K, V = 3, 4, 10
    logits = torch.randn(B, K + 1, V, generator=gen(2))
    drafts = logits[:, :K].argmax(-1)
    for count in COUNTS:
        n = torch.tensor([count, 1, K])
        want = reference.verify_greedy(logits, drafts, n.clamp(0, K))
        got = sk.verify_greedy(in_guard(logits, float("nan")), in_guard(drafts, 3), in_guard(n, 2**40),
                               backend=backend, validate=False)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), count


TREE = [-1, 0, 0, 1, 2, 3]
HOSTILE_PARENTS = [
    TREE,
    [-1, 0, 5, 1, 2, 3],  # a parent after its child
    [-1, -7, 0, 2**40, 1, 3],  # negative and huge parents
    [3, 0, 0, 1, 2, 3],  # the root with a parent
]


@pytest.mark.parametrize("backend", runnable_backends("verify_tree_greedy", "cpu"))
@pytest.mark.parametrize("parents", HOSTILE_PARENTS)
def test_verify_tree_greedy_hostile_parents_and_counts(backend, parents):
    B, N, V = 2, len(TREE), 9
    logits = torch.randn(B, N, V, generator=gen(3))
    tokens = torch.randint(0, V, (B, N), generator=gen(4))
    tokens[:, 1] = logits[:, 0].argmax(-1)
    tokens[:, 3] = logits[:, 1].argmax(-1)
    par = torch.tensor(parents)
    for count in COUNTS:
        n = torch.tensor([count, N])
        want = reference.verify_tree_greedy(logits, tokens, torch.tensor(TREE), n.clamp(0, N)) if parents == TREE else None
        got = sk.verify_tree_greedy(in_guard(logits, float("nan")), in_guard(tokens, 1), in_guard(par, 0),
                                    in_guard(n, 2**40), backend=backend, validate=False)
        ref = sk.verify_tree_greedy(logits, tokens, par, n, backend="reference", validate=False)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (parents, count)
        if want is not None:
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert ((got[1] >= -1) & (got[1] < N)).all()


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
        got = sk.tree_rejection_sample(in_guard(p, float("nan")), in_guard(tokens, 1), in_guard(par, 0),
                                       in_guard(q, float("nan")) if with_q else None, in_guard(n, 2**40),
                                       uniform_samples=in_guard(coins, 0.5), sample_uniforms=in_guard(final, 0.5),
                                       backend=backend, validate=False)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (parents, count)
        assert ((got[0] >= -1) & (got[0] < V)).all()


@pytest.mark.parametrize("backend", runnable_backends("tree_attention", "cpu"))
def test_tree_attention_invisible_slots_never_reach_the_output(backend):
    """Slots past a sequence (NaN, as torch.empty may leave them) and other sequences' slots
    never change the output, on every backend, for ragged batches."""
    B, N, H, Hkv, S, D = 3, 4, 4, 2, 32, 16
    g = gen(6)
    q = torch.randn(B, N, H, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    lens = torch.tensor([3, 17, 0], dtype=torch.int32)
    mask = sk.tree.ancestor_mask([-1, 0, 0, 1])
    want = reference.tree_attention(q, k, v, lens, mask)
    k_nan, v_nan = k.clone(), v.clone()
    for b in range(B):
        end = int(lens[b]) + N
        k_nan[b, :, end:] = float("nan")
        v_nan[b, :, end:] = float("nan")
    got = sk.tree_attention(q, k_nan, v_nan, lens, mask, backend=backend, validate=False)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", runnable_backends("tree_attention", "cpu"))
def test_tree_attention_out_of_range_lengths_are_clamped(backend):
    """cache_seqlens past S - N (2**30 once killed the process for memory) or negative act
    as the nearest valid length; nothing outside the caches is read."""
    B, N, H, Hkv, S, D = 2, 2, 2, 1, 16, 16
    g = gen(7)
    q = torch.randn(B, N, H, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    for bad, clamped in ((2**30, S - N), (S, S - N), (-4, 0)):
        lens = torch.tensor([5, bad], dtype=torch.int32)
        want = reference.tree_attention(q, k, v, torch.tensor([5, clamped], dtype=torch.int32))
        got = sk.tree_attention(q, in_guard(k, float("nan")), in_guard(v, float("nan")), lens, backend=backend, validate=False)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_compact_kv_cache_refuses_partly_overlapping_caches():
    base = torch.randn(1, 1, 24, 4)
    a, b = base[:, :, 0:16], base[:, :, 4:20]  # distinct starts, shared elements
    for backend in runnable_backends("compact_kv_cache", "cpu"):
        with pytest.raises(ValueError, match="aliases"):
            sk.compact_kv_cache([a, b], torch.tensor([0]), torch.tensor([[1]]), torch.tensor([1]), backend=backend)
    # disjoint views of one buffer are fine
    sk.compact_kv_cache([base[:, :, 0:12], base[:, :, 12:24]], torch.tensor([0]), torch.tensor([[1]]), torch.tensor([1]))


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


def test_compact_kv_cache_reference_clamps_and_skips_like_native():
    """Negative lengths, counts past M and slots past S (validate=False): the reference skips
    what the native kernels skip (it used to write slots counted from the end)."""
    from tests.utils import runnable_backends as rb

    for lens, idx, n in (([-3], [[3, 4]], [2]), ([0], [[1, 2]], [5]), ([8], [[0, 1]], [2]), ([6], [[1, 5]], [2])):
        results = []
        for backend in rb("compact_kv_cache", "cpu"):
            cache = torch.arange(8.0).view(1, 1, 1, 8, 1).expand(1, 2, 1, 8, 1).reshape(1, 2, 1, 1, 8, 1).clone()
            sk.compact_kv_cache(cache, torch.tensor(lens), torch.tensor(idx), torch.tensor(n), backend=backend, validate=False)
            results.append(cache[0, 0, 0, 0, :, 0].tolist())
        assert all(r == results[0] for r in results), (lens, idx, n, results)
        if lens == [-3]:
            assert results[0] == list(range(8))  # nothing valid to move


@pytest.mark.parametrize("backend", runnable_backends("verify_tree_greedy", "cpu"))
def test_verify_tree_greedy_backward_parent_never_accepted_out_of_order(backend):
    """parents = [-1, 0, 3, 1]: node 2 names a later node as parent.  Every backend walks the
    nodes in index order, so the accepted path stays increasing (compact_kv_cache needs it)."""
    V = 6
    logits = torch.full((1, 4, V), -5.0)
    for i in range(4):
        logits[0, i, i + 1] = 5.0  # the argmax after node i is token i + 1
    tokens = torch.tensor([[0, 1, 4, 2]])
    out, nodes, acc = sk.verify_tree_greedy(logits, tokens, torch.tensor([-1, 0, 3, 1]), backend=backend, validate=False)
    assert nodes[0].tolist() == [0, 1, 3, -1] and int(acc[0]) == 2


@pytest.mark.parametrize("backend", runnable_backends("rejection_sample", "cpu"))
def test_negative_and_nan_uniforms_act_as_zero(backend):
    p = torch.tensor([[[0.0, 0.0, 0.5, 0.5]]])
    for u in (-0.25, float("nan")):
        out, _ = sk.rejection_sample(p, None, torch.empty(1, 0, dtype=torch.long), sample_uniforms=torch.tensor([u]),
                                     uniform_samples=torch.empty(1, 0), backend=backend, validate=False)
        assert int(out[0, 0]) == 2  # never a token without mass


@pytest.mark.parametrize("backend", runnable_backends("sampling_probs", "cpu"))
def test_nan_top_p_acts_as_one(backend):
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    got = sk.sampling_probs(logits, top_p=torch.tensor([float("nan")]), backend=backend, validate=False)
    torch.testing.assert_close(got, torch.softmax(logits, -1))


def test_direct_op_num_splits_out_of_range_is_a_value_error():
    q = torch.randn(1, 1, 2, 16)
    k = torch.randn(1, 1, 4, 16)
    for bad in (-1, 1000):
        with pytest.raises(ValueError, match="num_splits"):
            torch.ops.specdec.tree_attention(q, k, k, torch.tensor([1], dtype=torch.int32), None, 0.25, bad)


def test_fake_kernels_raise_the_eager_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    logits, drafts = torch.randn(2, 3, 5), torch.zeros(2, 2, dtype=torch.long)
    with FakeTensorMode() as mode:
        fl, fd = mode.from_tensor(logits), mode.from_tensor(drafts)
        with pytest.raises(TypeError, match="draft_tokens"):
            torch.ops.specdec.verify_greedy(fl, fd.float())
        with pytest.raises(ValueError, match="backend"):
            torch.ops.specdec.verify_greedy(fl, fd, None, "bogus")
        with pytest.raises(ValueError, match="draft_tokens"):
            torch.ops.specdec.verify_greedy(fl, fd[:, :1])


@pytest.mark.parametrize("backend", runnable_backends("tree_attention", "cpu"))
@pytest.mark.parametrize("where", ["v", "k", "both"])
def test_tree_attention_masked_tree_slot_with_nan_reaches_only_its_viewers(backend, where):
    """A padding node of a tree (mask column empty for the real queries) whose K/V slot holds
    NaN or inf: the real queries' outputs are the reference's on clean data; a query that does
    see a NaN slot gets NaN (once every backend leaked NaN into all queries through 0 * NaN,
    and the torch path through an additive -inf mask plus inf)."""
    B, N, H, Hkv, S, D = 2, 5, 4, 2, 24, 16
    g = gen(11)
    q = torch.randn(B, N, H, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    lens = torch.tensor([4, 9], dtype=torch.int32)
    mask = sk.tree.ancestor_mask([-1, 0, 0, 1, 2])
    mask[:4, 4] = False  # node 4 (a padding node): no other query sees it
    want = reference.tree_attention(q, k, v, lens, mask)
    kb, vb = k.clone(), v.clone()
    for b in range(B):
        slot = int(lens[b]) + 4
        if where in ("v", "both"):
            vb[b, :, slot, 3] = float("nan")
        if where in ("k", "both"):
            kb[b, :, slot, 0] = float("inf")
    got = sk.tree_attention(q, kb, vb, lens, mask, backend=backend, validate=False)
    torch.testing.assert_close(got[:, :4], want[:, :4], atol=1e-5, rtol=1e-5)  # queries 0..3 do not see it
    assert got[:, 4].isnan().all()  # query 4 sees its own garbage slot


def test_compact_kv_cache_refuses_a_cache_whose_rows_overlap():
    base = torch.randn(64)
    rows_overlap = torch.as_strided(base, (1, 1, 8, 4), (32, 32, 2, 1))  # row stride 2 < D = 4
    with pytest.raises(ValueError, match="overlaps itself"):
        sk.compact_kv_cache([rows_overlap], torch.tensor([0]), torch.tensor([[1]]), torch.tensor([1]))
