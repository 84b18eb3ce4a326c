"""Trees sized by the measured pass cost (``adaptive.best_tree_size``, ``TreeBudget``, and
EAGLE-2's dynamic tree through the engine): the rule against hand-worked cost curves, the
calibration by hand, and greedy identity whatever size the rule picks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec_kernels.decoding import SpeculativeDecoder, packed
from specdec_kernels.decoding.drafters.eagle import EagleDrafter
from specdec_kernels.decoding.engine.adaptive import CostModelPolicy, TreeBudget, best_tree_size
from specdec_kernels.decoding.engine.calibration import Calibration
from tests.engine.test_eagle import random_head
from tests.engine.tiny import PROMPTS, tiny  # noqa: F401 (fixture)

VALUES = [0.6, 0.3, 0.25, 0.15, 0.1]


def cpu_curve(n_max, ratio8=1.8):
    """A pass of 8 tokens costs ratio8 times one token, linear in between (entry 0 unused)."""
    return [1.0] + [1 + (n - 1) * (ratio8 - 1) / 7 for n in range(1, n_max + 1)]


def calibrated_by(step_times, batch=1):
    """A run's ``Calibration`` whose step times by node count are ``step_times(n)`` (a curve
    given by hand in place of a measured one); its costs are fixed, so no growth limit."""
    fixed = CostModelPolicy(0, 8, warmup=0, draft_cost=(0.0, 0.0), verify_cost=(1.0, 0.0))
    calibration = Calibration(batch, fixed)
    calibration.step_times_by_nodes = step_times
    return calibration


def test_best_tree_size_by_hand():
    # E = 1, 1.6, 1.9, 2.15, 2.3, 2.4; T = 1 + (n - 1) * 0.8 / 7; E/T = 1, 1.436, 1.546, 1.601, 1.578, 1.527
    assert best_tree_size(VALUES, cpu_curve(6)) == 4
    # a GPU below its compute bound: the pass costs the same up to 64 tokens, every node pays
    values = [0.9**i for i in range(1, 64)]
    assert best_tree_size(values, [1.0] * 65) == 64
    # the same values on the CPU curve, by hand: E(n) = 10 - 9 * 0.9^(n - 1), T(n) = 1 + (n - 1) * 0.8 / 7;
    # n = 8: 5.6953 / 1.8 = 3.1641, n = 9: 6.1258 / 1.9143 = 3.2000, n = 10: 6.5132 / 2.0286 = 3.2107,
    # n = 11: 6.8619 / 2.1429 = 3.2022
    assert best_tree_size(values, cpu_curve(64)) == 10
    # the cost line caps n, and so do the candidates
    assert best_tree_size(VALUES, [1.0] * 4) == 3
    assert best_tree_size(VALUES, [1.0] * 20) == 6
    assert best_tree_size([], cpu_curve(8)) == 1
    assert best_tree_size(VALUES, cpu_curve(6, ratio8=50.0), n_min=2) == 2
    with pytest.raises(ValueError, match="non-increasing"):
        best_tree_size([0.1, 0.5], cpu_curve(3))
    with pytest.raises(ValueError, match="n_min"):
        best_tree_size(VALUES, cpu_curve(6), n_min=0)
    with pytest.raises(ValueError, match="step_time"):
        best_tree_size(VALUES, [1.0, 0.0, 1.0])


def test_tree_budget_calibration_by_hand():
    budget = TreeBudget(max_nodes=16, prior=4.0)
    budget.start(2)
    assert budget.choose(0, VALUES) == 6  # no cost known: the largest tree the candidates allow
    run = calibrated_by(lambda n: cpu_curve(n), batch=2)
    budget.start(2, run)
    paths = budget.paths  # the budget's tree calibration, kept in the run's Calibration
    assert run.paths[budget] is paths
    assert paths.factor(0) == 1.0 and budget.choose(0, VALUES) == 4
    # sequence 0 kept nodes worth 1.3 on each of 10 steps and accepted nothing: calibration 4 / 17
    for _ in range(10):
        budget.kept(0, VALUES[:4])
        budget.observe(torch.tensor([0, 0]), [True, False])
    assert paths.factor(0) == pytest.approx(4 / 17) and paths.factor(1) == 1.0
    # scaled values 0.1412, 0.0706, 0.0588: E = 1, 1.1412, 1.2118, 1.2706; E/T = 1, 1.0241, 0.9863, 0.9462
    assert budget.choose(0, VALUES) == 2
    assert paths.factor(1) == 1.0 and budget.choose(1, VALUES) == 4  # the other sequence is its own
    # a head that is better than its confidences: calibration above 1, values capped at 1
    budget.kept(1, [0.5])
    paths.update(1, 5)
    assert paths.factor(1) == pytest.approx(9 / 4.5)
    # scaled values 1, 0.6, 0.5, 0.3, 0.2: E/T = 1, 1.795, 2.116, 2.309, 2.333, 2.291: n = 5
    assert budget.choose(1, VALUES) == 5
    run.step_times_by_nodes = lambda n: None  # a cost model in its warm-up
    assert budget.choose(0, VALUES) == 6
    # the frontier width follows the latest choices: sequence 0 chose 2, sequence 1 chose 5
    assert budget.width([0], 10) == 2 and budget.width([0, 1], 10) == 5 and budget.width([0, 1], 3) == 3
    budget.start(2, calibrated_by(lambda n: cpu_curve(n), batch=2))
    assert budget.width([0, 1], 10) == 10  # nothing chosen yet: the full width
    assert budget.paths.factor(0) == 1.0  # a new run's calibration starts afresh
    with pytest.raises(ValueError):
        TreeBudget(4, min_nodes=5)
    with pytest.raises(ValueError):
        TreeBudget(4, prior=-1)


def test_cost_model_step_times_by_nodes_by_hand():
    policy = CostModelPolicy(0, 4, warmup=0, draft_cost=(0.0, 0.1), verify_cost=(1.0, 0.25))
    policy.start(SimpleNamespace(batch_size=1))
    # the prior's rates 0.5, 0.25, ...: E/T = 1 / 1.25, 1.5 / 1.6, 1.75 / 1.95, ...: K = 1, which
    # the choice records as the K whose draft time a tree's step adds
    assert policy.choose(SimpleNamespace(batch_size=1)) == [1] and policy.calibration.draft_k == 1
    policy.calibration.draft_k = 3  # a step that drafts K = 3
    assert policy.calibration.step_times_by_nodes(4) == pytest.approx([1.3 + 0.25 * n for n in range(5)])
    warm = CostModelPolicy(0, 4, warmup=2)
    warm.start(SimpleNamespace(batch_size=1))
    assert warm.calibration.step_times_by_nodes(4) is None


@pytest.mark.parametrize(
    "verify_cost, expect_small", [((1.0, 0.5), True), ((1.0, 0.0), False)], ids=["steep-cpu", "flat-gpu"]
)
def test_eagle_tree_is_sized_by_the_cost_and_stays_greedy(tiny, verify_cost, expect_small):
    """EAGLE-2's tree on the tiny model: a steep pass cost (each extra token half a pass) gives
    small trees, a flat one the full budget; the output is plain greedy either way."""
    _, model = tiny
    plain = SpeculativeDecoder(model).generate(PROMPTS, 12, 0).tokens
    drafter = EagleDrafter(model, random_head(), tree=True, top_k=4, max_nodes=16, check_fingerprint=False)
    nodes, widths = [], []
    decoder = SpeculativeDecoder(model, drafter)
    policy = CostModelPolicy(0, 4, warmup=0, explore_every=0, draft_cost=(0.0, 0.01), verify_cost=verify_cost)
    out = decoder.generate(
        PROMPTS,
        12,
        policy,
        on_step=lambda st: (
            nodes.extend(len(p) for p in getattr(drafter, "path_logprobs", [])),
            widths.append(drafter.budget.width(range(len(PROMPTS)), 4)),
        ),
    )
    assert out.tokens == plain
    drafted = [n for n in nodes if n > 1]
    assert drafted
    if expect_small:
        assert max(drafted) <= 4
        assert min(widths) < 4  # the frontier shrank with the budget
    else:
        assert max(drafted) == 16
        assert set(widths) == {4}
    # the budget read the run's calibration, the policy's; the next run (a fixed K) binds none
    assert drafter.budget.calibration is policy.calibration
    decoder.generate(PROMPTS, 4, 2)
    assert drafter.budget.calibration is None and drafter.budget.paths is None


def test_chain_wants_more_by_hand():
    """A chain drafts deeper while the rule could keep a deeper node, each deeper node valued
    as the last: on the CPU curve VALUES[:3] padded with 0.25 to 5 values gives E/T = 1,
    1.436, 1.546, 1.601, 1.647, 1.687 (n = 6: draft on), VALUES[:4] padded with 0.15 gives
    1.601 at n = 4, then 1.578, 1.559 (stop: no 5th node would be kept)."""
    budget = TreeBudget(max_nodes=16)
    budget.start(1)
    assert budget.wants_more(0, VALUES[:4], depth=5)  # no cost known: draft on
    budget.start(1, calibrated_by(lambda n: cpu_curve(n)))
    assert budget.wants_more(0, VALUES[:1], depth=5) and budget.wants_more(0, VALUES[:3], depth=5)
    assert not budget.wants_more(0, VALUES[:4], depth=5)
    assert not budget.wants_more(0, VALUES[:3], depth=3)  # the chain's K reached
    # a flat cost keeps every node; the node budget and K stop the chain
    budget.start(1, calibrated_by(lambda n: [1.0] * (n + 1)))
    assert budget.wants_more(0, VALUES[:4], depth=5) and not budget.wants_more(0, VALUES, depth=5)
    assert not TreeBudget(max_nodes=4).wants_more(0, VALUES[:3], depth=5)
    # a measured curve that is not convex (a step flat from 3 to 4 nodes, then almost flat):
    # values 0.5, 0.1, 0.06 want a 4th node, which ``choose`` keeps once it is 0.06
    steps = [1.0, 10.4, 11.0, 11.6, 12.4, 12.45]
    budget.start(1, calibrated_by(lambda n: steps[: n + 1]))
    assert budget.wants_more(0, [0.5, 0.1, 0.06], depth=4)
    assert budget.choose(0, [0.5, 0.1, 0.06, 0.06]) == 5


def test_stopping_a_chain_never_cuts_a_node_the_rule_keeps():
    """Random falling path probabilities and random rising step costs (convex or not): where
    ``wants_more`` stops at d nodes, ``choose`` over the whole chain keeps at most d + 1 nodes
    (root included), so the stop changes nothing that is verified."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        k = int(torch.randint(1, 9, (1,), generator=g))
        values = sorted(torch.rand(k, generator=g).tolist(), reverse=True)
        steps = torch.cumsum(torch.rand(k + 2, generator=g) * torch.rand(1, generator=g), 0) + 1.0
        budget = TreeBudget(max_nodes=int(torch.randint(2, 12, (1,), generator=g)))
        budget.start(1, calibrated_by(lambda n, s=[0.0] + steps.tolist(): s[: n + 1]))
        full = budget.choose(0, values)
        for d in range(1, k):
            if not budget.wants_more(0, values[:d], depth=k):
                assert full <= d + 1, (values, steps.tolist(), d, full)
                break


