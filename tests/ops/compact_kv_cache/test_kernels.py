"""Native compact_kv_cache (C++ CPU kernel, CUDA kernel) against the reference.

Two implementations run every correctness case (the ``impl`` fixture):

- ``native``: the public op with backend="native" on the ``device`` fixture: the CPU kernel
  here, the CUDA kernel where there is a GPU;
- ``cuda_emulated``: the CUDA kernel's own code (``csrc/compact_kv_cache_kernel.cu`` built by nvcc
  with SPECDEC_COMPACT_KV_HOST_EMULATION) run on the host, block by block, every thread's
  loads of a chunk before any thread's stores, with the real launch configuration; the
  caches are described by the same host helper the CUDA binding uses.  It checks the
  kernel's indexing, chunking, word widths, layouts and bounds on a machine without a GPU
  (it needs nvcc; memory-model questions are left to the GPU run and compute-sanitizer).

Every comparison is bitwise (the op moves bytes): the cache after the kernel must equal the
cache after ``specdec_kernels.reference.compact_kv_cache`` on a copy of the same input.
"""

import ctypes
import re
import warnings

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _native, reference
from specdec_kernels.ops import compact_kv_cache as op_module
from specdec_kernels.ops.compact_kv_cache import check_compact_kv_cache_args
from tests.ops.compact_kv_cache.cases import one_slot_move, spoil
from tests.ops.compact_kv_cache.host_emulation import LaunchArgs, describe_caches, set_index_args
from tests.utils import capture_and_replay

native = pytest.mark.requires_native_op("compact_kv_cache")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.float64, torch.float8_e4m3fn]
DTYPE_IDS = ["fp32", "fp16", "bf16", "i8", "u8", "fp64", "fp8e4m3"]


def random_cache(shape, dtype, seed, device):
    """Random bytes reinterpreted as ``dtype`` (exercises every bit pattern; compared bitwise)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape).to(device)


def same_bytes(a, b):
    return torch.equal(a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu())


def random_tree_paths(batch, max_accepted, capacity, seed, counts="ragged"):
    """Accepted paths of random token trees, one tree per sequence, plus cache_seqlens.

    ``ragged``: a random root-to-node path of a random tree (truncated to M nodes);
    ``full``: M strictly increasing nodes of a tree of up to 3M nodes; ``zero``: nothing.
    Returns (cache_seqlens, accepted_indices padded with -1, num_accepted), int64 on CPU.
    """
    g = torch.Generator().manual_seed(seed)
    seqlens, rows, ns = [], [], []
    for _ in range(batch):
        nodes = int(torch.randint(max(max_accepted, 1), 3 * max_accepted + 2, (1,), generator=g))
        if counts == "full":
            path = torch.randperm(nodes, generator=g)[:max_accepted].sort().values.tolist()
        else:
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, nodes)]
            node, path = int(torch.randint(0, nodes, (1,), generator=g)), []
            while node != -1:
                path.append(node)
                node = parents[node]
            path = path[::-1][:max_accepted]
        if counts == "zero":
            path = []
        seqlens.append(int(torch.randint(0, capacity - nodes + 1, (1,), generator=g)))
        rows.append(path + [-1] * (max_accepted - len(path)))
        ns.append(len(path))
    return torch.tensor(seqlens), torch.tensor(rows, dtype=torch.int64).reshape(batch, max_accepted), torch.tensor(ns)


def expected_after(cache6, seqlens, indices, counts):
    """The reference applied to a contiguous CPU copy of a [L, 2, B, Hkv, S, D] cache."""
    want = cache6.cpu().contiguous().clone()
    reference.compact_kv_cache(want, seqlens.cpu(), indices.cpu(), counts.cpu())
    return want


def make_layout(cache6, layout):
    """Hand the same contents over in one of the contract's layouts; return (arg, gather)."""
    L = cache6.shape[0]
    if layout == "buffer":
        return cache6, lambda: cache6
    if layout == "views":  # the 2L views of one buffer, as a flat list
        views = [cache6[l, kv] for l in range(L) for kv in range(2)]
        return views, lambda: cache6
    if layout == "layers":  # separately allocated [B, Hkv, S, D] tensors
        layers = [cache6[l, kv].clone() for l in range(L) for kv in range(2)]
        return layers, lambda: torch.stack(layers).reshape(cache6.shape)
    if layout == "pairs":
        pairs = [(cache6[l, 0].clone(), cache6[l, 1].clone()) for l in range(L)]
        return pairs, lambda: torch.stack([torch.stack(p) for p in pairs])
    if layout == "kv_major":  # a [2, L, ...] allocation seen as [L, 2, ...]: dims 0, 1 do not merge
        buf = cache6.transpose(0, 1).contiguous().transpose(0, 1)
        return buf, lambda: buf
    if layout == "padded_slots":  # each layer a [B, Hkv, :S] slice of a longer allocation
        S = cache6.shape[4]
        big = torch.zeros(*cache6.shape[:4], S + 3, cache6.shape[5], dtype=cache6.dtype, device=cache6.device)
        big[..., :S, :] = cache6
        views = [big[l, kv, :, :, :S] for l in range(L) for kv in range(2)]
        return views, lambda: big[..., :S, :]
    if layout == "mixed_strides":  # per-layer tensors with different strides (a table on CUDA)
        S = cache6.shape[4]
        layers = []
        for l in range(L):
            for kv in range(2):
                if (2 * l + kv) % 2:
                    layers.append(cache6[l, kv].clone())
                else:
                    big = torch.zeros(
                        *cache6.shape[2:4], S + 5, cache6.shape[5], dtype=cache6.dtype, device=cache6.device
                    )
                    big[:, :, 2 : 2 + S] = cache6[l, kv]
                    layers.append(big[:, :, 2 : 2 + S])
        return layers, lambda: torch.stack(layers).reshape(cache6.shape)
    raise AssertionError(layout)


