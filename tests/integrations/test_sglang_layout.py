"""SGLang's tree form: the converters of specdec_kernels.tree and the entry points of
specdec_kernels.serving.sglang, against plain-Python re-implementations of SGLang's kernels.

The re-implementations below follow the algorithms of sgl-kernel's ``verify_tree_greedy``
(eagle_utils.cu) and ``tree_speculative_sampling_target_only`` (speculative_sampling.cuh),
as SGLang's sources describe them, written here on nested Python lists (our code is not used
by them).
"""

import random
import re

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import tree
from specdec_kernels.serving import sglang as sg
from tests.ops.verify_tree_greedy.test_triton import random_parents
from tests.utils import DRAWS, P_THRESHOLD, chi_square_pvalue, gen, on_device, runnable_backends

GREEDY_BACKENDS = runnable_backends("verify_tree_greedy")
SAMPLE_BACKENDS = runnable_backends("tree_rejection_sample")


# --------------------------------------------------------------------------- SGLang in Python


def sglang_walk(b, candidates, retrive_index, next_token, next_sibling, num_spec_step, predicts, accept):
    """Row b's walk down SGLang's linked lists, the loop both kernels below share: from the root,
    at each of the num_spec_step - 1 steps, try the last accepted node's children in list order
    (retrive_next_token, then retrive_next_sibling) with accept(last accepted node, child); the
    first one accepted writes its token into predicts at the last accepted node's retrive_index
    and becomes the last accepted node; a step that accepts none ends the walk.  Returns the
    row's accept_index, the number of accepted nodes and the last accepted node."""
    accept_index = [-1] * num_spec_step
    accept_index[0] = retrive_index[b][0]
    node, cur, num = 0, 0, 0
    for _ in range(1, num_spec_step):
        cur = next_token[b][cur]
        while cur != -1:
            if accept(node, cur):
                predicts[retrive_index[b][node]] = candidates[b][cur]
                num += 1
                accept_index[num] = retrive_index[b][cur]
                node = cur
                break
            cur = next_sibling[b][cur]
        if cur == -1:
            break
    return accept_index, num, node


def sglang_verify_tree_greedy(candidates, retrive_index, next_token, next_sibling, target_predict, num_spec_step):
    """SGLang's greedy tree verification; target_predict is flat [B * N], read at retrive_index.

    Follows sgl-kernel's ``verify_tree_greedy`` (eagle_utils.cu): a child is accepted when its
    token is the target's argmax at the last accepted node."""
    B, N = len(candidates), len(candidates[0])
    predicts = [-1] * (B * N)
    accept_index, accept_num = [], []
    for b in range(B):
        index, num, node = sglang_walk(
            b,
            candidates,
            retrive_index,
            next_token,
            next_sibling,
            num_spec_step,
            predicts,
            lambda node, cur: candidates[b][cur] == target_predict[retrive_index[b][node]],
        )
        accept_index.append(index)
        accept_num.append(num)
        last = retrive_index[b][node]
        predicts[last] = target_predict[last]
    return predicts, accept_index, accept_num


def sglang_target_only(
    candidates,
    retrive_index,
    next_token,
    next_sibling,
    coins,
    final_coins,
    target_probs,
    num_spec_step,
    threshold_single=1.0,
    threshold_acc=1.0,
):
    """SGLang's target-only tree sampling (draft_probs zero-initialised, written on rejection).

    Follows sgl-kernel's ``tree_speculative_sampling_target_only`` (speculative_sampling.cuh):
    the children of the last accepted node are tried against its coin with their target
    probabilities accumulated (relaxed by threshold_acc and threshold_single); the final token
    is drawn from the last accepted node's target row less the rejected children's."""
    B, N, V = len(target_probs), len(target_probs[0]), len(target_probs[0][0])
    threshold_acc = max(threshold_acc, 1e-9)
    predicts = [-1] * (B * N)
    accept_index, accept_num = [], []
    for b in range(B):
        marked = [[0.0] * V for _ in range(N)]  # SGLang's draft_probs, written on rejection
        prob_acc = 0.0

        def accept(node, cur):
            nonlocal prob_acc
            token = candidates[b][cur]
            single = target_probs[b][node][token]
            prob_acc += single
            if coins[b][node] <= prob_acc / threshold_acc or single >= threshold_single:
                prob_acc = 0.0
                return True
            marked[node][token] = single
            return False

        index, num, row = sglang_walk(
            b, candidates, retrive_index, next_token, next_sibling, num_spec_step, predicts, accept
        )
        accept_index.append(index)
        accept_num.append(num)
        subtract = marked[row] if num != num_spec_step - 1 else [0.0] * V
        weights = [max(t - d, 0.0) for t, d in zip(target_probs[b][row], subtract)]
        u, acc, token = final_coins[b] * sum(weights), 0.0, None
        for v, w in enumerate(weights):
            acc += w
            if w > 0 and acc > u:
                token = v
                break
        if token is None:  # u at or past the total by rounding: the last token with mass
            token = max(v for v, w in enumerate(weights) if w > 0)
        predicts[retrive_index[b][row]] = token
    return predicts, accept_index, accept_num


