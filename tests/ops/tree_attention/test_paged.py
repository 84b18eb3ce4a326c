"""tree_attention over a paged KV cache (block_table), every backend against the dense op.

The paged inputs are made from a dense cache: each sequence's logical blocks are scattered
into a pool in shuffled order (some blocks shared between sequences, unused pool blocks and
the slots past every sequence filled with NaN, unused table entries -1 or garbage), so the
paged op must give the dense op's answer on the same data.  Triton runs in the interpreter
on CPU (tiny shapes), on the GPU when there is one.
"""

import re

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.ops.tree_attention import pack_tree_mask
from specdec_kernels.reference.tree_attention import gather_paged_kv
from specdec_kernels.tree import ancestor_mask
from tests.utils import NAN, assert_close, each_dtype, gen, runnable_backends

ALL = runnable_backends("tree_attention")


def random_parents(N, g):
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)]


def make_mask(kind, B, N, g):
    if kind == "causal":
        return None
    if kind == "bool":
        return ancestor_mask(random_parents(N, g))
    per_seq = ancestor_mask(torch.tensor([random_parents(N, g) for _ in range(B)]))
    return pack_tree_mask(per_seq) if kind == "packed" else per_seq


def to_pool(dense, table, num_blocks, layout, fill=NAN):
    """Scatter a dense cache [B, Hkv, M * bs, D] into a pool through ``table`` (entries >= 0)."""
    B, Hkv, S, D = dense.shape
    M = table.shape[1]
    bs = S // M
    shape = (num_blocks, bs, Hkv, D) if layout == "NHD" else (num_blocks, Hkv, bs, D)
    pool = torch.full(shape, fill, dtype=dense.dtype)
    for b in range(B):
        for j in range(M):
            blk = int(table[b, j])
            if blk < 0:
                continue
            block = dense[b, :, j * bs : (j + 1) * bs]  # [Hkv, bs, D]
            pool[blk] = block.transpose(0, 1) if layout == "NHD" else block
    return pool


