"""tree_rejection_sample: hand-worked trees, distribution tests, invariants and bad input."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.utils import DRAWS, assert_follows, bad_input_test, gen, on_each_backend, runnable_backends

BACKENDS = runnable_backends("tree_rejection_sample")

PARENTS = [-1, 0, 0]  # root with two children
TOKENS = [[9, 1, 2]]


sample = on_each_backend(sk.tree_rejection_sample, BACKENDS)


GOLDEN = {
    # deterministic children; p0 = [.1, .3, .4, .2]. node 1 (token 1): 0.5 * 1.0 >= 0.3 rejects,
    # p' loses token 1 (total 0.7); node 2 (token 2): 0.5 * 0.7 = 0.35 < 0.4 accepts.  Node 2 is a
    # leaf: sample from p2 = [.5, .5, 0, 0] with u = 0.6 -> threshold 0.6 -> token 1.
    "second_child_accepted": (None, [[0.5, 0.5]], [0.6], [[2, 1, -1]], [[0, 2, -1]], [0]),
    # node 2 with u = 0.9: 0.63 >= 0.4 rejects; p' = [.1, 0, 0, .2] (total .3); threshold
    # 0.5 * 0.3 = 0.15 -> cdf [.1, .1, .1, .3] -> token 3
    "both_children_rejected": (None, [[0.5, 0.9]], [0.5], [[3, -1, -1]], [[0, -1, -1]], [0]),
    # sampled children from q0 = uniform; p0 = [.1, .2, .5, .2]. node 1: 0.9 * .25 * 1 >= 0.2
    # rejects; p' = norm(max(0, p0 - q0)) = [0, 0, 1, 0] (total .25); node 2: 0.9 * .25 * .25 <
    # .25 accepts; leaf: p2 -> token 1 (u = 0.6)
    "sampled_second_child": ("uniform", [[0.9, 0.9]], [0.6], [[2, 1, -1]], [[0, 2, -1]], [0]),
}


@pytest.mark.parametrize("case", list(GOLDEN), ids=list(GOLDEN))
def test_golden(sample, case):
    draft, coins, final, want_out, want_nodes, _ = GOLDEN[case]
    p0 = [0.1, 0.3, 0.4, 0.2] if draft is None else [0.1, 0.2, 0.5, 0.2]
    target = torch.tensor([[p0, [0, 0, 0, 1.0], [0.5, 0.5, 0, 0]]])
    q = None if draft is None else torch.full((1, 3, 4), 0.25)
    out, nodes, acc = sample(
        target,
        torch.tensor(TOKENS),
        torch.tensor(PARENTS),
        q,
        uniform_samples=torch.tensor(coins),
        sample_uniforms=torch.tensor(final),
    )
    assert out.tolist() == want_out and nodes.tolist() == want_nodes
    assert acc.tolist() == [len([n for n in want_nodes[0] if n > 0])]


def test_accepted_path_goes_deep_and_bonus_comes_from_the_leaf(sample):
    # chain-shaped tree 0 -> 1 -> 2 with certain acceptance; the leaf's row puts all mass on 3
    target = torch.tensor([[[0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]]])
    out, nodes, acc = sample(
        target,
        torch.tensor([[0, 1, 2]]),
        torch.tensor([-1, 0, 1]),
        uniform_samples=torch.tensor([[0.99, 0.99]]),
        sample_uniforms=torch.tensor([0.5]),
    )
    assert out.tolist() == [[1, 2, 3]] and nodes.tolist() == [[0, 1, 2]] and acc.tolist() == [2]


def test_chain_tree_matches_chain_sampler_distribution():
    """A chain-shaped tree and rejection_sample realise the same law (first token ~ p0)."""
    g = gen(4)
    V, K = 10, 3
    target = sk.sampling_probs(torch.randn(1, K + 1, V, generator=g), 1.0)
    tokens = torch.cat([torch.zeros(1, 1, dtype=torch.long), target[0, :K].argmax(-1)[None]], 1)
    out, _, _ = reference.tree_rejection_sample(
        target.expand(DRAWS, -1, -1), tokens.expand(DRAWS, -1), torch.arange(-1, K), generator=gen(8)
    )
    assert_follows(out[:, 0], target[0, 0])


def random_case(V=12, seed=0):
    """A root with 3 children and 2 grandchildren under node 1; q close to p."""
    g = gen(seed)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1])
    logits = torch.randn(1, 6, V, generator=g) * 1.5
    return parents, logits, g


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, None, None), (0.6, None, None), (1.0, 6, None), (0.6, None, 0.9)],
    ids=["t1.0", "t0.6", "t1.0_topk6", "t0.6_topp0.9"],
)
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "topk_children"])
def test_distribution_matches_target(sampled, temperature, top_k, top_p):
    parents, logits, g = random_case(seed=3)
    target = sk.sampling_probs(logits, temperature, top_k, top_p)
    B, N, V = DRAWS, 6, logits.shape[-1]
    draft = sk.sampling_probs(logits + torch.randn(logits.shape, generator=g), temperature)
    tokens = torch.zeros(B, N, dtype=torch.long)
    if sampled:  # children drawn i.i.d. from q at their parent
        for node in range(1, N):
            tokens[:, node] = torch.multinomial(draft[0, parents[node]], B, replacement=True, generator=g)
        q = draft.expand(B, -1, -1)
    else:  # distinct deterministic children: the parent's top-k of the target
        top = target[0].topk(3, dim=-1).indices
        tokens[:, 1:4] = top[0]
        tokens[:, 4:6] = top[1, :2]
        q = None
    out, nodes, acc = reference.tree_rejection_sample(target.expand(B, -1, -1), tokens, parents, q, generator=g)
    assert_follows(out[:, 0], target[0, 0])
    via_node1 = nodes[:, 1] == 1  # next token after accepting node 1 follows row 1
    assert via_node1.sum() > 1000
    assert_follows(out[via_node1, 1], target[0, 1])
    assert (target[0, 0][out[:, 0]] > 0).all()


def test_invariants_and_batch_independence(sample):
    parents, logits, g = random_case(V=17, seed=5)
    B = 6
    target = sk.sampling_probs(logits.expand(B, -1, -1) + torch.randn(B, 6, 17, generator=g), 0.9)
    tokens = torch.randint(0, 17, (B, 6), generator=g)
    num_nodes = torch.tensor([6, 1, 4, 6, 2, 5])
    coins, final = torch.rand(B, 5, generator=g), torch.rand(B, generator=g)
    out, nodes, acc = sample(target, tokens, parents, None, num_nodes, uniform_samples=coins, sample_uniforms=final)
    assert torch.equal((out >= 0).sum(1), acc + 1)
    assert torch.equal((nodes >= 0).sum(1), acc + 1)
    assert (nodes < num_nodes[:, None]).all()
    for b in (0, 2, 5):
        one = sample(
            target[b : b + 1],
            tokens[b : b + 1],
            parents,
            None,
            num_nodes[b : b + 1],
            uniform_samples=coins[b : b + 1],
            sample_uniforms=final[b : b + 1],
        )
        assert torch.equal(one[0][0], out[b]) and torch.equal(one[1][0], nodes[b])


BAD = {
    "parents_order": (dict(tree_parents=torch.tensor([-1, 2, 0])), ValueError, "tree_parents"),
    "tokens_shape": (dict(tree_tokens=torch.zeros(1, 2, dtype=torch.long)), ValueError, "tree_tokens"),
    "draft_probs_shape": (dict(draft_probs=torch.zeros(1, 2, 4)), ValueError, "draft_probs"),
    "uniforms_shape": (dict(uniform_samples=torch.zeros(1, 3)), ValueError, "uniform_samples"),
    "num_nodes_range": (dict(num_nodes=torch.tensor([-1])), ValueError, "num_nodes"),
    "target_dtype": (dict(target_probs=torch.zeros(1, 3, 4, dtype=torch.int32)), TypeError, "target_probs"),
}


test_bad_input = bad_input_test(
    sk.tree_rejection_sample,
    BAD,
    lambda: dict(
        target_probs=torch.full((1, 3, 4), 0.25),
        tree_tokens=torch.zeros(1, 3, dtype=torch.long),
        tree_parents=torch.tensor(PARENTS),
    ),
)
