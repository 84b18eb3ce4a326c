"""tree_attention fast paths ("triton", "torch") against the float64 reference.

Triton runs in the interpreter on CPU (TRITON_INTERPRET=1, set by conftest) and on the GPU
when there is one.  Expected values come from the reference on the same inputs upcast to
fp32 (exact), so its float64 result is rounded once, to fp32, and the tolerance table of
tests/utils applies to the fast path's own error (no scale factor).
"""

import re

import pytest
import torch

import specdec_kernels
from specdec_kernels import _backend
from specdec_kernels.ops import tree_attention as ta_ops
from specdec_kernels.ops.tree_attention import choose_num_splits, pack_tree_mask, tree_attention, unpack_tree_mask
from specdec_kernels.reference.tree_attention import tree_attention as reference_tree_attention
from specdec_kernels.tree import ancestor_mask, path_to
from tests.utils import assert_close, each_dtype, runnable_backends

FAST = [b for b in runnable_backends("tree_attention") if b != "reference"]
ALL = runnable_backends("tree_attention")


def random_parents(N, gen):
    """A random token tree in topological order: parents[i] uniform in 0..i-1."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, N)]


def make_inputs(B, N, H, Hkv, S, D, lens, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, H, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    return q.to(device), k.to(device), v.to(device), seqlens.to(device)


def expected(q, k, v, seqlens, mask=None, **kw):
    """The reference (float64 inside) on the same values in fp32, on CPU."""
    mask = (
        None
        if mask is None
        else (unpack_tree_mask(mask.cpu(), q.shape[1]) if mask.dtype == torch.int32 else mask.cpu())
    )
    return reference_tree_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), seqlens.cpu(), mask, **kw)


def tree_mask_for(kind, B, N, seed, device):
    g = torch.Generator().manual_seed(seed)
    if kind == "causal":
        return None
    if kind == "shared":
        return ancestor_mask(random_parents(N, g)).to(device)
    if kind == "per_seq":
        return ancestor_mask(torch.tensor([random_parents(N, g) for _ in range(B)])).to(device)
    if kind == "packed":
        return pack_tree_mask(ancestor_mask(torch.tensor([random_parents(N, g) for _ in range(B)]))).to(device)
    raise ValueError(kind)


# ---------------------------------------------------------------------------------------
# parity with the reference
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [16, 64, 80, 128], ids=lambda d: f"d{d}")
@each_dtype
@pytest.mark.parametrize("backend", FAST)
def test_parity_per_dtype_and_head_dim(device, backend, dtype, D):
    # GQA 9/3, ragged lengths including 0, a random tree per sequence
    B, N, H, Hkv, S = 3, 11, 9, 3, 96
    q, k, v, lens = make_inputs(B, N, H, Hkv, S, D, [0, 37, 85], dtype, device, seed=D)
    mask = tree_mask_for("per_seq", B, N, seed=D, device=device)
    out = tree_attention(q, k, v, lens, mask, backend=backend)
    assert out.dtype == dtype and out.shape == (B, N, H, D) and out.device.type == device.type
    assert_close(out, expected(q, k, v, lens, mask), dtype)


CASES = {
    # name: B, N, H, Hkv, S, lens, mask kind
    "decode_n1_gqa9-3": (1, 1, 9, 3, 100, [77], "causal"),
    "decode_n1_b3_ragged": (3, 1, 8, 2, 70, [69, 0, 12], "causal"),
    "chain_n5_gqa4-1": (2, 5, 4, 1, 64, [10, 59], "causal"),
    "chain_n70_gqa4-1_row_tiles": (1, 70, 4, 1, 100, [30], "causal"),
    "tree_n13_shared_mha8-8": (3, 13, 8, 8, 150, [0, 37, 120], "shared"),
    "tree_n9_per_seq_equal_lens": (2, 9, 6, 2, 50, [30, 30], "per_seq"),
    "tree_n33_packed_gqa9-3": (2, 33, 9, 3, 128, [95, 4], "packed"),
    "tree_n40_per_seq_gqa4-1": (1, 40, 4, 1, 256, [216], "per_seq"),
    "tree_n128_shared_gqa4-2": (1, 128, 4, 2, 200, [60], "shared"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("backend", FAST)
def test_parity_shapes(device, backend, case):
    B, N, H, Hkv, S, lens, kind = CASES[case]
    dtype = torch.float16
    q, k, v, seqlens = make_inputs(B, N, H, Hkv, S, 64, lens, dtype, device, seed=N)
    mask = tree_mask_for(kind, B, N, seed=N, device=device)
    out = tree_attention(q, k, v, seqlens, mask, backend=backend)
    assert_close(out, expected(q, k, v, seqlens, mask), dtype)


@pytest.mark.parametrize("H,Hkv", [(9, 3), (4, 1), (8, 8)], ids=["gqa9-3", "gqa4-1", "mha8-8"])
@pytest.mark.parametrize("backend", FAST)
def test_gqa_ratios_fp32(device, backend, H, Hkv):
    B, N, S, D = 2, 6, 48, 32
    q, k, v, lens = make_inputs(B, N, H, Hkv, S, D, [41, 0], torch.float32, device, seed=H)
    mask = tree_mask_for("shared", B, N, seed=H, device=device)
    assert_close(tree_attention(q, k, v, lens, mask, backend=backend), expected(q, k, v, lens, mask), torch.float32)


@pytest.mark.parametrize("backend", FAST)
def test_non_contiguous_views_and_sm_scale(device, backend):
    # the engine's layout: K and V are views into one [L, 2, B, Hkv, S, D] cache, q comes out
    # of a fused projection; an explicit softmax scale and int64 cache_seqlens
    B, N, H, Hkv, S, D = 2, 7, 6, 2, 40, 32
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(3, 2, B, Hkv, S, D, generator=g).to(device)
    qkv = torch.randn(B, N, H + 2 * Hkv, D, generator=g).to(device)
    q, k, v = qkv[:, :, :H], kv[1, 0], kv[1, 1]
    lens = torch.tensor([20, 33], dtype=torch.int64, device=device)
    mask = tree_mask_for("shared", B, N, seed=5, device=device)
    out = tree_attention(q, k, v, lens, mask, sm_scale=0.3, backend=backend)
    assert_close(out, expected(q, k, v, lens, mask, sm_scale=0.3), torch.float32)


@pytest.mark.parametrize("backend", FAST)
def test_single_query_with_its_own_key_masked_sees_only_the_prefix(device, backend):
    # an explicit [1, 1] mask that hides the new key is not the plain-decoding fast case
    q, k, v, lens = make_inputs(2, 1, 6, 3, 30, 16, [20, 20], torch.float32, device, seed=1)
    mask = torch.zeros(1, 1, dtype=torch.bool, device=device)
    out = tree_attention(q, k, v, lens, mask, backend=backend)
    assert_close(out, expected(q, k, v, lens, mask), torch.float32)


# ---------------------------------------------------------------------------------------
# properties: tree path = causal chain; mask None = causal chain
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend", FAST)
def test_each_node_equals_causal_attention_over_its_path(device, backend, dtype):
    g = torch.Generator().manual_seed(3)
    N, H, Hkv, D, L, S = 12, 9, 3, 64, 21, 40
    parents = random_parents(N, g)
    q, k, v, lens = make_inputs(1, N, H, Hkv, S, D, [L], dtype, device, seed=3)
    out = tree_attention(q, k, v, lens, ancestor_mask(parents).to(device), backend=backend)
    for node in range(N):
        path = path_to(parents, node)
        slots = torch.tensor(list(range(L)) + [L + j for j in path])
        # the node as a plain decoding query at the end of the gathered chain
        chain = reference_tree_attention(
            q[:, node : node + 1].float().cpu(),
            k[:, :, slots].float().cpu(),
            v[:, :, slots].float().cpu(),
            torch.tensor([len(slots) - 1], dtype=torch.int32),
        )
        assert_close(out[:, node], chain[:, 0], dtype)


@pytest.mark.parametrize("backend", FAST)
def test_mask_none_equals_causal_attention_over_prefix_and_chain(device, backend):
    B, N, H, Hkv, S, D = 2, 9, 4, 2, 60, 32
    q, k, v, lens = make_inputs(B, N, H, Hkv, S, D, [30, 0], torch.float32, device, seed=9)
    out = tree_attention(q, k, v, lens, None, backend=backend)
    for b, L in enumerate(lens.tolist()):
        for i in range(N):
            # query i alone sees slots 0 .. L + i
            one = reference_tree_attention(
                q[b : b + 1, i : i + 1].cpu(),
                k[b : b + 1].cpu(),
                v[b : b + 1].cpu(),
                torch.tensor([L + i], dtype=torch.int32),
            )
            assert_close(out[b, i], one[0, 0], torch.float32)
    chain_mask = ancestor_mask(list(range(-1, N - 1))).to(device)
    assert_close(tree_attention(q, k, v, lens, chain_mask, backend=backend), out, torch.float32)


# ---------------------------------------------------------------------------------------
# flash-decoding splits
# ---------------------------------------------------------------------------------------


def few_keys_per_split(monkeypatch):
    """Let a split hold as few keys as one key tile (``min_split_keys=1``), so that the short
    prefixes of these tests run several splits (by default a split holds 256 keys at least)."""
    from functools import partial

    from specdec_kernels.ops._triton import tree_attention as kernels

    monkeypatch.setattr(kernels, "launch_config", partial(kernels.launch_config, min_split_keys=1))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("kind", ["causal", "per_seq", "packed"])
def test_forced_splits(device, kind, num_splits, monkeypatch):
    if "triton" not in FAST:
        pytest.skip("num_splits is a Triton-backend parameter and triton is not runnable here")
    few_keys_per_split(monkeypatch)
    # 7 splits of a 150-key prefix leave some splits empty; the empty prefix (length 0) too
    B, N, H, Hkv, S, D = 3, 6, 6, 2, 160, 48
    q, k, v, lens = make_inputs(B, N, H, Hkv, S, D, [150, 0, 65], torch.float32, device, seed=num_splits)
    mask = tree_mask_for(kind, B, N, seed=num_splits, device=device)
    out = tree_attention(q, k, v, lens, mask, num_splits=num_splits, backend="triton")
    assert_close(out, expected(q, k, v, lens, mask), torch.float32)


def test_forced_splits_with_several_row_tiles(device, monkeypatch):
    if "triton" not in FAST:
        pytest.skip("num_splits is a Triton-backend parameter and triton is not runnable here")
    few_keys_per_split(monkeypatch)
    B, N, H, Hkv, S, D = 1, 45, 8, 2, 120, 32  # G * N = 180 query rows: several row tiles
    q, k, v, lens = make_inputs(B, N, H, Hkv, S, D, [70], torch.float16, device, seed=45)
    for mask in (None, tree_mask_for("shared", B, N, seed=45, device=device)):
        out = tree_attention(q, k, v, lens, mask, num_splits=3, backend="triton")
        assert_close(out, expected(q, k, v, lens, mask), torch.float16)


def test_split_heuristic(monkeypatch):
    # without a GPU the CUDA branch runs on a fake SM count; the device object needs no GPU
    from specdec_kernels import _device

    monkeypatch.setattr(_device, "_cuda_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert choose_num_splits(1, 3, 1, 3, 4096, 64, torch.device("cpu")) == 1
    one_seq = choose_num_splits(1, 3, 1, 3, 4096, 64, cuda)  # 3 programs for 132 SMs
    assert 1 < one_seq <= 4096 // 256
    assert choose_num_splits(1, 3, 1, 3, 300, 64, cuda) == 1  # too short to split
    assert choose_num_splits(64, 8, 1, 4, 4096, 128, cuda) == 1  # 512 programs fill the GPU
    assert choose_num_splits(2, 8, 1, 4, 32768, 128, cuda) == triton_cdiv(2 * 132, 16)


def triton_cdiv(a, b):
    return -(-a // b)


# ---------------------------------------------------------------------------------------
# bit-packed masks
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("N", [1, 5, 31, 32, 33, 70], ids=lambda n: f"n{n}")
def test_pack_unpack_roundtrip(N):
    g = torch.Generator().manual_seed(N)
    mask = torch.rand(2, N, N, generator=g) < 0.4
    packed = pack_tree_mask(mask)
    assert packed.dtype == torch.int32 and packed.shape == (2, N, (N + 31) // 32)
    assert torch.equal(unpack_tree_mask(packed, N), mask)
    assert torch.equal(pack_tree_mask(mask[0]), packed[0])
    for i, j in [(0, 0), (N - 1, N - 1), (N // 2, N // 3)]:
        bit = (int(packed[1, i, j // 32]) >> (j % 32)) & 1
        assert bit == int(mask[1, i, j])


def test_pack_tree_mask_example_and_errors():
    assert pack_tree_mask(torch.ones(3, 3, dtype=torch.bool).tril()).tolist() == [[1], [3], [7]]
    full = pack_tree_mask(torch.ones(32, 32, dtype=torch.bool))
    assert int(full[0, 0]) == -1  # all 32 bits set, two's complement
    with pytest.raises(TypeError, match="mask"):
        pack_tree_mask(torch.ones(3, 3))
    with pytest.raises(ValueError, match="mask"):
        pack_tree_mask(torch.ones(3, 4, dtype=torch.bool))


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per_seq"])
@pytest.mark.parametrize("backend", ALL)
def test_packed_mask_equals_bool_mask(device, backend, shared):
    B, N, H, Hkv, S, D = 2, 37, 4, 2, 80, 16
    q, k, v, lens = make_inputs(B, N, H, Hkv, S, D, [0, 40], torch.float32, device, seed=37)
    g = torch.Generator().manual_seed(37)
    mask = ancestor_mask(random_parents(N, g) if shared else torch.tensor([random_parents(N, g) for _ in range(B)]))
    packed = pack_tree_mask(mask)
    packed[..., -1] |= -(1 << 5)  # garbage in the padding bits (j >= 37) must be ignored
    out_bool = tree_attention(q, k, v, lens, mask.to(device), backend=backend)
    out_packed = tree_attention(q, k, v, lens, packed.to(device), backend=backend)
    assert torch.equal(out_bool, out_packed)


# ---------------------------------------------------------------------------------------
# registration, dispatch, bad input
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,num_splits", [(0, 1), (1, 1), (2, 2)], ids=["causal", "bool", "packed_split2"])
def test_opcheck(device, kind, num_splits):
    if "triton" not in FAST:
        pytest.skip("the Triton op needs CUDA or the interpreter")
    B, N, H, Hkv, S, D = 2, 5, 4, 2, 40, 16
    q, k, v, lens = make_inputs(B, N, H, Hkv, S, D, [3, 30], torch.float32, device)
    mask = ancestor_mask([-1, 0, 0, 1, 2]).to(device)
    mask = [None, mask, pack_tree_mask(mask)][kind]
    # the Triton launcher is no op of its own: the public op's Triton branch is what is checked
    torch.library.opcheck(
        torch.ops.specdec.tree_attention.default, (q, k, v, lens, mask, 0.25, num_splits), {"backend": "triton"}
    )


def test_automatic_choice(device, monkeypatch):
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    specdec_kernels.reset_backends()  # the choice is made once per process
    assert {"reference", "torch", "triton", "native"} <= set(ta_ops.IMPLEMENTED)
    # CUDA: Triton; CPU: the C++ kernel when built, else SDPA
    native = _backend._can_run("native", "tree_attention", device) is None
    want = "triton" if device.type == "cuda" else "native" if native else "torch"
    assert _backend.resolve("tree_attention", device, None, ta_ops.IMPLEMENTED) == want


def _good_args(device):
    q, k, v, lens = make_inputs(1, 2, 4, 2, 8, 16, [3], torch.float32, device)
    return dict(
        q=q, k_cache=k, v_cache=v, cache_seqlens=lens, tree_mask=torch.ones(2, 2, dtype=torch.bool, device=device)
    )


BAD = {
    "mask_size": (lambda a: dict(tree_mask=torch.ones(3, 3, dtype=torch.bool)), ValueError, "tree_mask"),
    "mask_batch": (lambda a: dict(tree_mask=torch.ones(2, 2, 2, dtype=torch.bool)), ValueError, "tree_mask"),
    "packed_size": (lambda a: dict(tree_mask=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "tree_mask"),
    "mask_dtype": (lambda a: dict(tree_mask=torch.ones(2, 2, dtype=torch.int64)), TypeError, "tree_mask"),
    "beyond_capacity": (
        lambda a: dict(cache_seqlens=torch.tensor([7], dtype=torch.int32)),
        ValueError,
        "cache_seqlens",
    ),
    "negative_seqlen": (
        lambda a: dict(cache_seqlens=torch.tensor([-1], dtype=torch.int32)),
        ValueError,
        "cache_seqlens",
    ),
    "head_dim_24": (
        lambda a: dict(q=torch.zeros(1, 2, 4, 24), k_cache=torch.zeros(1, 2, 8, 24), v_cache=torch.zeros(1, 2, 8, 24)),
        ValueError,
        "head dim",
    ),
    "head_dim_272": (
        lambda a: dict(
            q=torch.zeros(1, 2, 4, 272), k_cache=torch.zeros(1, 2, 8, 272), v_cache=torch.zeros(1, 2, 8, 272)
        ),
        ValueError,
        "head dim",
    ),
    "heads_not_multiple": (lambda a: dict(q=torch.zeros(1, 2, 3, 16)), ValueError, "multiple"),
    "capacity_below_n": (lambda a: dict(q=torch.zeros(1, 9, 4, 16), tree_mask=None), ValueError, "capacity"),
    "num_splits_zero": (lambda a: dict(num_splits=0), ValueError, "num_splits"),
    "num_splits_float": (lambda a: dict(num_splits=2.0), TypeError, "num_splits"),
}


# cases that only a read of tensor values finds: checked by default on CPU tensors, and on CUDA
# tensors only with validate=True (the default there reads no values: no host sync)
VALUE_CASES = {"beyond_capacity", "negative_seqlen"}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("backend", ALL)
def test_bad_input_raises_through_the_public_op(device, backend, case):
    args = _good_args(device)
    override, err, name = BAD[case]
    args.update(
        {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in override(args).items()}
    )
    validate = {"validate": True} if case in VALUE_CASES and device.type == "cuda" else {}
    with pytest.raises(err, match=re.escape(name)):
        tree_attention(**args, backend=backend, **validate)


@pytest.mark.parametrize(
    "seqlens", [[100_000_000, 2], [-100_000_000, 7], [7, -1]], ids=["huge", "very_negative", "one_past"]
)
@pytest.mark.parametrize(
    "backend",
    [b for b in FAST if b == "triton"] or [pytest.param("triton", marks=pytest.mark.skip(reason="no triton"))],
)
def test_unvalidated_bad_seqlens_never_read_outside_the_cache(device, backend, seqlens):
    """validate=False (the default on CUDA, no host sync) with cache_seqlens outside
    [0, S - N]: the kernel clamps them to that range, so it never loads a key or value outside
    the cache.  The cache is a view into a NaN-filled buffer: any load past it shows up as a
    NaN, and the result equals the reference on the clamped lengths."""
    B, N, H, Hkv, S, D = 2, 2, 4, 2, 8, 16
    q, k, v, _ = make_inputs(B, N, H, Hkv, S, D, [0] * B, torch.float32, device)
    bufs = []
    for t in (k, v):
        buf = torch.full((B, Hkv, 3 * S, D), float("nan"), device=device)
        buf[:, :, S : 2 * S] = t
        bufs.append(buf[:, :, S : 2 * S])
    k_view, v_view = bufs
    lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    mask = ancestor_mask([-1, 0]).to(device)
    out = tree_attention(q, k_view, v_view, lens, mask, backend=backend, validate=False)
    clamped = lens.clamp(0, S - N)
    assert not out.isnan().any()
    assert_close(out.float().cpu(), expected(q, k_view, v_view, clamped, mask), torch.float32)


@pytest.mark.parametrize("backend", [b for b in ALL if b != "triton"])
def test_meta_tensors_give_meta_outputs(backend):
    """Shape propagation without data (the meta device): the output's shape and dtype, no error."""
    m = "meta"
    q, k = torch.zeros(1, 2, 4, 16, device=m), torch.zeros(1, 2, 8, 16, device=m)
    out = tree_attention(q, k, k, torch.tensor([3], dtype=torch.int32, device=m), backend=backend)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == q.dtype
