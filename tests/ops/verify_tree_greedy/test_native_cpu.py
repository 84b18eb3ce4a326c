"""verify_tree_greedy: the C++ CPU fast path (csrc/verify_sample_cpu.cpp, backend="native")
against the reference, on the random trees (shared and per sequence) of the Triton kernel tests
(test_triton.py)."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.ops.verify_tree_greedy import test_triton as tree_verify_tests
from tests.utils import assert_same

pytestmark = pytest.mark.requires_native_op("verify_tree_greedy")


@pytest.mark.parametrize("shared", [True, False], ids=["shared_tree", "per_sequence_tree"])
@pytest.mark.parametrize(
    "shape", tree_verify_tests.SHAPES, ids=[f"B{b}-N{n}-V{v}" for b, n, v in tree_verify_tests.SHAPES]
)
def test_verify_tree_greedy_matches_reference(shape, shared):
    for seed, id_dtype in enumerate((torch.int32, torch.int64)):
        logits, tokens, parents, n = tree_verify_tests.make_case(*shape, shared=shared, id_dtype=id_dtype, seed=seed)
        assert_same(
            sk.verify_tree_greedy(logits, tokens, parents, n, backend="native"),
            reference.verify_tree_greedy(logits, tokens, parents, n),
        )
