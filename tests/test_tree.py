"""specdec_kernels.tree: masks, depths, Medusa choices and trie merging, worked by hand."""

import pytest
import torch

from specdec_kernels import tree


def test_ancestor_mask_by_hand():
    mask = tree.ancestor_mask([-1, 0, 0, 1, 2])
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 1, 0, 1],
    ]


def test_batched_masks_and_depths():
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 0]])
    assert tree.ancestor_mask(parents).shape == (2, 3, 3)
    assert tree.tree_depths(parents).tolist() == [[0, 1, 2], [0, 1, 1]]


def test_chain_mask_is_lower_triangular():
    assert torch.equal(tree.ancestor_mask(list(range(-1, 5))), torch.ones(6, 6, dtype=torch.bool).tril())


def test_path_to():
    assert tree.path_to([-1, 0, 0, 1, 3], 4) == [0, 1, 3, 4]
    with pytest.raises(ValueError, match="node"):
        tree.path_to([-1, 0], 5)


def test_medusa_choices():
    t = tree.medusa_choices_to_tree([[0], [0, 0], [1], [0, 1]])
    assert t.parents.tolist() == [-1, 0, 0, 1, 1]
    assert t.depths.tolist() == [0, 1, 1, 2, 2]
    assert t.topk_index.tolist() == [-1, 0, 1, 0, 1]
    assert t.choices == [(0,), (1,), (0, 0), (0, 1)]


@pytest.mark.parametrize("choices,match", [([[0, 1]], "prefix"), ([[0], [0]], "repeat"), ([[]], "non-empty")])
def test_medusa_choices_bad(choices, match):
    with pytest.raises(ValueError, match=match):
        tree.medusa_choices_to_tree(choices)


def test_merge_chains_deduplicates_shared_prefixes():
    t = tree.merge_chains(5, [[1, 2, 3], [1, 4], [7]])
    assert t.tokens == [5, 1, 2, 3, 4, 7]
    assert t.parents == [-1, 0, 1, 2, 1, 0]
    assert t.sources[1] == {0, 1} and t.sources[4] == {1} and t.sources[5] == {2}


def test_merge_respects_max_nodes_and_drops_orphans():
    t = tree.merge_chains(5, [[1, 2, 3], [4, 6]], max_nodes=4)
    assert t.tokens == [5, 1, 2, 3]
    t = tree.merge_trees(0, [([0, 1, 2, 3], [-1, 0, 0, 1])], max_nodes=3)
    assert t.tokens == [0, 1, 2] and t.parents == [-1, 0, 0]


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3]], ids=["root", "self", "forward"])
def test_bad_parent_lists(parents):
    with pytest.raises(ValueError, match="parents"):
        tree.ancestor_mask(parents)


def test_merge_accepts_tensors_like_lists():
    """Tensors hash by identity: parents given as a tensor once dropped every node."""
    as_lists = tree.merge_trees(5, [([5, 1, 2, 9], [-1, 0, 1, 0])])
    as_tensors = tree.merge_trees(5, [(torch.tensor([5, 1, 2, 9]), torch.tensor([-1, 0, 1, 0]))])
    assert as_tensors.tokens == as_lists.tokens == [5, 1, 2, 9]
    assert as_tensors.parents == as_lists.parents == [-1, 0, 1, 0]
    assert tree.merge_chains(torch.tensor(5), [torch.tensor([1, 2]), [1, 4]]).tokens == [5, 1, 2, 4]


BAD_HELPER_CALLS = {
    "float_parents": (lambda: tree.ancestor_mask([-1, 0.7, 1.2]), TypeError, "parents"),
    "float_parent_tensor": (lambda: tree.tree_depths(torch.tensor([-1.0, 0.0])), TypeError, "parents"),
    "empty_parents": (lambda: tree.ancestor_mask([]), ValueError, "root"),
    "empty_depths": (lambda: tree.tree_depths([]), ValueError, "root"),
    "three_dim_parents": (lambda: tree.ancestor_mask(torch.full((1, 1, 1), -1)), ValueError, "shape"),
    "float_choices": (lambda: tree.medusa_choices_to_tree([[0.5], [1.9]]), TypeError, "choices"),
    "path_to_batched": (lambda: tree.path_to([[-1, 0], [-1, 0]], 1), ValueError, "one"),
    "max_nodes_zero": (lambda: tree.merge_chains(5, [[1]], max_nodes=0), ValueError, "max_nodes"),
    "max_nodes_negative": (lambda: tree.merge_chains(5, [[1]], max_nodes=-3), ValueError, "max_nodes"),
    "max_nodes_float": (lambda: tree.merge_chains(5, [[1]], max_nodes=2.5), TypeError, "max_nodes"),
    "negative_token": (lambda: tree.merge_chains(5, [[1, -1]]), ValueError, "tokens"),
    "negative_root": (lambda: tree.merge_chains(-1, [[1]]), ValueError, "root_token"),
    "float_tokens": (lambda: tree.merge_chains(5, [[1.5]]), TypeError, "chains"),
    "merge_bad_root": (
        lambda: tree.merge_trees(5, [([5, 1], [0, 0])]),
        ValueError,
        r"trees\[0\]: parents\[0\] must be -1",
    ),
    "merge_forward_parent": (
        lambda: tree.merge_trees(5, [([5, 1], [-1, 0]), ([5, 1, 2], [-1, 2, 0])]),
        ValueError,
        r"trees\[1\]: parents must satisfy 0 <= parents\[i\] < i .*node 1 has parent 2",
    ),
    "merge_negative_parent": (
        lambda: tree.merge_trees(5, [([5, 1, 2], [-1, 0, -1])]),
        ValueError,
        "node 2 has parent -1",
    ),
    "merge_float_parents": (lambda: tree.merge_trees(5, [([5, 1], [-1, 0.5])]), TypeError, "parents"),
}


@pytest.mark.parametrize("case", list(BAD_HELPER_CALLS), ids=list(BAD_HELPER_CALLS))
def test_helpers_reject_bad_input_by_name(case):
    call, err, name = BAD_HELPER_CALLS[case]
    with pytest.raises(err, match=name):
        call()


def test_meta_parents_raise_a_clear_error():
    with pytest.raises(ValueError, match="meta"):
        tree.ancestor_mask(torch.tensor([-1, 0, 0], device="meta"))
