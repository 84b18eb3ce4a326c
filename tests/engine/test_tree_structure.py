"""The engine's tree masks and depths are built once per tree shape (issue #55): ``tree_structure``
equals the per-node definitions for every kind of parent list, and a repeated parent list is a
lookup that returns the same tensors."""

import pytest
import torch

from specdec_kernels.decoding import draft as draft_module
from specdec_kernels.decoding.draft import Draft, tree_structure
from specdec_kernels.tree import ancestor_mask


def loop_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depths by the definition: a node is one deeper than its parent."""
    depth = torch.zeros_like(parents, dtype=torch.int64)
    for i in range(1, parents.shape[1]):
        depth[:, i] = depth.gather(1, parents[:, i : i + 1].long()).squeeze(1) + 1
    return depth


def random_parents(B, N, g):
    p = torch.zeros(B, N, dtype=torch.int64)
    p[:, 0] = -1
    for i in range(1, N):
        p[:, i] = torch.randint(0, i, (B,), generator=g)
    return p


@pytest.fixture(autouse=True)
def empty_cache():
    draft_module._TREE_SHAPES.clear()
    yield
    draft_module._TREE_SHAPES.clear()


@pytest.mark.parametrize("B,N", [(1, 1), (1, 2), (3, 5), (2, 16), (4, 64)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_equals_the_definitions(B, N, dtype):
    g = torch.Generator().manual_seed(B * 100 + N)
    parents = random_parents(B, N, g).to(dtype)
    depths, mask = tree_structure(parents, "cpu")
    assert torch.equal(mask, ancestor_mask(parents))
    assert depths.dtype == torch.int64 and torch.equal(depths, loop_depths(parents))


def test_golden_tree():
    # root -> (1, 2); 1 -> 3; 3 -> 4; 2 -> 5; a padding node 6 under the root
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2, 0]])
    depths, mask = tree_structure(parents, "cpu")
    assert depths.tolist() == [[0, 1, 1, 2, 3, 2, 1]]
    assert mask[0, 4].nonzero().flatten().tolist() == [0, 1, 3, 4]


def test_a_repeated_tree_is_a_lookup():
    g = torch.Generator().manual_seed(0)
    parents = random_parents(2, 16, g)
    first = tree_structure(parents, "cpu")
    again = tree_structure(parents.clone(), "cpu")  # equal values, another tensor
    assert again[0] is first[0] and again[1] is first[1]
    other = parents.clone()
    other[1, 15] = 3 if int(other[1, 15]) != 3 else 2
    changed = tree_structure(other, "cpu")
    assert changed[1] is not first[1] and not torch.equal(changed[1], first[1])
    assert torch.equal(changed[0], loop_depths(other))


def test_a_device_entry_is_a_copy_of_the_host_entry(monkeypatch):
    """Another device's entry (here "meta", as a GPU's would) is copied from the host's: the
    ancestor mask of a shape is computed once, whichever devices ask for it."""
    calls = []
    real = draft_module.ancestor_mask
    monkeypatch.setattr(draft_module, "ancestor_mask", lambda p: calls.append(1) or real(p))
    parents = random_parents(3, 12, torch.Generator().manual_seed(5))
    on_meta = tree_structure(parents, "meta")
    on_host = tree_structure(parents, "cpu")
    assert len(calls) == 1
    assert on_meta[0].device.type == "meta" and on_meta[1].shape == on_host[1].shape == (3, 12, 12)
    assert tree_structure(parents, torch.device("meta")) is on_meta and len(calls) == 1


def test_a_slice_of_wider_parents_is_keyed_by_its_values():
    g = torch.Generator().manual_seed(1)
    parents = random_parents(2, 12, g)
    d, m = tree_structure(parents[:, :7], "cpu")  # not contiguous
    assert torch.equal(m, ancestor_mask(parents[:, :7])) and torch.equal(d, loop_depths(parents[:, :7]))


def test_the_cache_is_bounded():
    g = torch.Generator().manual_seed(2)
    for _ in range(draft_module.MAX_TREE_SHAPES + 5):
        tree_structure(random_parents(1, 12, g), "cpu")
    assert len(draft_module._TREE_SHAPES) <= draft_module.MAX_TREE_SHAPES


def test_draft_methods_use_it():
    g = torch.Generator().manual_seed(3)
    parents = random_parents(2, 9, g)
    d = Draft(torch.zeros(2, 9, dtype=torch.int64), parents, torch.full((2,), 9), None, is_chain=False)
    assert torch.equal(d.mask(), ancestor_mask(parents)) and torch.equal(d.depths(), loop_depths(parents))
    chain = Draft.from_lists([([5, 6, 7], [-1, 0, 1])])
    assert chain.mask() is None and chain.depths().tolist() == [[0, 1, 2]]


def test_bad_parents_are_still_refused():
    with pytest.raises((ValueError, TypeError)):
        tree_structure(torch.tensor([[-1, 2, 0]]), "cpu")


def test_step_results_reach_the_host_in_one_copy():
    """The loop's four per-step results go to the host as one packed copy on CUDA
    (``to_host_once``): same values and shapes as one copy each."""
    from specdec_kernels.decoding.engine.loop import to_host_once

    g = torch.Generator().manual_seed(4)
    out = torch.randint(-1, 50, (3, 5), generator=g)
    nodes = torch.randint(-1, 5, (3, 5), generator=g)
    acc = torch.randint(0, 5, (3,), generator=g)
    depth = torch.randint(0, 5, (3,), generator=g)
    got = to_host_once([out, nodes, acc, depth])
    for a, b in zip(got, [out, nodes, acc, depth]):
        assert a.shape == b.shape and a.dtype == torch.int64 and torch.equal(a, b)