def python_bfs(next_token, next_sibling):
    """One row's expected renumbering: breadth-first, children in list order."""
    N = len(next_token)
    order, parents, depths, k = [0], [-1], [0], 0
    while k < len(order):
        child = next_token[order[k]]
        while child != -1:
            order.append(child)
            parents.append(k)
            depths.append(depths[k] + 1)
            child = next_sibling[child]
        k += 1
    n = len(order)
    order += sorted(set(range(N)) - set(order))
    return order, parents + [0] * (N - n), n, depths + [-1] * (N - n)


def random_sglang_tree(N, n_real, rng, bushy=False):
    """Linked lists of a random tree of n_real nodes among N local slots: root 0, the other
    nodes at random slots (the rest padding with -1 links), sibling lists in random order."""
    labels = [0] + rng.sample(range(1, N), n_real - 1)
    children = {k: [] for k in range(n_real)}
    for k in range(1, n_real):
        children[rng.randint(max(0, k - 3) if bushy else 0, k - 1)].append(k)
    next_token, next_sibling = [-1] * N, [-1] * N
    for k, kids in children.items():
        rng.shuffle(kids)
        if kids:
            next_token[labels[k]] = labels[kids[0]]
        for a, c in zip(kids, kids[1:]):
            next_sibling[labels[a]] = labels[c]
    return next_token, next_sibling, labels, children


def random_batch(B, N, seed, full=False):
    rng = random.Random(seed)
    rows = [random_sglang_tree(N, N if full or b == 0 else rng.randint(1, N), rng, bushy=b % 2 == 1) for b in range(B)]
    nt = torch.tensor([r[0] for r in rows])
    ns = torch.tensor([r[1] for r in rows])
    return nt, ns, rows


def standard_retrive_index(B, N):
    return torch.arange(B * N).view(B, N)


# --------------------------------------------------------------------------- converters


def test_from_sglang_tree_renumbers_sibling_list_order_by_hand():
    # the root lists [3, 1]: node 3 is tried first, so it becomes our node 1; node 3's child 4
    # then precedes node 1's child 2
    t = sg.from_sglang_tree(torch.tensor([3, 2, -1, 4, -1]), torch.tensor([-1, -1, -1, 1, -1]))
    assert t.order.tolist() == [0, 3, 1, 4, 2]
    assert t.parents.tolist() == [-1, 0, 0, 1, 2]
    assert t.depths.tolist() == [0, 1, 1, 2, 2]
    assert t.num_nodes.shape == () and int(t.num_nodes) == 5


def test_from_sglang_tree_batch_with_padding_by_hand():
    # row 0: root -> [1, 2], 2 -> [3]; row 1: root -> [2], slots 1 and 3 padding (-1 lists);
    # row 2: the root alone
    nt = torch.tensor([[1, -1, 3, -1], [2, -1, -1, -1], [-1, -1, -1, -1]])
    ns = torch.tensor([[-1, 2, -1, -1], [-1, -1, -1, -1], [-1, -1, -1, -1]])
    t = sg.from_sglang_tree(nt, ns)
    assert t.order.tolist() == [[0, 1, 2, 3], [0, 2, 1, 3], [0, 1, 2, 3]]
    assert t.parents.tolist() == [[-1, 0, 0, 2], [-1, 0, 0, 0], [-1, 0, 0, 0]]
    assert t.num_nodes.tolist() == [4, 2, 1]
    assert t.depths.tolist() == [[0, 1, 1, 2], [0, 1, -1, -1], [0, -1, -1, -1]]


def test_from_sglang_tree_of_an_ascending_breadth_first_tree_is_the_identity():
    # what build_tree_kernel_efficient makes for a depth-sorted tree: lists ascending
    nt, ns = torch.tensor([1, 3, 5, -1, -1, -1]), torch.tensor([-1, 2, -1, 4, -1, -1])
    t = sg.from_sglang_tree(nt, ns)
    assert t.order.tolist() == list(range(6)) and t.parents.tolist() == [-1, 0, 0, 1, 1, 2]


def test_to_sglang_tree_by_hand():
    nt, ns = sg.to_sglang_tree([-1, 0, 0, 1, 2])
    assert nt.tolist() == [1, 3, 4, -1, -1] and ns.tolist() == [-1, 2, -1, -1, -1]
    nt, ns = sg.to_sglang_tree(torch.tensor([[-1, 0, 0, 0], [-1, 0, 1, 0]]), torch.tensor([4, 2]))
    assert nt.tolist() == [[1, -1, -1, -1], [1, -1, -1, -1]]
    assert ns.tolist() == [[-1, 2, 3, -1], [-1, -1, -1, -1]]
    assert sg.to_sglang_tree([-1, 0, 0], 0)[0].tolist() == [-1, -1, -1]


