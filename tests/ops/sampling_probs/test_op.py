"""sampling_probs: hand-worked temperature, top-k and top-p cases, and bad input."""

import math

import pytest
import torch

import specdec_kernels as sk
from tests.utils import bad_input_test, on_each_backend, runnable_backends

BACKENDS = runnable_backends("sampling_probs")


probs_of = on_each_backend(sk.sampling_probs, BACKENDS)


LOGITS = torch.tensor([[math.log(1), math.log(2), math.log(3), math.log(4)]])  # softmax = [.1 .2 .3 .4]


def test_temperature_one_is_softmax(probs_of):
    torch.testing.assert_close(probs_of(LOGITS, 1.0), torch.tensor([[0.1, 0.2, 0.3, 0.4]]))


def test_temperature_half_squares_the_odds(probs_of):
    # p_i ∝ i^2: [1, 4, 9, 16] / 30
    torch.testing.assert_close(probs_of(LOGITS, 0.5), torch.tensor([[1, 4, 9, 16]]) / 30.0)


def test_temperature_zero_is_one_hot_argmax(probs_of):
    assert probs_of(LOGITS, 0.0).tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_top_k_keeps_the_k_largest(probs_of):
    torch.testing.assert_close(probs_of(LOGITS, 1.0, 2), torch.tensor([[0, 0, 3 / 7, 4 / 7]]))


def test_top_k_keeps_ties_at_the_boundary(probs_of):
    logits = torch.tensor([[1.0, 2.0, 2.0, 3.0]])
    kept = probs_of(logits, 1.0, 2) > 0
    assert kept.tolist() == [[False, True, True, True]]


def test_top_p_keeps_the_smallest_nucleus(probs_of):
    # sorted: .4, .3 (mass .7), .2 (mass .9): top_p 0.7 -> {.4, .3}; top_p 0.71 -> {.4, .3, .2}
    torch.testing.assert_close(probs_of(LOGITS, 1.0, None, 0.7), torch.tensor([[0, 0, 3 / 7, 4 / 7]]))
    torch.testing.assert_close(probs_of(LOGITS, 1.0, None, 0.71), torch.tensor([[0, 2 / 9, 3 / 9, 4 / 9]]))


def test_top_p_below_the_largest_keeps_one_token(probs_of):
    assert probs_of(LOGITS, 1.0, None, 0.05).tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_per_sequence_parameters(probs_of):
    logits = LOGITS.expand(3, 4)
    out = probs_of(logits, torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), torch.tensor([1.0, 1.0, 1.0]))
    torch.testing.assert_close(out, torch.tensor([[0.1, 0.2, 0.3, 0.4], [0, 0, 0, 1.0], [0, 0, 0, 1.0]]))


def test_rows_of_a_3d_input_share_their_sequence_parameters(probs_of):
    logits = LOGITS.expand(2, 4)[:, None].expand(2, 3, 4)
    out = probs_of(logits, torch.tensor([1.0, 0.0]))
    assert out.shape == (2, 3, 4)
    assert out[1].tolist() == [[0.0, 0.0, 0.0, 1.0]] * 3
    torch.testing.assert_close(out[0], torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_logits_give_float32_probs(probs_of, dtype):
    out = probs_of(torch.randn(2, 5, 111).to(dtype), 0.7, 20, 0.9)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 5))
    assert ((out > 0).sum(-1) <= 20).all()


BAD = {
    "negative_temperature": (dict(temperature=-1.0), ValueError, "temperature"),
    "top_p_zero": (dict(top_p=0.0), ValueError, "top_p"),
    "top_p_above_one": (dict(top_p=1.5), ValueError, "top_p"),
    "top_k_float": (dict(top_k=2.5), TypeError, "top_k"),
    "per_sequence_shape": (dict(temperature=torch.ones(3)), ValueError, "temperature"),
    "bool_temperature_tensor": (dict(temperature=torch.tensor([False, True])), TypeError, "temperature"),
    "bool_top_p_tensor": (dict(top_p=torch.tensor([True, True])), TypeError, "top_p"),
    "logits_rank": (dict(logits=torch.zeros(4)), ValueError, "logits"),
    "logits_dtype": (dict(logits=torch.zeros(1, 4, dtype=torch.long)), TypeError, "logits"),
}


test_bad_input = bad_input_test(sk.sampling_probs, BAD, lambda: dict(logits=torch.zeros(2, 4)))