# --------------------------------------------------------------------------- CUDA kernel on the host


def as_cache_list(kv_cache):
    """The public op's layouts as the native op's list (one buffer goes over whole)."""
    if isinstance(kv_cache, torch.Tensor):
        return [kv_cache]
    flat = []
    for item in kv_cache:
        flat.extend(item if isinstance(item, (list, tuple)) else [item])
    return flat


def emulate_cuda(lib, caches, seqlens, indices, counts, threads=0, blocks=0):
    """Run the CUDA kernel's code on host tensors; return (form, word bytes).

    form is 1 for the strided description (one base and strides), 0 for the table.  The
    caches are described as the binding does: a 6-D buffer expands into its 2L slices.
    """
    slices = []
    for t in caches:
        esz = t.element_size()
        st = [x * esz for x in t.stride()]
        if t.dim() == 4:
            slices.append((t.data_ptr(), st[0], st[1], st[2]))
        else:
            slices.extend(
                (t.data_ptr() + l * st[0] + kv * st[1], st[2], st[3], st[4])
                for l in range(t.shape[0])
                for kv in range(2)
            )
    first = caches[0]
    assert all(t.stride(-1) == 1 for t in caches), "the CUDA kernel needs contiguous rows"
    a = LaunchArgs()
    form, _table = describe_caches(lib, a, slices, first.shape[-1] * first.element_size())
    a.batch, a.heads, a.capacity = first.shape[-4], first.shape[-3], first.shape[-2]
    set_index_args(a, seqlens, indices, counts)
    assert lib.specdec_compact_kv_cache_emulate(ctypes.byref(a), threads, blocks) == 0
    return form, lib.specdec_compact_kv_cache_word_bytes(ctypes.byref(a))


