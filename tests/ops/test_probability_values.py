"""Probabilities checked as probabilities (issue #58): with ``validate=True`` every op that
takes probabilities refuses a negative, NaN or infinite entry in a row it uses, naming the
argument (``checks.check_probability_values``); rows past a sequence's count are ignored;
``validate`` None or False reads no values (the default path's host cost is unchanged)."""

from __future__ import annotations

import math
import re

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import checks
from specdec_kernels.serving import sglang as sg

B, K, V = 2, 3, 8
N = 4
PARENTS = torch.tensor([-1, 0, 0, 1])
BAD = {"negative": -0.5, "nan": math.nan, "inf": math.inf, "minus_inf": -math.inf}
KIND = {"negative": "(negative)", "nan": "(NaN)", "inf": "(infinite)", "minus_inf": "(infinite)"}
SEEDS = dict(seeds=torch.tensor([1, 2]), offsets=torch.tensor([0, 0]))


def probs(*shape, seed=0):
    return torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), -1)


def chain(target, draft, validate, counts=None):
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    return sk.rejection_sample(target, draft, tokens, counts, validate=validate, **SEEDS)


def flattened(target, draft, validate, counts=None):
    """The chain batch in vLLM's form: request 0 has 3 drafts, request 1 has 2; target rows
    [T + B, V] hold each request's draft rows and its bonus row (rows 0..3 and 4..6)."""
    tokens = torch.tensor([1, 2, 3, 4, 5])
    cu = torch.tensor([3, 5])
    return sk.rejection_sample_flattened(target, draft, tokens, cu, max_spec_len=3, validate=validate, **SEEDS)


def tree(target, draft, validate, counts=None):
    tokens = torch.tensor([[0, 1, 2, 3], [0, 4, 5, 6]])
    return sk.tree_rejection_sample(target, tokens, PARENTS, draft, counts, validate=validate, **SEEDS)


def sglang(target, draft, validate, counts=None):
    nt, ns = sg.to_sglang_tree(PARENTS.expand(B, N), counts)
    candidates = torch.tensor([[0, 1, 2, 3], [0, 4, 5, 6]])
    return sg.tree_rejection_sample_sglang(
        candidates, torch.arange(B * N).view(B, N), nt, ns, target, draft, num_spec_step=N, validate=validate
    )


# op -> (call, target shape, draft shape, a target row and a draft row that the op uses)
OPS = {
    "rejection_sample": (chain, (B, K + 1, V), (B, K, V), (1, 3), (1, 2)),
    "rejection_sample_flattened": (flattened, (5 + B, V), (5, V), (6,), (4,)),
    "tree_rejection_sample": (tree, (B, N, V), (B, N, V), (1, 3), (0, 2)),
    "tree_rejection_sample_sglang": (sglang, (B, N, V), (B, N, V), (1, 3), (0, 1)),
}


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("argument", ["target_probs", "draft_probs"])
@pytest.mark.parametrize("op", list(OPS))
def test_validate_true_refuses_what_is_not_a_probability(op, argument, kind):
    call, t_shape, d_shape, t_row, d_row = OPS[op]
    target, draft = probs(*t_shape, seed=1), probs(*d_shape, seed=2)
    bad = target if argument == "target_probs" else draft
    bad[(t_row if argument == "target_probs" else d_row) + (5,)] = BAD[kind]
    with pytest.raises(
        ValueError, match=rf"^{argument} must hold probabilities .*{argument}\[.*\] = .* {re.escape(KIND[kind])}"
    ):
        call(target, draft, True)
    # the same inputs without value checks: no error (nothing read on the host)
    for validate in (False, None):
        call(target, draft, validate)


@pytest.mark.parametrize("op", list(OPS))
def test_raw_logits_as_target_probs_are_refused(op):
    """The issue's case: logits (negative entries) handed over as probabilities."""
    call, t_shape, d_shape, _, _ = OPS[op]
    logits = torch.randn(*t_shape, generator=torch.Generator().manual_seed(3))
    assert (logits < 0).any()
    with pytest.raises(ValueError, match="target_probs must hold probabilities .* sampling_probs"):
        call(logits, None, True)
    call(logits.softmax(-1), None, True)  # the same rows as probabilities pass


@pytest.mark.parametrize("op", ["rejection_sample", "tree_rejection_sample", "tree_rejection_sample_sglang"])
def test_rows_past_a_count_are_ignored_whatever_they_hold(op):
    """Padding rows (past num_draft_tokens + 1 / num_nodes) may hold anything, NaN included."""
    call, t_shape, d_shape, _, _ = OPS[op]
    target, draft = probs(*t_shape, seed=4), probs(*d_shape, seed=5)
    counts = torch.tensor([3, 1])
    # sequence 1 uses target row 0..1 (chain) or node 0 only (trees): rows 2.. are padding
    target[1, 2:] = math.nan
    draft[1, 2:] = -1.0
    call(target, draft, True, counts)
    target[1, 1 if op == "rejection_sample" else 0] = -1.0  # a used row
    with pytest.raises(ValueError, match=r"target_probs\[1, "):
        call(target, draft, True, counts)


def test_probabilities_need_not_sum_to_one():
    """Weights are probabilities up to normalisation (the ops sample proportionally)."""
    target = probs(B, K + 1, V, seed=6) * 3.0
    chain(target, None, True)


def test_the_check_reads_nothing_unless_validate_is_true():
    """validate None (the CPU default) and False never read the rows: a meta tensor (no
    values to read) passes them, and fails validate=True."""
    meta = torch.empty(B, K + 1, V, device="meta")
    for validate in (None, False):
        checks.check_probability_values("target_probs", meta, validate)
    with pytest.raises((RuntimeError, NotImplementedError)):
        checks.check_probability_values("target_probs", meta, True)


def test_shared_check_messages_name_argument_index_and_kind():
    t = torch.ones(2, 3)
    t[1, 2] = -2.0
    with pytest.raises(ValueError, match=r"draft_probs\[1, 2\] = -2\.0 \(negative\)"):
        checks.check_probability_values("draft_probs", t, True)
    checks.check_probability_values("draft_probs", t, True, torch.tensor([True, False]))  # row 1 unused
    checks.check_probability_values("draft_probs", t.to(torch.bfloat16), False)