@pytest.mark.parametrize("N", [1, 2, 7, 16, 33])
def test_from_sglang_tree_matches_python_walk_on_random_batches(N):
    nt, ns, _ = random_batch(5, N, seed=N)
    t = sg.from_sglang_tree(nt, ns)
    for b in range(5):
        order, parents, n, depths = python_bfs(nt[b].tolist(), ns[b].tolist())
        assert t.order[b].tolist() == order and t.parents[b].tolist() == parents
        assert int(t.num_nodes[b]) == n and t.depths[b].tolist() == depths
    real = torch.arange(N) < t.num_nodes[:, None]
    assert torch.equal(torch.where(real, tree.tree_depths(t.parents), -1), t.depths)
    # int32 links and validate=False (the path CUDA takes) give the same tree
    again = sg.from_sglang_tree(nt.int(), ns.int(), validate=False)
    assert all(torch.equal(a, b) for a, b in zip(again, t))


def builder_trees():
    g = gen(11)
    medusa = tree.medusa_choices_to_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2, 0], [0, 1, 0]])
    merged = tree.merge_chains(5, [[1, 2, 3], [1, 4], [7, 8], [1, 2, 9]])
    return {
        "medusa": medusa.parents,
        "merge_chains": torch.tensor(merged.parents),
        "random_wide": random_parents(20, g, bushy=False),
        "random_deep": random_parents(20, g, bushy=True),
        "root_only": torch.tensor([-1]),
    }


@pytest.mark.parametrize("name", list(builder_trees()))
def test_round_trip_relabels_and_keeps_sibling_order(name):
    parents = builder_trees()[name]
    nt, ns = sg.to_sglang_tree(parents)
    t = sg.from_sglang_tree(nt, ns)
    N = parents.numel()
    assert int(t.num_nodes) == N
    inv = t.order.argsort()  # SGLang (= original) index -> our index
    assert t.parents[0] == -1
    assert all(int(t.parents[i]) == int(inv[parents[t.order[i]]]) for i in range(1, N))
    for a in range(1, N):  # siblings keep their relative order
        for c in range(a + 1, N):
            if parents[a] == parents[c]:
                assert inv[a] < inv[c]
    assert torch.equal(t.depths, tree.tree_depths(parents)[t.order])
    # back to SGLang's lists in our numbering: the same lists, relabelled
    nt2, ns2 = sg.to_sglang_tree(t.parents)
    relabel = lambda x: torch.where(x >= 0, inv[x.clamp(min=0)], -1)  # noqa: E731
    assert torch.equal(nt2, relabel(nt)[t.order]) and torch.equal(ns2, relabel(ns)[t.order])
    if name in ("medusa", "root_only"):  # already breadth-first: the identity
        assert t.order.tolist() == list(range(N)) and torch.equal(t.parents, parents)


def test_round_trip_of_a_padded_batch():
    g = gen(3)
    parents = torch.stack([random_parents(9, g, bushy=b % 2 == 0) for b in range(4)])
    num_nodes = torch.tensor([9, 1, 5, 3])
    nt, ns = sg.to_sglang_tree(parents, num_nodes)
    assert (nt[1] == -1).all() and (ns[1] == -1).all()
    t = sg.from_sglang_tree(nt, ns)
    assert torch.equal(t.num_nodes, num_nodes)
    for b in range(4):
        n = int(num_nodes[b])
        assert t.order[b, n:].tolist() == list(range(n, 9))  # the padding, in ascending order
        assert (t.depths[b, n:] == -1).all()


def sg_args(nt, ns):
    return dict(
        retrive_next_token=torch.tensor(nt, dtype=torch.long), retrive_next_sibling=torch.tensor(ns, dtype=torch.long)
    )


BAD_TREES = {
    "sibling_cycle": (sg_args([1, -1, -1], [-1, 2, 1]), ValueError, "retrive_next_sibling"),
    "first_child_is_root": (sg_args([1, 0, -1], [-1, -1, -1]), ValueError, "retrive_next_token"),
    "sibling_is_root": (sg_args([1, -1, -1], [-1, 0, -1]), ValueError, "retrive_next_sibling"),
    "self_child": (sg_args([1, 1, -1], [-1, -1, -1]), ValueError, "retrive_next_token"),
    # root lists [1, 3, 2] and node 1 lists [2]: node 1's first-child link reaches 2 again
    "two_parents": (sg_args([1, 2, -1, -1], [-1, 3, -1, 2]), ValueError, "retrive_next_token"),
    # root lists [1, 3] and node 1 lists [2, 3]: node 2's sibling link reaches 3 again
    "shared_sibling": (sg_args([1, 2, -1, -1], [-1, 3, 3, -1]), ValueError, "retrive_next_sibling"),
    "shared_first_child": (sg_args([1, 3, 3, -1], [-1, 2, -1, -1]), ValueError, "retrive_next_token"),
    "link_past_n": (sg_args([1, 3, -1], [-1, -1, -1]), ValueError, "retrive_next_token"),
    "link_below_minus_one": (sg_args([1, -1, -1], [-1, -2, -1]), ValueError, "retrive_next_sibling"),
    "shape_mismatch": (
        dict(retrive_next_token=torch.tensor([-1, -1]), retrive_next_sibling=torch.tensor([-1])),
        ValueError,
        "retrive_next_sibling",
    ),
    "empty": (sg_args([], []), ValueError, "retrive_next_token"),
    "three_dims": (
        dict(retrive_next_token=torch.full((1, 1, 2), -1), retrive_next_sibling=torch.full((1, 1, 2), -1)),
        ValueError,
        "retrive_next_token",
    ),
    "float_links": (
        dict(retrive_next_token=torch.tensor([-1.0]), retrive_next_sibling=torch.tensor([-1])),
        TypeError,
        "retrive_next_token",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TREES), ids=list(BAD_TREES))
