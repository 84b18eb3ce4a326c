"""compact_kv_cache over a PAGED KV cache (``block_table``): every backend against the dense op.

The oracle: a dense [L, 2, B, Hkv, S, D] cache compacted by the dense reference.  The same
contents are scattered into shuffled blocks of a pool (spare blocks and the slack of the last
block filled with other random bytes, unused table entries -1), compacted with
``block_table``, and gathered back: the logical slots must equal the dense result byte for
byte (the op moves bytes), and every byte of the pool that is no logical slot of a
sequence (spare blocks, slack) must be unchanged.

Implementations (the ``impl`` fixture): the public op with backend "reference" and "native"
on the ``device`` fixture (the C++ kernel on CPU, the CUDA kernel on a GPU), and
``cuda_emulated``: the CUDA kernel's own code (``csrc/compact_kv_cache_kernel.cu`` built by nvcc with
SPECDEC_COMPACT_KV_HOST_EMULATION) run on the host block by block, every thread's loads of a
chunk before any thread's stores, the pools described by the binding's own host helper (as
``test_kernels.py`` does for the dense kernel).
"""

import ctypes
import re

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _backend, reference
from specdec_kernels.ops import compact_kv_cache as op_module
from specdec_kernels.ops.compact_kv_cache import check_paged_compact_kv_cache_args
from specdec_kernels.reference.compact_kv_cache import _paged_compact_kv_cache, cache_views
from tests.ops.compact_kv_cache.cases import one_slot_move, spoil
from tests.ops.compact_kv_cache.host_emulation import PagedLaunchArgs, describe_caches, set_index_args
from tests.utils import capture_and_replay, over_bad_inputs

OP = "paged_compact_kv_cache"
native = pytest.mark.requires_native_op(OP)
LAYOUTS = ["NHD", "HND"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.float8_e4m3fn]
DTYPE_IDS = ["fp32", "fp16", "bf16", "u8", "fp8e4m3"]


