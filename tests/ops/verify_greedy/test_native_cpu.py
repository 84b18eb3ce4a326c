"""verify_greedy: the C++ CPU fast path (csrc/verify_sample_cpu.cpp, backend="native") against
the reference, on the shapes and dtypes of the Triton kernel tests (test_triton.py), NaN rows and
strided logits, and torch.argmax's rule (NaN, +-inf, the first of tied maxima) in its argmax."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.ops.verify_greedy import test_triton as verify_tests
from tests.utils import assert_same, each_dtype, gen

pytestmark = pytest.mark.requires_native_op("verify_greedy")


@each_dtype
@pytest.mark.parametrize("shape", verify_tests.SHAPES, ids=[f"B{b}-K{k}-V{v}" for b, k, v in verify_tests.SHAPES])
def test_verify_greedy_matches_reference(shape, dtype):
    for seed, id_dtype in enumerate((torch.int32, torch.int64)):
        logits, drafts, counts = verify_tests.make_case(*shape, dtype=dtype, id_dtype=id_dtype, seed=seed)
        assert_same(
            sk.verify_greedy(logits, drafts, counts, backend="native"), reference.verify_greedy(logits, drafts, counts)
        )


def test_verify_greedy_nan_rows_and_strided_logits():
    logits = torch.randn(3, 4, 9, generator=gen(1))
    logits[0, 1] = float("nan")
    logits[1, 2, 5] = float("nan")
    drafts = logits.argmax(-1)[:, :3]
    wide = torch.randn(3, 4, 20, generator=gen(2))[..., ::2].clone()[..., :9]
    for lg in (logits, logits.transpose(0, 1).contiguous().transpose(0, 1), wide):
        d = lg.argmax(-1)[:, :3]
        assert_same(sk.verify_greedy(lg, d, backend="native"), reference.verify_greedy(lg, d))
    assert_same(sk.verify_greedy(logits, drafts, backend="native"), reference.verify_greedy(logits, drafts))


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