def test_invalid_lists_raise_naming_the_argument(case):
    args, err, name = BAD_TREES[case]
    with pytest.raises(err, match=re.escape(name)):
        sg.from_sglang_tree(**args)


def test_unchecked_bad_lists_still_give_a_valid_tree():
    # a sibling cycle and an out-of-range link, unchecked: the walk stops, the tree is valid
    t = sg.from_sglang_tree(
        torch.tensor([[1, -1, -1, -1], [1, 9, -1, -1]]), torch.tensor([[-1, 2, 1, -1], [-1, 2, -1, -1]]), validate=False
    )
    assert t.num_nodes.tolist() == [3, 3]
    for b in range(2):
        assert sorted(t.order[b].tolist()) == [0, 1, 2, 3]
        sk.tree.tree_depths(t.parents[b])  # a valid parent list


def test_to_sglang_tree_bad_input():
    with pytest.raises(ValueError, match="num_nodes"):
        sg.to_sglang_tree([-1, 0], 3)
    with pytest.raises(ValueError, match="parents"):
        sg.to_sglang_tree([-1, 1, 0])
    with pytest.raises(TypeError, match="num_nodes"):
        sg.to_sglang_tree([-1, 0], 1.5)


# --------------------------------------------------------------------------- greedy


def greedy_case(B, N, V, seed, full=False):
    """Random SGLang trees; a node's token is the target argmax at its parent with
    probability 0.6 (else random, small V makes collisions), so paths of every length occur."""
    nt, ns, rows = random_batch(B, N, seed, full)
    g = gen(seed)
    logits = torch.randn(B, N, V, generator=g)
    argmax = logits.argmax(-1)
    candidates = torch.randint(0, V, (B, N), generator=g)
    for b, (_, _, labels, children) in enumerate(rows):
        for k, kids in children.items():
            for c in kids:
                if torch.rand((), generator=g) < 0.6:
                    candidates[b, labels[c]] = argmax[b, labels[k]]
    return candidates, nt, ns, logits


def sglang_comparisons(op, device, backend, shape, make_case, seed_stride, steps):
    """The runs that compare an entry point of specdec_kernels.serving with SGLang's kernel in
    Python: (op on device with backend, seed, make_case(B, N, V, seed + seed_stride * N),
    the standard retrive_index, num_spec_step) for seeds 0 and 1 and each num_spec_step of steps."""
    B, N, V = shape
    fn = on_device(op, device, backend=backend)
    for seed in range(2):
        case = make_case(B, N, V, seed=seed + seed_stride * N)
        ri = standard_retrive_index(B, N)
        for num_spec_step in sorted(steps):
            yield fn, seed, case, ri, num_spec_step


GREEDY_SHAPES = [(1, 1, 3), (3, 2, 4), (4, 7, 5), (2, 12, 3), (3, 9, 111)]


@pytest.mark.parametrize("backend", GREEDY_BACKENDS)
@pytest.mark.parametrize("shape", GREEDY_SHAPES, ids=[f"B{b}-N{n}-V{v}" for b, n, v in GREEDY_SHAPES])
def test_verify_tree_greedy_sglang_matches_sglang(device, backend, shape):
    B, N, V = shape
    runs = sglang_comparisons(sg.verify_tree_greedy_sglang, device, backend, shape, greedy_case, 10, {1, 2, 3, N + 2})
    for fn, seed, (candidates, nt, ns, logits), ri, steps in runs:
        want = sglang_verify_tree_greedy(
            candidates.tolist(), ri.tolist(), nt.tolist(), ns.tolist(), logits.argmax(-1).flatten().tolist(), steps
        )
        # seed 1: the flat logits layout and int32 ids and links
        flat = logits.reshape(B * N, V) if seed else logits
        ids = [x.int() if seed else x for x in (candidates, ri, nt, ns)]
        predicts, accept_index, accept_num = fn(*ids, flat, num_spec_step=steps)
        assert predicts.dtype == accept_index.dtype == accept_num.dtype == torch.int32
        assert accept_index.shape == (B, steps)
        assert predicts.tolist() == want[0], (steps, seed)
        assert accept_index.tolist() == want[1] and accept_num.tolist() == want[2]


