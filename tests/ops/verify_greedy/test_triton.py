"""Triton verify_greedy kernels against the reference (interpreter on CPU, the GPU when present).

Parity over odd shapes (vocab not a power of two, uneven batches, K from 0 to 16, ragged
counts), all logit dtypes and both id dtypes, the split argmax over the vocabulary, strided
inputs, and the edge cases of torch.argmax (NaN, ties) and of the drafts (out-of-range ids,
-1, entries past the count).
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.ops import verify_greedy as op
from specdec_kernels.ops._triton.verify_greedy import verify_greedy_triton
from tests.utils import assert_docstring_is_the_fronts_own, each_dtype

NAN, INF = float("nan"), float("inf")


def make_case(B, K, V, dtype=torch.float32, id_dtype=torch.int64, seed=0, corrupt=0.25):
    """Random logits, drafts equal to the target argmax with random corruptions, ragged counts.

    Corruptions are a random id in [0, V) (may still match), an id >= V, or -1, so the
    accepted length varies from row to row.
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g).to(dtype)
    drafts = logits.argmax(-1)[:, :K].clone()
    kind = torch.randint(0, 3, (B, K), generator=g)
    bad = torch.where(kind == 0, torch.randint(0, V, (B, K), generator=g), torch.where(kind == 1, V + 3, -1))
    drafts = torch.where(torch.rand(B, K, generator=g) < corrupt, bad, drafts)
    counts = torch.randint(0, K + 1, (B,), generator=g)
    return logits, drafts.to(id_dtype), counts


def run_triton(device, logits, drafts, counts, **tiling):
    out, acc = verify_greedy_triton(logits.to(device), drafts.to(device), counts.to(device), **tiling)
    return out.cpu(), acc.cpu()


def assert_matches_reference(device, logits, drafts, counts, **tiling):
    out, acc = run_triton(device, logits, drafts, counts, **tiling)
    want_out, want_acc = reference.verify_greedy(logits, drafts, counts)
    assert out.dtype == torch.int64 and acc.dtype == torch.int64
    assert torch.equal(acc, want_acc), (acc, want_acc)
    assert torch.equal(out, want_out), (out, want_out)
    return out, acc


# (B, K, V): batch 1 and uneven batches, K in 0..8 and 16, vocab 1, 7, 111, 1000.
SHAPES = [
    (1, 0, 7),
    (3, 0, 111),
    (1, 1, 1),
    (8, 2, 1),
    (3, 3, 111),
    (8, 4, 7),
    (1, 5, 1000),
    (8, 5, 111),
    (3, 6, 7),
    (3, 7, 1000),
    (1, 8, 111),
    (8, 8, 7),
    (3, 16, 111),
    (8, 16, 7),
]


@each_dtype
@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{b}-K{k}-V{v}" for b, k, v in SHAPES])
def test_matches_reference(device, shape, dtype):
    B, K, V = shape
    for seed, id_dtype in enumerate((torch.int32, torch.int64)):
        logits, drafts, counts = make_case(B, K, V, dtype, id_dtype, seed=seed)
        assert_matches_reference(device, logits, drafts, counts)


def test_acceptance_varies_across_the_random_cases(device):
    """The random parity cases exercise rejection at the first draft, in the middle and none."""
    regimes = set()
    for seed in range(4):
        logits, drafts, counts = make_case(8, 8, 111, seed=seed)
        _, acc = assert_matches_reference(device, logits, drafts, counts)
        for a, n in zip(acc.tolist(), counts.tolist()):
            regimes.add("first" if a == 0 < n else "all" if a == n > 0 else "middle" if 0 < a < n else "no drafts")
    assert {"first", "middle", "all"} <= regimes


@pytest.mark.parametrize("V", [32000, 128256, 151936, 256000])
def test_large_vocabulary_tail_tile(device, V):
    """Vocabularies of real models; the maximum sits in the last, partial tile."""
    logits, drafts, counts = make_case(1, 1, V, torch.bfloat16, seed=V)
    logits[0, 0, V - 1] = 100.0
    drafts[0, 0] = V - 1
    out, acc = assert_matches_reference(device, logits, drafts, torch.tensor([1]))
    assert acc.item() == 1 and out[0, 0].item() == V - 1


