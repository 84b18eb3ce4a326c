"""The host side of a decode step on lists: ``Draft.from_lists`` (one tensor per field),
``Draft.truncate`` (the draft itself where nothing is cut), ``check_draft`` (its checks on
host lists, in the order the tensor checks had) and ``build_block``'s chain path (positions,
valid nodes and depths from lists), each against golden cases by hand and against the tensor
formulas they replace, over ragged batches, batch 1 and padded buckets."""

from __future__ import annotations

import random

import pytest
import torch

from specdec_kernels.decoding.draft import Draft, chain_parents
from specdec_kernels.decoding.engine.draft_checks import check_draft
from specdec_kernels.decoding.engine.state import node_bucket
from specdec_kernels.decoding.engine.verify import build_block


def test_from_lists_golden():
    d = Draft.from_lists([([5, 6, 7], [-1, 0, 1]), ([9], [-1])])
    assert d.tokens.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert d.parents.tolist() == [[-1, 0, 1], [-1, 0, 0]]
    assert d.num_nodes.tolist() == [3, 1] and d.is_chain and d.probs is None
    assert all(t.dtype == torch.int64 for t in (d.tokens, d.parents, d.num_nodes))
    tree = Draft.from_lists([([5, 6, 7], [-1, 0, 0])])
    assert not tree.is_chain and tree.parents.tolist() == [[-1, 0, 0]]
    assert not Draft.from_lists([([5, 6], [-1, 0])], is_chain=False).is_chain
    # tensors and numpy-like ints are read as ints; an empty tree is a row of padding
    d = Draft.from_lists([(torch.tensor([4, 2]), torch.tensor([-1, 0])), ([], [])])
    assert d.tokens.tolist() == [[4, 2], [0, 0]] and d.parents.tolist() == [[-1, 0], [-1, 0]]
    assert d.num_nodes.tolist() == [2, 0]


def test_from_lists_refuses_mismatched_or_empty_trees():
    with pytest.raises(ValueError, match="tokens .3. and parents .2."):
        Draft.from_lists([([5, 6, 7], [-1, 0])])
    with pytest.raises(ValueError, match="every tree is empty"):
        Draft.from_lists([([], [])])


def test_truncate_keeps_the_draft_where_nothing_is_cut():
    d = Draft.from_lists([([5, 6, 7], chain_parents(3)), ([9, 1], chain_parents(2))])
    assert d.truncate([3, 8]) is d
    cut = d.truncate([2, 0])  # a limit below 1 keeps the root
    assert cut is not d and cut.num_nodes.tolist() == [2, 1]
    assert cut.tokens is d.tokens and cut.parents is d.parents and cut.is_chain
    with pytest.raises(ValueError, match="one limit per sequence"):
        d.truncate([3])


def _check(draft, histories, active=None, vocab=100):
    active = active if active is not None else [True] * len(histories)
    return check_draft(draft, "t", histories, active, vocab)


def test_check_draft_on_lists_names_the_first_fault_in_row_order():
    hist = [[1, 5], [2, 9]]
    ok = Draft.from_lists([([5, 6, 7], [-1, 0, 1]), ([9], [-1])])
    assert _check(ok, hist) is ok
    # a bad parent in row 1 and a broken chain in row 0: the parent is named (all parents first)
    bad = Draft(
        torch.tensor([[5, 6, 7], [9, 3, 0]]), torch.tensor([[-1, 0, 0], [-1, 1, 0]]), torch.tensor([3, 2]), None, True
    )
    with pytest.raises(ValueError, match="sequence 1, node 1 has parent 1"):
        _check(bad, hist)
    bad = Draft(torch.tensor([[5, 6, 7]]), torch.tensor([[-1, 0, 0]]), torch.tensor([3]), None, True)
    with pytest.raises(ValueError, match="not a chain"):
        _check(bad, [[5]])
    # a chain's padding past num_nodes may have any valid parent
    padded = Draft(torch.tensor([[5, 6, 0]]), torch.tensor([[-1, 0, 0]]), torch.tensor([2]), None, True)
    assert _check(padded, [[5]]) is padded
    # the first token outside the vocabulary in row-major order, padding past num_nodes ignored
    bad = Draft.from_lists([([5, 6, 300], [-1, 0, 1]), ([9, -1], [-1, 0])])
    with pytest.raises(ValueError, match=r"draft token 300 \(sequence 0, node 2\)"):
        _check(bad, hist)
    beyond = Draft(torch.tensor([[5, 6, 300]]), torch.tensor([[-1, 0, 1]]), torch.tensor([2]), None, True)
    assert _check(beyond, [[5]]) is beyond
    # a finished sequence's root is not checked; its declared tokens are
    assert _check(ok, [[1, 5], [2, 8]], active=[True, False]) is ok
    with pytest.raises(ValueError, match="root is 9, not its last committed token 8"):
        _check(ok, [[1, 5], [2, 8]])
    bad = Draft.from_lists([([5], [-1]), ([9, 100], [-1, 0])])
    with pytest.raises(ValueError, match="sequence 1, node 1"):
        _check(bad, hist, active=[True, False])


def test_check_draft_probs_mask_follows_counts_and_activity():
    """With probs, a drafted node of a running sequence needs q > 0; padding and finished rows
    are not checked (the mask built from the host lists)."""
    V = 8
    probs = torch.full((2, 3, V), 1.0 / V)
    probs[1, 0, 4] = 0.0  # row 1's first draft (token 4) drawn where q = 0
    d = Draft(torch.tensor([[5, 6, 7], [2, 4, 0]]), torch.tensor([[-1, 0, 1], [-1, 0, 1]]), torch.tensor([3, 2]), probs)
    with pytest.raises(ValueError, match=r"\(sequence 1, node 1\) has probability 0.0"):
        check_draft(d, "t", [[5], [2]], [True, True], V)
    assert check_draft(d, "t", [[5], [2]], [True, False], V) is d
    d1 = Draft(d.tokens, d.parents, torch.tensor([3, 1]), probs)  # node 1 of row 1 is padding
    assert check_draft(d1, "t", [[5], [2]], [True, True], V) is d1


def _tensor_block_fields(counts, seqlens, width):
    """What build_block computed with tensor ops for a chain: positions, valid nodes, depths."""
    depths = torch.arange(width).expand(len(counts), width)
    valid = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]
    positions = torch.tensor(seqlens, dtype=torch.int64)[:, None] + depths
    return positions, valid, torch.where(valid, depths, 0).max(dim=1).values


@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("bucket", [None, 16])
def test_chain_block_from_lists_equals_the_tensor_formulas(B, bucket):
    rng = random.Random(B * 7 + (bucket or 0))
    for _ in range(20):
        counts = [rng.randint(1, 12) for _ in range(B)]
        seqlens = [rng.randint(0, 50) for _ in range(B)]
        draft = Draft.from_lists([([rng.randrange(100) for _ in range(c)], chain_parents(c)) for c in counts])
        block = build_block(draft, seqlens, bucket, "cpu")
        n = max(counts)
        width = block.width
        assert block.cut == n and width == (node_bucket(n, bucket) if bucket else n)
        positions, valid, depth = _tensor_block_fields(counts, seqlens, width)
        assert torch.equal(block.host_positions, positions) and torch.equal(block.positions, positions)
        assert torch.equal(block.host_valid, valid) and torch.equal(block.depth, depth)
        assert block.depth.dtype == torch.int64 and block.host_valid.dtype == torch.bool
        assert block.tree_mask is None and block.is_chain
        assert block.tokens[:, :n].tolist() == draft.tokens.tolist()
        assert block.host_num_nodes.tolist() == counts