class Impl:
    """One implementation under test: ``public(kv_cache, ...)`` takes the public op's layouts,
    ``op(caches, ...)`` the native op's list; both with validation off."""

    def __init__(self, name, device, lib=None):
        self.name, self.device, self.lib = name, torch.device(device), lib
        self.last = None  # emulation: (form, word bytes) of the last call

    def op(self, caches, seqlens, indices, counts, **launch):
        if self.lib is None:
            torch.ops.specdec_native.compact_kv_cache(
                caches, seqlens.to(self.device), indices.to(self.device), counts.to(self.device), False
            )
        else:
            self.last = emulate_cuda(self.lib, caches, seqlens, indices, counts, **launch)

    def public(self, kv_cache, seqlens, indices, counts, **launch):
        if self.lib is None:
            sk.compact_kv_cache(
                kv_cache, seqlens.to(self.device), indices.to(self.device), counts.to(self.device), backend="native"
            )
        else:
            check_compact_kv_cache_args(kv_cache, seqlens, indices, counts)  # valid input only
            self.op(as_cache_list(kv_cache), seqlens, indices, counts, **launch)


@pytest.fixture(params=[pytest.param("native", marks=native), "cuda_emulated"])
def impl(request, device):
    if request.param == "native":
        return Impl("native", device)
    return Impl("cuda_emulated", "cpu", request.getfixturevalue("emulator"))


