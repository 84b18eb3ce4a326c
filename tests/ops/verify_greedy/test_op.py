"""verify_greedy: golden cases worked out by hand, invariants and bad input, on every backend."""

import re

import pytest
import torch

import specdec_kernels as sk
from tests.ops import greedy
from tests.utils import on_each_backend, over_bad_inputs, runnable_backends

BACKENDS = runnable_backends("verify_greedy")


def logits_with_argmax(argmax_rows, vocab=7):
    """Logits [B, K+1, V] whose argmax is the given ids (a clear margin, no ties)."""
    return greedy.logits_with_argmax(argmax_rows, vocab)


verify = on_each_backend(sk.verify_greedy, BACKENDS)


# Each case: target argmax per row, drafts, counts -> expected output row and accepted count.
GOLDEN = {
    "all_accepted": ([[3, 1, 4, 5]], [[3, 1, 4]], None, [[3, 1, 4, 5]], [3]),
    "first_rejected": ([[3, 1, 4, 5]], [[2, 1, 4]], None, [[3, -1, -1, -1]], [0]),
    "middle_rejected": ([[3, 1, 4, 5]], [[3, 6, 4]], None, [[3, 1, -1, -1]], [1]),
    "last_rejected": ([[3, 1, 4, 5]], [[3, 1, 0]], None, [[3, 1, 4, -1]], [2]),
    "zero_drafts": ([[6]], [[]], None, [[6]], [0]),
    "ragged": (
        [[3, 1, 4, 5], [2, 2, 2, 2], [0, 6, 6, 6]],
        [[3, 1, 4], [2, 2, 9], [0, 6, 6]],
        [3, 2, 1],
        [[3, 1, 4, 5], [2, 2, 2, -1], [0, 6, -1, -1]],
        [3, 2, 1],
    ),
    "zero_count_ignores_drafts": ([[3, 1, 4, 5]], [[3, 1, 4]], [0], [[3, -1, -1, -1]], [0]),
}


@pytest.mark.parametrize("case", list(GOLDEN), ids=list(GOLDEN))
def test_golden(verify, case):
    argmax, drafts, counts, want_out, want_acc = GOLDEN[case]
    logits = logits_with_argmax(argmax)
    drafts = torch.tensor(drafts, dtype=torch.int64).reshape(len(argmax), -1)
    counts = None if counts is None else torch.tensor(counts)
    out, acc = verify(logits, drafts, counts)
    assert out.tolist() == want_out
    assert acc.tolist() == want_acc
    assert out.dtype == torch.int64 and acc.dtype == torch.int64


def test_ids_out_of_range_and_padding_never_match(verify):
    logits = logits_with_argmax([[3, 1, 4, 5], [3, 1, 4, 5]])
    drafts = torch.tensor([[3, -1, 4], [3, 1, 700]], dtype=torch.int32)
    out, acc = verify(logits, drafts)
    assert out.tolist() == [[3, 1, -1, -1], [3, 1, 4, -1]]
    assert acc.tolist() == [1, 2]


def test_nan_counts_as_maximum_and_ids_stay_in_vocab(verify):
    logits = torch.zeros(2, 2, 5)
    logits[0, 0, 3] = float("nan")
    logits[1, :] = float("nan")
    out, acc = verify(logits, torch.tensor([[3], [0]]))
    assert out.tolist() == [[3, 0], [0, 0]]
    assert acc.tolist() == [1, 1]


def test_ties_take_the_first_index(verify):
    logits = torch.zeros(1, 2, 6)
    logits[0, 0, [2, 4]] = 1.0
    out, acc = verify(logits, torch.tensor([[4]]))
    assert out.tolist() == [[2, -1]] and acc.tolist() == [0]


def test_empty_batch(verify):
    out, acc = verify(torch.zeros(0, 4, 11), torch.zeros(0, 3, dtype=torch.int64))
    assert out.shape == (0, 4) and acc.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_logits(verify, dtype):
    logits = logits_with_argmax([[3, 1, 4, 5]]).to(dtype)
    out, acc = verify(logits, torch.tensor([[3, 1, 2]]))
    assert out.tolist() == [[3, 1, 4, -1]] and acc.tolist() == [2]


def test_invariants_on_random_inputs(verify):
    B, K, V = 9, 5, 13
    logits, drafts, g = greedy.drafts_near_argmax(B, K, V, seed=1, wrong=0.3, shift=1)
    counts = torch.randint(0, K + 1, (B,), generator=g)
    out, acc = verify(logits, drafts, counts)
    emitted = (out >= 0).sum(1)
    assert torch.equal(emitted, acc + 1)  # emitted = accepted + 1
    assert (acc <= counts).all()
    for b in range(B):  # a sequence's result does not depend on the rest of the batch
        out_b, acc_b = verify(logits[b : b + 1], drafts[b : b + 1], counts[b : b + 1])
        assert torch.equal(out_b[0], out[b]) and acc_b.item() == acc[b].item()


BAD = {
    "logits_rank": (lambda: (torch.zeros(4, 11), torch.zeros(1, 3, dtype=torch.long)), ValueError, "target_logits"),
    "logits_dtype": (
        lambda: (torch.zeros(1, 4, 11, dtype=torch.int32), torch.zeros(1, 3, dtype=torch.long)),
        TypeError,
        "target_logits",
    ),
    "drafts_dtype": (lambda: (torch.zeros(1, 4, 11), torch.zeros(1, 3)), TypeError, "draft_tokens"),
    "batch_mismatch": (
        lambda: (torch.zeros(2, 4, 11), torch.zeros(3, 3, dtype=torch.long)),
        ValueError,
        "draft_tokens",
    ),
    "missing_bonus_row": (lambda: (torch.zeros(1, 3, 11), torch.zeros(1, 3, dtype=torch.long)), ValueError, "K+1"),
    "counts_range": (
        lambda: (torch.zeros(1, 4, 11), torch.zeros(1, 3, dtype=torch.long), torch.tensor([4])),
        ValueError,
        "num_draft_tokens",
    ),
    "counts_shape": (
        lambda: (torch.zeros(2, 4, 11), torch.zeros(2, 3, dtype=torch.long), torch.tensor([1])),
        ValueError,
        "num_draft_tokens",
    ),
    "not_a_tensor": (lambda: ([[0.0]], torch.zeros(1, 0, dtype=torch.long)), TypeError, "target_logits"),
}


@over_bad_inputs(sk.verify_greedy, BAD)
def test_bad_input(fn, case):
    make, err, name = BAD[case]
    with pytest.raises(err, match=re.escape(name)):
        fn(*make())


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend"):
        sk.verify_greedy(torch.zeros(1, 2, 5), torch.zeros(1, 1, dtype=torch.long), backend="cuda-magic")
