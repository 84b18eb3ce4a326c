"""Triton verify_tree_greedy kernels against the reference (interpreter on CPU, the GPU when present).

Random topological trees (one shared by the batch, or one per sequence) up to 100 nodes,
ragged num_nodes, all logit dtypes and both id dtypes, trees where a later sibling is the
match, the split argmax over the vocabulary, strided inputs and the argmax edge cases.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.ops import verify_tree_greedy as op
from specdec_kernels.ops._triton.verify_tree_greedy import verify_tree_greedy_triton
from tests.utils import NAN, assert_docstring_is_the_fronts_own, each_dtype


def random_parents(N, g, bushy):
    """A topological parent list: parents[0] = -1, 0 <= parents[i] < i.

    ``bushy`` draws parents from the last few nodes (deep, branching trees); otherwise
    uniformly from all earlier nodes (shallow, wide trees).
    """
    parents = [-1]
    for i in range(1, N):
        low = max(0, i - 4) if bushy else 0
        parents.append(int(torch.randint(low, i, (1,), generator=g)))
    return torch.tensor(parents)


def make_case(B, N, V, *, shared, dtype=torch.float32, id_dtype=torch.int64, seed=0, corrupt=0.35):
    """Random logits; node i's token is the target argmax at its parent, with corruptions
    (a random id, an id >= V, or -1), so paths of every length occur; ragged num_nodes."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, N, V, generator=g).to(dtype)
    if shared:
        parents = random_parents(N, g, bushy=seed % 2 == 0)
        parent_rows = parents.expand(B, N)
    else:
        parents = torch.stack([random_parents(N, g, bushy=(seed + b) % 2 == 0) for b in range(B)])
        parent_rows = parents
    tokens = logits.argmax(-1).gather(1, parent_rows.clamp(min=0))
    kind = torch.randint(0, 3, (B, N), generator=g)
    bad = torch.where(kind == 0, torch.randint(0, V, (B, N), generator=g), torch.where(kind == 1, V + 2, -1))
    tokens = torch.where(torch.rand(B, N, generator=g) < corrupt, bad, tokens)
    num_nodes = torch.randint(0, N + 1, (B,), generator=g)
    num_nodes[0] = N
    return logits, tokens.to(id_dtype), parents.to(id_dtype), num_nodes


def run_triton(device, logits, tokens, parents, num_nodes, **tiling):
    outs = verify_tree_greedy_triton(
        logits.to(device), tokens.to(device), parents.to(device), num_nodes.to(device), **tiling
    )
    return tuple(t.cpu() for t in outs)


def assert_matches_reference(device, logits, tokens, parents, num_nodes, **tiling):
    got = run_triton(device, logits, tokens, parents, num_nodes, **tiling)
    want = reference.verify_tree_greedy(logits, tokens, parents, num_nodes)
    for name, g, w in zip(("output_tokens", "accepted_nodes", "num_accepted"), got, want):
        assert g.dtype == torch.int64, name
        assert torch.equal(g, w), (name, g, w)
    return got


# (B, N, V): one node (the root alone) to 100 nodes; small vocabularies make random tokens
# match often, 111 and 1000 are not powers of two.
SHAPES = [(1, 1, 7), (3, 2, 5), (8, 5, 3), (3, 9, 111), (1, 17, 4), (8, 33, 3), (3, 64, 5), (2, 65, 3), (3, 100, 4)]