# --------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("counts", ["ragged", "zero", "full"])
@pytest.mark.parametrize("head_dim", [64, 67, 128], ids=["D64", "D67", "D128"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["buffer", "layers"])
def test_matches_reference_random_trees(impl, layout, dtype, head_dim, counts):
    L, B, Hkv, S, M = 2, 3, 2, 40, 6
    cache = random_cache((L, 2, B, Hkv, S, head_dim), dtype, seed=head_dim, device=impl.device)
    seqlens, indices, n = random_tree_paths(B, M, S, seed=7 + head_dim, counts=counts)
    want = expected_after(cache, seqlens, indices, n)
    arg, gather = make_layout(cache.clone(), layout)
    impl.public(arg, seqlens, indices, n)
    assert same_bytes(gather(), want)
    if impl.name == "cuda_emulated" and layout == "buffer":  # aligned rows: the widest word that divides them
        row = head_dim * cache.element_size()
        assert impl.last == (1, next(w for w in (16, 8, 4, 2, 1) if row % w == 0))


# How the CUDA binding describes each layout: 1 = one base and strides, 0 = a table.
LAYOUT_FORM = {
    "buffer": 1,
    "views": 1,
    "pairs": None,
    "layers": None,
    "kv_major": 1,
    "padded_slots": 1,
    "mixed_strides": 0,
}


@pytest.mark.parametrize("layout", list(LAYOUT_FORM))
def test_layouts(impl, layout):
    L, B, Hkv, S, D, M = 3, 4, 2, 30, 64, 5  # batch 4 with ragged counts
    cache = random_cache((L, 2, B, Hkv, S, D), torch.float16, seed=3, device=impl.device)
    seqlens, indices, n = random_tree_paths(B, M, S, seed=11)
    want = expected_after(cache, seqlens, indices, n)
    arg, gather = make_layout(cache.clone(), layout)
    impl.public(arg, seqlens, indices, n)
    assert same_bytes(gather(), want)
    if impl.name == "cuda_emulated" and LAYOUT_FORM[layout] is not None:  # clones may land anywhere
        assert impl.last[0] == LAYOUT_FORM[layout]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_index_dtypes_and_strided_index_tensors(impl, index_dtype):
    L, B, Hkv, S, D, M = 1, 3, 1, 24, 16, 4
    cache = random_cache((L, 2, B, Hkv, S, D), torch.float32, seed=5, device=impl.device)
    seqlens, indices, n = random_tree_paths(B, M, S, seed=13)
    want = expected_after(cache, seqlens, indices, n)
    # accepted_indices with column stride 2, num_accepted with stride 2, made on the device
    # (moving a strided tensor to another device would make it contiguous)
    wide = torch.full((B, 2 * M), 99, dtype=index_dtype, device=impl.device)
    wide[:, ::2] = indices.to(index_dtype)
    every_other = torch.full((2 * B,), 77, dtype=index_dtype, device=impl.device)
    every_other[::2] = n.to(index_dtype)
    assert wide[:, ::2].stride() == (2 * M, 2) and every_other[::2].stride() == (2,)
    got = cache.clone()
    impl.public(got, seqlens.to(index_dtype), wide[:, ::2], every_other[::2])
    assert same_bytes(got, want)


def test_overlap_hazard(impl):
    # seq 0: [0, 2, 3] after 1 slot: slot 1 stays, 3 -> 2, 4 -> 3 (slot 3 is read, then written);
    # seq 1: [1, 2, 3, 5] after 2: 3 -> 2, 4 -> 3, 5 -> 4, 7 -> 5: each source but the last is the
    # destination of the row before it, so a kernel that writes before reading corrupts it.
    L, B, Hkv, S, D = 2, 2, 3, 10, 5
    cache = torch.arange(L * 2 * B * Hkv * S * D, dtype=torch.float32).reshape(L, 2, B, Hkv, S, D).to(impl.device)
    seqlens, indices, n = torch.tensor([1, 2]), torch.tensor([[0, 2, 3, -1], [1, 2, 3, 5]]), torch.tensor([3, 4])
    want = expected_after(cache, seqlens, indices, n)
    got = cache.clone()
    impl.public(got, seqlens, indices, n)
    assert same_bytes(got, want)
    # by hand: sequence 1 of layer 1's values, head 2: slots 2..5 hold the old slots 3, 4, 5, 7
    for i, src in enumerate([3, 4, 5, 7]):
        assert torch.equal(got[1, 1, 1, 2, 2 + i], cache[1, 1, 1, 2, src])
    assert torch.equal(got[:, :, 0, :, 2:4], cache[:, :, 0, :, 3:5])
    assert torch.equal(got[:, :, 1, :, 6:], cache[:, :, 1, :, 6:])  # nothing past the block moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8], ids=["fp32", "fp16", "u8"])
def test_long_paths_span_many_chunks(impl, dtype):
    # Paths longer than one CUDA chunk (a block moves a chunk of words, then the next), with
    # D = 67 so chunk boundaries fall inside rows.
    B, Hkv, S, D, M = 2, 2, 160, 67, 48
    cache = random_cache((1, 2, B, Hkv, S, D), dtype, seed=17, device=impl.device)
    g = torch.Generator().manual_seed(2)
    indices = (torch.arange(M) + torch.randint(0, 2, (B, M), generator=g).cumsum(1)).contiguous()
    seqlens, n = torch.tensor([0, 9]), torch.tensor([M, M - 5])
    want = expected_after(cache, seqlens, indices, n)
    got = cache.clone()
    impl.public(got, seqlens, indices, n)
    assert same_bytes(got, want)


@pytest.mark.parametrize(
    "threads,blocks", [(32, 0), (64, 0), (32, 3), (128, 1)], ids=["t32", "t64", "t32_b3", "t128_b1"]
)
@pytest.mark.parametrize("head_dim", [8, 40, 67], ids=["D8", "D40", "D67"])
def test_emulated_kernel_with_other_launch_shapes(emulator, threads, blocks, head_dim):
    # Narrower blocks (more chunks per slice) and fewer blocks than slices (the grid-stride
    # loop) must give the same result as the launcher's own configuration.  A thread's next
    # word lies whole rows on (D8: one 16-byte word a row), rows and columns on (D40: 5 words
    # a row) or columns on (D67: 67 2-byte words, more than 32 threads).
    L, B, Hkv, S, M = 2, 3, 2, 120, 40
    cache = random_cache((L, 2, B, Hkv, S, head_dim), torch.float16, seed=19, device="cpu")
    g = torch.Generator().manual_seed(3)
    indices = (torch.arange(M) + torch.randint(0, 3, (B, M), generator=g).cumsum(1)).contiguous()
    seqlens, n = torch.tensor([0, 2, 1]), torch.tensor([M, 17, 0])
    want = expected_after(cache, seqlens, indices, n)
    got = cache.clone()
    emulate_cuda(emulator, [got], seqlens, indices, n, threads=threads, blocks=blocks)
    assert same_bytes(got, want)


@pytest.mark.parametrize("offset,word", [(1, 2), (2, 4), (4, 8), (8, 16)], ids=["off1", "off2", "off4", "off8"])
def test_misaligned_base(impl, offset, word):
    # The cache starts `offset` fp16 elements into its allocation: D = 64 rows would allow
    # 16-byte words, the base only allows `word` bytes.
    L, B, Hkv, S, D, M = 1, 2, 2, 20, 64, 4
    src = random_cache((L, 2, B, Hkv, S, D), torch.float16, seed=23, device=impl.device)
    seqlens, indices, n = random_tree_paths(B, M, S, seed=29)
    want = expected_after(src, seqlens, indices, n)
    flat = torch.zeros(src.numel() + 16, dtype=src.dtype, device=impl.device)
    view = flat[offset : offset + src.numel()].view(src.shape)
    view.copy_(src)
    impl.public(view, seqlens, indices, n)
    assert same_bytes(view, want)
    assert same_bytes(flat[:offset], torch.zeros(offset, dtype=src.dtype))
    assert same_bytes(flat[offset + src.numel() :], torch.zeros(16 - offset, dtype=src.dtype))
    if impl.name == "cuda_emulated":
        assert flat.data_ptr() % 16 == 0 and impl.last == (1, word)


def test_identity_and_empty_change_nothing(impl):
    cache = random_cache((2, 2, 3, 2, 12, 8), torch.bfloat16, seed=31, device=impl.device)
    got = cache.clone()
    seqlens = torch.tensor([0, 4, 11])
    impl.public(got, seqlens, torch.tensor([[0, 1, 2], [0, 1, 2], [0, -1, -1]]), torch.tensor([3, 2, 1]))
    impl.public(got, seqlens, torch.tensor([[5, 6, 7]] * 3), torch.tensor([0, 0, 0]))
    impl.public(got, seqlens, torch.zeros(3, 0, dtype=torch.int64), torch.tensor([0, 0, 0]))
    assert same_bytes(got, cache)


def test_batch_zero_is_a_no_op(impl):
    cache = torch.zeros(1, 2, 0, 2, 8, 4, device=impl.device)
    empty = torch.zeros(0, dtype=torch.int64)
    impl.public(cache, empty, torch.zeros(0, 3, dtype=torch.int64), empty)


@native
def test_native_strided_head_dim_on_cpu():
    # The CPU kernel follows any strides: here every other element of a wider last dim.
    L, B, Hkv, S, D, M = 1, 2, 2, 16, 9, 3
    wide = random_cache((L, 2, B, Hkv, S, 2 * D), torch.float32, seed=37, device="cpu")
    seqlens, indices, n = random_tree_paths(B, M, S, seed=41)
    want = wide.clone()
    want_view = want[..., ::2]
    views = [want_view[0, kv].contiguous() for kv in range(2)]
    reference.compact_kv_cache(views, seqlens, indices, n)
    for kv in range(2):
        want_view[0, kv] = views[kv]
    got = wide.clone()
    sk.compact_kv_cache([got[..., ::2][0, kv] for kv in range(2)], seqlens, indices, n, backend="native")
    assert same_bytes(got, want)  # the odd elements (not part of the cache) are untouched too


# --------------------------------------------------------------------------- no stray writes


# One bad sequence per case (validate=False): (sequence, what is wrong with it).
OUT_OF_RANGE = {
    "beyond_capacity": (1, dict(index=(3, 12))),  # slot 5 + 12 >= S
    "negative_index": (0, dict(index=(1, -9))),  # slot 2 - 9 < 0
    "huge_index": (2, dict(row=[2**62, 2**63 - 1, -(2**63), 3])),  # wrap around in 64 bits
    "negative_seqlen": (0, dict(seqlen=-3)),
    "seqlen_past_capacity": (2, dict(seqlen=12 + 100)),
    "count_above_M": (1, dict(count=4 + 50)),
    "negative_count": (0, dict(count=-4)),
    "not_increasing": (0, dict(row=[3, 1, 0, 0])),
}


@pytest.mark.parametrize("alloc", ["guarded", "exact"])
@pytest.mark.parametrize("case", list(OUT_OF_RANGE), ids=list(OUT_OF_RANGE))
def test_out_of_range_values_never_leave_the_cache(impl, case, alloc):
    """validate=False with bad values in one sequence: no byte outside the caches changes, the
    valid sequences are compacted exactly, and of the bad sequence only its own destination
    slots seqlens[b] + i, i < min(count, M), may change (to unspecified values).

    ``guarded``: the caches are views into a bigger buffer with guard slots around every row
    block and guard caches before and after, compared byte for byte.  ``exact``: each cache is
    its own allocation, so that compute-sanitizer memcheck (scripts/compute_sanitizer.sh, with
    PyTorch's caching allocator off) flags any access past it.
    """
    num_caches, B, Hkv, S, D, M, guard = 4, 3, 2, 12, 6, 4, 5
    buf = random_cache((num_caches + 2, B, Hkv, S + 2 * guard, D), torch.float32, seed=43, device=impl.device)
    if alloc == "guarded":
        views = [buf[1 + c, :, :, guard : guard + S] for c in range(num_caches)]
    else:
        views = [buf[1 + c, :, :, guard : guard + S].clone() for c in range(num_caches)]
    seqlens = torch.tensor([2, 5, 8])
    indices = torch.tensor([[0, 2, 3, 6], [1, 2, 4, 5], [1, 2, 3, -1]])
    counts = torch.tensor([4, 4, 3])
    bad, what = OUT_OF_RANGE[case]
    valid_counts = counts.clone()
    valid_counts[bad] = 0
    want = [v.cpu().clone() for v in views]
    reference.compact_kv_cache(want, seqlens, indices, valid_counts)  # the valid sequences only
    spoil(bad, what, seqlens, indices, counts)
    before = buf.cpu().clone()
    impl.op(views, seqlens, indices, counts)
    if alloc == "guarded":
        after = buf.cpu()
        # outside the caches: the guard caches before and after, and the guard slots of each row
        assert same_bytes(after[0], before[0]) and same_bytes(after[-1], before[-1])
        assert same_bytes(after[:, :, :, :guard], before[:, :, :, :guard])
        assert same_bytes(after[:, :, :, guard + S :], before[:, :, :, guard + S :])
    # inside: everything but the bad sequence's destination slots equals the reference
    lo = int(seqlens[bad])
    hi = lo + max(0, min(int(counts[bad]), M))
    free = torch.zeros(B, S, dtype=torch.bool)
    free[bad, max(lo, 0) : max(min(hi, S), 0)] = True
    for c in range(num_caches):
        got = views[c].cpu()
        assert same_bytes(got.transpose(1, 2)[~free], want[c].transpose(1, 2)[~free]), c


# --------------------------------------------------------------------------- bad input


def good_args(device):
    return dict(
        kv_cache=torch.zeros(2, 2, 1, 2, 8, 4, device=device),
        cache_seqlens=torch.tensor([3], device=device),
        accepted_indices=torch.tensor([[0, 2]], device=device),
        num_slots=torch.tensor([2], device=device),
    )


PUBLIC_BAD = {
    "not_increasing": (dict(accepted_indices=[[2, 2]]), ValueError, "strictly increasing"),
    "below_position": (dict(accepted_indices=[[0, 0]]), ValueError, ">= i"),
    "beyond_capacity": (dict(accepted_indices=[[0, 5]]), ValueError, "capacity S=8"),
    "layer_shapes": (dict(kv_cache="shapes"), ValueError, "kv_cache[1]"),
    "layer_dtypes": (dict(kv_cache="dtypes"), TypeError, "kv_cache[1]"),
    "wrong_device": (dict(cache_seqlens="meta"), ValueError, "cache_seqlens must be on"),
}


@native
@pytest.mark.parametrize("case", list(PUBLIC_BAD), ids=list(PUBLIC_BAD))
def test_public_op_rejects_bad_input_on_native(device, case):
    args = good_args(device)
    override, err, msg = PUBLIC_BAD[case]
    for k, v in override.items():
        if k == "kv_cache":
            other = (
                torch.zeros(1, 2, 9, 4, device=device)
                if v == "shapes"
                else torch.zeros(1, 2, 8, 4, dtype=torch.float16, device=device)
            )
            args[k] = [torch.zeros(1, 2, 8, 4, device=device), other]
        elif v == "meta":
            args[k] = args[k].to("meta")
        else:
            args[k] = torch.tensor(v, device=device)
    with pytest.raises(err, match=re.escape(msg)):
        sk.compact_kv_cache(**args, backend="native", validate=True)


def native_args(device, **override):
    args = dict(
        caches=[torch.zeros(2, 2, 1, 2, 8, 4, device=device)],
        cache_seqlens=torch.tensor([3], device=device),
        accepted_indices=torch.tensor([[0, 2]], device=device),
        num_accepted=torch.tensor([2], device=device),
    )
    args.update(override)
    return args


def _expanded(device):
    return [torch.zeros(1, 2, 1, 4, device=device).expand(1, 2, 8, 4)]


NATIVE_BAD = {
    "not_increasing": (dict(accepted_indices=[[2, 2]]), ValueError, "strictly increasing"),
    "below_position": (dict(accepted_indices=[[0, 0]]), ValueError, ">= i"),
    "beyond_capacity": (dict(accepted_indices=[[0, 5]]), ValueError, "capacity S=8"),
    "negative_seqlen": (dict(cache_seqlens=[-1]), ValueError, "cache_seqlens must be >= 0"),
    "count_range": (dict(num_accepted=[3]), ValueError, "num_accepted must lie in 0..2"),
    "no_caches": (dict(caches=[]), ValueError, "at least one"),
    "cache_rank": (dict(caches=lambda d: [torch.zeros(2, 8, 4, device=d)]), ValueError, "caches[0] must be"),
    "layer_shapes": (
        dict(caches=lambda d: [torch.zeros(1, 2, 8, 4, device=d), torch.zeros(1, 2, 9, 4, device=d)]),
        ValueError,
        "caches[1] must end in",
    ),
    "layer_dtypes": (
        dict(caches=lambda d: [torch.zeros(1, 2, 8, 4, device=d), torch.zeros(1, 2, 8, 4, device=d).half()]),
        TypeError,
        "caches[1] must have the dtype",
    ),
    "not_kv_pairs": (
        dict(caches=lambda d: [torch.zeros(2, 3, 1, 2, 8, 4, device=d)]),
        ValueError,
        "[L, 2, B, Hkv, S, D]",
    ),
    "aliasing": (dict(caches=lambda d: [torch.zeros(1, 2, 8, 4, device=d)] * 2), ValueError, "must not alias"),
    "self_overlap": (dict(caches=_expanded), ValueError, "overlaps itself"),
    "index_dtype": (dict(accepted_indices=[[0.0, 2.0]]), TypeError, "accepted_indices must have dtype int32 or int64"),
    "seqlens_shape": (dict(cache_seqlens=[1, 2]), ValueError, "cache_seqlens must have shape (1,)"),
}


@native
@pytest.mark.parametrize("case", list(NATIVE_BAD), ids=list(NATIVE_BAD))
def test_native_op_rejects_bad_input(device, case):
    override, err, msg = NATIVE_BAD[case]
    args = native_args(device)
    for k, v in override.items():
        if callable(v):
            args[k] = v(device)
        elif k == "caches":
            args[k] = v
        else:
            args[k] = torch.tensor(v, device=device)
    snapshot = [t.clone() for t in args["caches"]]
    with pytest.raises(err, match=re.escape(msg)):
        torch.ops.specdec_native.compact_kv_cache(**args, validate=True)
    assert all(torch.equal(a, b) for a, b in zip(args["caches"], snapshot))  # nothing moved


# --------------------------------------------------------------------------- registration


@native
@pytest.mark.parametrize("layout", ["buffer", "layers"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_opcheck(device, layout, index_dtype):
    assert op_module.register_fake()
    cache = random_cache((2, 2, 2, 2, 10, 67), torch.float16, seed=47, device=device)
    caches = [cache] if layout == "buffer" else [cache[l, kv].clone() for l in range(2) for kv in range(2)]
    seqlens, indices, n = (
        t.to(index_dtype).to(device)
        for t in (torch.tensor([1, 3]), torch.tensor([[0, 2, 3], [1, 2, 5]]), torch.tensor([3, 2]))
    )
    torch.library.opcheck(torch.ops.specdec_native.compact_kv_cache.default, (caches, seqlens, indices, n, False))


@native
def test_fake_checks_shapes(device):
    assert op_module.register_fake()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        caches = [torch.empty(1, 2, 3, 2, 8, 4, device=device)]
        bad_seqlens = torch.empty(2, dtype=torch.int64, device=device)
        idx = torch.empty(3, 2, dtype=torch.int64, device=device)
        n = torch.empty(3, dtype=torch.int64, device=device)
        torch.ops.specdec_native.compact_kv_cache(caches, torch.empty(3, dtype=torch.int64, device=device), idx, n)
        with pytest.raises(RuntimeError, match="cache_seqlens must have 3 rows"):
            torch.ops.specdec_native.compact_kv_cache(caches, bad_seqlens, idx, n)


def test_missing_native_op_falls_back_to_reference_with_one_warning(monkeypatch):
    # What a SPECDEC_SKIP_EXTENSION=1 install sees: no kernel for the op.
    monkeypatch.setattr(_native, "has_kernel", lambda name, device_type: False)
    monkeypatch.setattr(_native, "_warned", set())
    monkeypatch.delenv("SPECDEC_BACKEND", raising=False)
    sk.reset_backends()  # the choice is made once per process
    cache = random_cache((1, 2, 2, 1, 8, 4), torch.float32, seed=53, device="cpu")
    args = (torch.tensor([1, 0]), torch.tensor([[0, 2], [1, 3]]), torch.tensor([2, 2]))
    want = expected_after(cache, *args)
    with pytest.warns(RuntimeWarning, match="specdec_native::compact_kv_cache is unavailable"):
        sk.compact_kv_cache(cache, *args)
    assert torch.equal(cache, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        sk.compact_kv_cache(cache.clone(), *args)
    with pytest.raises(ValueError, match="backend='native' cannot run compact_kv_cache"):
        sk.compact_kv_cache(cache, *args, backend="native")


# --------------------------------------------------------------------------- CUDA only


@pytest.mark.requires_cuda
@native
def test_cuda_rejects_strided_head_dim():
    wide = torch.zeros(1, 2, 1, 1, 8, 8, device="cuda")
    with pytest.raises(ValueError, match="last dimension"):
        torch.ops.specdec_native.compact_kv_cache([wide[..., ::2]], *one_slot_move("cuda"))


@pytest.mark.requires_cuda
@native
@pytest.mark.parametrize("where", ["cache_seqlens", "accepted_indices", "num_accepted"])
def test_cuda_rejects_index_tensors_on_another_device(where):
    args = native_args("cuda")
    args[where] = args[where].cpu()
    with pytest.raises(ValueError, match=f"{where} must be on cuda"):
        torch.ops.specdec_native.compact_kv_cache(**args)


@pytest.mark.requires_cuda
@native
def test_cuda_graph_capture_of_one_buffer():
    L, B, Hkv, S, D, M = 2, 3, 2, 32, 64, 5
    cache = random_cache((L, 2, B, Hkv, S, D), torch.bfloat16, seed=59, device="cuda")
    seqlens, indices, n = (t.cuda() for t in random_tree_paths(B, M, S, seed=61))
    want = expected_after(cache, seqlens, indices, n)
    got = cache.clone()
    capture_and_replay(lambda: torch.ops.specdec_native.compact_kv_cache([got], seqlens, indices, n, False), got, cache)
    assert same_bytes(got, want)
    layers, _ = make_layout(cache.clone(), "mixed_strides")  # unequal strides: the table form
    with pytest.raises(RuntimeError, match="CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.ops.specdec_native.compact_kv_cache(layers, seqlens, indices, n, False)
