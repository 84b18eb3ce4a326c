"""tree_rejection_sample, Triton kernel: token-exact parity with the reference for the same
randoms, distribution tests on the kernel itself, invariants, use of each random number, edge
cases, and the torch.library registration (opcheck)."""

import pytest
import torch

from specdec_kernels.ops import tree_rejection_sample as op
from specdec_kernels.ops.sampling_probs import sampling_probs
from specdec_kernels.reference.tree_rejection_sample import tree_rejection_sample as reference_tree_rejection_sample
from tests.ops import sampling
from tests.ops.sampling import TARGETS, TILINGS, random_probs
from tests.utils import DRAWS, assert_follows, assert_same, each_dtype, gen, requires_triton, to_device

pytestmark = requires_triton("tree_rejection_sample")


def kernel(*args, **kwargs):
    return op.tree_rejection_sample(*args, backend="triton", **kwargs)


def random_parents(N, g, fanout_bias=True):
    """A topological parent list; with fanout_bias nodes attach mostly to the first few nodes,
    which gives nodes with several children (several rejections in a row)."""
    parents = [-1]
    for i in range(1, N):
        hi = min(i, 3) if fanout_bias and torch.rand(1, generator=g) < 0.6 else i
        parents.append(int(torch.randint(0, hi, (1,), generator=g)))
    return torch.tensor(parents)


def tree_case(
    B, N, V, *, sampled, seed=0, dtype=torch.float32, shared=True, ragged=True, index_dtype=torch.int64, coin_power=1.0
):
    g = gen(seed)
    target = random_probs((B, N, V), g)
    if shared:
        parents = random_parents(N, g)
        per_seq = parents.expand(B, N)
    else:
        per_seq = torch.stack([random_parents(N, g) for _ in range(B)]) if B else torch.zeros(0, N, dtype=torch.long)
        parents = per_seq
    tokens = torch.zeros(B, N, dtype=torch.long)
    if sampled:
        draft = 0.5 * random_probs((B, N, V), g) + 0.5 * target
        for c in range(1, N):  # children of node i drawn i.i.d. from draft[:, i]
            rows = draft[torch.arange(B), per_seq[:, c]]
            tokens[:, c] = torch.multinomial(rows, 1, generator=g)[:, 0] if B else tokens[:, c]
    else:
        draft = None
        # distinct deterministic children: the k-th child of a node takes the k-th best token
        # of a noisy copy of the target row there
        for b in range(B):
            order = (target[b] + 0.3 * torch.rand(N, V, generator=g)).argsort(-1, descending=True)
            seen = {}
            for c in range(1, N):
                par = int(per_seq[b, c])
                k = seen.get(par, 0)
                seen[par] = k + 1
                tokens[b, c] = order[par, k % V]
        tokens[:, 0] = torch.randint(0, V, (B,), generator=g)
    counts = torch.randint(0, N + 1, (B,), generator=g) if ragged else torch.full((B,), N)
    coins = torch.rand(B, N - 1, generator=g) ** coin_power
    final = torch.rand(B, generator=g)
    return dict(
        target_probs=target.to(dtype),
        tree_tokens=tokens.to(index_dtype),
        tree_parents=parents.to(index_dtype),
        draft_probs=None if draft is None else draft.to(dtype),
        num_nodes=counts,
        uniform_samples=coins,
        sample_uniforms=final,
    )


ARGS = ("target_probs", "tree_tokens", "tree_parents", "draft_probs", "num_nodes")


def run_both(case, device):
    """(kernel result, reference result), both on CPU, for the same inputs and randoms."""
    return sampling.kernel_and_reference(kernel, reference_tree_rejection_sample, ARGS, case, device)


# ---------------------------------------------------------------------------------------------
# parity with the reference for the same randoms

SHAPES = [(1, 1, 1), (1, 2, 7), (3, 5, 111), (8, 9, 1000), (3, 13, 111), (8, 6, 7), (2, 64, 111), (2, 70, 50)]


