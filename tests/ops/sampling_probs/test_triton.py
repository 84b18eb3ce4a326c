"""sampling_probs, Triton kernel: the kept set (top-k / top-p, ties included) equals the
reference's exactly, probabilities agree within float32 rounding, special rows, and the
torch.library registration (opcheck)."""

import pytest
import torch

from specdec_kernels.ops import sampling_probs as op
from specdec_kernels.reference.sampling_probs import sampling_probs as reference_sampling_probs
from tests.utils import TOLERANCES, each_dtype, gen, requires_triton

pytestmark = requires_triton("sampling_probs")

FP32 = TOLERANCES[torch.float32]


def kernel(logits, *args, **kwargs):
    return op.sampling_probs(logits, *args, backend="triton", **kwargs)


def to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def check(logits, device, temperature=1.0, top_k=None, top_p=None):
    """Kernel vs reference: same kept set (exactly), same values (float32 tolerance: the kernel
    computes from the same float32 inputs with its own exp and sums), rows summing to 1."""
    got = kernel(logits.to(device), to(temperature, device), to(top_k, device), to(top_p, device)).cpu()
    want = reference_sampling_probs(logits, temperature, top_k, top_p)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got > 0, want > 0), "kept sets differ"
    torch.testing.assert_close(got, want, equal_nan=True, **FP32)
    finite = ~got.isnan().any(-1)
    if finite.any():
        torch.testing.assert_close(got[finite].sum(-1), torch.ones_like(got[finite].sum(-1)), atol=1e-5, rtol=0)
    return got


SHAPES = [(1, 1), (3, 7), (8, 111), (1, 1000), (3, 2, 111), (8, 3, 7)]
SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.6": dict(temperature=0.6),
    "greedy": dict(temperature=0.0),
    "topk1": dict(top_k=1),
    "topk5": dict(temperature=0.6, top_k=5),
    "topk_ge_V": dict(top_k=5000),
    "topk0": dict(top_k=0),
    "topp0.9": dict(top_p=0.9),
    "topp0.3": dict(temperature=0.6, top_p=0.3),
    "topp1": dict(top_p=1.0),
    "topk5_topp0.8": dict(temperature=1.3, top_k=5, top_p=0.8),
}


@pytest.mark.parametrize("setting", list(SETTINGS), ids=list(SETTINGS))
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_matches_reference(device, shape, setting):
    logits = torch.randn(shape, generator=gen(sum(shape))) * 3
    check(logits, device, **SETTINGS[setting])


@each_dtype
def test_low_precision_logits(device, dtype):
    logits = (torch.randn(4, 2, 111, generator=gen(1)) * 4).to(dtype)  # bf16 rounding makes ties too
    for setting in (dict(temperature=0.7), dict(temperature=0.0), dict(top_k=9, top_p=0.7)):
        check(logits, device, **setting)


def test_per_sequence_parameters(device):
    B = 6
    logits = torch.randn(B, 3, 50, generator=gen(2)) * 2  # 3 rows per sequence share its values
    temperature = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 0.8])
    top_k = torch.tensor([0, 3, 7, 50, 1, 60], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.2, 0.7, 0.05])
    check(logits, device, temperature, top_k, top_p)
    check(logits[:, 0], device, temperature, top_k.long(), top_p)


def test_ties_at_the_top_k_boundary_are_kept(device):
    logits = torch.tensor(
        [[3.0, 2.0, 2.0, 2.0, 1.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [-0.0, 0.0, 1.0, -0.0, -1.0, 0.0]]
    )
    got = check(logits, device, top_k=2)
    assert (got[0] > 0).tolist() == [True, True, True, True, False, False]
    assert (got[1] > 0).all()  # all tied
    assert (got[2] > 0).tolist() == [True, True, True, True, False, True]  # -0.0 ties with +0.0


def test_ties_at_the_top_p_boundary_are_kept(device):
    # probabilities [.4, .2, .2, .2] (up to rounding): with top_p = 0.5 the nucleus needs the
    # second token, and every token tied with it comes along
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2], [0.5, 0.25, 0.125, 0.125]]))
    got = check(logits, device, top_p=0.5)
    assert (got[0] > 0).all()
    assert (got[1] > 0).tolist() == [True, False, False, False]  # mass before token 1 is 0.5, not < 0.5
    got = check(logits, device, top_p=0.51)
    assert (got[1] > 0).tolist() == [True, True, False, False]