def test_verify_tree_greedy_sglang_accepts_a_later_sibling_by_hand():
    """Root 0 with children 1, 2 (in that list order) and 3 under 2: the target's argmax at
    the root is node 2's token, not node 1's, so the walk must go past the list's head.
    Both our op and the transliteration give the hand-worked result."""
    V = 10
    candidates = torch.tensor([[0, 5, 7, 9]])
    next_token = torch.tensor([[1, -1, 3, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, -1]])
    argmax = torch.tensor([[7, 1, 9, 4]])  # the target's argmax at each node
    logits = torch.nn.functional.one_hot(argmax, V).float()
    ri = standard_retrive_index(1, 4)
    predicts, accept_index, accept_num = sg.verify_tree_greedy_sglang(
        candidates, ri, next_token, next_sibling, logits, num_spec_step=3
    )
    assert accept_index.tolist() == [[0, 2, 3]] and accept_num.tolist() == [2]
    assert [predicts.flatten().tolist()[i] for i in (0, 2, 3)] == [7, 9, 4]  # drafts 2, 3, then the bonus
    want = sglang_verify_tree_greedy(
        candidates.tolist(), ri.tolist(), next_token.tolist(), next_sibling.tolist(), argmax.flatten().tolist(), 3
    )
    assert want[1] == accept_index.tolist() and want[2] == accept_num.tolist()
    assert [want[0][i] for i in (0, 2, 3)] == [7, 9, 4]


def test_verify_tree_greedy_sglang_sometimes_accepts_a_later_sibling():
    """The random cases exercise list order: some accepted node is not its list's head."""
    hits = 0
    for seed in range(4):
        candidates, nt, ns, logits = greedy_case(4, 12, 3, seed=seed + 120)
        _, accept_index, _ = sg.verify_tree_greedy_sglang(
            candidates, standard_retrive_index(4, 12), nt, ns, logits, num_spec_step=12
        )
        for b in range(4):
            heads = set(nt[b].tolist())  # the first child of every list
            hits += sum(int(i) % 12 not in heads for i in accept_index[b, 1:] if i >= 0)
    assert hits > 0


def test_verify_tree_greedy_sglang_on_our_tree_equals_our_op():
    g = gen(5)
    B, N, V = 4, 10, 3
    parents = torch.stack([random_parents(N, g, bushy=b % 2 == 0) for b in range(B)])
    logits = torch.randn(B, N, V, generator=g)
    tokens = torch.where(
        torch.rand(B, N, generator=g) < 0.7,
        logits.argmax(-1).gather(1, parents.clamp(min=0)),
        torch.randint(0, V, (B, N), generator=g),
    )
    out, nodes, acc = sk.verify_tree_greedy(logits, tokens, parents)
    nt, ns = sg.to_sglang_tree(parents)
    predicts, accept_index, accept_num = sg.verify_tree_greedy_sglang(
        tokens, standard_retrive_index(B, N), nt, ns, logits, num_spec_step=N
    )
    assert torch.equal(accept_num.long(), acc)
    assert torch.equal(accept_index.long(), torch.where(nodes >= 0, nodes + N * torch.arange(B)[:, None], -1))
    for b in range(B):
        path = nodes[b, : int(acc[b]) + 1]
        assert torch.equal(predicts[b * N + path].long(), out[b, : int(acc[b]) + 1])


def test_retrive_index_addresses_the_outputs():
    """retrive_index only says where outputs go: a permuted retrive_index permutes them."""
    B, N, V = 3, 6, 4
    candidates, nt, ns, logits = greedy_case(B, N, V, seed=7, full=True)
    perm = torch.randperm(B * N, generator=gen(1))
    base = sg.verify_tree_greedy_sglang(candidates, standard_retrive_index(B, N), nt, ns, logits, num_spec_step=N)
    moved = sg.verify_tree_greedy_sglang(candidates, perm.view(B, N), nt, ns, logits, num_spec_step=N)
    assert torch.equal(moved[0][perm], base[0])
    assert torch.equal(moved[1], torch.where(base[1] >= 0, perm[base[1].long().clamp(min=0)].int(), -1))
    assert torch.equal(moved[2], base[2])


# --------------------------------------------------------------------------- sampling


