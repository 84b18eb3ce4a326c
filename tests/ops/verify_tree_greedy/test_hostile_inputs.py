"""verify_tree_greedy: hostile inputs with value checks off (validate=False, the CUDA default); the
guard buffers and the rule they check are described in tests/ops/hostile.py."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.ops.hostile import COUNTS, HOSTILE_PARENTS, TREE, in_guard
from tests.utils import gen, runnable_backends


@pytest.mark.parametrize("backend", runnable_backends("verify_tree_greedy", "cpu"))
@pytest.mark.parametrize("parents", HOSTILE_PARENTS)
def test_verify_tree_greedy_hostile_parents_and_counts(backend, parents):
    B, N, V = 2, len(TREE), 9
    logits = torch.randn(B, N, V, generator=gen(3))
    tokens = torch.randint(0, V, (B, N), generator=gen(4))
    tokens[:, 1] = logits[:, 0].argmax(-1)
    tokens[:, 3] = logits[:, 1].argmax(-1)
    par = torch.tensor(parents)
    for count in COUNTS:
        n = torch.tensor([count, N])
        want = (
            reference.verify_tree_greedy(logits, tokens, torch.tensor(TREE), n.clamp(0, N)) if parents == TREE else None
        )
        got = sk.verify_tree_greedy(
            in_guard(logits, float("nan")),
            in_guard(tokens, 1),
            in_guard(par, 0),
            in_guard(n, 2**40),
            backend=backend,
            validate=False,
        )
        ref = sk.verify_tree_greedy(logits, tokens, par, n, backend="reference", validate=False)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (parents, count)
        if want is not None:
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert ((got[1] >= -1) & (got[1] < N)).all()


@pytest.mark.parametrize("backend", runnable_backends("verify_tree_greedy", "cpu"))
def test_verify_tree_greedy_backward_parent_never_accepted_out_of_order(backend):
    """parents = [-1, 0, 3, 1]: node 2 names a later node as parent.  Every backend walks the
    nodes in index order, so the accepted path stays increasing (compact_kv_cache needs it)."""
    V = 6
    logits = torch.full((1, 4, V), -5.0)
    for i in range(4):
        logits[0, i, i + 1] = 5.0  # the argmax after node i is token i + 1
    tokens = torch.tensor([[0, 1, 4, 2]])
    out, nodes, acc = sk.verify_tree_greedy(
        logits, tokens, torch.tensor([-1, 0, 3, 1]), backend=backend, validate=False
    )
    assert nodes[0].tolist() == [0, 1, 3, -1] and int(acc[0]) == 2