def random_bytes(shape, dtype, seed, device="cpu"):
    """Random bytes seen as ``dtype`` (every bit pattern, NaNs included: compared bitwise)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape).to(device)


def same_bytes(a, b):
    return torch.equal(a.contiguous().cpu().view(torch.uint8), b.contiguous().cpu().view(torch.uint8))


def block_rows(pool6, layout):
    """A [L, 2, num_blocks, ...] pool as [L, 2, num_blocks, block_size, Hkv, D] (a view)."""
    return pool6 if layout == "NHD" else pool6.transpose(3, 4)


def to_paged(dense, block_size, layout, seed, spare=3, pad=2):
    """Scatter a dense [L, 2, B, Hkv, S, D] cache into shuffled blocks of a pool.

    Returns (pool [L, 2, num_blocks, ...] in ``layout``, block_table int32 [B, max_blocks]):
    sequence b's logical block j is block block_table[b, j]; ``spare`` blocks belong to no
    sequence, ``pad`` table entries past each sequence's blocks are -1 (never touched), and
    the slack past S in each sequence's last block holds random bytes.
    """
    L, _, B, H, S, D = dense.shape
    per_seq = -(-S // block_size)
    num_blocks = B * per_seq + spare
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g)
    table = torch.full((B, per_seq + pad), -1, dtype=torch.int32)
    table[:, :per_seq] = order[: B * per_seq].reshape(B, per_seq).to(torch.int32)
    shape = (L, 2, num_blocks, block_size, H, D) if layout == "NHD" else (L, 2, num_blocks, H, block_size, D)
    pool = random_bytes(shape, dense.dtype, seed + 1, dense.device)
    rows = block_rows(pool, layout)
    for b in range(B):
        for j in range(per_seq):
            lo, hi = j * block_size, min(S, (j + 1) * block_size)
            rows[:, :, int(table[b, j]), : hi - lo] = dense[:, :, b, :, lo:hi].transpose(2, 3)
    return pool, table.to(dense.device)


def from_paged(pool, table, layout, S):
    """The logical slots 0..S-1 of every sequence as a dense [L, 2, B, Hkv, S, D] cache."""
    rows = block_rows(pool, layout)
    block_size = rows.shape[3]
    out = []
    for b in range(table.shape[0]):
        slots = torch.arange(S, device=table.device)
        blocks = table[b].long()[slots // block_size]
        out.append(rows[:, :, blocks, slots % block_size].transpose(2, 3))  # [L, 2, Hkv, S, D]
    return torch.stack(out, dim=2)


def foreign_bytes_mask(pool, table, layout, S):
    """Bool [num_blocks, block_size]: True where a block row is no logical slot < S of any
    sequence (spare blocks, the slack of last blocks): the op must never change those."""
    num_blocks, block_size = block_rows(pool, layout).shape[2:4]
    mask = torch.ones(num_blocks, block_size, dtype=torch.bool)
    for b in range(table.shape[0]):
        for s in range(S):
            blk = int(table[b, s // block_size])
            mask[blk, s % block_size] = False
    return mask


def random_paths(B, M, S, seed, zero_rows=(), identity_rows=()):
    """Accepted paths of random token trees: (cache_seqlens, accepted_indices padded with -1,
    num_accepted), int64.  ``zero_rows``: num_accepted 0; ``identity_rows``: a zero-draft
    sequence (its tree is the root alone, accepted [0])."""
    g = torch.Generator().manual_seed(seed)
    seqlens, rows, counts = [], [], []
    for b in range(B):
        n = int(torch.randint(1, M + 1, (1,), generator=g))
        path = (torch.arange(n) + torch.randint(0, 3, (n,), generator=g).cumsum(0)).tolist()
        if b in zero_rows:
            n = 0
        if b in identity_rows:
            path, n = [0], 1
        tree = max(path) + 1 if path else 1
        seqlens.append(int(torch.randint(0, S - tree + 1, (1,), generator=g)))
        rows.append(path + [-1] * (M - len(path)))
        counts.append(n)
    return torch.tensor(seqlens), torch.tensor(rows, dtype=torch.int64), torch.tensor(counts)


def dense_after(dense, seqlens, indices, counts):
    want = dense.cpu().clone()
    reference.compact_kv_cache(want, seqlens.cpu(), indices.cpu(), counts.cpu())
    return want


def as_container(pool, container):
    """The pool handed over as one 6-D buffer, a flat list of separately allocated per-layer
    pools, or (key, value) pairs; returns (kv_cache, gather back to a 6-D pool)."""
    L = pool.shape[0]
    if container == "buffer":
        return pool, lambda: pool
    if container == "layers":
        layers = [pool[l, kv].clone() for l in range(L) for kv in range(2)]
        return layers, lambda: torch.stack(layers).reshape(pool.shape)
    if container == "pairs":
        pairs = [(pool[l, 0].clone(), pool[l, 1].clone()) for l in range(L)]
        return pairs, lambda: torch.stack([torch.stack(p) for p in pairs])
    if container == "vllm":  # vLLM's kv_caches: one [2, num_blocks, ...] tensor per layer
        layers = [pool[l].clone() for l in range(L)]
        return layers, lambda: torch.stack(layers)
    if container == "vllm_layer":  # one layer's [2, num_blocks, ...] tensor alone
        assert L == 1
        layer = pool[0].clone()
        return layer, lambda: layer[None]
    if container == "vllm_strided":  # a (num_blocks, 2, ...) allocation per layer, seen as [2, ...]
        layers = [pool[l].transpose(0, 1).contiguous().transpose(0, 1) for l in range(L)]
        assert not layers[0].is_contiguous()
        return layers, lambda: torch.stack(layers)
    raise AssertionError(container)


# --------------------------------------------------------------------------- CUDA kernel on the host


def emulate_cuda(lib, pools, layout, seqlens, indices, counts, table, threads=0, blocks=0):
    """Run the paged CUDA kernel's code on host pools (4-D per-layer pools and/or 6-D buffers,
    described as the binding does); return (form, word bytes): form 1 is one base and strides,
    0 a table of per-pool bases."""
    slot_dim, head_dim = (1, 2) if layout == "NHD" else (2, 1)
    slices = []
    for t in pools:
        esz = t.element_size()
        st = [x * esz for x in t.stride()]
        assert st[-1] == esz, "the CUDA kernel needs contiguous rows"
        if t.dim() == 4:
            slices.append((t.data_ptr(), st[0], st[head_dim], st[slot_dim]))
        else:
            slices.extend(
                (t.data_ptr() + l * st[0] + kv * st[1], st[2], st[2 + head_dim], st[2 + slot_dim])
                for l in range(t.shape[0])
                for kv in range(2)
            )
    first = pools[0]
    p = PagedLaunchArgs()
    a = p.kv
    form, _c_slices = describe_caches(lib, a, slices, first.shape[-1] * first.element_size())
    a.batch, a.heads = seqlens.shape[0], first.shape[-4 + head_dim]
    a.capacity = 123456789  # ignored by the paged kernel (set from the table); must not matter
    set_index_args(a, seqlens, indices, counts)
    p.block_table, p.block_table_int64 = table.data_ptr(), table.dtype == torch.int64
    p.block_table_stride_b, p.block_table_stride_m = table.stride()
    p.max_blocks_per_seq, p.num_blocks = table.shape[1], first.shape[-4]
    p.block_size = first.shape[-4 + slot_dim]
    assert lib.specdec_paged_compact_kv_cache_emulate(ctypes.byref(p), threads, blocks) == 0
    return form, lib.specdec_compact_kv_cache_word_bytes(ctypes.byref(a))


def as_pool_list(kv_cache):
    """The front's containers as the native op's list (one buffer goes over whole, a 5-D
    per-layer [2, ...] tensor as its keys and values)."""
    if isinstance(kv_cache, torch.Tensor):
        return [kv_cache] if kv_cache.dim() == 6 else [kv_cache[0], kv_cache[1]]
    flat = []
    for item in kv_cache:
        if isinstance(item, torch.Tensor) and item.dim() == 5:
            item = [item[0], item[1]]
        flat.extend(item if isinstance(item, (list, tuple)) else [item])
    return flat


class Impl:
    """One implementation under test, all taking the public front's arguments."""

    def __init__(self, name, device, lib=None):
        self.name, self.device, self.lib = name, torch.device(device), lib
        self.last = None  # emulation: (form, word bytes) of the last call

    def __call__(self, kv_cache, seqlens, indices, counts, table, layout, validate=None, **launch):
        d = self.device
        seqlens, indices, table = seqlens.to(d), indices.to(d), table.to(d)
        counts = counts.to(d) if counts is not None else None
        if self.lib is None:
            sk.compact_kv_cache(
                kv_cache,
                seqlens,
                indices,
                counts,
                block_table=table,
                kv_layout=layout,
                backend=self.name,
                validate=validate,
            )
            return
        _, _, _, _, n = check_paged_compact_kv_cache_args(kv_cache, seqlens, indices, counts, table, layout, validate)
        if counts is not None:
            n = counts  # the kernel clamps the counts itself
        self.last = emulate_cuda(self.lib, as_pool_list(kv_cache), layout, seqlens, indices, n, table, **launch)