@pytest.mark.parametrize(
    "verify_cost, expect_short", [((1.0, 0.5), True), ((1.0, 0.0), False)], ids=["steep-cpu", "flat-gpu"]
)
def test_eagle_chain_is_sized_by_the_cost_and_stays_greedy(tiny, verify_cost, expect_short):
    """``EagleDrafter(tree=False)`` (size_by_cost=True, the default): a steep pass cost cuts
    the chain (and the draft steps stop at the first node it would not keep), a flat one
    drafts what the uncut chain (size_by_cost=False) drafts; the output is plain greedy
    either way."""
    _, model = tiny
    plain = SpeculativeDecoder(model).generate(PROMPTS, 12, 0).tokens
    nodes, steps = {}, {}
    for sized in (False, True):
        kwargs = {} if sized else {"size_by_cost": False}
        drafter = EagleDrafter(model, random_head(), tree=False, check_fingerprint=False, **kwargs)
        assert (drafter.budget is not None) == sized
        policy = CostModelPolicy(4, 4, warmup=0, explore_every=0, draft_cost=(0.0, 0.01), verify_cost=verify_cost)
        seen = nodes[sized] = []
        real_step, calls = drafter._fused_step, steps.setdefault(sized, [])
        drafter._fused_step = lambda *a, real_step=real_step, calls=calls: calls.append(1) or real_step(*a)
        out = SpeculativeDecoder(model, drafter).generate(
            PROMPTS,
            12,
            policy,
            on_step=lambda st, d=drafter, seen=seen: seen.append([len(p) for p in getattr(d, "path_logprobs", [])]),
        )
        assert out.tokens == plain
    if expect_short:
        flat = [n for step in nodes[True] for n in step]
        assert max(flat) < 5 and max(flat) < max(n for step in nodes[False] for n in step)
        if packed.has_kernel("decoder_layer"):  # the one-call chain steps (the early stop's path)
            assert len(steps[True]) < len(steps[False])  # the head stopped drafting early
    else:
        assert nodes[True] == nodes[False] and len(steps[True]) == len(steps[False])
    with pytest.raises(TypeError, match="size_by_cost"):
        EagleDrafter(model, random_head(), size_by_cost=1)