@pytest.mark.parametrize("shared", [True, False], ids=["shared_tree", "per_sequence_tree"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{b}-N{n}-V{v}" for b, n, v in SHAPES])
def test_matches_reference(device, shape, shared):
    B, N, V = shape
    for seed, id_dtype in enumerate((torch.int32, torch.int64)):
        logits, tokens, parents, num_nodes = make_case(B, N, V, shared=shared, id_dtype=id_dtype, seed=seed)
        assert_matches_reference(device, logits, tokens, parents, num_nodes)


@each_dtype
def test_logit_dtypes(device, dtype):
    logits, tokens, parents, num_nodes = make_case(3, 20, 1000, shared=False, dtype=dtype, seed=7, corrupt=0.2)
    assert_matches_reference(device, logits, tokens, parents, num_nodes)


def test_paths_of_several_lengths_occur(device):
    """The random parity cases reach deep paths as well as stopping at the root."""
    lengths = set()
    for seed in range(3):
        logits, tokens, parents, num_nodes = make_case(8, 33, 3, shared=seed % 2 == 0, seed=seed)
        _, _, acc = assert_matches_reference(device, logits, tokens, parents, num_nodes)
        lengths.update(acc.tolist())
    assert 0 in lengths and max(lengths) >= 4


@pytest.mark.parametrize("N", [64, 65, 100])
def test_long_chain_fully_accepted(device, N):
    """A chain whose every draft matches: the path reaches the last node (index N - 1)."""
    logits = torch.randn(2, N, 5, generator=torch.Generator().manual_seed(N))
    parents = torch.arange(-1, N - 1)
    tokens = torch.cat([torch.zeros(2, 1, dtype=torch.int64), logits.argmax(-1)[:, :-1]], 1)
    tokens[1, N - 1] = -1  # the second sequence misses the last draft
    out, nodes, acc = assert_matches_reference(device, logits, tokens, parents, torch.tensor([N, N]))
    assert acc.tolist() == [N - 1, N - 2]
    assert nodes[0].tolist() == list(range(N)) and nodes[1, -1].item() == -1


def chain_logits(argmax_per_node, V=9):
    """Logits [B, N, V] whose argmax per node is given (clear margin, no ties)."""
    ids = torch.tensor(argmax_per_node)
    return torch.zeros(*ids.shape, V).scatter(-1, ids[..., None], 1.0)


def test_second_sibling_matches(device):
    # Root 0 has children 1, 2, 3; node 2 has children 4, 5; node 1 has child 6.
    parents = torch.tensor([-1, 0, 0, 0, 2, 2, 1])
    logits = chain_logits([[5, 0, 7, 0, 0, 0, 0]])  # argmax: root -> 5, node 2 -> 7
    tokens = torch.tensor([[0, 4, 5, 5, 3, 7, 5]])  # node 1 misses; 2 and 3 match (2 is first)
    out, nodes, acc = assert_matches_reference(device, logits, tokens, parents, torch.tensor([7]))
    assert nodes.tolist() == [[0, 2, 5, -1, -1, -1, -1]]
    assert out.tolist() == [[5, 7, 0, -1, -1, -1, -1]] and acc.tolist() == [2]


def test_equal_sibling_tokens_follow_the_lowest_index(device):
    # Children 1 and 2 of the root carry the same token; only node 2 has a matching child,
    # but the rule takes node 1 (lowest index) and stops there.
    parents = torch.tensor([-1, 0, 0, 2])
    logits = chain_logits([[4, 8, 6, 1]])
    tokens = torch.tensor([[0, 4, 4, 6]])
    out, nodes, acc = assert_matches_reference(device, logits, tokens, parents, torch.tensor([4]))
    assert nodes.tolist() == [[0, 1, -1, -1]] and out.tolist() == [[4, 8, -1, -1]] and acc.tolist() == [1]


def test_ragged_num_nodes_cut_the_path(device):
    # A chain 0 -> 1 -> 2 -> 3 whose tokens all match; num_nodes limits how far it goes.
    parents = torch.tensor([-1, 0, 1, 2])
    logits = chain_logits([[3, 1, 4, 6]] * 5)
    tokens = torch.tensor([[0, 3, 1, 4]] * 5)
    out, nodes, acc = assert_matches_reference(device, logits, tokens, parents, torch.tensor([4, 3, 2, 1, 0]))
    assert acc.tolist() == [3, 2, 1, 0, 0]
    # num_nodes = 0 still emits the argmax at the root, as the reference does.
    assert out.tolist() == [[3, 1, 4, 6], [3, 1, 4, -1], [3, 1, -1, -1], [3, -1, -1, -1], [3, -1, -1, -1]]


def test_out_of_range_tokens_never_match(device):
    parents = torch.tensor([-1, 0, 0, 0, 3])
    logits = chain_logits([[2, 0, 0, 5, 0]] * 2, V=6)
    big = 2**31 - 1
    tokens = torch.tensor([[0, -1, 6, 2, 5], [0, big, -(2**30), 8, 2]], dtype=torch.int32)
    out, nodes, acc = assert_matches_reference(device, logits, tokens, parents, torch.tensor([5, 5]))
    assert nodes.tolist() == [[0, 3, 4, -1, -1], [0, -1, -1, -1, -1]]
    assert out.tolist() == [[2, 5, 0, -1, -1], [2, -1, -1, -1, -1]]


def test_nan_and_tied_rows(device):
    V = 40
    parents = torch.tensor([-1, 0, 1, 1])
    logits = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(2))
    logits[0, 0] = NAN  # all-NaN root -> argmax 0
    logits[1, 0, 11] = 30.0
    logits[1, 0, 25] = NAN  # NaN after the max -> 25
    logits[2, 0, [33, 6, 19]] = 50.0  # tie -> 6
    tokens = torch.tensor([[0, 0, 1, 2], [0, 25, 0, 0], [0, 6, 0, 0]])
    out, nodes, acc = assert_matches_reference(
        device, logits, tokens, parents, torch.tensor([4, 4, 4]), block_v=16, num_splits=3
    )
    assert out[:, 0].tolist() == [0, 25, 6] and (acc >= 1).all()
    assert ((out >= -1) & (out < V)).all()


@pytest.mark.parametrize("block_v,num_splits", [(16, 2), (16, 1000), (64, 3)], ids=["b16-s2", "b16-smax", "b64-s3"])
def test_split_vocabulary(device, block_v, num_splits):
    logits, tokens, parents, num_nodes = make_case(2, 12, 300, shared=True, seed=num_splits, corrupt=0.2)
    assert_matches_reference(device, logits, tokens, parents, num_nodes, block_v=block_v, num_splits=num_splits)


def test_vocab_49152(device):
    logits, tokens, parents, num_nodes = make_case(2, 6, 49152, shared=False, dtype=torch.bfloat16, seed=3, corrupt=0.1)
    assert_matches_reference(device, logits, tokens, parents, num_nodes)


def test_strided_inputs(device):
    B, N, V = 3, 10, 111
    logits, tokens, parents, num_nodes = make_case(B, N, V, shared=False, seed=4)
    wide = torch.randn(B, N + 2, V)
    wide[:, :N] = logits
    spaced = torch.zeros(B, N, 2 * V)
    spaced[..., 1::2] = logits
    for view in (wide[:, :N], logits.transpose(0, 1).contiguous().transpose(0, 1), spaced[..., 1::2]):
        assert not view.is_contiguous()
        assert_matches_reference(device, view, tokens, parents, num_nodes)
    assert_matches_reference(device, logits, tokens.t().contiguous().t(), parents.t().contiguous().t(), num_nodes)
    shared = parents[0]
    assert_matches_reference(device, logits, tokens, torch.stack([shared, shared], 1)[:, 0], num_nodes)


def test_empty_batch(device):
    outs = run_triton(
        device,
        torch.zeros(0, 5, 11),
        torch.zeros(0, 5, dtype=torch.int64),
        torch.tensor([-1, 0, 0, 1, 1]),
        torch.zeros(0, dtype=torch.int64),
    )
    assert [tuple(t.shape) for t in outs] == [(0, 5), (0, 5), (0,)]
    assert all(t.dtype == torch.int64 for t in outs)


def test_public_op_dispatches_to_triton(device):
    assert "triton" in op.IMPLEMENTED
    logits, tokens, parents, num_nodes = make_case(
        3, 15, 7, shared=True, dtype=torch.float16, id_dtype=torch.int32, seed=5
    )
    got = sk.verify_tree_greedy(
        logits.to(device), tokens.to(device), parents.to(device), num_nodes.to(torch.int32).to(device), backend="triton"
    )
    want = reference.verify_tree_greedy(logits, tokens, parents, num_nodes)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
    got = sk.verify_tree_greedy(logits.to(device), tokens.to(device), parents.to(device), backend="triton")  # all nodes
    want = reference.verify_tree_greedy(logits, tokens, parents)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


def test_public_docstring_is_the_fronts_own():
    assert_docstring_is_the_fronts_own("verify_tree_greedy")


@pytest.mark.parametrize("shared", [True, False], ids=["shared_tree", "per_sequence_tree"])
def test_opcheck(device, shared):
    logits, tokens, parents, num_nodes = make_case(2, 6, 13, shared=shared, seed=6)
    args = (logits.to(device), tokens.to(device), parents.to(device), num_nodes.to(device))
    # the Triton launcher is no op of its own: the public op's Triton branch is what is checked
    torch.library.opcheck(torch.ops.specdec.verify_tree_greedy.default, args, {"backend": "triton"})