def sampling_case(B, N, V, seed, full=False, temperature=0.5):
    """Random SGLang trees with distinct tokens among siblings; target rows normalised."""
    nt, ns, rows = random_batch(B, N, seed, full)
    g = gen(seed)
    target = torch.softmax(torch.randn(B, N, V, generator=g, dtype=torch.float64) * 2 / temperature, -1).float()
    candidates = torch.randint(0, V, (B, N), generator=g)
    for b, (_, _, labels, children) in enumerate(rows):
        for k, kids in children.items():
            # half the time the parent's most likely tokens, else random distinct ones
            pick = target[b, labels[k]].argsort(descending=True) if seed % 2 else torch.randperm(V, generator=g)
            for c, token in zip(kids, pick.tolist()):
                candidates[b, labels[c]] = token
    coins, final = torch.rand(B, N, generator=g), torch.rand(B, generator=g)
    return candidates, nt, ns, target, coins, final


def python_target_only(candidates, nt, ns, target, coins, final, steps, **thresholds):
    B, N = candidates.shape
    return sglang_target_only(
        candidates.tolist(),
        standard_retrive_index(B, N).tolist(),
        nt.tolist(),
        ns.tolist(),
        coins.tolist(),
        final.tolist(),
        target.double().tolist(),
        steps,
        **thresholds,
    )


SAMPLE_SHAPES = [(1, 1, 5), (3, 2, 4), (4, 7, 6), (3, 9, 17)]


@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
@pytest.mark.parametrize("shape", SAMPLE_SHAPES, ids=[f"B{b}-N{n}-V{v}" for b, n, v in SAMPLE_SHAPES])
def test_target_only_sampling_gives_sglang_tokens_for_the_same_uniforms(device, backend, shape):
    B, N, V = shape
    runs = sglang_comparisons(sg.tree_rejection_sample_sglang, device, backend, shape, sampling_case, 7, {1, 3, N + 1})
    for fn, seed, (candidates, nt, ns, target, coins, final), ri, steps in runs:
        want = python_target_only(candidates, nt, ns, target, coins, final, steps)
        got = fn(
            candidates,
            ri,
            nt,
            ns,
            target,
            None,
            num_spec_step=steps,
            uniform_samples=coins,
            uniform_samples_for_final_sampling=final,
        )
        assert got[0].tolist() == want[0], (seed, steps)
        assert got[1].tolist() == want[1] and got[2].tolist() == want[2]


@pytest.mark.parametrize(
    "thresholds",
    [
        dict(threshold_single=0.3),
        dict(threshold_acc=0.5),
        dict(threshold_single=0.2, threshold_acc=0.1),
        dict(threshold_acc=0.0),
    ],
    ids=["single0.3", "acc0.5", "single0.2_acc0.1", "acc0"],
)
def test_thresholds_reproduce_sglang_relaxation(thresholds):
    B, N, V = 6, 9, 7
    for seed in range(3):
        candidates, nt, ns, target, coins, final = sampling_case(B, N, V, seed=seed, temperature=0.7)
        want = python_target_only(candidates, nt, ns, target, coins, final, N, **thresholds)
        got = sg.tree_rejection_sample_sglang(
            candidates,
            standard_retrive_index(B, N),
            nt,
            ns,
            target,
            num_spec_step=N,
            uniform_samples=coins,
            uniform_samples_for_final_sampling=final,
            **thresholds,
        )
        assert got[0].tolist() == want[0] and got[1].tolist() == want[1] and got[2].tolist() == want[2]


def test_all_zero_draft_probs_are_taken_as_none():
    B, N, V = 4, 7, 6
    candidates, nt, ns, target, coins, final = sampling_case(B, N, V, seed=3)
    ri = standard_retrive_index(B, N)
    kw = dict(num_spec_step=N, uniform_samples=coins, uniform_samples_for_final_sampling=final)
    none = sg.tree_rejection_sample_sglang(candidates, ri, nt, ns, target, None, **kw)
    zeros = sg.tree_rejection_sample_sglang(candidates, ri, nt, ns, target, torch.zeros(B, N, V), **kw)
    assert all(torch.equal(a, b) for a, b in zip(none, zeros))
    # our op given the zeros as q = 0 accepts the first child whenever it has mass: lossy
    t = sg.from_sglang_tree(nt, ns)
    rows = torch.arange(B)[:, None]
    _, nodes, _ = sk.tree_rejection_sample(
        target[rows, t.order],
        candidates.gather(1, t.order),
        t.parents,
        torch.zeros(B, N, V),
        t.num_nodes,
        uniform_samples=torch.full((B, N - 1), 0.99),
        sample_uniforms=final,
    )
    has_child = nt[:, 0] >= 0
    assert (nodes[has_child, 1] == 1).all()