def test_vocab_49152_batch_with_split(device):
    logits, drafts, counts = make_case(3, 4, 49152, torch.float16, torch.int32, seed=5)
    assert_matches_reference(device, logits, drafts, counts)
    assert_matches_reference(device, logits, drafts, counts, num_splits=5)


@pytest.mark.parametrize("num_splits", [2, 3, 7, 1000], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("block_v", [16, 64], ids=lambda b: f"block{b}")
def test_split_vocabulary(device, block_v, num_splits):
    """The argmax split over V (several programs per row, combined in the finishing kernel)."""
    logits, drafts, counts = make_case(3, 5, 300, seed=block_v + num_splits)
    assert_matches_reference(device, logits, drafts, counts, block_v=block_v, num_splits=num_splits)


def test_split_ties_and_nans_across_chunks(device):
    """Ties and NaNs in different chunks of one row: the first index wins, NaN beats numbers."""
    V = 100
    logits = torch.zeros(1, 5, V)
    logits[0, 0, [70, 20, 90]] = 3.0  # tie across chunks -> 20
    logits[0, 1, 10] = 5.0
    logits[0, 1, 80] = NAN  # NaN in a later chunk beats the max of an earlier one -> 80
    logits[0, 2, [95, 33]] = NAN  # first NaN -> 33
    logits[0, 3, :] = -INF  # all -inf -> 0
    logits[0, 4, [99, 50]] = INF  # tie of +inf -> 50
    drafts = torch.tensor([[20, 80, 33, 0]])
    for block_v, num_splits in [(16, 7), (16, 2), (32, 4), (128, 1)]:
        out, acc = assert_matches_reference(
            device, logits, drafts, torch.tensor([4]), block_v=block_v, num_splits=num_splits
        )
        assert out.tolist() == [[20, 80, 33, 0, 50]] and acc.tolist() == [4]


@each_dtype
def test_nan_rows(device, dtype):
    V = 37
    logits = torch.randn(4, 3, V, generator=torch.Generator().manual_seed(0))
    logits[0, 0] = NAN  # all-NaN row -> 0
    logits[1, 0, 5] = 50.0
    logits[1, 0, 30] = NAN  # NaN after the maximum -> the NaN's index
    logits[2, 0, [7, 3, 21]] = NAN  # several NaNs -> the first
    logits[3, 1] = NAN  # a later row all NaN
    logits = logits.to(dtype)
    target = logits.float().argmax(-1)
    drafts = target[:, :2].clone()
    out, acc = assert_matches_reference(device, logits, drafts, torch.tensor([2, 2, 2, 2]))
    assert out[:, 0].tolist() == [0, 30, 3, int(target[3, 0])]
    assert out[3, 1].item() == 0
    assert ((out >= -1) & (out < V)).all()


@each_dtype
def test_ties_take_the_first_index(device, dtype):
    logits = torch.zeros(2, 2, 300, dtype=dtype)
    logits[0, 0, [250, 17, 120]] = 2.0
    logits[1, 0] = -INF
    logits[1, 1, [299, 298]] = 1.0
    out, acc = assert_matches_reference(device, logits, torch.tensor([[17], [0]]), torch.tensor([1, 1]))
    assert out.tolist() == [[17, 0], [0, 298]] and acc.tolist() == [1, 1]


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_out_of_range_and_padding_ids_never_match(device, id_dtype):
    """Ids outside [0, V) and -1 inside the counted range stop acceptance; nothing is read there."""
    V = 7
    logits = torch.zeros(5, 4, V)
    logits[..., 2] = 1.0  # argmax 2 everywhere
    big = 2**31 - 1 if id_dtype == torch.int32 else 2**40
    drafts = torch.tensor([[2, -1, 2], [2, 2, V], [big, 2, 2], [-(2**20), 2, 2], [2, 2, 2]], dtype=id_dtype)
    out, acc = assert_matches_reference(device, logits, drafts, torch.tensor([3, 3, 3, 3, 3]))
    assert acc.tolist() == [1, 2, 0, 0, 3]
    assert out.tolist() == [[2, 2, -1, -1], [2, 2, 2, -1], [2, -1, -1, -1], [2, -1, -1, -1], [2, 2, 2, 2]]


def test_entries_past_the_count_are_ignored(device):
    """Drafts that would match, or garbage, past num_draft_tokens change nothing."""
    logits = torch.zeros(3, 4, 11)
    logits[..., 4] = 1.0
    drafts = torch.tensor([[4, 4, 4], [4, -5, 99], [4, 4, 4]])
    out, acc = assert_matches_reference(device, logits, drafts, torch.tensor([0, 1, 2]))
    assert acc.tolist() == [0, 1, 2]
    assert out.tolist() == [[4, -1, -1, -1], [4, 4, -1, -1], [4, 4, 4, -1]]


def test_zero_drafts(device):
    logits, drafts, _ = make_case(3, 0, 111, seed=1)
    out, acc = assert_matches_reference(device, logits, drafts, torch.zeros(3, dtype=torch.int64))
    assert out[:, 0].tolist() == logits[:, 0].argmax(-1).tolist() and acc.tolist() == [0, 0, 0]


@pytest.mark.parametrize("K", [0, 3])
def test_empty_batch(device, K):
    out, acc = run_triton(
        device, torch.zeros(0, K + 1, 11), torch.zeros(0, K, dtype=torch.int32), torch.zeros(0, dtype=torch.int64)
    )
    assert out.shape == (0, K + 1) and acc.shape == (0,)
    assert out.dtype == torch.int64 and acc.dtype == torch.int64


def test_strided_inputs(device):
    """Row slices and permuted layouts are read through their strides; a non-unit vocabulary
    stride is copied; strided draft tokens are read through their strides."""
    B, K, V = 3, 5, 111
    logits, drafts, counts = make_case(B, K, V, seed=3)
    wide = torch.randn(B, K + 3, V)
    wide[:, : K + 1] = logits
    permuted = logits.transpose(0, 1).contiguous().transpose(0, 1)  # batch stride V
    spaced = torch.zeros(B, K + 1, 2 * V)
    spaced[..., ::2] = logits
    draft_cols = torch.zeros(B, 2 * K, dtype=drafts.dtype)
    draft_cols[:, ::2] = drafts
    for view in (wide[:, : K + 1], permuted, spaced[..., ::2]):
        assert not view.is_contiguous()
        assert_matches_reference(device, view, drafts, counts)
    assert_matches_reference(device, logits, draft_cols[:, ::2], counts)
    assert_matches_reference(device, logits, drafts.t().contiguous().t(), counts)


def test_public_op_dispatches_to_triton(device):
    assert "triton" in op.IMPLEMENTED
    logits, drafts, counts = make_case(3, 4, 111, torch.float16, torch.int32, seed=2)
    out, acc = sk.verify_greedy(
        logits.to(device), drafts.to(device), counts.to(torch.int32).to(device), backend="triton"
    )
    want_out, want_acc = reference.verify_greedy(logits, drafts, counts)
    assert torch.equal(out.cpu(), want_out) and torch.equal(acc.cpu(), want_acc)
    out, acc = sk.verify_greedy(logits.to(device), drafts.to(device), backend="triton")  # counts None: all K
    want_out, want_acc = reference.verify_greedy(logits, drafts)
    assert torch.equal(out.cpu(), want_out) and torch.equal(acc.cpu(), want_acc)


def test_public_docstring_is_the_fronts_own():
    assert_docstring_is_the_fronts_own("verify_greedy")


def test_opcheck(device):
    logits, drafts, counts = make_case(2, 3, 37, seed=4)
    args = (logits.to(device), drafts.to(device), counts.to(device))
    # the Triton launcher is no op of its own: the public op's Triton branch is what is checked
    torch.library.opcheck(torch.ops.specdec.verify_greedy.default, args, {"backend": "triton"})