@pytest.fixture(params=["reference", pytest.param("native", marks=native), "cuda_emulated"])
def impl(request, device):
    if request.param == "cuda_emulated":
        return Impl("cuda_emulated", "cpu", request.getfixturevalue("emulator"))
    return Impl(request.param, device)


def run_case(impl, dense, block_size, layout, seqlens, indices, counts, container="buffer", seed=0):
    """Compact the paged copy of ``dense`` with ``impl``; check it against the dense oracle and
    that no foreign byte moved.  Returns the pool after and the table."""
    S = dense.shape[4]
    pool, table = to_paged(dense.to(impl.device), block_size, layout, seed)
    before = pool.cpu().clone()
    arg, gather = as_container(pool.clone(), container)
    impl(arg, seqlens, indices, counts, table, layout)
    after = gather()
    assert same_bytes(from_paged(after, table, layout, S), dense_after(dense, seqlens, indices, counts))
    foreign = foreign_bytes_mask(pool, table.cpu(), layout, S)
    assert same_bytes(block_rows(after.cpu(), layout)[:, :, foreign], block_rows(before, layout)[:, :, foreign])
    return after, table


# --------------------------------------------------------------------------- against the dense op


@pytest.mark.parametrize("container", ["buffer", "layers"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [1, 16, 7], ids=["bs1", "bs16", "bs7"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matches_dense_on_shuffled_blocks(impl, dtype, block_size, layout, container):
    # ragged batch of 5: one sequence accepts nothing, one is a zero-draft sequence (root only)
    L, B, H, S, D, M = 2, 5, 2, 40, 8, 6
    dense = random_bytes((L, 2, B, H, S, D), dtype, seed=block_size)
    seqlens, indices, counts = random_paths(B, M, S, seed=block_size + 1, zero_rows=(1,), identity_rows=(3,))
    run_case(impl, dense, block_size, layout, seqlens, indices, counts, container, seed=block_size + 2)
    if impl.name == "cuda_emulated" and container == "buffer":  # one base and strides, the widest word
        row = D * dense.element_size()
        assert impl.last == (1, next(w for w in (16, 8, 4, 2, 1) if row % w == 0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_key_value_pairs_and_odd_head_dim(impl, layout):
    L, B, H, S, D, M = 3, 3, 3, 33, 67, 5
    dense = random_bytes((L, 2, B, H, S, D), torch.float16, seed=5)
    seqlens, indices, counts = random_paths(B, M, S, seed=6)
    run_case(impl, dense, 5, layout, seqlens, indices, counts, container="pairs", seed=7)


@pytest.mark.parametrize("block_size", [2, 256], ids=["bs2", "bs256"])
def test_long_paths_and_extreme_block_sizes(impl, block_size):
    # paths of 40 accepted tokens (many blocks of 2; all inside one block of 256)
    L, B, H, S, D, M = 1, 2, 2, 120, 16, 40
    dense = random_bytes((L, 2, B, H, S, D), torch.bfloat16, seed=8)
    g = torch.Generator().manual_seed(9)
    indices = torch.arange(M) + torch.randint(0, 2, (B, M), generator=g).cumsum(1)
    seqlens, counts = torch.tensor([0, 13]), torch.tensor([M, M - 7])
    run_case(impl, dense, block_size, "NHD", seqlens, indices, counts, seed=10)


@pytest.mark.parametrize("container", ["vllm", "vllm_layer", "vllm_strided"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_per_layer_kv_tensors(impl, layout, container):
    """vLLM's per-layer kv_cache [2, num_blocks, block_size, Hkv, D] (HND: [2, num_blocks, Hkv,
    block_size, D]) alone, a list of them (vLLM's kv_caches) and per-layer (num_blocks, 2, ...)
    allocations seen as [2, ...]: the dense op's result, no foreign byte moved."""
    L = 1 if container == "vllm_layer" else 3
    B, H, S, D, M = 3, 2, 21, 8, 5
    dense = random_bytes((L, 2, B, H, S, D), torch.float16, seed=41)
    seqlens, indices, counts = random_paths(B, M, S, seed=42, zero_rows=(2,))
    run_case(impl, dense, 4, layout, seqlens, indices, counts, container, seed=43)


def test_vllm_form_errors_name_the_argument():
    pool = torch.zeros(3, 4, 4, 1, 8)  # 5-D, first dimension not 2
    args = (torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]))
    table = torch.tensor([[0]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"kv_cache must be one layer's keys and values \[2, num_blocks"):
        sk.compact_kv_cache(pool, *args, block_table=table)
    with pytest.raises(ValueError, match=r"kv_cache\[1\] must be one layer's keys and values"):
        sk.compact_kv_cache([pool[:2], pool], *args, block_table=table)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_index_dtypes_and_int64_block_table(impl, index_dtype):
    L, B, H, S, D, M = 1, 3, 1, 24, 4, 4
    dense = random_bytes((L, 2, B, H, S, D), torch.float32, seed=11)
    seqlens, indices, counts = random_paths(B, M, S, seed=12)
    pool, table = to_paged(dense.to(impl.device), 4, "HND", seed=13)
    impl(pool, seqlens.to(index_dtype), indices.to(index_dtype), counts.to(index_dtype), table.to(index_dtype), "HND")
    assert same_bytes(from_paged(pool, table, "HND", S), dense_after(dense, seqlens, indices, counts))


def test_num_accepted_none_moves_every_column(impl):
    L, B, H, S, D = 1, 2, 1, 16, 4
    dense = random_bytes((L, 2, B, H, S, D), torch.float32, seed=14)
    seqlens, indices = torch.tensor([2, 5]), torch.tensor([[1, 3, 4], [0, 2, 6]])
    pool, table = to_paged(dense.to(impl.device), 3, "NHD", seed=15)
    impl(pool, seqlens, indices, None, table, "NHD")
    assert same_bytes(from_paged(pool, table, "NHD", S), dense_after(dense, seqlens, indices, torch.tensor([3, 3])))


def mixed_stride_pools(pool, layout):
    """Per-layer pools with different strides: every other one is the middle of a bigger
    allocation (padded blocks), so the CUDA binding needs its table form."""
    L = pool.shape[0]
    pools = []
    for l in range(L):
        for kv in range(2):
            p = pool[l, kv]
            if (2 * l + kv) % 2:
                pools.append(p.clone())
            else:
                big = torch.zeros(p.shape[0], p.shape[1] + 3, *p.shape[2:], dtype=p.dtype, device=p.device)
                big[:, 1 : 1 + p.shape[1]] = p
                pools.append(big[:, 1 : 1 + p.shape[1]])
    return pools, lambda: torch.stack(pools).reshape(pool.shape)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pools_with_different_strides(impl, layout):
    L, B, H, S, D, M = 2, 3, 2, 30, 16, 5
    dense = random_bytes((L, 2, B, H, S, D), torch.float16, seed=40)
    seqlens, indices, counts = random_paths(B, M, S, seed=41)
    pool, table = to_paged(dense.to(impl.device), 4, layout, seed=42)
    pools, gather = mixed_stride_pools(pool, layout)
    impl(pools, seqlens, indices, counts, table, layout)
    assert same_bytes(from_paged(gather(), table, layout, S), dense_after(dense, seqlens, indices, counts))
    if impl.name == "cuda_emulated":
        assert impl.last[0] == 0  # the table form


@pytest.mark.parametrize("offset,word", [(1, 2), (2, 4), (4, 8), (8, 16)], ids=["off1", "off2", "off4", "off8"])
def test_misaligned_pool_base(impl, offset, word):
    # The pool starts `offset` fp16 elements into its allocation: D = 64 rows would allow
    # 16-byte words, the base only `word` bytes; nothing before or after the pool changes.
    L, B, H, S, D, M = 1, 2, 2, 20, 64, 4
    dense = random_bytes((L, 2, B, H, S, D), torch.float16, seed=43)
    seqlens, indices, counts = random_paths(B, M, S, seed=44)
    pool, table = to_paged(dense, 8, "NHD", seed=45)
    flat = torch.zeros(pool.numel() + 16, dtype=pool.dtype, device=impl.device)
    view = flat[offset : offset + pool.numel()].view(pool.shape)
    view.copy_(pool)
    impl(view, seqlens, indices, counts, table, "NHD")
    assert same_bytes(from_paged(view, table.to(impl.device), "NHD", S), dense_after(dense, seqlens, indices, counts))
    assert same_bytes(flat[:offset], torch.zeros(offset, dtype=pool.dtype))
    assert same_bytes(flat[offset + pool.numel() :], torch.zeros(16 - offset, dtype=pool.dtype))
    if impl.name == "cuda_emulated":
        assert flat.data_ptr() % 16 == 0 and impl.last == (1, word)


@pytest.mark.parametrize("threads,blocks", [(32, 0), (32, 3), (64, 1)], ids=["t32", "t32_b3", "t64_b1"])
@pytest.mark.parametrize("head_dim", [8, 67], ids=["D8", "D67"])
def test_emulated_kernel_with_other_launch_shapes(emulator, threads, blocks, head_dim):
    # Narrow blocks (many chunks per slice, chunk boundaries inside rows and blocks) and fewer
    # thread blocks than slices (the grid-stride loop) give the same result.
    L, B, H, S, M = 2, 3, 2, 96, 30
    dense = random_bytes((L, 2, B, H, S, head_dim), torch.float16, seed=46)
    g = torch.Generator().manual_seed(47)
    indices = (torch.arange(M) + torch.randint(0, 3, (B, M), generator=g).cumsum(1)).contiguous()
    seqlens, counts = torch.tensor([0, 2, 1]), torch.tensor([M, 17, 0])
    want = dense_after(dense, seqlens, indices, counts)
    for layout in LAYOUTS:
        pool, table = to_paged(dense, 5, layout, seed=48)
        emulate_cuda(emulator, [pool], layout, seqlens, indices, counts, table, threads=threads, blocks=blocks)
        assert same_bytes(from_paged(pool, table, layout, S), want)


# --------------------------------------------------------------------------- overlap, by hand


def test_overlap_in_one_block_and_across_blocks(impl):
    # block_size 4.  seq 0 (start 2): [1, 2, 3, 5] -> slots 3, 4, 5, 7 move to 2, 3, 4, 5: each
    # source but the last is the destination of the row before, and the moves cross the block
    # boundary at slot 4 both ways.  seq 1 (start 8): [1, 2] -> 9, 10 move to 8, 9, all inside
    # one block.  A kernel that wrote before reading, or across blocks out of order, corrupts it.
    L, B, H, S, D, bs = 2, 2, 3, 16, 5, 4
    dense = torch.arange(L * 2 * B * H * S * D, dtype=torch.float32).reshape(L, 2, B, H, S, D)
    seqlens, indices, counts = torch.tensor([2, 8]), torch.tensor([[1, 2, 3, 5], [1, 2, -1, -1]]), torch.tensor([4, 2])
    after, table = run_case(impl, dense, bs, "NHD", seqlens, indices, counts, seed=16)
    got = from_paged(after, table, "NHD", S).cpu()
    for i, src in enumerate([3, 4, 5, 7]):  # by hand: layer 1 values, head 2
        assert torch.equal(got[1, 1, 0, 2, 2 + i], dense[1, 1, 0, 2, src])
    assert torch.equal(got[:, :, 1, :, 8:10], dense[:, :, 1, :, 9:11])
    assert torch.equal(got[:, :, 0, :, 6:], dense[:, :, 0, :, 6:])  # nothing past the accepted block moved
    assert torch.equal(got[:, :, :, :, :2], dense[:, :, :, :, :2])


def test_shared_prefix_blocks_stay_untouched(impl):
    # Three sequences forked from one prompt of 9 tokens (block_size 4): logical blocks 0 and 1
    # are the SAME physical blocks (5, 2) in every table; block 2 (prompt token 8 + the tree) was
    # copied on write into a private block per sequence.  Only the private blocks may change.
    L, H, D, bs, M = 2, 2, 6, 4, 4
    num_blocks = 12
    pool = random_bytes((L, 2, num_blocks, bs, H, D), torch.bfloat16, seed=17)
    table = torch.tensor([[5, 2, 7, 0, -1], [5, 2, 9, 3, -1], [5, 2, 1, 11, 4]], dtype=torch.int32)  # 16 slots each
    for blk in (9, 1):  # the copies of the partly filled prompt block
        pool[:, :, blk, 0] = pool[:, :, 7, 0]
    seqlens = torch.tensor([9, 9, 9])
    indices = torch.tensor([[0, 1, 3, 6], [2, 4, 5, 6], [0, 1, 2, 3]])
    counts = torch.tensor([4, 3, 2])
    S = 16
    dense = from_paged(pool, table, "NHD", S)
    want = dense_after(dense, seqlens, indices, counts)
    before = pool.clone()
    got = pool.clone().to(impl.device)
    impl(got, seqlens, indices, counts, table, "NHD", validate=True)  # not refused: nothing written is shared
    assert same_bytes(from_paged(got, table.to(impl.device), "NHD", S), want)
    written = {7, 0, 9, 3, 1, 11}
    for blk in range(num_blocks):
        if blk not in written:
            assert same_bytes(got[:, :, blk], before[:, :, blk]), blk
    assert same_bytes(got[:, :, [5, 2]], before[:, :, [5, 2]])  # the shared prompt blocks


# --------------------------------------------------------------------------- no stray writes


# validate=False; one bad entry (or row) per case in sequence `bad`.  Every kernel skips exactly
# the entries whose source or destination is outside the table or in a block outside the pool,
# so the reference defines the result exactly.
SKIPPED = {
    "slot_beyond_table": (1, dict(index=(3, 40))),
    "negative_index": (0, dict(index=(1, -9))),
    "huge_index": (2, dict(row=[2**62, 2**63 - 1, -(2**63), 3])),
    "negative_seqlen": (0, dict(seqlen=-3)),
    "seqlen_past_table": (2, dict(seqlen=10**6)),
    "count_above_M": (1, dict(count=50)),
    "negative_count": (0, dict(count=-4)),
    "block_minus_one": (1, dict(block=-1)),
    "block_num_blocks": (0, dict(block="num_blocks")),
    "block_int32_max": (2, dict(block=2**31 - 1)),
    "block_int32_min": (1, dict(block=-(2**31))),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(SKIPPED), ids=list(SKIPPED))
def test_out_of_range_entries_are_skipped_and_never_leave_the_pool(impl, case, layout):
    """The pool is a slice of a bigger buffer with guard blocks before and after it; with
    validate=False and a bad value, no guard byte changes and the pool equals the reference
    (which skips the same entries)."""
    L, B, H, D, bs, M, guard = 2, 3, 2, 4, 4, 4, 3
    num_blocks = 12
    shape = (L, 2, num_blocks + 2 * guard, bs, H, D) if layout == "NHD" else (L, 2, num_blocks + 2 * guard, H, bs, D)
    buf = random_bytes(shape, torch.float32, seed=19, device=impl.device)
    pool = buf[:, :, guard : guard + num_blocks]
    table = torch.tensor([[3, 7, 0, -1], [9, 1, 4, 11], [2, 8, 5, 6]], dtype=torch.int32)
    seqlens = torch.tensor([2, 5, 7])
    indices = torch.tensor([[0, 2, 3, 6], [1, 2, 4, 5], [1, 2, 3, -1]])
    counts = torch.tensor([4, 4, 3])
    bad, what = SKIPPED[case]
    spoil(bad, what, seqlens, indices, counts)
    if "block" in what:  # the block of the bad sequence's second destination slot
        value = num_blocks if what["block"] == "num_blocks" else what["block"]
        table[bad, (int(seqlens[bad]) + 1) // bs] = value
    want = pool.cpu().clone()
    _paged_compact_kv_cache(cache_views(want), layout, seqlens, indices, counts, table)  # the reference, unchecked
    before = buf.cpu().clone()
    impl(pool, seqlens, indices, counts, table, layout, validate=False)
    after = buf.cpu()
    assert same_bytes(after[:, :, :guard], before[:, :, :guard])
    assert same_bytes(after[:, :, guard + num_blocks :], before[:, :, guard + num_blocks :])
    assert same_bytes(pool, want)
    assert not same_bytes(want, before[:, :, guard : guard + num_blocks])  # the valid sequences moved


@pytest.mark.parametrize("case", ["not_increasing", "shared_written_block", "table_names_block_twice"])
def test_invalid_inputs_stay_inside_the_pool(impl, case):
    """Inputs the value checks refuse, run with validate=False: the result is unspecified, but
    no byte outside the pool changes."""
    L, B, H, D, bs, guard, num_blocks = 1, 2, 2, 8, 4, 2, 6
    buf = random_bytes((L, 2, num_blocks + 2 * guard, bs, H, D), torch.float16, seed=23, device=impl.device)
    pool = buf[:, :, guard : guard + num_blocks]
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    seqlens, indices, counts = torch.tensor([1, 2]), torch.tensor([[1, 2, 5], [0, 3, 4]]), torch.tensor([3, 3])
    if case == "not_increasing":
        indices[0] = torch.tensor([5, 1, 0])
    elif case == "shared_written_block":
        table[1] = table[0]
    else:
        table[0, 1] = 0
    before = buf.cpu().clone()
    impl(pool, seqlens, indices, counts, table, "NHD", validate=False)
    after = buf.cpu()
    assert same_bytes(after[:, :, :guard], before[:, :, :guard])
    assert same_bytes(after[:, :, guard + num_blocks :], before[:, :, guard + num_blocks :])


# --------------------------------------------------------------------------- bad input


def good_args(**override):
    args = dict(
        kv_cache=torch.zeros(2, 2, 6, 4, 2, 3),
        cache_seqlens=torch.tensor([3, 1]),
        accepted_indices=torch.tensor([[0, 2], [1, 3]]),
        num_slots=torch.tensor([2, 2]),
        block_table=torch.tensor([[0, 1, -1], [2, 3, -1]], dtype=torch.int32),
        kv_layout="NHD",
    )
    args.update(override)
    return args


BAD = {
    "layout_name": (dict(kv_layout="NDH"), ValueError, "kv_layout must be 'NHD' or 'HND'"),
    "layout_type": (dict(kv_layout=1), TypeError, "kv_layout must be a str"),
    "table_dtype": (dict(block_table=torch.zeros(2, 3)), TypeError, "block_table must have dtype"),
    "table_rank": (
        dict(block_table=torch.zeros(6, dtype=torch.int32)),
        ValueError,
        "block_table must have 2 dimensions",
    ),
    "table_rows": (
        dict(block_table=torch.zeros(3, 3, dtype=torch.int32)),
        ValueError,
        "block_table must have shape (2, max_blocks_per_seq)",
    ),
    "table_device": (
        dict(block_table=torch.zeros(2, 3, dtype=torch.int32, device="meta")),
        ValueError,
        "block_table must be on",
    ),
    "cache_rank": (dict(kv_cache=torch.zeros(6, 4, 2, 3)), ValueError, "kv_cache must have 5 or 6 dimensions"),
    "six_dims_not_kv": (
        dict(kv_cache=torch.zeros(2, 3, 6, 4, 2, 3)),
        ValueError,
        "[L, 2, num_blocks, block_size, Hkv, D]",
    ),
    "layer_shapes": (dict(kv_cache=[torch.zeros(6, 4, 2, 3), torch.zeros(6, 4, 2, 5)]), ValueError, "kv_cache[1]"),
    "layer_dtypes": (
        dict(kv_cache=[torch.zeros(6, 4, 2, 3), torch.zeros(6, 4, 2, 3).half()]),
        TypeError,
        "kv_cache[1]",
    ),
    "aliasing_layers": (dict(kv_cache=[torch.zeros(6, 4, 2, 3)] * 2), ValueError, "alias"),
    "indices_rows": (
        dict(accepted_indices=torch.tensor([[0, 2]])),
        ValueError,
        "accepted_indices must have shape (2, M)",
    ),
    "not_increasing": (dict(accepted_indices=torch.tensor([[2, 2], [1, 3]])), ValueError, "strictly increasing"),
    "below_position": (dict(accepted_indices=torch.tensor([[0, 0], [1, 3]])), ValueError, ">= i"),
    "count_range": (dict(num_slots=torch.tensor([3, 0])), ValueError, "num_slots must lie in 0..2"),
    "negative_seqlen": (dict(cache_seqlens=torch.tensor([-1, 1])), ValueError, "cache_seqlens must be >= 0"),
    "beyond_table": (dict(cache_seqlens=torch.tensor([10, 1])), ValueError, "capacity of the block table"),
    "block_minus_one": (
        dict(block_table=torch.tensor([[0, -1, -1], [2, 3, -1]], dtype=torch.int32)),
        ValueError,
        "block_table[0, 1] = -1",
    ),
    "block_past_pool": (
        dict(block_table=torch.tensor([[0, 1, -1], [6, 3, -1]], dtype=torch.int32)),
        ValueError,
        "block_table[1, 0] = 6",
    ),
    # sequence 1 writes slot 1 (block 0 for it too), which is sequence 0's prefix
    "writes_into_shared_prefix": (
        dict(block_table=torch.tensor([[0, 1, -1], [0, 3, -1]], dtype=torch.int32)),
        ValueError,
        "must not be shared",
    ),
    # both sequences write the same physical slots
    "two_sequences_write_one_slot": (
        dict(cache_seqlens=torch.tensor([1, 1]), block_table=torch.tensor([[0, 1, -1], [0, 1, -1]], dtype=torch.int32)),
        ValueError,
        "must not be shared",
    ),
    # one table naming a block twice: logical slot 4 (block 1) is the prefix slot 0's row
    "block_twice_in_one_row": (
        dict(cache_seqlens=torch.tensor([3, 1]), block_table=torch.tensor([[0, 0, -1], [2, 3, -1]], dtype=torch.int32)),
        ValueError,
        "must not be shared",
    ),
}


@over_bad_inputs(sk.compact_kv_cache, BAD)
def test_bad_input(fn, case):
    override, err, msg = BAD[case]
    args = good_args(**override)
    snapshot = args["kv_cache"].clone() if isinstance(args["kv_cache"], torch.Tensor) else None
    with pytest.raises(err, match=re.escape(msg)):
        fn(**args)
    if snapshot is not None:  # a rejected call changes nothing
        assert torch.equal(args["kv_cache"], snapshot)


NATIVE_BAD = {
    k: BAD[k]
    for k in (
        "layout_name",
        "table_dtype",
        "table_rank",
        "table_rows",
        "six_dims_not_kv",
        "layer_shapes",
        "layer_dtypes",
        "aliasing_layers",
        "indices_rows",
        "not_increasing",
        "below_position",
        "count_range",
        "negative_seqlen",
        "beyond_table",
        "block_minus_one",
        "block_past_pool",
        "writes_into_shared_prefix",
        "two_sequences_write_one_slot",
        "block_twice_in_one_row",
    )
}
NATIVE_MESSAGE = {  # the C++ wording where it differs from the Python front's
    "table_dtype": "block_table must have dtype int32 or int64",
    "table_rows": "block_table must have shape (2, max_blocks_per_seq)",
    "six_dims_not_kv": "[L, 2, num_blocks, block_size, Hkv, D]",
    "layer_shapes": "caches[1] must end in",
    "layer_dtypes": "caches[1] must have the dtype",
    "aliasing_layers": "must not alias",
    "count_range": "num_accepted must lie in 0..2",  # the native op's name of the slot count
}


@native
@pytest.mark.parametrize("case", list(NATIVE_BAD), ids=list(NATIVE_BAD))
def test_native_op_rejects_bad_input_with_validate(device, case):
    """The native op's own checks (validate=True for direct callers): same errors, nothing moved."""
    assert op_module.register_fake(paged=True)
    override, err, msg = NATIVE_BAD[case]
    args = good_args(**override)
    to = lambda t: t.to(device) if t.device.type != "meta" else t  # noqa: E731
    caches = as_pool_list(args["kv_cache"])
    caches = [to(c) for c in caches]
    snapshot = [c.clone() for c in caches]
    with pytest.raises(err, match=re.escape(NATIVE_MESSAGE.get(case, msg))):
        torch.ops.specdec_native.paged_compact_kv_cache(
            caches,
            to(args["cache_seqlens"]),
            to(args["accepted_indices"]),
            to(args["num_slots"]),
            to(args["block_table"]),
            args["kv_layout"],
            True,
        )
    assert all(torch.equal(a, b) for a, b in zip(caches, snapshot))


def test_good_args_pass_and_validate_false_skips_value_checks():
    # the baseline of BAD is accepted; a value error is not looked for with validate=False
    sk.compact_kv_cache(**good_args())
    sk.compact_kv_cache(**good_args(cache_seqlens=torch.tensor([10, 1])), validate=False)


def test_kv_layout_is_checked_on_dense_caches_too():
    with pytest.raises(ValueError, match="kv_layout"):
        sk.compact_kv_cache(torch.zeros(1, 2, 1, 1, 8, 4), torch.tensor([3]), torch.tensor([[0, 2]]), kv_layout="nhd")


# --------------------------------------------------------------------------- registration


def paged_backends(device="cpu"):
    return [b for b in op_module.IMPLEMENTED if _backend._can_run(b, OP, torch.device(device)) is None]


def opcheck_inputs(layout, container, index_dtype, device="cpu"):
    L, B, H, S, D = 2, 2, 2, 12, 8
    dense = random_bytes((L, 2, B, H, S, D), torch.float16, seed=29)
    pool, table = to_paged(dense, 4, layout, seed=31)
    caches = [pool] if container == "buffer" else [pool[l, kv].clone() for l in range(L) for kv in range(2)]
    seqlens, idx, n = torch.tensor([1, 3]), torch.tensor([[0, 2, 3], [1, 2, 5]]), torch.tensor([3, 2])
    cast = lambda t: t.to(index_dtype).to(device)  # noqa: E731
    return [c.to(device) for c in caches], cast(seqlens), cast(idx), cast(n), cast(table)


@pytest.mark.parametrize("container", ["buffer", "layers"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_opcheck_public_op(layout, container, index_dtype):
    caches, seqlens, idx, n, table = opcheck_inputs(layout, container, index_dtype)
    for backend in paged_backends():
        torch.library.opcheck(
            torch.ops.specdec.paged_compact_kv_cache.default,
            (caches, seqlens, idx, n, table, layout),
            {"backend": backend},
        )
    torch.library.opcheck(torch.ops.specdec.paged_compact_kv_cache.default, (caches, seqlens, idx, None, table, layout))


@native
@pytest.mark.parametrize("container", ["buffer", "layers"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_native_op(device, layout, container):
    assert op_module.register_fake(paged=True)
    caches, seqlens, idx, n, table = opcheck_inputs(layout, container, torch.int32, device)
    torch.library.opcheck(
        torch.ops.specdec_native.paged_compact_kv_cache.default, (caches, seqlens, idx, n, table, layout, False)
    )


def test_front_runs_under_fake_tensor_mode_with_validate_false():
    """No host read of tensor values with validate=False (CUDA graphs, torch.compile)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    caches, seqlens, idx, n, table = opcheck_inputs("NHD", "buffer", torch.int64)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (caches[0], seqlens, idx, n, table)]
        sk.compact_kv_cache(fake[0], *fake[1:4], block_table=fake[4], validate=False)
        with pytest.raises(ValueError, match="block_table must have shape"):
            sk.compact_kv_cache(fake[0], *fake[1:4], block_table=fake[4][:1], validate=False)


def test_compiled_call_equals_eager():
    torch._dynamo.reset()
    caches, seqlens, idx, n, table = opcheck_inputs("HND", "buffer", torch.int32)

    def step(pool, seqlens, idx, n, table):
        sk.compact_kv_cache(pool, seqlens, idx, n, block_table=table, kv_layout="HND", validate=False)
        return pool.sum()

    eager, compiled = caches[0].clone(), caches[0].clone()
    step(eager, seqlens, idx, n, table)
    torch.compile(step, fullgraph=True, backend="aot_eager")(compiled, seqlens, idx, n, table)
    assert same_bytes(compiled, eager) and not same_bytes(eager, caches[0])


# --------------------------------------------------------------------------- CUDA only


@pytest.mark.requires_cuda
@native
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_model_sized_pool_matches_reference(layout):
    # Llama-3-8B-like heads (Hkv 8, D 128), block_size 16, ragged batch of 8, bf16.
    L, B, H, S, D, M = 4, 8, 8, 512, 128, 16
    dense = random_bytes((L, 2, B, H, S, D), torch.bfloat16, seed=60)
    seqlens, indices, counts = random_paths(B, M, S, seed=61, zero_rows=(2,), identity_rows=(5,))
    run_case(Impl("native", "cuda"), dense, 16, layout, seqlens, indices, counts, seed=62)


@pytest.mark.requires_cuda
@native
def test_cuda_graph_capture_of_one_pool():
    L, B, H, S, D, M = 2, 3, 2, 64, 64, 5
    dense = random_bytes((L, 2, B, H, S, D), torch.bfloat16, seed=63)
    seqlens, indices, counts = (t.cuda() for t in random_paths(B, M, S, seed=64))
    pool, table = to_paged(dense.cuda(), 16, "NHD", seed=65)
    want = dense_after(dense, seqlens, indices, counts)
    got = pool.clone()

    def launch():
        torch.ops.specdec_native.paged_compact_kv_cache([got], seqlens, indices, counts, table, "NHD", False)

    capture_and_replay(launch, got, pool)
    assert same_bytes(from_paged(got, table, "NHD", S), want)
    pools, _ = mixed_stride_pools(pool.clone(), "NHD")  # unequal strides: the table form
    with pytest.raises(RuntimeError, match="CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.ops.specdec_native.paged_compact_kv_cache(pools, seqlens, indices, counts, table, "NHD", False)


@pytest.mark.requires_cuda
@native
def test_cuda_rejects_strided_head_dim():
    wide = torch.zeros(1, 2, 4, 4, 1, 8, device="cuda")
    with pytest.raises(ValueError, match="last dimension"):
        torch.ops.specdec_native.paged_compact_kv_cache(
            [wide[..., ::2]],
            *one_slot_move("cuda"),
            torch.tensor([[0, 1]], dtype=torch.int32, device="cuda"),
            "NHD",
            False,
        )


@pytest.mark.requires_cuda
@native
@pytest.mark.parametrize("where", ["cache_seqlens", "accepted_indices", "num_slots", "block_table"])
def test_cuda_rejects_index_tensors_on_another_device(where):
    args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in good_args().items()}
    args[where] = args[where].cpu()
    name = {"num_slots": "num_accepted"}.get(where, where)  # the native op's name of the slot count
    with pytest.raises(ValueError, match=f"{name} must be on cuda"):
        torch.ops.specdec_native.paged_compact_kv_cache(
            [args["kv_cache"]],
            args["cache_seqlens"],
            args["accepted_indices"],
            args["num_slots"],
            args["block_table"],
            "NHD",
            False,
        )