@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_draft_probs_run_our_op_on_the_converted_tree(device, backend):
    B, N, V = 3, 8, 9
    candidates, nt, ns, target, coins, final = sampling_case(B, N, V, seed=4)
    draft = torch.softmax(torch.randn(B, N, V, generator=gen(9)), -1)
    draft[0, nt[0] == -1] = 0  # zero rows are fine at leaves (no child is drawn from them)
    t = sg.from_sglang_tree(nt, ns)
    ri = standard_retrive_index(B, N)
    steps = 4
    got = on_device(sg.tree_rejection_sample_sglang, device, backend=backend)(
        candidates,
        ri,
        nt,
        ns,
        target,
        draft,
        num_spec_step=steps,
        uniform_samples=coins,
        uniform_samples_for_final_sampling=final,
    )
    rows = torch.arange(B)[:, None]
    n = ((t.depths >= 0) & (t.depths < steps)).sum(1)
    out, nodes, acc = sk.tree_rejection_sample(
        target[rows, t.order],
        candidates.gather(1, t.order),
        t.parents,
        draft[rows, t.order],
        n,
        uniform_samples=coins.gather(1, t.order)[:, 1:],
        sample_uniforms=final,
        backend="reference",
    )
    assert torch.equal(got[2].long(), acc)
    want_index = torch.where(nodes[:, :steps] >= 0, t.order.gather(1, nodes[:, :steps].clamp(min=0)) + N * rows, -1)
    assert torch.equal(got[1].long(), want_index)
    for b in range(B):
        k = int(acc[b]) + 1
        assert torch.equal(got[0][want_index[b, :k]].long(), out[b, :k])
    assert (got[0] >= 0).sum() == (acc + 1).sum()


def test_repeated_sibling_token_is_not_accepted_twice():
    """Root lists [1, 2], both token 3, p0(3) = 0.5, coin 0.7.  SGLang's accumulated test
    counts token 3 twice (0.5, then 1.0 >= 0.7) and accepts node 2, over-sampling token 3;
    ours rejects node 1, never accepts the repeat and samples from p0 without token 3:
    [0.1, 0.2, 0.2, 0, 0] with final uniform 0.5 -> 0.5 * 0.5 = 0.25 -> token 1."""
    target = torch.tensor([[[0.1, 0.2, 0.2, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 1.0]]])
    args = (
        torch.tensor([[0, 3, 3]]),
        standard_retrive_index(1, 3),
        torch.tensor([[1, -1, -1]]),
        torch.tensor([[-1, 2, -1]]),
    )
    coins, final = torch.tensor([[0.7, 0.5, 0.5]]), torch.tensor([0.5])
    want = sglang_target_only(*[a.tolist() for a in args], coins.tolist(), final.tolist(), target.tolist(), 3)
    assert want[1] == [[0, 2, -1]]  # SGLang's lossy acceptance of the repeat
    predicts, accept_index, accept_num = sg.tree_rejection_sample_sglang(
        *args, target, num_spec_step=3, uniform_samples=coins, uniform_samples_for_final_sampling=final
    )
    assert accept_index.tolist() == [[0, -1, -1]] and accept_num.tolist() == [0]
    assert predicts.tolist() == [1, -1, -1]


def chi_square_tree(B):
    """One SGLang tree repeated B times: the root lists its children as [4, 1, 2] (not index
    order), node 1 has child 3; the children's tokens are three likely target tokens."""
    V = 12
    g = gen(21)
    target = torch.softmax(torch.randn(1, 5, V, generator=g) * 1.5, -1)
    top = target[0, 0].argsort(descending=True).tolist()
    candidates = torch.tensor([[0, top[1], top[0], target[0, 1].argmax().item(), top[2]]])
    nt = torch.tensor([[4, 3, -1, -1, -1]])
    ns = torch.tensor([[-1, 2, -1, -1, 1]])
    expand = lambda x: x.expand(B, *x.shape[1:]).contiguous()  # noqa: E731
    return [expand(x) for x in (candidates, nt, ns, target)] + [target[0, 0]]


def test_all_zero_draft_probs_mapped_call_is_lossless():
    """The emitted first token follows the target's root row exactly.

    P_THRESHOLD = 1e-3 with DRAWS = 20,000 over 12 tokens (tests/utils.py):
    a correct sampler fails with probability 0.1%, and a total-variation error of a few
    percent is detected with near certainty.  Here the error of the unmapped call (q = 0:
    the head of the list always accepted) is total: the negative control below shows it.
    """
    candidates, nt, ns, target, p0 = chi_square_tree(DRAWS)
    ri = standard_retrive_index(DRAWS, 5)
    predicts, accept_index, _ = sg.tree_rejection_sample_sglang(
        candidates, ri, nt, ns, target, torch.zeros_like(target), num_spec_step=3, generator=gen(5)
    )
    first = predicts.long()[accept_index[:, 0].long()]
    assert chi_square_pvalue(first, p0) > P_THRESHOLD
    # negative control: the zeros passed to our op as they are
    t = sg.from_sglang_tree(nt[:1], ns[:1])
    out, _, _ = sk.tree_rejection_sample(
        target[:, t.order[0]], candidates[:, t.order[0]], t.parents[0], torch.zeros_like(target), generator=gen(5)
    )
    assert chi_square_pvalue(out[:, 0], p0) < 1e-12
    assert (out[:, 0] == candidates[0, 4]).all()  # the head of the root's list, node 4