@pytest.mark.parametrize("top_k", [1, 2, 37, 110, 111])
def test_top_k_keeps_exactly_k_distinct_values(device, top_k):
    logits = (torch.randperm(111, generator=gen(top_k)).float()[None] - 55.0) * 0.1  # no exp underflow
    got = check(logits, device, top_k=top_k)
    assert int((got > 0).sum()) == top_k


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")  # 5 / 1e-38, on purpose
def test_special_rows(device):
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [0.0, nan, 1.0, nan],  # NaN: a NaN row, or one-hot at the first NaN when greedy
            [inf, 0.0, 1.0, 2.0],  # +inf: one-hot at the first +inf (as the reference)
            [-inf, -inf, -inf, -inf],  # no finite logit: NaN row; greedy picks index 0
            [-inf, 1.0, -inf, 1.0],  # -inf carries no probability; greedy picks the first max
            [1e30, -1e30, 0.0, 5.0],  # huge logits, finite
        ]
    )
    for t in (1.0, 0.0, 1e-38):  # 1e-38: 5 / 1e-38 overflows to inf
        for k, p in ((None, None), (2, None), (None, 0.5), (1, 0.3)):
            check(logits, device, t, k, p)
    greedy = kernel(logits.to(device), 0.0).cpu()
    assert greedy.argmax(-1).tolist() == [1, 0, 0, 1, 0]
    sampled = kernel(logits.to(device), 1.0).cpu()
    assert sampled[1].tolist() == [1.0, 0.0, 0.0, 0.0]  # golden: the +inf row
    assert sampled[0].isnan().all() and sampled[2].isnan().all()


@pytest.mark.parametrize("V", [16, 17, 111], ids=lambda v: f"V{v}")
def test_infinite_temperature_is_uniform(device, V):
    """temperature inf: every finite logit becomes 0, a uniform row, as in the reference; with
    V not a multiple of the tile the padding lanes must not turn the row into NaN."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(V))
    got = check(logits, device, float("inf"))
    torch.testing.assert_close(got, torch.full_like(got, 1.0 / V), **FP32)
    per_row = torch.tensor([float("inf"), 1.0, float("inf")])
    got = check(logits, device, per_row)
    torch.testing.assert_close(got[[0, 2]], torch.full((2, V), 1.0 / V), **FP32)


CHUNKINGS = [(4, 16, 5), (1, 32, 3)]


@pytest.mark.parametrize("tiling", CHUNKINGS, ids=[f"BB{b}-BV{v}-S{s}" for b, v, s in CHUNKINGS])
def test_vocabulary_chunks_match_reference(device, tiling):
    """The vocabulary cut into chunks (the batch-1 split): per-chunk statistics, pivot counts
    and masses combined across chunks give the reference's kept sets, ties included."""
    from functools import partial
    from unittest import mock

    from specdec_kernels.ops._triton import sampling_probs as kernels

    block_b, block_v, splits = tiling
    tiled = partial(kernels.launch_config, tile=(block_b, block_v), num_splits=splits)
    ties = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, -1.0] * 20])  # tied values across chunks
    nan_row = torch.randn(1, 120, generator=gen(9))
    nan_row[0, 70] = float("nan")
    with mock.patch.object(kernels, "launch_config", tiled):
        # every setting on one shape per tiling; the combined top-k/top-p on both shapes
        for shape, settings in (((1, 111), ("greedy", "topk5_topp0.8")), ((3, 2, 70), ("topp0.9", "topk5_topp0.8"))):
            logits = torch.randn(shape, generator=gen(sum(shape))) * 3
            for setting in settings:
                check(logits, device, **SETTINGS[setting])
        check(ties, device, top_k=2)
        check(ties, device, top_p=0.3)
        check(nan_row, device, 1.0, 3, 0.5)
        # the argmax's first index when the maximum repeats in a later chunk
        rep = torch.zeros(1, 100)
        rep[0, [5, 60, 99]] = 4.0
        assert kernel(rep.to(device), 0.0).cpu().argmax(-1).item() == 5