def test_trees_grow_from_small_sizes_as_the_pass_cost_is_measured():
    """With a measured cost, a tree is never larger than twice the largest pass measured (2 before
    any): a cost line known at one size only (flat) or at small sizes only cannot send a step to
    ``max_nodes`` untried.  Before this rule a first measured 64-node pass made the line flat and
    every later tree 64 nodes (0.13x plain greedy on the CPU)."""
    policy = CostModelPolicy(0, 8, warmup=0)
    policy.start(SimpleNamespace(batch_size=1, pass_costs=None))
    budget = TreeBudget(max_nodes=64)
    budget.start(1, policy.calibration)
    values = [0.99**i for i in range(1, 64)]  # a head so confident that every node seems to pay
    assert policy.calibration.largest_verified_nodes() == 0 and budget.growth_limit() == 2
    assert budget.choose(0, values) == 2  # nothing measured: the smallest tree
    assert not budget.wants_more(0, values[:1], 10)  # nor a deeper chain than that
    sizes = []
    for _ in range(6):  # each step's pass measured at a flat cost: the line says "bigger is free"
        n = budget.choose(0, values)
        sizes.append(n)
        policy.calibration.verify_cost.add(n, 0.01)
    assert sizes == [2, 4, 8, 16, 32, 64]
    fixed = CostModelPolicy(0, 8, warmup=0, draft_cost=(0.0, 0.0), verify_cost=(1.0, 0.0))
    fixed.start(SimpleNamespace(batch_size=1, pass_costs=None))
    assert fixed.calibration.largest_verified_nodes() is None  # fixed costs: nothing to measure, no limit
    budget.start(1, fixed.calibration)
    fixed.calibration.draft_k = 8
    assert budget.growth_limit() is None and budget.choose(0, values) == 64


def test_default_decoder_sizes_an_eagle_tree_from_small_passes(tiny):
    """``SpeculativeDecoder``'s default policy ("auto") hands the tree budget its calibration: the
    first drafted tree has at most 2 nodes and no tree outgrows twice the largest pass measured
    before it; the output is plain greedy."""
    _, model = tiny
    plain = SpeculativeDecoder(model).generate(PROMPTS, 12, 0).tokens
    drafter = EagleDrafter(model, random_head(), tree=True, top_k=4, max_nodes=64, check_fingerprint=False)
    widths = []
    decoder = SpeculativeDecoder(model, drafter)
    out = decoder.generate(
        PROMPTS, 12, on_step=lambda st: widths.append(st.last_step.block_width if st.last_step else None)
    )
    assert out.tokens == plain
    assert out.stats.policy.startswith("cost-model")
    measured = [w for w in widths if w is not None]
    assert measured and measured[0] <= 2
    for i, w in enumerate(measured[1:], 1):
        assert w <= max(2, 2 * max(measured[:i])), measured
