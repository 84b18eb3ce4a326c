"""verify_tree_greedy: hand-worked trees, invariants and bad input, on every backend."""

import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.ops import greedy
from tests.utils import bad_input_test, on_each_backend, runnable_backends

BACKENDS = runnable_backends("verify_tree_greedy")

# root 0 -> 1 (tok 5), 2 (tok 7); 1 -> 3 (tok 2); 2 -> 4 (tok 8), 5 (tok 9)
PARENTS = [-1, 0, 0, 1, 2, 2]
TOKENS = [11, 5, 7, 2, 8, 9]


def logits_with_argmax(argmax, vocab=13):
    """Logits [B, N, V] whose argmax is the given ids (a clear margin, no ties)."""
    return greedy.logits_with_argmax(argmax, vocab)


verify = on_each_backend(sk.verify_tree_greedy, BACKENDS)


def test_second_child_matches_twice(verify):
    # argmax at node 0 is 7 (node 2, the second child), at node 2 it is 9 (node 5), at node 5: 4
    logits = logits_with_argmax([[7, 0, 9, 0, 0, 4]])
    out, nodes, acc = verify(logits, torch.tensor([TOKENS]), torch.tensor(PARENTS))
    assert out.tolist() == [[7, 9, 4, -1, -1, -1]]
    assert nodes.tolist() == [[0, 2, 5, -1, -1, -1]]
    assert acc.tolist() == [2]


def test_no_child_matches(verify):
    logits = logits_with_argmax([[3, 0, 0, 0, 0, 0]])
    out, nodes, acc = verify(logits, torch.tensor([TOKENS]), torch.tensor(PARENTS))
    assert out.tolist() == [[3, -1, -1, -1, -1, -1]]
    assert nodes.tolist() == [[0, -1, -1, -1, -1, -1]] and acc.tolist() == [0]


def test_first_child_wins_between_equal_siblings(verify):
    parents, tokens = [-1, 0, 0, 1], [1, 6, 6, 3]  # two siblings with the same token
    logits = logits_with_argmax([[6, 3, 3, 2]])
    out, nodes, acc = verify(logits, torch.tensor([tokens]), torch.tensor(parents))
    assert nodes.tolist() == [[0, 1, 3, -1]] and out.tolist() == [[6, 3, 2, -1]] and acc.tolist() == [2]


def test_per_sequence_parents_and_ragged_nodes(verify):
    parents = torch.tensor([PARENTS, [-1, 0, 1, 2, 3, 4]])  # second sequence: a chain
    tokens = torch.tensor([TOKENS, [11, 1, 2, 3, 4, 5]])
    logits = logits_with_argmax([[7, 0, 9, 0, 0, 4], [1, 2, 3, 4, 5, 6]])
    num_nodes = torch.tensor([5, 3])  # node 5 missing in seq 0; seq 1 keeps nodes 0..2
    out, nodes, acc = verify(logits, tokens, parents, num_nodes)
    assert nodes.tolist() == [[0, 2, -1, -1, -1, -1], [0, 1, 2, -1, -1, -1]]
    assert out.tolist() == [[7, 9, -1, -1, -1, -1], [1, 2, 3, -1, -1, -1]]
    assert acc.tolist() == [1, 2]


def test_root_only_tree(verify):
    logits = logits_with_argmax([[4], [2]])
    out, nodes, acc = verify(logits, torch.tensor([[1], [1]]), torch.tensor([-1]))
    assert out.tolist() == [[4], [2]] and nodes.tolist() == [[0], [0]] and acc.tolist() == [0, 0]


def test_chain_tree_equals_verify_greedy(verify):
    B, K, V = 6, 7, 17
    logits, drafts, _ = greedy.drafts_near_argmax(B, K, V, seed=3, wrong=0.25, shift=3)
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), drafts], 1)
    out_t, nodes, acc_t = verify(logits, tokens, torch.arange(-1, K))
    out_c, acc_c = reference.verify_greedy(logits, drafts)
    assert torch.equal(acc_t, acc_c) and torch.equal(out_t[:, : K + 1], out_c)


BAD = {
    "parent_not_below_index": (dict(tree_parents=torch.tensor([-1, 0, 2])), ValueError, "tree_parents"),
    "root_parent": (dict(tree_parents=torch.tensor([0, 0, 1])), ValueError, "tree_parents"),
    "parents_length": (dict(tree_parents=torch.tensor([-1, 0])), ValueError, "tree_parents"),
    "tokens_shape": (dict(tree_tokens=torch.zeros(1, 4, dtype=torch.long)), ValueError, "tree_tokens"),
    "tokens_dtype": (dict(tree_tokens=torch.zeros(1, 3)), TypeError, "tree_tokens"),
    "num_nodes_range": (dict(num_nodes=torch.tensor([4])), ValueError, "num_nodes"),
    "logits_rank": (dict(target_logits=torch.zeros(3, 5)), ValueError, "target_logits"),
}


test_bad_input = bad_input_test(
    sk.verify_tree_greedy,
    BAD,
    lambda: dict(
        target_logits=torch.zeros(1, 3, 5),
        tree_tokens=torch.zeros(1, 3, dtype=torch.long),
        tree_parents=torch.tensor([-1, 0, 1]),
    ),
)
