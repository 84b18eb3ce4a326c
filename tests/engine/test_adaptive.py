"""Adaptive draft length: the heuristic's K sequence on a scripted acceptance pattern (by
hand, alone and through the engine), the cost model's choice against a hand computation
(fixed and measured costs), policy resolution, and greedy equivalence of adaptive runs on
the tiny and the real model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdec_kernels.decoding import (
    Draft,
    Drafter,
    LayerSkipDrafter,
    NgramDrafter,
    NoDrafter,
    SpeculativeDecoder,
    Transformer,
)
from specdec_kernels.decoding.draft import chain_parents
from specdec_kernels.decoding.engine.adaptive import (
    EXPLORE_BACKOFF,
    CostModelPolicy,
    FixedPolicy,
    HeuristicPolicy,
    LinearCost,
    best_draft_length,
    default_policy,
    expected_tokens,
    resolve_policy,
)
from specdec_kernels.decoding.engine.loop import StepRecord
from tests.engine.tiny import PROMPTS, real_only, tiny  # noqa: F401 (fixture)
from tests.utils import one_thread  # noqa: F401 (fixture)


def record(ks, depths, accepted, *, draft_time=0.0, verify_time=1.0, nodes=None):
    return StepRecord(
        ks=list(ks),
        depths=list(depths),
        num_nodes=list(nodes) if nodes is not None else [d + 1 for d in depths],
        num_accepted=list(accepted),
        active=[True] * len(ks),
        block_width=max(nodes) if nodes is not None else max(depths) + 1,
        draft_time=draft_time,
        verify_time=verify_time,
    )


# Scripted (draft depth, accepted) per step and the K a hand applies (start 4, [1, 8], +2/-1):
#   K=4 depth 4 acc 4: all accepted -> 6       K=6 depth 6 acc 2: rejection -> 5
#   K=5 depth 0 acc 0: no draft -> 5           K=5 depth 3 acc 3: short draft, whole -> 5
#   K=5 depth 5 acc 5 -> 7                     K=7 depth 7 acc 7 -> 8 (k_max)
#   K=8 depth 8 acc 8 -> 8                     K=8 depth 8 acc 0 -> 7
SCRIPT = [(4, 4), (6, 2), (0, 0), (3, 3), (5, 5), (7, 7), (8, 8), (8, 0)]
HAND_KS = [4, 6, 5, 5, 5, 7, 8, 8, 7]


def test_heuristic_sequence_by_hand():
    policy = HeuristicPolicy(k_init=4, k_min=1, k_max=8, up=2, down=1)
    policy.start(SimpleNamespace(batch_size=1))
    ks = []
    for depth, acc in SCRIPT:
        (k,) = policy.choose(None)
        ks.append(k)
        policy.update(None, record([k], [depth], [acc]))
    ks.append(policy.choose(None)[0])
    assert ks == HAND_KS
    assert policy.next_k(1, 3, 0) == 1  # never below k_min


class ScriptedDrafter(Drafter):
    """Proposes K tokens whose first ``accept`` are the known greedy continuation and the rest
    a wrong token, or a shorter draft, following SCRIPT."""

    name = "scripted"

    def __init__(self, prompt_len, future, script):
        self.prompt_len, self.future, self.script, self.step = prompt_len, future, script, 0

    def propose(self, request):
        if self.step >= len(self.script):
            return Draft.from_lists([([h[-1]], [-1]) for h in request.histories])
        depth, acc = self.script[self.step]
        self.step += 1
        (h,), (k,) = request.histories, request.num_draft_tokens
        assert depth <= k
        done = len(h) - self.prompt_len
        good = self.future[done : done + acc]
        wrong = (self.future[done + acc] + 1) % 111 if done + acc < len(self.future) else 0
        chain = [h[-1]] + good + [wrong] * (depth - acc)
        return Draft.from_lists([(chain, chain_parents(len(chain)))])


def test_heuristic_through_the_engine(tiny):
    """The engine consults the policy each step and records the K it used."""
    _, model = tiny
    prompt = PROMPTS[0]
    future = SpeculativeDecoder(model).generate([prompt], 60).tokens[0]
    drafter = ScriptedDrafter(len(prompt), future, SCRIPT)
    n = sum(acc + 1 for _, acc in SCRIPT) + 9  # the scripted steps' tokens, then room for K = 8
    result = SpeculativeDecoder(model, drafter).generate([prompt], n, num_draft_tokens=HeuristicPolicy(4, 1, 8))
    assert result.tokens[0] == future[:n]
    ks = result.stats.draft_lengths
    assert ks[: len(HAND_KS)] == HAND_KS
    assert result.stats.mean_draft_length == pytest.approx(sum(ks) / len(ks))
    assert result.stats.policy.startswith("heuristic")


# ---------------------------------------------------------------------------- cost model
def test_best_draft_length_by_hand():
    rates = [0.8, 0.6, 0.4, 0.2]
    assert [expected_tokens(rates, k) for k in range(5)] == pytest.approx([1, 1.8, 2.4, 2.8, 3.0])
    # c = 0.1: E/T = 1, 1.64, 2.00, 2.15, 2.14 -> 3; c = 0.4: 1, 1.29, 1.33, 1.27, 1.15 -> 2
    assert best_draft_length(rates, [1 + 0.1 * k for k in range(5)]) == 3
    assert best_draft_length(rates, [1 + 0.4 * k for k in range(5)]) == 2
    # c = 1: drafting never pays (E/T = 1, 0.9, 0.8, ...) unless K >= 1 is forced
    assert best_draft_length(rates, [1 + k for k in range(5)]) == 0
    assert best_draft_length(rates, [1 + k for k in range(5)], k_min=1) == 1
    # free drafts, a verify cost growing 0.2 per node: (1.8/1.2, 2.4/1.4, 2.8/1.6, 3/1.8)
    assert best_draft_length(rates, [1 + 0.2 * k for k in range(5)]) == 3
    with pytest.raises(ValueError, match="k_min"):
        best_draft_length(rates, [1.0, 1.1], k_min=2)


def feed_rates(policy, steps=10):
    """Steps at K = 4 accepting 0, 0, 1, 1, 2, 2, 3, 3, 4, 4: r = (0.8, 0.6, 0.4, 0.2)."""
    for i in range(steps):
        acc = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4][i % 10]
        policy.update(None, record([4], [4], [acc], draft_time=0.4, verify_time=1.0, nodes=[5]))


@pytest.mark.parametrize("ratio,expected", [(0.1, 3), (0.4, 2), (1.0, 0)], ids=["c0.1", "c0.4", "c1"])
def test_cost_model_fixed_costs(ratio, expected):
    """Raw rates (no pseudo-counts) and given costs: the hand computation above."""
    policy = CostModelPolicy(
        0, 4, warmup=0, explore_every=0, prior_strength=0, seq_prior=0, draft_cost=(0, ratio), verify_cost=(1, 0)
    )
    policy.start(SimpleNamespace(batch_size=1))
    feed_rates(policy)
    assert policy.calibration.sequence_rates(0) == pytest.approx([0.8, 0.6, 0.4, 0.2])
    assert policy.choose(SimpleNamespace(batch_size=1)) == [expected]


def test_cost_model_keeps_rates_per_draft_source():
    """Steps alternate between two draft sources: source 0's drafts are accepted whole,
    source 1's never.  Drafts cost 0.1 of a pass per token, the pass is flat: source 0 drafts
    K = 4 (E/T = 5 / 1.4) and source 1 none (E = 1 at every K).  Pooled, the rate is 0.5 at
    every depth, E(K) = 1 + 0.5 K, so both draft K = 4 (3 / 1.4 > 1)."""

    def run(named):
        policy = CostModelPolicy(
            0, 4, warmup=0, explore_every=0, prior_strength=0, seq_prior=0, draft_cost=(0, 0.1), verify_cost=(1, 0)
        )
        policy.start(SimpleNamespace(batch_size=1))
        state = lambda s: SimpleNamespace(batch_size=1, draft_sources=[s] if named else None)  # noqa: E731
        for i in range(10):
            policy.choose(state(i % 2))
            policy.update(None, record([4], [4], [4 if i % 2 == 0 else 0], nodes=[5]))
        return [policy.choose(state(s)) for s in (0, 1)]

    assert run(True) == [[4], [0]]
    assert run(False) == [[4], [4]]


def test_cost_model_source_lines_take_only_their_own_steps():
    """Batch 2.  A step whose drafting sequences drew from two sources adds its draft time to
    the line of all steps only; a step whose drafting sequences all drew from one source adds
    it to that source's line too, unless it is the source's first drafting step; a source
    without a line of its own costs the line of all steps; without sources only that line
    exists."""
    policy = CostModelPolicy(0, 4, warmup=0, explore_every=0)
    policy.start(SimpleNamespace(batch_size=2))

    def step(sources, ks, draft_time):
        policy.choose(SimpleNamespace(batch_size=2, draft_sources=sources))
        policy.update(None, record(ks, ks, [0, 0], draft_time=draft_time))

    cal = policy.calibration
    step([0, 1], [2, 2], 9.0)  # the first step: no line takes it
    step([0, 1], [2, 2], 0.4)  # mixed: the line of all steps only
    assert cal.draft_costs == {} and cal.draft_cost.points == {2: [1, 0.4]}
    step([0, 1], [3, 0], 0.3)  # source 0 alone drafts (it drafted before)
    assert list(cal.draft_costs) == [0] and cal.draft_costs[0].points == {3: [1, 0.3]}
    assert cal.verify_by_ks[0].points == {3: [1, 1.0]}
    assert cal.draft_cost_of(0) is cal.draft_costs[0] and cal.draft_cost_of(1) is cal.draft_cost
    step([2, 2], [1, 1], 5.0)  # source 2's first drafting step: not its line
    assert 2 not in cal.draft_costs
    step([2, 2], [1, 1], 0.1)
    assert cal.draft_costs[2].points == {1: [1, 0.1]}
    assert cal.step_times(2)[1] == pytest.approx(0.1 + 1.0)  # its draft line, its verify time at K = 1

    plain = CostModelPolicy(0, 4, warmup=0, explore_every=0)
    plain.start(SimpleNamespace(batch_size=2))
    for ks, t in (([2, 2], 9.0), ([2, 2], 0.4), ([3, 0], 0.3)):
        plain.choose(SimpleNamespace(batch_size=2))
        plain.update(None, record(ks, ks, [0, 0], draft_time=t))
    cal = plain.calibration
    assert cal.draft_costs == {} and cal.draft_cost.points == {2: [1, 0.4], 3: [1, 0.3]}
    assert cal.draft_cost_of(0) is cal.draft_cost


def test_cost_model_measured_costs():
    """Costs measured from the step records: draft 0.1 s per token, verify 1 s + 0.05 s per
    node (fitted through two measured K / widths).  T(K) = 0.1 K + 1 + 0.05 (K + 1) =
    1.05, 1.2, 1.35, 1.5, 1.65 -> E/T = 0.95, 1.5, 1.78, 1.87, 1.82: K = 3."""
    policy = CostModelPolicy(0, 4, warmup=0, explore_every=0, prior_strength=0, seq_prior=0)
    policy.start(SimpleNamespace(batch_size=1))
    pattern = [(4, 0), (4, 0), (4, 1), (4, 1), (4, 2), (4, 2), (4, 3), (4, 3), (4, 4), (4, 4)]
    for k, acc in pattern:
        policy.update(None, record([k], [k], [acc], draft_time=0.1 * k, verify_time=1.0 + 0.05 * (k + 1)))
    cal = policy.calibration
    cal.draft_cost.add(2, 0.2)
    cal.verify_cost.add(3, 1.15)
    assert cal.draft_cost(3) == pytest.approx(0.3) and cal.verify_cost(4) == pytest.approx(1.2)
    assert cal.step_times() == pytest.approx([1.05, 1.2, 1.35, 1.5, 1.65])
    assert policy.choose(SimpleNamespace(batch_size=1)) == [3]


def test_cost_model_explores_and_warms_up():
    policy = CostModelPolicy(0, 4, k_init=2, warmup=3, explore_every=4, draft_cost=(0, 10.0), verify_cost=(1, 0))
    state = SimpleNamespace(batch_size=2)
    policy.start(state)
    assert policy.choose(state) == [2, 2]  # warm-up: the heuristic's start
    for _ in range(3):
        policy.update(state, record([2, 2], [2, 2], [0, 2]))
    policy.update(state, record([2, 2], [2, 2], [0, 2]))
    assert policy.calibration.steps == 4 and policy.choose(state) == [1, 1]  # drafts cost 10x: K = 0, probed at 1
    policy.update(state, record([1, 1], [1, 1], [0, 1]))
    assert policy.choose(state) == [0, 0]


def test_cost_model_probes_back_off_while_drafts_do_not_pay():
    """A sequence that keeps choosing K = 0 probes at step explore_every, then at gaps doubled
    up to EXPLORE_BACKOFF x explore_every; one whose drafts pay probes every explore_every."""
    state = SimpleNamespace(batch_size=1)
    costly = CostModelPolicy(0, 4, warmup=0, explore_every=2, draft_cost=(0, 10.0), verify_cost=(1, 0))
    costly.start(state)
    probes = []
    for step in range(80):
        k = costly.choose(state)[0]
        if k > 0:
            probes.append(step)
        costly.update(state, record([k], [k], [0]))  # nothing accepted
    assert probes == [2, 6, 14, 30, 46, 62, 78]  # gaps 4, 8, 16, then EXPLORE_BACKOFF * 2
    assert EXPLORE_BACKOFF == 8 and costly.probe_gap == [16]
    cheap = CostModelPolicy(0, 3, warmup=0, explore_every=2, draft_cost=(0, 1e-4), verify_cost=(1, 0))
    cheap.start(state)
    probed = []
    for step in range(40):
        k = cheap.choose(state)[0]
        probed.append(cheap.next_probe[0])
        cheap.update(state, record([k], [k], [k]))  # every draft accepted
    assert cheap.probe_gap == [2]  # drafting pays: the gap never grows
    assert sorted(set(probed)) == list(range(2, 42, 2))


def test_linear_cost():
    c = LinearCost(proportional=True)
    assert c(3) == 0.0 and not c.known
    c.add(2, 0.4)
    assert c(5) == pytest.approx(1.0)  # one point: proportional
    flat = LinearCost()
    flat.add(2, 0.4)
    assert flat(5) == pytest.approx(0.4)  # one point: flat
    c.add(4, 0.6)
    assert c.coefficients() == pytest.approx((0.2, 0.1))
    assert LinearCost(0.5, 0.25)(2) == pytest.approx(1.0)


def test_policy_resolution_and_bad_arguments(tiny):
    _, model = tiny
    ngram, layerskip = NgramDrafter(), LayerSkipDrafter(model, 2)
    assert resolve_policy(None, ngram) is None
    assert isinstance(resolve_policy("heuristic", ngram), HeuristicPolicy)
    assert isinstance(resolve_policy("cost-model", layerskip), CostModelPolicy)
    assert isinstance(default_policy(layerskip), CostModelPolicy)
    assert isinstance(default_policy(ngram), CostModelPolicy) and isinstance(default_policy(None), FixedPolicy)
    # drafts that cost a model pass warm up cheaply (from K = 1, 2 steps); free drafts from K = 4, 6 steps
    costly, free = default_policy(layerskip), default_policy(ngram)
    assert (costly.k_init, costly.warmup) == (1, 2) and (free.k_init, free.warmup) == (4, 6)
    with pytest.raises(ValueError, match="policy"):
        SpeculativeDecoder(model, ngram, policy="fastest")
    with pytest.raises(TypeError, match="policy"):
        SpeculativeDecoder(model, ngram, policy=3)
    with pytest.raises(ValueError, match="k_min"):
        HeuristicPolicy(k_min=3, k_max=2)
    with pytest.raises(ValueError, match="k_init"):
        CostModelPolicy(1, 4, k_init=0)
    with pytest.raises(ValueError, match="draft_cost"):
        CostModelPolicy(draft_cost=(1, -1))


def test_defaults_come_from_what_a_drafter_declares_not_its_name():
    """``default_k`` and ``drafts_free`` (Drafter attributes) choose the default policy: a
    custom drafter that calls itself "ngram" gets the base defaults, one that declares its own
    K and free drafts gets those."""

    class Named(Drafter):
        name = "ngram"

        def propose(self, request):
            raise AssertionError("not called")

    class Declared(Named):
        name = "mine"
        default_k, drafts_free = 5, True

    named, declared = default_policy(Named()), default_policy(Declared())
    assert (named.k_max, named.k_init, named.warmup) == (4, 1, 2)  # a costly drafter's warm-up
    assert (declared.k_max, declared.k_init, declared.warmup) == (5, 4, 6)  # free drafts
    assert resolve_policy("fixed", Declared()).describe() == "fixed(K=5)"
    assert resolve_policy("fixed", NgramDrafter()).describe() == "fixed(K=8)"
    assert isinstance(default_policy(NoDrafter()), FixedPolicy)


@pytest.mark.parametrize("bad", [-1, 2.7, True, "3", None, 10**30])
def test_a_bad_default_k_is_refused_naming_it(tiny, bad):
    class Odd(NgramDrafter):
        default_k = bad

    with pytest.raises(ValueError, match="default_k"):
        SpeculativeDecoder(tiny[1], Odd())
    with pytest.raises(ValueError, match="k_max"):
        default_policy(NgramDrafter(), k_max=2.5)


@pytest.mark.parametrize("policy", ["heuristic", "cost-model", "auto"])
def test_tiny_adaptive_is_greedy(tiny, policy):
    _, model = tiny
    greedy = SpeculativeDecoder(model).generate(PROMPTS, 20).tokens
    for drafter in (NgramDrafter(), LayerSkipDrafter(model, 2, tree_widths=(2,))):
        result = SpeculativeDecoder(model, drafter, policy=policy).generate(PROMPTS, 20)
        assert result.tokens == greedy
        s = result.stats
        assert len(s.draft_lengths) == s.sequence_steps and s.policy


def test_cost_model_starts_from_the_decoders_measured_pass_costs(tiny):
    """The target pass's cost curve measured by earlier requests (same numerics, threads, batch)
    is where the next request's cost model starts: its verify cost is known before its first
    step, and the curve grows with every request; outputs stay greedy."""
    _, model = tiny
    greedy = SpeculativeDecoder(model).generate(PROMPTS[:1], 24).tokens
    seen = []

    class Spy(CostModelPolicy):
        def start(self, state):
            super().start(state)
            seen.append({x: p[0] for x, p in self.calibration.verify_cost.points.items()})

    decoder = SpeculativeDecoder(model, NgramDrafter(), policy=Spy(0, 6))
    for _ in range(3):
        assert decoder.generate(PROMPTS[:1], 24).tokens == greedy
    assert seen[0] == {}  # the first request measures from scratch
    assert seen[1] and sum(seen[2].values()) > sum(seen[1].values())  # then starts from the curve, which grows
    (curve,) = decoder.pass_costs.values()
    assert set(curve.points) >= set(seen[1])
    fixed = SpeculativeDecoder(model, NgramDrafter(), policy=Spy(0, 6, verify_cost=(1.0, 0.0)))
    fixed.generate(PROMPTS[:1], 8)
    fixed.generate(PROMPTS[:1], 8)
    assert seen[-1] == {}  # fixed costs are not replaced by measurements


# ---------------------------------------------------------------------------- real model
@real_only
def test_real_model_adaptive_is_greedy():
    from specdec_kernels.decoding.loading import load_checkpoint

    config, state_dict, tok = load_checkpoint()
    model = Transformer.from_hf(config, state_dict)
    texts = ["Rename the function add to plus:\n\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))", "Say hello."]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False)
        for t in texts
    ]
    stops = [tok.eos_token_id]
    greedy = [SpeculativeDecoder(model, stop_token_ids=stops).generate([p], 16).tokens[0] for p in prompts]
    for drafter, policy in (
        (NgramDrafter(), HeuristicPolicy(4, 1, 8)),
        (LayerSkipDrafter(model, 24), CostModelPolicy(0, 4, warmup=2)),
    ):
        result = SpeculativeDecoder(model, drafter, stop_token_ids=stops).generate(prompts, 16, num_draft_tokens=policy)
        assert result.tokens == greedy
        assert len(set(result.stats.draft_lengths)) > 1  # K did change


def test_measured_cost_keeps_steps():
    """Well-observed widths cost their own mean (a step at 2 nodes), others the line."""
    c = LinearCost()
    for _ in range(3):
        c.add(1, 1.0)
        c.add(2, 1.5)
        c.add(8, 1.5)
    assert c(1) == pytest.approx(1.0) and c(2) == pytest.approx(1.5) and c(8) == pytest.approx(1.5)
    a, b = c.coefficients()
    assert c(5) == pytest.approx(a + 5 * b)