SAMPLE_BAD = {
    "threshold_with_draft": (dict(draft_probs="uniform", threshold_acc=0.5), ValueError, "threshold"),
    "threshold_single_zero": (dict(threshold_single=0.0), ValueError, "threshold_single"),
    "threshold_acc_above_one": (dict(threshold_acc=1.5), ValueError, "threshold_acc"),
    "threshold_type": (dict(threshold_acc="1"), TypeError, "threshold_acc"),
    "partly_zero_draft": (dict(draft_probs="zero_root_row"), ValueError, "draft_probs"),
    "draft_vocab": (dict(draft_probs=torch.zeros(2, 4, 5)), ValueError, "draft_probs"),
    "uniforms_shape": (dict(uniform_samples=torch.zeros(2, 3)), ValueError, "uniform_samples"),
    "uniforms_range": (dict(uniform_samples=torch.ones(2, 4)), ValueError, "uniform_samples"),
    "final_uniforms_shape": (
        dict(uniform_samples_for_final_sampling=torch.zeros(3)),
        ValueError,
        "uniform_samples_for_final_sampling",
    ),
    "generator_type": (dict(generator=[gen(0)]), TypeError, "generator"),
    "target_rows": (dict(target_probs=torch.full((7, 6), 0.1)), ValueError, "target_probs"),
    "num_spec_step": (dict(num_spec_step=0), ValueError, "num_spec_step"),
    "retrive_index_range": (dict(retrive_index=torch.full((2, 4), 8)), ValueError, "retrive_index"),
    "retrive_index_shape": (dict(retrive_index=torch.zeros(2, 3, dtype=torch.long)), ValueError, "retrive_index"),
    "candidates_dtype": (dict(candidates=torch.zeros(2, 4)), TypeError, "candidates"),
    "sibling_cycle": (
        dict(retrive_next_sibling=torch.tensor([[-1, 2, 1, -1]] * 2)),
        ValueError,
        "retrive_next_sibling",
    ),
}


@pytest.mark.parametrize("case", list(SAMPLE_BAD), ids=list(SAMPLE_BAD))
def test_sampling_bad_input(case):
    override, err, name = SAMPLE_BAD[case]
    args = dict(
        candidates=torch.zeros(2, 4, dtype=torch.long),
        retrive_index=standard_retrive_index(2, 4),
        retrive_next_token=torch.tensor([[1, -1, -1, -1]] * 2),
        retrive_next_sibling=torch.tensor([[-1, 2, -1, -1]] * 2),
        target_probs=torch.full((2, 4, 6), 1 / 6),
        num_spec_step=3,
    )
    if override.get("draft_probs") == "uniform":
        override = dict(override, draft_probs=torch.full((2, 4, 6), 1 / 6))
    elif override.get("draft_probs") == "zero_root_row":
        q = torch.full((2, 4, 6), 1 / 6)
        q[1, 0] = 0  # the root has children
        override = dict(override, draft_probs=q)
    args.update(override)
    with pytest.raises(err, match=re.escape(name)):
        sg.tree_rejection_sample_sglang(**args)


def test_greedy_bad_input():
    args = dict(
        candidates=torch.zeros(2, 4, dtype=torch.long),
        retrive_index=standard_retrive_index(2, 4),
        retrive_next_token=torch.tensor([[1, -1, -1, -1]] * 2),
        retrive_next_sibling=torch.full((2, 4), -1),
        target_logits=torch.zeros(2, 4, 6),
        num_spec_step=2,
    )
    for override, err, name in [
        (dict(target_logits=torch.zeros(2, 3, 6)), ValueError, "target_logits"),
        (dict(target_logits=torch.zeros(2, 4, 6, dtype=torch.long)), TypeError, "target_logits"),
        (dict(retrive_next_token=torch.tensor([[1, 4, -1, -1]] * 2)), ValueError, "retrive_next_token"),
        (dict(num_spec_step=1.0), TypeError, "num_spec_step"),
    ]:
        with pytest.raises(err, match=re.escape(name)):
            sg.verify_tree_greedy_sglang(**dict(args, **override))


def test_generator_draws_like_sglangs_caller():
    """Uniforms not given: rand(B, N) then rand(B) from the generator."""
    B, N, V = 3, 6, 5
    candidates, nt, ns, target, _, _ = sampling_case(B, N, V, seed=2)
    g = gen(17)
    coins, final = torch.rand(B, N, generator=g), torch.rand(B, generator=g)
    ri = standard_retrive_index(B, N)
    drawn = sg.tree_rejection_sample_sglang(candidates, ri, nt, ns, target, num_spec_step=N, generator=gen(17))
    given = sg.tree_rejection_sample_sglang(
        candidates, ri, nt, ns, target, num_spec_step=N, uniform_samples=coins, uniform_samples_for_final_sampling=final
    )
    assert all(torch.equal(a, b) for a, b in zip(drawn, given))