@pytest.mark.parametrize("shared", [True, False], ids=["shared_tree", "per_sequence_trees"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
@pytest.mark.parametrize("B,N,V", SHAPES, ids=[f"B{b}-N{n}-V{v}" for b, n, v in SHAPES])
def test_matches_reference(device, B, N, V, sampled, shared):
    assert_same(*run_both(tree_case(B, N, V, sampled=sampled, shared=shared, seed=N * V), device))


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
@each_dtype
def test_matches_reference_low_precision_and_int32_ids(device, dtype, sampled):
    case = tree_case(4, 8, 111, sampled=sampled, seed=3, dtype=dtype, index_dtype=torch.int32, shared=False)
    assert_same(*run_both(case, device))


@pytest.mark.parametrize(
    "V,sampled",
    [(49152, True), (128256, False), (151936, True)],
    ids=["V49152-sampled", "V128256-deterministic", "V151936-sampled"],
)
def test_matches_reference_at_real_vocabulary_sizes(device, V, sampled):
    # high coins: several rejections at a node, so the residual is rebuilt over the whole row
    case = tree_case(1, 5, V, sampled=sampled, seed=V, ragged=False, coin_power=0.3)
    assert_same(*run_both(case, device))


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
def test_many_siblings_many_rejections(device, sampled):
    # a root with 15 children, then a chain: up to 15 successive residual updates at one node
    B, N, V = 16, 20, 37
    case = tree_case(B, N, V, sampled=sampled, seed=5, ragged=False, coin_power=0.2)
    parents = torch.tensor([-1] + [0] * 15 + [1, 16, 17, 18])
    case["tree_parents"] = parents
    if sampled:
        for c in range(1, N):
            case["tree_tokens"][:, c] = torch.multinomial(case["draft_probs"][:, int(parents[c])], 1, generator=gen(c))[
                :, 0
            ]
    got, want = run_both(case, device)
    assert_same(got, want)
    assert ((got[1][:, 1] > 3) | (got[2] == 0)).any()  # three or more rejections at the root


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
@pytest.mark.parametrize("tiling", TILINGS, ids=[f"BB{b}-BV{v}-S{s}" for b, v, s in TILINGS])
def test_vocabulary_chunks_match_reference(device, tiling, sampled):
    """Every chunking gives the reference's tokens: the nodes' totals t_0 are summed from chunk
    partials, the residual updates and the final sample walk the row in tiles (several rows a
    program)."""
    from functools import partial
    from unittest import mock

    from specdec_kernels.ops._triton import tree_rejection_sample as kernels

    block_b, block_v, splits = tiling
    tiled = partial(kernels.launch_config, tile=(block_b, block_v), num_splits=splits)
    with mock.patch.object(kernels, "launch_config", tiled):
        for B, N, V in [(1, 6, 111), (3, 5, 200), (2, 1, 37), (2, 20, 61)]:
            assert_same(*run_both(tree_case(B, N, V, sampled=sampled, seed=B * N + V, coin_power=0.3), device))


@pytest.mark.parametrize("seed", [0, 1, 3, 19])
def test_many_residual_updates_match_reference(device, seed):
    """Up to 12 successive residual updates at one node (each new total one pass over the row,
    rebuilt from the reciprocals of the totals before) agree with the reference, with several
    chunks per row and several tiles per pass."""
    from functools import partial
    from unittest import mock

    from specdec_kernels.ops._triton import tree_rejection_sample as kernels

    B, N, V = 8, 20, 37
    case = tree_case(B, N, V, sampled=True, seed=7 + seed, ragged=False, coin_power=0.2)
    parents = torch.tensor([-1] + [0] * 12 + [1, 1, 1, 13, 16, 16, 16])
    case["tree_parents"] = parents
    case["draft_probs"] = random_probs((B, N, V), gen(8 + seed))  # far from the target: many rejections
    for c in range(1, N):
        case["tree_tokens"][:, c] = torch.multinomial(case["draft_probs"][:, int(parents[c])], 1, generator=gen(c))[
            :, 0
        ]
    with mock.patch.object(kernels, "launch_config", partial(kernels.launch_config, tile=(16, 16), num_splits=3)):
        got, want = run_both(case, device)
    assert_same(got, want)
    assert ((got[1][:, 1] > 4) | (got[2] == 0)).any()  # four or more rejections at the root
    for B, N, V in SHAPES:
        assert_same(*run_both(tree_case(B, N, V, sampled=True, shared=False, seed=N + V + seed), device))


def test_duplicate_deterministic_children(device):
    # the same token twice among a node's children: once rejected it has no mass left
    B, V = 12, 9
    case = tree_case(B, 5, V, sampled=False, seed=9, ragged=False)
    case["tree_parents"] = torch.tensor([-1, 0, 0, 0, 0])
    case["tree_tokens"][:, 1:] = torch.tensor([3, 3, 5, 3])
    case["target_probs"][:, 0, 3] = 0.2  # mass 0.2 at token 3, below every first coin
    coins = torch.rand(B, 4, generator=gen(10))
    coins[:, 0] = 0.5 + 0.5 * coins[:, 0]  # the first 3 is rejected (0.2 / total < 0.5)
    coins[:, 1] = 0.0  # a coin of 0 accepts any token that still has mass
    case["uniform_samples"] = coins
    got, want = run_both(case, device)
    assert_same(got, want)
    assert (got[1][:, 1] != 2).all()  # the second 3 had no mass left: never accepted


# ---------------------------------------------------------------------------------------------
# invariants


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
def test_invariants(device, sampled):
    B, N, V = 24, 11, 40
    case = tree_case(B, N, V, sampled=sampled, seed=21, shared=False)
    (out, nodes, acc), _ = run_both(case, device)
    target, tokens, parents, counts = case["target_probs"], case["tree_tokens"], case["tree_parents"], case["num_nodes"]
    assert out.shape == nodes.shape == (B, N) and acc.shape == (B,)
    for b in range(B):
        n = int(acc[b])
        path = nodes[b, : n + 1].tolist()
        assert path[0] == 0 and (nodes[b, n + 1 :] == -1).all()
        for prev, node in zip(path, path[1:]):
            assert int(parents[b, node]) == prev and node < int(counts[b])  # child of the previous node
            assert target[b, prev, tokens[b, node]] > 0  # never accepts a zero-probability token
        assert (out[b] != -1).sum() == n + 1 and (out[b, n + 1 :] == -1).all()  # emitted = accepted + 1
        assert out[b, :n].tolist() == [int(tokens[b, node]) for node in path[1:]]
        tok = int(out[b, n])
        assert 0 <= tok < V and target[b, path[-1], tok] > 0  # the sample has mass at the last node


# ---------------------------------------------------------------------------------------------
# each random number is used at most once, and for one purpose


def coin_readers(parents, count, path):
    """Nodes whose coin the walk reads: children of a path node, up to the next path node."""
    used = set()
    for i, node in enumerate(path):
        nxt = path[i + 1] if i + 1 < len(path) else count
        used |= {c for c in range(1, count) if int(parents[c]) == node and c <= nxt}
    return used


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
def test_coins_of_untested_nodes_are_unused(device, sampled):
    B, N, V = 16, 12, 20
    case = tree_case(B, N, V, sampled=sampled, seed=31, shared=False)
    got, _ = run_both(case, device)
    nodes, acc = got[1], got[2]
    keep = torch.zeros(B, N - 1, dtype=torch.bool)
    for b in range(B):
        path = nodes[b, : int(acc[b]) + 1].tolist()
        for c in coin_readers(case["tree_parents"][b], int(case["num_nodes"][b]), path):
            keep[b, c - 1] = True
    assert keep.any() and (~keep).any()
    fresh = torch.rand(B, N - 1, generator=gen(99))
    again, _ = run_both(dict(case, uniform_samples=torch.where(keep, case["uniform_samples"], fresh)), device)
    assert_same(again, got)


def test_the_sample_uniform_only_moves_the_sampled_token(device):
    case = tree_case(16, 7, 30, sampled=True, seed=41)
    sampling.assert_only_the_sampled_token_moves(run_both, case, device, (0.01, 0.4, 0.7, 0.99))


# ---------------------------------------------------------------------------------------------
# edge cases


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
def test_root_only_and_empty_batch(device, sampled):
    assert_same(*run_both(tree_case(5, 1, 111, sampled=sampled, seed=51), device))
    draft = torch.rand(0, 4, 9, device=device) if sampled else None
    out, nodes, acc = kernel(
        torch.rand(0, 4, 9, device=device),
        torch.zeros(0, 4, dtype=torch.long, device=device),
        torch.tensor([-1, 0, 0, 1], device=device),
        draft,
    )
    assert out.shape == nodes.shape == (0, 4) and acc.shape == (0,)


def test_residual_without_mass_keeps_the_previous_residual(device):
    # q == p at the root and each child's token outside the support: every child is rejected,
    # max(0, p' - q) has no mass each time, so p' stays p and the final sample comes from p
    B = 8
    case = sampling.without_mass_at(4, (B, 4, 9), seed=61)
    case.update(
        tree_tokens=torch.full((B, 4), 4),
        tree_parents=torch.tensor([-1, 0, 0, 0]),
        draft_probs=case["target_probs"].clone(),
        num_nodes=None,
    )
    got, want = run_both(case, device)
    assert_same(got, want)
    assert (got[2] == 0).all() and (got[0][:, 0] != 4).all()


def test_unnormalised_rows_match_the_reference(device):
    for sampled in (True, False):
        case = tree_case(6, 7, 23, sampled=sampled, seed=71)
        case["target_probs"] = case["target_probs"] * torch.tensor([3.0, 0.2, 1.0, 7.0, 0.5, 1.0])[:, None, None]
        assert_same(*run_both(case, device))


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
def test_nan_and_negative_probabilities_carry_no_mass(device, sampled):
    B, N, V = 6, 6, 17
    case = tree_case(B, N, V, sampled=sampled, seed=81, ragged=False)
    t = case["target_probs"]
    t[:, :, ::3] = float("nan")
    t[:, :, 1::5] = -0.5
    t[0, 0] = float("nan")  # no mass at the root of sequence 0: it samples token 0
    if sampled:
        case["draft_probs"][:, :, 2::4] = float("nan")
    got, want = run_both(case, device)
    assert_same(got, want)
    out, nodes, acc = got
    assert acc[0] == 0 and out[0, 0] == 0
    for b in range(1, B):
        last = int(nodes[b, int(acc[b])])
        assert t[b, last, int(out[b, int(acc[b])])] > 0


def test_out_of_range_ids_are_rejected_without_reading_outside(device):
    B, N, V = 6, 5, 11
    for sampled in (True, False):
        case = tree_case(B, N, V, sampled=sampled, seed=91, ragged=False)
        big_t = torch.full((B, N, V + 20), 1e30)
        big_t[:, :, 10 : 10 + V] = case["target_probs"]
        case["target_probs"] = big_t[:, :, 10 : 10 + V]
        if sampled:
            big_q = torch.full((B, N, V + 20), 1e-30)
            big_q[:, :, 10 : 10 + V] = case["draft_probs"]
            case["draft_probs"] = big_q[:, :, 10 : 10 + V]
        case["tree_parents"] = torch.tensor([-1, 0, 0, 1, 2])
        case["tree_tokens"][:, 1] = torch.tensor([-1, V, V + 5, -10, 2**40, -(2**40)])
        got, want = run_both(case, device)
        assert_same(got, want)
        assert (got[1][:, 1] != 1).all() and ((got[0] >= -1) & (got[0] < V)).all()


# ---------------------------------------------------------------------------------------------
# distribution of the kernel's output

# root -> nodes 1, 2, 3; node 1 -> 4, 5; node 2 -> 6
TREE = torch.tensor([-1, 0, 0, 0, 1, 1, 2])


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
@pytest.mark.parametrize("setting", list(TARGETS), ids=list(TARGETS))
def test_distribution_matches_target(device, setting, sampled):
    V, N = 23, len(TREE)
    g = gen(101)
    logits_p = torch.randn(N, V, generator=g) * 1.5
    logits_q = logits_p + torch.randn(N, V, generator=g)
    p = sampling_probs(logits_p.to(device), backend="triton", **TARGETS[setting])
    q = sampling_probs(logits_q.to(device), temperature=1.0, backend="triton")
    pc, qc = p.cpu(), q.cpu()
    g = gen(202)
    tokens = torch.zeros(DRAWS, N, dtype=torch.long)
    if sampled:  # each child drawn i.i.d. from its parent's draft distribution
        for c in range(1, N):
            tokens[:, c] = torch.multinomial(qc[TREE[c]], DRAWS, replacement=True, generator=g)
        draft = q.expand(DRAWS, N, V)
    else:  # distinct deterministic children: the parent's draft top-k, in order
        rank = {}
        for c in range(1, N):
            par = int(TREE[c])
            tokens[:, c] = qc[par].argsort(descending=True)[rank.get(par, 0)]
            rank[par] = rank.get(par, 0) + 1
        draft = None
    out, nodes, acc = kernel(p.expand(DRAWS, N, V), tokens.to(device), TREE.to(device), draft, generator=gen(303))
    out, nodes, acc = out.cpu(), nodes.cpu(), acc.cpu()
    assert_follows(out[:, 0], pc[0])
    # having accepted node 1, the next token follows the target's row at node 1
    via1 = nodes[:, 1] == 1
    assert via1.sum() > 1000
    assert_follows(out[via1, 1], pc[1])


def test_distribution_negative_control(device):
    # a walk that forgets to remove a rejected deterministic child from p' is detectably wrong:
    # resampling the rejected rows' token from p (rejected child included) fails the test
    V, N = 23, 4
    g = gen(111)
    p = torch.softmax(torch.randn(N, V, generator=g), -1)
    tree = torch.tensor([-1, 0, 0, 0])
    children = p[0].argsort(descending=True)[:3]
    tokens = torch.cat([torch.zeros(1, dtype=torch.long), children]).expand(DRAWS, N).contiguous()
    out, nodes, acc = kernel(
        p.expand(DRAWS, N, V).to(device), tokens.to(device), tree.to(device), None, generator=gen(112)
    )
    sampling.assert_residual_matters(out.cpu(), acc.cpu(), p[0], g)


# ---------------------------------------------------------------------------------------------
# torch.library registration


@pytest.mark.parametrize("shared", [True, False], ids=["shared_tree", "per_sequence_trees"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
def test_opcheck(device, sampled, shared):
    case = to_device(tree_case(3, 6, 19, sampled=sampled, seed=121, shared=shared), device)
    parents = case["tree_parents"]
    parents = parents.expand(3, 6) if parents.dim() == 1 else parents
    args = (
        case["target_probs"],
        case["tree_tokens"],
        parents,
        case["draft_probs"],
        case["num_nodes"],
        case["uniform_samples"],
        case["sample_uniforms"],
    )
    # the Triton launcher is no op of its own: the public op's Triton branch is what is checked
    torch.library.opcheck(torch.ops.specdec.tree_rejection_sample.default, args, {"backend": "triton"})
