"""The C++ CPU kernel of paged tree attention (backend="native",
torch.ops.specdec_native.paged_tree_attention, csrc/paged_attention_cpu.cpp) against the
float64 reference.

Inputs come from test_paged.py's ``paged_case``: each sequence's logical
blocks scattered over a pool in shuffled order, some shared between sequences, unused blocks
and the slots past every sequence NaN, unused table entries -1.  On top of those cases: many
(N, D) pairs and prefixes longer than the kernel's 32-slot chunks, every dtype, visible
non-finite keys and values (exactly the queries that see them are NaN), hostile block ids and
lengths with validate=False (the pool inside a bigger NaN buffer), opcheck of the native op.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _backend, reference
from specdec_kernels.ops import tree_attention as ta
from tests.ops.tree_attention.test_paged import (
    CASES,
    assert_clamped,
    expected,
    hostile_case,
    make_mask,
    paged_case,
    to_pool,
)
from tests.utils import NAN, assert_close, each_dtype, gen, one_thread  # noqa: F401  (one intra-op thread)

pytestmark = pytest.mark.requires_native_op("paged_tree_attention")


def native(q, pk, pv, lens, mask, table, layout, **kw):
    return sk.tree_attention(q, pk, pv, lens, mask, block_table=table, kv_layout=layout, backend="native", **kw)


@each_dtype
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_native_equals_reference_on_the_paged_cases(case, dtype):
    B, N, H, Hkv, D, lens, bs, layout, kind, shared = CASES[case]
    q, k, v, lens_t, table, pk, pv = paged_case(
        B, N, H, Hkv, D, lens, bs, layout, dtype=dtype, seed=len(case), shared=shared
    )
    mask = make_mask(kind, B, N, gen(N))
    got = native(q, pk, pv, lens_t, mask, table, layout)
    assert got.shape == q.shape and got.dtype == dtype and got.is_contiguous()
    assert not got.isnan().any()
    assert_close(got, expected(q, k, v, lens_t, mask), dtype)


SHAPES = [  # N, D, H, Hkv, lens, block_size, layout, mask kind
    (1, 16, 2, 1, [0, 3, 40], 1, "NHD", "causal"),
    (1, 128, 9, 3, [100, 33, 64], 16, "HND", "bool"),
    (2, 64, 4, 4, [70, 0], 7, "NHD", "per_seq"),
    (5, 128, 6, 2, [31, 32, 33], 16, "NHD", "packed"),
    (8, 16, 8, 2, [95, 1], 7, "HND", "causal"),
    (16, 64, 9, 3, [64, 130], 16, "NHD", "per_seq"),
    (17, 16, 4, 2, [0, 50, 17], 7, "HND", "packed"),
    (17, 128, 2, 1, [200], 16, "NHD", "bool"),
    (40, 32, 3, 1, [10, 0], 7, "NHD", "per_seq"),  # more tree nodes than one 32-slot chunk
    (3, 256, 4, 2, [45, 9], 5, "HND", "causal"),
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"N{s[0]}-D{s[1]}-{s[6]}-{s[7]}" for s in SHAPES])
def test_native_equals_reference_over_shapes(shape):
    N, D, H, Hkv, lens, bs, layout, kind = shape
    B = len(lens)
    q, k, v, lens_t, table, pk, pv = paged_case(B, N, H, Hkv, D, lens, bs, layout, seed=N + D, shared=0)
    mask = make_mask(kind, B, N, gen(N + 1))
    got = native(q, pk, pv, lens_t, mask, table, layout)
    assert not got.isnan().any()
    assert_close(got, expected(q, k, v, lens_t, mask), torch.float32)


@each_dtype
def test_native_long_prefix_shared_blocks_and_dtypes(dtype):
    B, N, H, Hkv, D, bs = 3, 4, 9, 3, 64, 16
    q, k, v, lens, table, pk, pv = paged_case(B, N, H, Hkv, D, [300, 257, 5], bs, "NHD", dtype=dtype, seed=3, shared=4)
    mask = make_mask("per_seq", B, N, gen(3))
    got = native(q, pk, pv, lens, mask, table, "NHD")
    assert got.dtype == dtype and not got.isnan().any()
    assert_close(got, expected(q, k, v, lens, mask), dtype)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_zero_queries_average_the_values_of_their_logical_slots(layout):
    # block_size 2; slots 0..4 of sequence 0 in blocks [3, 0, 5]; slot s holds value 10 s + 1;
    # node 0 sees slots 0..3 (mean 16), node 1 sees 0..4 (mean 21)
    D, N = 16, 2
    table = torch.tensor([[3, 0, 5, -1]], dtype=torch.int32)
    vals = torch.full((6, 2), NAN)
    for s in range(5):
        vals[int(table[0, s // 2]), s % 2] = 10.0 * s + 1
    pool = vals[:, :, None, None].expand(6, 2, 1, D).contiguous()
    if layout == "HND":
        pool = pool.transpose(1, 2).contiguous()
    out = native(
        torch.zeros(1, N, 2, D), torch.zeros_like(pool), pool, torch.tensor([3], dtype=torch.int32), None, table, layout
    )
    assert torch.equal(out[0, :, :, 0], torch.tensor([[16.0, 16.0], [21.0, 21.0]]))


@pytest.mark.parametrize("L", [63, 64, 127, 200])
def test_zero_queries_average_the_values_across_key_splits(L):
    """Lists longer than the kernel's 64-key splits: each split's softmax is combined with the
    others' (equal scores: every split weighs exp(0) = 1).  Node i of a chain after a prefix of
    L slots sees the L + i + 1 values 0, 1, ..., L + i, whose mean is (L + i) / 2."""
    D, N, H = 16, 3, 2
    S = L + N
    v = torch.arange(S, dtype=torch.float32)[None, None, :, None].expand(1, 1, S, D).contiguous()
    out = sk.tree_attention(torch.zeros(1, N, H, D), torch.zeros(1, 1, S, D), v, torch.tensor([L]), backend="native")
    for i in range(N):
        want = (L + i) / 2
        assert (out[0, i] - want).abs().max() <= 4e-7 * want, f"node {i}"


def test_non_finite_keys_and_values_in_any_split_reach_exactly_the_queries_that_see_them():
    """Prefixes over several 64-key splits: a non-finite key or value in any split (a whole
    chunk of the prefix, the rest after the last whole chunk, a tree slot) makes exactly the
    rows that see it NaN, through the combination of the splits."""
    B, N, H, Hkv, D = 3, 3, 4, 2, 16
    q, k, v, lens, table, _, _ = paged_case(B, N, H, Hkv, D, [200, 70, 130], 16, "NHD", seed=22)
    k, v = k.nan_to_num(0.5), v.nan_to_num(0.5)
    mask = sk.tree.ancestor_mask([-1, 0, 0])  # node 2 does not see node 1
    k[0, 1, 10, 3] = NAN  # split 0 of sequence 0, kv head 1: heads 2, 3 of every node
    v[0, 0, 150, 2] = float("inf")  # split 2 of sequence 0, kv head 0: heads 0, 1 of every node
    v[1, 0, 70 + 1, 0] = -float("inf")  # the tree slot of node 1 in sequence 1 (split 1): node 1's heads 0, 1
    k[2, 1, 129, 0] = float("inf")  # prefix slot 129 of sequence 2 (split 2, after the whole chunks): heads 2, 3
    want = expected(q, k, v, lens, mask)
    nb = int(table.max()) + 3
    for layout in ("NHD", "HND"):
        pk, pv = to_pool(k, table, nb, layout), to_pool(v, table, nb, layout)
        got = native(q, pk, pv, lens, mask, table, layout, validate=False)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), layout
        assert nan[0].all() and nan[1, 1, :2].all() and nan[2, :, 2:].all()
        assert nan.sum() == nan[0].numel() + nan[1, 1, :2].numel() + nan[2, :, 2:].numel()
        assert_close(got.masked_fill(nan, 0), want.masked_fill(nan, 0), torch.float32)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_visible_non_finite_keys_and_values_reach_exactly_the_queries_that_see_them(layout):
    B, N, H, Hkv, D, bs = 3, 4, 4, 2, 16, 4
    q, k, v, lens, table, _, _ = paged_case(B, N, H, Hkv, D, [9, 6, 0], bs, "NHD", seed=21)
    k, v = k.nan_to_num(0.5), v.nan_to_num(0.5)
    parents = [-1, 0, 0, 1]  # node 2 does not see node 1 or 3; node 3 sees node 1
    mask = sk.tree.ancestor_mask(parents)
    k[0, 1, 5, 3] = NAN  # a prefix key of sequence 0, kv head 1: heads 2, 3 of every node NaN
    v[1, 0, 6 + 1, 7] = float("inf")  # tree slot of node 1 in sequence 1, kv head 0: nodes 1 and 3
    v[2, 1, 0 + 2, 0] = -float("inf")  # node 2 of sequence 2 (empty prefix), kv head 1
    k[2, 0, 0 + 3, 0] = float("inf")  # node 3 of sequence 2, kv head 0
    want = expected(q, k, v, lens, mask)
    nb = int(table.max()) + 3
    pk, pv = to_pool(k, table, nb, layout), to_pool(v, table, nb, layout)
    got = native(q, pk, pv, lens, mask, table, layout, validate=False)
    nan = want.isnan()
    assert nan.any() and not nan.all()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(nan[0, :, 2:].all(-1), torch.ones(N, 2, dtype=torch.bool))  # the heads of kv head 1
    assert_close(got.masked_fill(nan, 0), want.masked_fill(nan, 0), torch.float32)


@pytest.mark.parametrize("poison", [NAN, float("inf")], ids=["nan", "inf"])
def test_invisible_slots_never_reach_the_output(poison):
    B, N, H, Hkv, D, bs = 3, 4, 4, 2, 16, 4
    q, k, v, lens, table, _, _ = paged_case(B, N, H, Hkv, D, [0, 6, 13], bs, "NHD", seed=10)
    mask = make_mask("per_seq", B, N, gen(10))
    want = expected(q, k.nan_to_num(0.5), v.nan_to_num(0.5), lens, mask)
    dirty_k, dirty_v = k.masked_fill(k.isnan(), poison), v.masked_fill(v.isnan(), poison)
    for layout in ("NHD", "HND"):
        pk = to_pool(dirty_k, table, int(table.max()) + 4, layout, fill=poison)
        pv = to_pool(dirty_v, table, int(table.max()) + 4, layout, fill=poison)
        got = native(q, pk, pv, lens, mask, table, layout, validate=False)
        assert not got.isnan().any(), layout
        assert_close(got, want, torch.float32)


def test_a_query_that_sees_no_key_is_nan_as_in_the_reference():
    q, k, v, lens, table, pk, pv = paged_case(2, 3, 2, 1, 16, [0, 4], 4, "NHD", seed=5)
    mask = torch.ones(2, 3, 3, dtype=torch.bool).tril()
    mask[0, 1] = False  # sequence 0 has no prefix: its node 1 sees nothing
    got = native(q, pk, pv, lens, mask, table, "NHD")
    want = expected(q, k, v, lens, mask)
    assert (
        torch.equal(got.isnan(), want.isnan()) and got[0, 1].isnan().all() and want.isnan().sum() == got[0, 1].numel()
    )


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_hostile_block_ids_and_lengths_never_read_outside_the_pool(layout):
    """validate=False, used ids outside [0, num_blocks), a huge length, the pool a slice of a
    3x bigger NaN buffer: all outputs finite, sequence 1 unchanged, and everything equal to the
    reference on the clamped ids and lengths."""
    c = hostile_case(layout)
    q, pk, pv, lens, table, bufs = c["q"], c["pk"], c["pv"], c["lens"], c["table"], c["guarded"]
    for lens_dtype in (torch.int32, torch.int64):
        got = native(q, *bufs, c["hostile_lens"].to(lens_dtype), None, c["hostile"], layout, validate=False)
        assert_clamped(got, c, layout)
    neg = lens.clone()
    neg[0] = -5  # acts as 0
    got = native(q, bufs[0], bufs[1], neg, None, table, layout, validate=False)
    want = reference.tree_attention(q, pk, pv, neg.clamp(min=0), block_table=table, kv_layout=layout)
    assert_close(got, want, torch.float32)


def test_unused_table_entries_are_never_dereferenced():
    q, k, v, lens, table, pk, pv = paged_case(3, 2, 2, 1, 16, [1, 9, 4], 4, "HND", seed=11)
    want = reference.tree_attention(q, pk, pv, lens, block_table=table, kv_layout="HND")
    garbage = table.clone()
    values = [2**31 - 1, -(2**31), 77, -3, 1 << 20, 0]
    for i, (b, j) in enumerate((table < 0).nonzero().tolist()):
        garbage[b, j] = values[i % len(values)]
    got = native(q, pk, pv, lens, None, garbage, "HND", validate=True)
    assert not got.isnan().any()
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_strided_pools_a_layer_of_a_bigger_cache_and_sm_scale(layout):
    B, N, H, Hkv, D, bs = 2, 3, 4, 2, 32, 3
    q, k, v, lens, table, pk, pv = paged_case(B, N, H, Hkv, D, [4, 40], bs, layout, seed=14)
    padded = []
    for pool in (pk, pv):  # head-dim rows padded to D + 8: strided views
        buf = torch.full((*pool.shape[:3], D + 8), NAN)
        buf[..., :D] = pool
        padded.append(buf[..., :D])
    assert not padded[0].is_contiguous()
    got = native(q, padded[0], padded[1], lens.long(), None, table, layout, sm_scale=0.3)
    assert_close(got, expected(q, k, v, lens, None, sm_scale=0.3), torch.float32)
    cache = torch.randn(3, 2, *pk.shape)  # one layer of an [L, 2, ...] buffer
    cache[1, 0], cache[1, 1] = pk, pv
    got = native(q, cache[1, 0], cache[1, 1], lens, None, table, layout)
    assert_close(got, expected(q, k, v, lens, None), torch.float32)
    # head-dim stride != 1 (a transposed pool): the kernel copies it first
    odd_k = pk.transpose(-1, -2).contiguous().transpose(-1, -2)
    got = native(q, odd_k, pv, lens, None, table, layout)
    assert_close(got, expected(q, k, v, lens, None), torch.float32)


def test_empty_batch_and_no_queries():
    pool = torch.randn(4, 2, 1, 16)
    out = native(
        torch.zeros(0, 2, 2, 16),
        pool,
        pool,
        torch.zeros(0, dtype=torch.int32),
        None,
        torch.zeros(0, 3, dtype=torch.int32),
        "NHD",
    )
    assert out.shape == (0, 2, 2, 16)
    out = native(
        torch.zeros(2, 0, 2, 16),
        pool,
        pool,
        torch.tensor([1, 5], dtype=torch.int32),
        None,
        torch.tensor([[0, 1, 2], [3, 2, 1]], dtype=torch.int32),
        "NHD",
    )
    assert out.shape == (2, 0, 2, 16)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("lens", [[50, 3, 0, 77], [90], [62, 190], [300]], ids=["B4", "B1", "B2 long", "B1 long"])
def test_threads_give_the_same_bits(lens, threads):
    # 1 thread: one task per sequence (all its KV heads); more threads than sequences: one task
    # per KV head; either way each 64-key split of a list is a work item of its own, and the
    # threads take contiguous runs of them
    B = len(lens)
    q, k, v, lens_t, table, pk, pv = paged_case(B, 3, 6, 3, 32, lens, 7, "NHD", seed=30)
    mask = make_mask("per_seq", B, 3, gen(30))
    one = native(q, pk, pv, lens_t, mask, table, "NHD")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        more = native(q, pk, pv, lens_t, mask, table, "NHD")
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, more)
    assert_close(one, expected(q, k, v, lens_t, mask), torch.float32)


def test_automatic_cpu_backend_is_native_for_both_ops(monkeypatch):
    cpu = torch.device("cpu")
    assert _backend.resolve("paged_tree_attention", cpu, None, ta.PAGED_IMPLEMENTED) == "native"
    assert _backend.resolve("tree_attention", cpu, None, ta.IMPLEMENTED) == "native"
    q, k, v, lens, table, pk, pv = paged_case(2, 3, 4, 2, 16, [5, 9], 4, "NHD", seed=13)
    by_native = native(q, pk, pv, lens, None, table, "NHD")
    by_torch = sk.tree_attention(q, pk, pv, lens, block_table=table, backend="torch")  # still there
    assert_close(by_torch, by_native, torch.float32)
    # the automatic CPU path is the C++ kernel on every call (a fixed rule, no timing)
    assert ta.automatic_cpu_path(paged=True) == ta.automatic_cpu_path(paged=False) == "native"
    for _ in range(4):
        assert torch.equal(sk.tree_attention(q, pk, pv, lens, block_table=table), by_native)
    # SPECDEC_PAGED_ATTENTION pins it, for users who need one path's bits
    for name, out in (("native", by_native), ("torch", by_torch)):
        monkeypatch.setenv("SPECDEC_PAGED_ATTENTION", name)
        sk.reset_backends()  # environment variables are read at import and on reset
        assert torch.equal(sk.tree_attention(q, pk, pv, lens, block_table=table), out)
    monkeypatch.setenv("SPECDEC_PAGED_ATTENTION", "fastest")
    sk.reset_backends()  # environment variables are read at import and on reset
    with pytest.raises(ValueError, match="SPECDEC_PAGED_ATTENTION"):
        sk.tree_attention(q, pk, pv, lens, block_table=table)
    monkeypatch.delenv("SPECDEC_PAGED_ATTENTION")
    sk.reset_backends()  # environment variables are read at import and on reset
    # the dense op's C++ kernel is the paged one over the dense cache (B blocks of S slots)
    dense_k, dense_v = k.nan_to_num(), v.nan_to_num()
    assert_close(
        sk.tree_attention(q, dense_k, dense_v, lens, backend="native"),
        sk.tree_attention(q, dense_k, dense_v, lens, backend="reference"),
        torch.float32,
    )


def test_direct_calls_with_bad_arguments_raise():
    q, k, v, lens, table, pk, pv = paged_case(2, 3, 4, 2, 16, [5, 9], 4, "NHD", seed=13)
    op = torch.ops.specdec_native.paged_tree_attention
    with pytest.raises(ValueError, match="kv_layout"):
        op(q, pk, pv, lens, None, table, "NDH", 0.25)
    with pytest.raises(ValueError, match="block_table"):
        op(q, pk, pv, lens, None, table[:1], "NHD", 0.25)
    with pytest.raises(TypeError, match="block_table"):
        op(q, pk, pv, lens, None, table.long(), "NHD", 0.25)
    with pytest.raises(ValueError, match="multiple"):
        op(q[:, :, :3], pk, pv, lens, None, table, "NHD", 0.25)
    with pytest.raises(TypeError, match="tree_mask"):
        op(q, pk, pv, lens, torch.zeros(3, 1, dtype=torch.int32), table, "NHD", 0.25)
    with pytest.raises(ValueError, match="capacity"):
        op(torch.zeros(2, 13, 4, 16), pk, pv, lens, None, table[:, :3], "NHD", 0.25)


@pytest.mark.parametrize(
    "layout,kind,dtype",
    [
        ("NHD", "bool", torch.float32),
        ("HND", "per_seq", torch.float32),
        ("NHD", "causal", torch.float16),
        ("HND", "causal", torch.bfloat16),
    ],
)
def test_opcheck_native_op(layout, kind, dtype):
    q, k, v, lens, table, pk, pv = paged_case(2, 3, 4, 2, 16, [5, 9], 4, layout, dtype=dtype, seed=13)
    pk, pv = pk.nan_to_num(), pv.nan_to_num()  # opcheck compares outputs with NaN != NaN
    mask = make_mask(kind, 2, 3, gen(13))
    torch.library.opcheck(
        torch.ops.specdec_native.paged_tree_attention.default, (q, pk, pv, lens, mask, table, layout, 0.25)
    )
    torch.library.opcheck(
        torch.ops.specdec.paged_tree_attention.default,
        (q, pk, pv, lens, mask, table, layout, 0.25),
        {"backend": "native"},
    )