def test_unchecked_top_p_at_or_below_zero_keeps_the_maximum(device):
    """With value checks off (the default on CUDA), top_p <= 0 keeps the most probable token
    and its ties, as the reference does (a nucleus has at least one token), never an empty row."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [2.0, 2.0, 1.0, -1.0]])
    for p in (0.0, -0.5):
        top_p = torch.full((2,), p)
        got = kernel(logits.to(device), 1.0, None, top_p.to(device), validate=False).cpu()
        from specdec_kernels.ops.sampling_probs import check_sampling_args
        from specdec_kernels.reference.sampling_probs import _sampling_probs

        per_row = check_sampling_args(logits, 1.0, None, top_p, validate=False)  # [B] each
        want = _sampling_probs(logits.float(), *(x[:, None] for x in per_row))
        assert torch.equal(got > 0, want > 0)
        assert (got[0] > 0).tolist() == [False, True, False, False] and (got[1] > 0).tolist() == [
            True,
            True,
            False,
            False,
        ]
        torch.testing.assert_close(got, want, **FP32)


def test_the_searches_resolve_every_candidate():
    """The top-k radix select resolves all 32 bits of an order key (RADIX_PASSES passes of
    RADIX_BITS bits each), and PASSES multi-pivot passes (NPIV pivots each, pivots as in
    ``_pivots``) bring the widest top-p interval, the 2**31 float32 bits from -1 to +inf, down
    to one candidate."""
    from specdec_kernels.ops._triton import sampling_probs as sp

    assert sp.RADIX_BITS * sp.RADIX_PASSES == 32 and sp.RADIX_PASSES < 8
    w = 0x7F800000 + 1
    for _ in range(sp.PASSES):  # a pass leaves at most ceil(w / (NPIV + 1)) candidates
        step = max((w + sp.NPIV) // (sp.NPIV + 1), 1)
        w = max(step, w - sp.NPIV * step)
    assert w == 1
    assert sp.PASSES < 31  # the bisection it replaces took 31 passes


def order_keys(x):
    """The kernels' order keys of float32 values (int64): sorted as the values, -0.0 = +0.0."""
    bits = x.float().view(torch.int32).long()
    return torch.where(x == 0, 0, torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_finds_the_kth_largest_key_of_every_kind_of_value(device, seed):
    """The radix select over the order keys' bytes, read back from the search's per-row
    output: negative and positive values, -0.0 and +0.0 (equal), subnormals, -inf, huge
    magnitudes, neighbours that differ in the last byte only, ties; k from 1 to V - 1."""
    from specdec_kernels.ops._triton import sampling_probs as sp
    from tests.ops.launches import recorded_launches

    special = torch.tensor(
        [float("-inf"), -3e38, -1e30, -2.0, -1.0, -1e-40, -0.0, 0.0, 1e-45, 1e-40, 1e-30, 0.5, 2.0, 2.0, 1e30, 3e38]
    )
    near = (torch.tensor([1.0]).view(torch.int32) + torch.arange(-3, 4, dtype=torch.int32)).view(torch.float32)
    row = torch.cat([special, near, torch.randn(40, generator=gen(seed)) * 10])
    rows = torch.stack([row[torch.randperm(row.numel(), generator=gen(seed * 10 + i))] for i in range(3)])
    V = rows.shape[1]
    keys = order_keys(rows).sort(dim=-1, descending=True).values
    for k in [1, 2, 3, 7, 8, 15, 16, 17, 30, V - 1]:
        with recorded_launches(sp) as launches:
            got = kernel(rows.to(device), 1.0, k).cpu()
        search = [x for x in launches if x.kernel == "_sampling_search_kernel"][0]
        row_i32 = search.args[4].cpu()  # per row: argmax, mode, top-k key, top-p bits, then 3 fp32
        assert row_i32[:, 2].tolist() == keys[:, k - 1].tolist(), k
        want = reference_sampling_probs(rows, 1.0, k)
        assert torch.equal(got > 0, want > 0) and torch.equal(got.isnan(), want.isnan())


def test_empty_batch(device):
    out = kernel(torch.zeros(0, 17, device=device), 0.7, 3, 0.9)
    assert out.shape == (0, 17) and out.dtype == torch.float32
    out = kernel(torch.zeros(0, 2, 17, device=device), torch.zeros(0, device=device))
    assert out.shape == (0, 2, 17)


@pytest.mark.parametrize(
    "V,setting",
    [
        (151936, dict(temperature=0.8)),
        (49152, dict(temperature=0.6, top_k=40, top_p=0.9)),
        (128256, dict(temperature=0.9, top_p=0.95)),
        (128256, dict(top_k=5000)),
    ],
    ids=["V151936-temperature", "V49152-topk-topp", "V128256-topp", "V128256-topk5000"],
)
def test_real_vocabulary_sizes(device, V, setting):
    logits = torch.randn(2, V, generator=gen(V)) * 3
    check(logits, device, **setting)


@pytest.mark.parametrize("use", ["none", "top_k", "top_p", "both"])
def test_opcheck(device, use):
    B, V = 3, 29
    logits = torch.randn(B, 2, V, generator=gen(5)).to(device)
    args = (
        logits,
        torch.tensor([1.0, 0.0, 0.6], device=device),
        torch.tensor([0, 3, 7], device=device) if use in ("top_k", "both") else None,
        torch.tensor([1.0, 0.5, 0.8], device=device) if use in ("top_p", "both") else None,
    )
    # the Triton launcher is no op of its own: the public op's Triton branch is what is checked
    torch.library.opcheck(torch.ops.specdec.sampling_probs.default, args, {"backend": "triton"})


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")  # on purpose
def test_an_overflowing_division_is_one_hot_at_the_largest_logit(device):
    """temperature 1e-40 (a float32 subnormal): several logits overflow to +inf, and the row is
    one-hot at the largest logit (the limit of T -> 0), not at the first +inf (golden)."""
    logits = torch.tensor([[1.0, 2.0, 0.5, -3.0, 1.5], [0.25, -1.0, 0.75, 0.75, 0.1]])
    for k, p in ((None, None), (2, None), (None, 0.5)):
        got = check(logits, device, 1e-40, k, p)
        assert got.argmax(-1).tolist() == [1, 2] and torch.equal(got.sum(-1), torch.ones(2))