def paged_case(
    B, N, H, Hkv, D, lens, block_size, layout, dtype=torch.float32, seed=0, shared=0, extra_blocks=3, pad_entry=-1
):
    """Dense inputs and the same data paged.

    Each sequence uses ceil((lens + N) / block_size) blocks of its table (with one spare
    column); the slots past lens + N hold NaN in the dense cache and in the pool (the rest of
    the last block), unused pool blocks are NaN, unused table entries are ``pad_entry``.  With
    ``shared`` > 0, sequence 1 shares its first ``shared`` blocks (and their data) with
    sequence 0, as a common prompt would.
    Returns q, dense k/v [B, Hkv, M * bs, D], lens, table, pool k/v.
    """
    g = gen(seed)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    need = [-(-(L + N) // block_size) for L in lens]
    M = max(need) + 1
    S = M * block_size
    q = torch.randn(B, N, H, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    if shared:
        assert B > 1 and shared * block_size <= min(lens[0], lens[1])
        k[1, :, : shared * block_size] = k[0, :, : shared * block_size]
        v[1, :, : shared * block_size] = v[0, :, : shared * block_size]
    for b, L in enumerate(lens):
        k[b, :, L + N :] = NAN
        v[b, :, L + N :] = NAN
    owned = sum(need) - (shared if shared else 0)
    num_blocks = owned + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((B, M), pad_entry, dtype=torch.int32)
    for b in range(B):
        for j in range(need[b]):
            table[b, j] = table[0, j] if (shared and b == 1 and j < shared) else perm.pop()
    pk, pv = to_pool(k, table, num_blocks, layout), to_pool(v, table, num_blocks, layout)
    return q, k, v, lens_t, table, pk, pv


def expected(q, k, v, lens, mask, **kw):
    """The float64 reference on the dense cache (inputs upcast to fp32, exact)."""
    if mask is not None and mask.dtype == torch.int32:
        mask = sk.ops.tree_attention.unpack_tree_mask(mask, q.shape[1])
    return reference.tree_attention(q.float(), k.float(), v.float(), lens, mask, **kw)


def on(device, *ts):
    return [None if t is None else t.to(device) for t in ts]


# ---------------------------------------------------------------------------------------
# hand-worked case
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("backend", ALL)
def test_zero_queries_average_the_values_of_their_logical_slots(device, backend, layout):
    # block_size 2; sequence 0 has 3 prefix slots + 2 chain nodes = slots 0..4 in blocks
    # [3, 0, 5]; zero queries average the values they see.  Slot s holds value 10 * s + 1.
    D, N = 16, 2
    table = torch.tensor([[3, 0, 5, -1]], dtype=torch.int32)
    vals = torch.full((6, 2), NAN)  # [block, offset] -> value, NaN where no slot lives
    for s in range(5):
        vals[int(table[0, s // 2]), s % 2] = 10.0 * s + 1
    pool = vals[:, :, None, None].expand(6, 2, 1, D).contiguous()  # NHD, Hkv = 1
    if layout == "HND":
        pool = pool.transpose(1, 2).contiguous()
    q = torch.zeros(1, N, 2, D)
    lens = torch.tensor([3], dtype=torch.int32)
    out = sk.tree_attention(
        *on(device, q, torch.zeros_like(pool), pool, lens),
        block_table=table.to(device),
        kv_layout=layout,
        backend=backend,
    ).cpu()
    # node 0 sees slots 0..3 -> mean(1, 11, 21, 31) = 16; node 1 sees 0..4 -> 21
    assert torch.allclose(out[0, :, :, 0], torch.tensor([[16.0, 16.0], [21.0, 21.0]]))


# ---------------------------------------------------------------------------------------
# paged = dense on the same data
# ---------------------------------------------------------------------------------------


CASES = {
    # name: B, N, H, Hkv, D, lens, block_size, layout, mask, shared blocks
    "bs1_causal_nhd_gqa": (3, 3, 4, 2, 16, [0, 5, 9], 1, "NHD", "causal", 0),
    "bs1_bool_hnd": (2, 4, 2, 2, 16, [6, 1], 1, "HND", "bool", 0),
    "bs7_per_seq_nhd_ragged": (3, 5, 6, 2, 32, [0, 12, 30], 7, "NHD", "per_seq", 0),
    "bs7_packed_hnd_shared": (2, 6, 4, 1, 16, [15, 21], 7, "HND", "packed", 2),
    "bs16_causal_hnd_shared": (3, 4, 6, 3, 16, [33, 40, 2], 16, "HND", "causal", 2),
    "bs16_packed_nhd_gqa9-3": (2, 7, 9, 3, 64, [20, 0], 16, "NHD", "packed", 0),
    "bs16_bool_nhd_decode": (2, 1, 4, 2, 16, [47, 16], 16, "NHD", "bool", 0),
    "bs5_per_seq_nhd_mha_shared": (2, 3, 3, 3, 16, [10, 10], 5, "NHD", "per_seq", 2),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("backend", ALL)
def test_paged_equals_dense(device, backend, case):
    B, N, H, Hkv, D, lens, bs, layout, kind, shared = CASES[case]
    q, k, v, lens_t, table, pk, pv = paged_case(B, N, H, Hkv, D, lens, bs, layout, seed=len(case), shared=shared)
    mask = make_mask(kind, B, N, gen(N))
    want = expected(q, k, v, lens_t, mask)
    got = sk.tree_attention(
        *on(device, q, pk, pv, lens_t, mask), block_table=table.to(device), kv_layout=layout, backend=backend
    )
    assert got.shape == q.shape and got.dtype == q.dtype and got.device.type == device.type
    assert not got.isnan().any()
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_reference_is_the_dense_reference_on_the_gathered_cache(layout):
    # same capacity, same data: bit for bit
    q, k, v, lens, table, pk, pv = paged_case(3, 4, 4, 2, 16, [9, 20, 0], 7, layout, seed=4, shared=1)
    mask = make_mask("per_seq", 3, 4, gen(4))
    gathered = gather_paged_kv(pk, table, layout)
    for b, L in enumerate(lens.tolist()):
        assert torch.equal(gathered[b, :, : L + 4], k[b, :, : L + 4])
    want = reference.tree_attention(q, k, v, lens, mask)
    got = reference.tree_attention(q, pk, pv, lens, mask, block_table=table, kv_layout=layout)
    assert torch.equal(got, want)


@each_dtype
@pytest.mark.parametrize("backend", ALL)
def test_dtypes(device, backend, dtype):
    B, N, H, Hkv, D = 2, 5, 6, 2, 32
    q, k, v, lens, table, pk, pv = paged_case(B, N, H, Hkv, D, [11, 26], 16, "NHD", dtype=dtype, seed=7)
    mask = make_mask("per_seq", B, N, gen(7))
    got = sk.tree_attention(*on(device, q, pk, pv, lens, mask), block_table=table.to(device), backend=backend)
    assert got.dtype == dtype
    assert_close(got, expected(q, k, v, lens, mask), dtype)


@pytest.mark.parametrize("backend", ALL)
def test_int64_block_table_gives_the_int32_result(device, backend):
    """vLLM's tables are int32 and other stacks' int64: both are taken, with the same bits."""
    B, N, H, Hkv, D = 2, 4, 4, 2, 16
    q, k, v, lens, table, pk, pv = paged_case(B, N, H, Hkv, D, [6, 17], 4, "NHD", seed=9)
    mask = make_mask("per_seq", B, N, gen(9))
    args = on(device, q, pk, pv, lens, mask)
    want = sk.tree_attention(*args, block_table=table.to(device), backend=backend)
    got = sk.tree_attention(*args, block_table=table.long().to(device), backend=backend)
    assert torch.equal(got, want)
    assert_close(got, expected(q, k, v, lens, mask), torch.float32)


@pytest.mark.parametrize("backend", ALL)
def test_sm_scale_int64_lengths_and_a_pool_inside_a_bigger_cache(device, backend):
    # the pool of one layer of a [L, 2, num_blocks, bs, Hkv, D] cache, int64 cache_seqlens
    B, N, H, Hkv, D, bs = 2, 3, 4, 2, 16, 4
    q, k, v, lens, table, pk, pv = paged_case(B, N, H, Hkv, D, [5, 13], bs, "NHD", seed=8)
    cache = torch.randn(3, 2, *pk.shape)
    cache[1, 0], cache[1, 1] = pk, pv
    got = sk.tree_attention(
        *on(device, q, cache[1, 0], cache[1, 1], lens.long()),
        block_table=table.to(device),
        sm_scale=0.3,
        backend=backend,
    )
    assert_close(got, expected(q, k, v, lens, None, sm_scale=0.3), torch.float32)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("backend", ALL)
def test_vllm_per_layer_kv_cache_with_an_int64_table(device, backend, layout):
    """vLLM's per-layer kv_cache [2, num_blocks, block_size, Hkv, D] (HND: [2, num_blocks, Hkv,
    block_size, D]) passed whole with v_cache None, also from a (num_blocks, 2, ...)
    allocation, int32 or int64 table: the separate pools' bits, the dense op's answer."""
    B, N, H, Hkv, D, bs = 2, 3, 4, 2, 16, 4
    q, k, v, lens, table, pk, pv = paged_case(B, N, H, Hkv, D, [5, 9], bs, layout, seed=21)
    mask = make_mask("bool", B, N, gen(22))
    want = sk.tree_attention(
        *on(device, q, pk, pv, lens, mask), block_table=table.to(device), kv_layout=layout, backend=backend
    )
    kv = torch.stack([pk, pv])  # [2, num_blocks, ...]
    interleaved = torch.stack([pk, pv], dim=1).transpose(0, 1)  # memory (num_blocks, 2, ...)
    assert not interleaved.is_contiguous()
    for cache in (kv, interleaved):
        for t in (table, table.long()):
            q_, cache_, lens_, mask_ = on(device, q, cache, lens, mask)
            got = sk.tree_attention(
                q_, cache_, None, lens_, mask_, block_table=t.to(device), kv_layout=layout, backend=backend
            )
            assert torch.equal(got, want)
    assert_close(want, expected(q, k, v, lens, mask), torch.float32)
    dense = sk.tree_attention(*on(device, q, torch.stack([k, v])), None, *on(device, lens, mask), backend=backend)
    assert_close(dense, expected(q, k, v, lens, mask), torch.float32)


def test_v_cache_none_needs_one_layers_keys_and_values():
    B, N, H, Hkv, D, bs = 1, 2, 2, 1, 16, 4
    q, k, v, lens, table, pk, pv = paged_case(B, N, H, Hkv, D, [3], bs, "NHD", seed=23)
    with pytest.raises(ValueError, match="k_cache must have 5 dimensions"):
        sk.tree_attention(q, pk, None, lens, block_table=table)
    with pytest.raises(ValueError, match=r"with v_cache None, k_cache must hold one layer's keys and values"):
        sk.tree_attention(q, torch.stack([pk, pv, pv]), None, lens, block_table=table)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("backend", ALL)
def test_pools_with_padded_rows(device, backend, layout):
    # head-dim rows padded to 24 elements: the pools are strided views, not contiguous
    B, N, H, Hkv, D, bs = 2, 2, 4, 2, 16, 3
    q, k, v, lens, table, pk, pv = paged_case(B, N, H, Hkv, D, [4, 8], bs, layout, seed=14)
    padded = []
    for pool in (pk, pv):
        buf = torch.full((*pool.shape[:3], D + 8), NAN)
        buf[..., :D] = pool
        padded.append(buf[..., :D])
    assert not padded[0].is_contiguous()
    got = sk.tree_attention(
        *on(device, q, padded[0], padded[1], lens), block_table=table.to(device), kv_layout=layout, backend=backend
    )
    assert_close(got, expected(q, k, v, lens, None), torch.float32)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_triton_forced_splits(device, num_splits, monkeypatch):
    if "triton" not in ALL:
        pytest.skip("triton is not runnable here")
    from functools import partial

    from specdec_kernels.ops._triton import tree_attention as kernels

    # a split may hold a single key tile: the 70-key prefix runs several splits
    monkeypatch.setattr(kernels, "launch_config", partial(kernels.launch_config, min_split_keys=1))
    B, N, H, Hkv, D = 2, 3, 4, 2, 16
    q, k, v, lens, table, pk, pv = paged_case(B, N, H, Hkv, D, [70, 3], 7, "HND", seed=num_splits)
    mask = make_mask("bool", B, N, gen(num_splits))
    got = sk.tree_attention(
        *on(device, q, pk, pv, lens, mask),
        block_table=table.to(device),
        kv_layout="HND",
        num_splits=num_splits,
        backend="triton",
    )
    assert_close(got, expected(q, k, v, lens, mask), torch.float32)


@pytest.mark.parametrize("backend", ALL)
def test_empty_batch_and_no_queries(device, backend):
    pool = torch.randn(4, 2, 1, 16, device=device)
    out = sk.tree_attention(
        torch.zeros(0, 2, 2, 16, device=device),
        pool,
        pool,
        torch.zeros(0, dtype=torch.int32, device=device),
        block_table=torch.zeros(0, 3, dtype=torch.int32, device=device),
        backend=backend,
    )
    assert out.shape == (0, 2, 2, 16)
    out = sk.tree_attention(
        torch.zeros(2, 0, 2, 16, device=device),
        pool,
        pool,
        torch.tensor([1, 5], dtype=torch.int32, device=device),
        block_table=torch.tensor([[0, 1, 2], [3, 2, 1]], dtype=torch.int32, device=device),
        backend=backend,
    )
    assert out.shape == (2, 0, 2, 16)


def test_kv_layout_is_ignored_by_the_dense_op(device):
    q, k, v, lens, _, _, _ = paged_case(2, 3, 4, 2, 16, [4, 9], 4, "NHD", seed=9)
    q, k, v, lens = q.to(device), k.nan_to_num().to(device), v.nan_to_num().to(device), lens.to(device)
    for backend in ALL:
        a = sk.tree_attention(q, k, v, lens, backend=backend)
        assert torch.equal(sk.tree_attention(q, k, v, lens, kv_layout="HND", backend=backend), a)


# ---------------------------------------------------------------------------------------
# invisible slots never leak (dense and paged)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("poison", [NAN, float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", ALL)
def test_invisible_slots_never_reach_the_output_dense_and_paged(device, backend, poison):
    """NaN/inf in the slots past every sequence (the rest of its last block too), in unused
    pool blocks and in other sequences' blocks: every output equals the reference on clean
    data, dense and paged, for a ragged batch with an empty prefix."""
    B, N, H, Hkv, D, bs = 3, 4, 4, 2, 16, 4
    q, k, v, lens, table, _, _ = paged_case(B, N, H, Hkv, D, [0, 6, 13], bs, "NHD", seed=10)
    clean_k, clean_v = k.nan_to_num(0.5), v.nan_to_num(0.5)
    mask = make_mask("per_seq", B, N, gen(10))
    want = expected(q, clean_k, clean_v, lens, mask)
    dirty_k, dirty_v = k.masked_fill(k.isnan(), poison), v.masked_fill(v.isnan(), poison)  # the invisible slots
    dense = sk.tree_attention(*on(device, q, dirty_k, dirty_v, lens, mask), backend=backend, validate=False)
    assert not dense.isnan().any()
    assert_close(dense, want, torch.float32)
    for layout in ("NHD", "HND"):
        pk = to_pool(dirty_k, table, int(table.max()) + 4, layout, fill=poison)  # 3 unused blocks of poison
        pv = to_pool(dirty_v, table, int(table.max()) + 4, layout, fill=poison)
        paged = sk.tree_attention(
            *on(device, q, pk, pv, lens, mask),
            block_table=table.to(device),
            kv_layout=layout,
            backend=backend,
            validate=False,
        )
        assert not paged.isnan().any(), layout
        assert_close(paged, want, torch.float32)


@pytest.mark.parametrize("backend", ALL)
def test_unused_table_entries_are_never_dereferenced(device, backend):
    """Entries past the blocks a sequence uses hold garbage (huge, negative): the result is
    the one with -1 padding, and the value checks accept them."""
    q, k, v, lens, table, pk, pv = paged_case(3, 2, 2, 1, 16, [1, 9, 4], 4, "HND", seed=11)
    want = sk.tree_attention(q, pk, pv, lens, block_table=table, kv_layout="HND", backend="reference")
    garbage = table.clone()
    values = [2**31 - 1, -(2**31), 77, -3, 1 << 20, 0]
    pads = (table < 0).nonzero().tolist()
    assert len(pads) >= 4
    for i, (b, j) in enumerate(pads):
        garbage[b, j] = values[i % len(values)]
    got = sk.tree_attention(
        *on(device, q, pk, pv, lens), block_table=garbage.to(device), kv_layout="HND", backend=backend, validate=True
    )
    assert not got.isnan().any()
    assert_close(got, want, torch.float32)


def hostile_case(layout):
    """The bounds case of validate=False: 3 sequences (lengths 5, 9, 2, N = 2, block size 4),
    every block of the pools finite (``pk``, ``pv``) and ``guarded``, the same pools as slices
    of 3x bigger NaN buffers; the ``hostile`` table holds two block ids that sequence 0 uses
    outside [0, num_blocks), ``hostile_lens`` a huge length of sequence 2."""
    B, N, H, Hkv, D, bs = 3, 2, 4, 2, 16, 4
    q, k, v, lens, table, pk, pv = paged_case(B, N, H, Hkv, D, [5, 9, 2], bs, layout, seed=12, extra_blocks=0)
    pk, pv = pk.nan_to_num(0.25), pv.nan_to_num(0.25)  # every block of the pool finite
    nb = pk.shape[0]
    guarded = []
    for pool in (pk, pv):
        buf = torch.full((3 * nb, *pool.shape[1:]), NAN)
        buf[nb : 2 * nb] = pool
        guarded.append(buf[nb : 2 * nb])
    hostile = table.clone()
    hostile[0, 0], hostile[0, 1] = -7, 2**31 - 1  # both used by sequence 0 (5 + 2 slots)
    hostile_lens = lens.clone()
    hostile_lens[2] = 2**30  # clamped to capacity - N
    return dict(q=q, pk=pk, pv=pv, lens=lens, table=table, guarded=guarded, hostile=hostile, hostile_lens=hostile_lens)


def assert_clamped(got, case, layout):
    """``got`` (the output on the hostile case) is finite, sequence 1's output is the clean
    reference's, and all of it is the reference's on the clamped block ids and lengths."""
    q, pk, pv, table = case["q"], case["pk"], case["pv"], case["table"]
    clean = sk.tree_attention(q, pk, pv, case["lens"], block_table=table, kv_layout=layout, backend="reference")
    assert not got.isnan().any()
    assert_close(got[1], clean[1], torch.float32)
    cap, N = table.shape[1] * 4, q.shape[1]
    hostile_lens, hostile = case["hostile_lens"].clamp(0, cap - N), case["hostile"].clamp(0, pk.shape[0] - 1)
    want = reference.tree_attention(q, pk, pv, hostile_lens, block_table=hostile, kv_layout=layout)
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("backend", ALL)
def test_hostile_block_ids_never_read_outside_the_pool(device, backend, layout):
    """validate=False with used block ids outside [0, num_blocks) and huge cache_seqlens:
    the pool is a slice of a bigger buffer whose outside is NaN, so any read outside it
    would show.  Ids are clamped into the pool (the reference does the same): every output
    is finite, the other sequences' outputs are unchanged, and the hostile sequence's output
    is the reference's on the clamped ids."""
    c = hostile_case(layout)
    got = sk.tree_attention(
        *on(device, c["q"], *c["guarded"], c["hostile_lens"]),
        block_table=c["hostile"].to(device),
        kv_layout=layout,
        backend=backend,
        validate=False,
    ).cpu()
    assert_clamped(got, c, layout)


# ---------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------


def _good():
    pool = torch.zeros(6, 4, 2, 16)  # NHD: 6 blocks of 4 slots, Hkv 2, D 16
    return dict(
        q=torch.zeros(2, 3, 4, 16),
        k_cache=pool,
        v_cache=pool.clone(),
        cache_seqlens=torch.tensor([2, 6], dtype=torch.int32),
        block_table=torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32),
    )


BAD = {
    "kv_layout": (dict(kv_layout="NDH"), ValueError, "kv_layout"),
    "kv_layout_lower": (dict(kv_layout="nhd"), ValueError, "kv_layout"),
    "k_cache_rank": (dict(k_cache=torch.zeros(6, 4, 32)), ValueError, "k_cache"),
    "v_cache_shape": (dict(v_cache=torch.zeros(6, 4, 2, 32)), ValueError, "v_cache"),
    "k_cache_head_dim": (
        dict(k_cache=torch.zeros(6, 4, 2, 32), v_cache=torch.zeros(6, 4, 2, 32)),
        ValueError,
        "k_cache",
    ),
    "kv_dtype": (dict(k_cache=torch.zeros(6, 4, 2, 16, dtype=torch.float16)), TypeError, "k_cache"),
    "heads_not_multiple": (
        dict(k_cache=torch.zeros(6, 4, 3, 16), v_cache=torch.zeros(6, 4, 3, 16)),
        ValueError,
        "multiple",
    ),
    # the NHD pool read as HND: Hkv = 4 (and block_size 2), which 6 query heads are no multiple of
    "hnd_heads_not_multiple": (dict(kv_layout="HND", q=torch.zeros(2, 3, 6, 16)), ValueError, "multiple"),
    "empty_pool": (dict(k_cache=torch.zeros(0, 4, 2, 16), v_cache=torch.zeros(0, 4, 2, 16)), ValueError, "k_cache"),
    "table_rank": (dict(block_table=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, "block_table"),
    "table_rows": (dict(block_table=torch.tensor([[0, 1, 2]], dtype=torch.int32)), ValueError, "block_table"),
    "table_dtype_float": (dict(block_table=torch.zeros(2, 3)), TypeError, "block_table"),
    "table_below_n": (dict(block_table=torch.zeros(2, 0, dtype=torch.int32)), ValueError, "block_table"),
    "table_too_small": (dict(block_table=torch.tensor([[0], [1]], dtype=torch.int32)), ValueError, "block_table"),
    "table_too_small_for_lengths": (
        dict(block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)),
        ValueError,
        "block_table",
    ),
    "used_id_negative": (
        dict(block_table=torch.tensor([[0, -1, -1], [2, 3, 4]], dtype=torch.int32)),
        ValueError,
        "block_table[0, 1]",
    ),
    "used_id_past_pool": (
        dict(block_table=torch.tensor([[0, 1, -1], [2, 3, 6]], dtype=torch.int32)),
        ValueError,
        "block_table[1, 2]",
    ),
    "negative_seqlen": (dict(cache_seqlens=torch.tensor([-1, 6], dtype=torch.int32)), ValueError, "cache_seqlens"),
    "mask_shape": (dict(tree_mask=torch.ones(2, 2, dtype=torch.bool)), ValueError, "tree_mask"),
    "packed_mask_shape": (dict(tree_mask=torch.zeros(3, 2, dtype=torch.int32)), ValueError, "tree_mask"),
}


# cases that only a read of tensor values finds: checked by default on CPU tensors, and on CUDA
# tensors only with validate=True (the default there reads no values: no host sync)
VALUE_CASES = {
    "table_too_small",
    "table_too_small_for_lengths",
    "used_id_negative",
    "used_id_past_pool",
    "negative_seqlen",
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("backend", ALL)
def test_bad_input_raises_naming_the_argument(device, backend, case):
    args = _good()
    override, err, name = BAD[case]
    args.update(override)
    args = {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in args.items()}
    validate = {"validate": True} if case in VALUE_CASES and device.type == "cuda" else {}
    with pytest.raises(err, match=re.escape(name)):
        sk.tree_attention(**args, backend=backend, **validate)


@pytest.mark.parametrize("case", ["kv_layout", "table_too_small_for_lengths", "used_id_negative", "table_dtype_float"])
def test_reference_backend_raises_alike(case):
    args = _good()
    override, err, name = BAD[case]
    args.update(override)
    with pytest.raises(err, match=re.escape(name)):
        sk.tree_attention(**args, backend="reference")


def test_bad_kv_layout_raises_for_the_dense_op_too():
    q, k = torch.zeros(1, 1, 2, 16), torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="kv_layout"):
        sk.tree_attention(q, k, k, torch.tensor([1], dtype=torch.int32), kv_layout="BSHD")


# ---------------------------------------------------------------------------------------
# registered ops, fake tensors
# ---------------------------------------------------------------------------------------


def _op_args(layout="NHD", kind="bool"):
    q, k, v, lens, table, pk, pv = paged_case(2, 3, 4, 2, 16, [5, 9], 4, layout, seed=13)
    pk, pv = pk.nan_to_num(), pv.nan_to_num()  # opcheck compares outputs with NaN != NaN
    mask = make_mask(kind if kind != "causal" else "bool", 2, 3, gen(13))
    return q, pk, pv, lens, None if kind == "causal" else mask, table


@pytest.mark.parametrize("layout,kind", [("NHD", "bool"), ("HND", "packed"), ("NHD", "causal")])
def test_opcheck_paged_tree_attention(layout, kind):
    q, pk, pv, lens, mask, table = _op_args(layout, kind)
    for backend in runnable_backends("tree_attention", "cpu"):
        torch.library.opcheck(
            torch.ops.specdec.paged_tree_attention.default,
            (q, pk, pv, lens, mask, table, layout, 0.25),
            {"backend": backend},
        )


@pytest.mark.parametrize("layout,kind,splits", [("NHD", 1, 1), ("HND", 2, 2), ("NHD", 0, 3)])
def test_opcheck_paged_triton_op(device, layout, kind, splits):
    if "triton" not in ALL:
        pytest.skip("the Triton op needs CUDA or the interpreter")
    q, pk, pv, lens, mask, table = _op_args(layout, ["causal", "bool", "packed"][kind])
    args = on(device, q, pk, pv, lens, mask, table)
    # the Triton launcher is no op of its own: the public op's Triton branch is what is checked
    torch.library.opcheck(
        torch.ops.specdec.paged_tree_attention.default, (*args, layout, 0.25, splits), {"backend": "triton"}
    )


def test_registered_op_checks_shapes_for_direct_callers():
    q, pk, pv, lens, mask, table = _op_args()
    with pytest.raises(ValueError, match="kv_layout"):
        torch.ops.specdec.paged_tree_attention(q, pk, pv, lens, mask, table, "NDH", 0.25)
    with pytest.raises(ValueError, match="block_table"):
        torch.ops.specdec.paged_tree_attention(q, pk, pv, lens, mask, table[:1], "NHD", 0.25)
    with pytest.raises(ValueError, match="backend must be one of"):
        torch.ops.specdec.paged_tree_attention(q, pk, pv, lens, mask, table, "NHD", 0.25, 0, "fast")


def test_the_front_calls_the_paged_op_and_matches_it(monkeypatch):
    # the automatic CPU path picks native or torch by timing; pin it so the two calls agree bit for bit
    monkeypatch.setenv("SPECDEC_PAGED_ATTENTION", "native")
    sk.reset_backends()  # environment variables are read at import and on reset
    q, pk, pv, lens, mask, table = _op_args()
    a = torch.ops.specdec.paged_tree_attention(q, pk, pv, lens, mask, table, "NHD", 16**-0.5)
    assert torch.equal(a, sk.tree_attention(q, pk, pv, lens, mask, block_table=table))


def test_runs_under_fake_tensor_mode_with_validate_false():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = _op_args("HND", "packed")
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        q, pk, pv, lens, mask, table = (mode.from_tensor(t) for t in real)
        out = sk.tree_attention(q, pk, pv, lens, mask, block_table=table, kv_layout="HND", validate=False)
        assert out.shape == q.shape and out.dtype == q.dtype
        with pytest.raises(ValueError, match="block_table"):
            sk.tree_attention(q, pk, pv, lens, mask, block_table=table[:1], kv_layout="HND", validate=False)


@pytest.mark.parametrize("backend", [b for b in ALL if b != "triton"])
def test_meta_tensors_give_meta_outputs(backend):
    m = "meta"
    q, pool = torch.zeros(2, 3, 4, 16, device=m), torch.zeros(5, 4, 2, 16, device=m)
    out = sk.tree_attention(
        q,
        pool,
        pool,
        torch.tensor([1, 2], dtype=torch.int32, device=m),
        block_table=torch.zeros(2, 3, dtype=torch.int32, device=m),
        backend=backend,
    )
    assert out.device.type == "meta" and out.shape == q.shape


def test_cpu_workspace_survives_inference_mode_and_fake_mode():
    """The torch path's reused gather buffer: first made inside ``torch.inference_mode`` (the
    engine's generate) or under a FakeTensorMode (tracing), it must not break later plain calls
    (an inference tensor cannot be written outside inference mode; a fake one holds no data)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from specdec_kernels.ops._torch import tree_attention as ta

    g = torch.Generator().manual_seed(5)
    B, N, H, Hkv, D, bs = 2, 3, 4, 2, 16, 4
    table = torch.tensor([[2, 0, 1], [4, 3, 5]], dtype=torch.int32)
    k = torch.randn(6, bs, Hkv, D, generator=g)
    v = torch.randn(6, bs, Hkv, D, generator=g)
    q = torch.randn(B, N, H, D, generator=g)
    lens = torch.tensor([5, 7], dtype=torch.int32)
    for attr in list(vars(ta._WORKSPACE)):
        delattr(ta._WORKSPACE, attr)
    want = reference.tree_attention(q, k, v, lens, block_table=table)
    with FakeTensorMode(allow_non_fake_inputs=True):
        ta._workspace(10_000, torch.float32)
    with torch.inference_mode():
        inside = sk.tree_attention(q, k, v, lens, block_table=table, backend="torch")
    outside = sk.tree_attention(q, k, v, lens, block_table=table, backend="torch")
    torch.testing.assert_close(inside, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outside, want, atol=1e-5, rtol=1e-5)
