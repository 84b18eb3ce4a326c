"""Multi-draft speculation (``MultiDrafter``): the trie merge of several drafters' chains and
trees (hand-worked), the accepted path mapped back to each sub-drafter's own nodes, per-drafter
counters, a layer-skip sub-drafter's cache kept as exact as when it drafts alone, greedy
equivalence on the tiny and the real model, and the target distribution at temperature > 0.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec_kernels.decoding import (
    Draft,
    Drafter,
    LayerSkipDrafter,
    NgramDrafter,
    SamplingParams,
    SpeculativeDecoder,
    Transformer,
)
from specdec_kernels.decoding.drafters.multi import MultiDrafter, map_to_merged, own_accepted_path
from specdec_kernels.decoding.engine.draft_checks import check_draft_sources
from tests.engine.drive import request, run_for, start, step
from tests.engine.tiny import PROMPTS, exact_marginals, ngram_friendly_prompt, real_only, tiny  # noqa: F401 (fixture)
from tests.utils import P_THRESHOLD, chi_square_pvalue, one_thread  # noqa: F401 (fixture)


class FixedDrafter(Drafter):
    """Proposes the same (tokens, parents) tree every step (the root is replaced by the
    sequence's own) and records what it observes."""

    def __init__(self, name, tokens, parents):
        self.name, self.tree = name, (list(tokens), list(parents))
        self.observed = []

    def propose(self, request):
        t, p = self.tree
        return Draft.from_lists(
            [([h[-1]] + t[1:], p) if a else ([h[-1]], [-1]) for h, a in zip(request.histories, request.active)]
        )

    def observe(self, result):
        super().observe(result)
        if not result.started:
            self.observed.append((result.accepted_nodes.tolist(), result.num_accepted.tolist(), list(result.active)))


# Hand-worked: root 5; the n-gram chain 7 8 9; the layer-skip tree 7(-> 8 -> 1) and 3 -> 6.
#   merged node: 0  1  2  3  4  5  6
#   token:       5  7  8  9  3  6  1
#   parent:     -1  0  1  2  0  4  2
NGRAM = ([5, 7, 8, 9], [-1, 0, 1, 2])
LAYERSKIP = ([5, 7, 3, 8, 6, 1], [-1, 0, 0, 1, 2, 3])
MERGED_TOKENS = [5, 7, 8, 9, 3, 6, 1]
MERGED_PARENTS = [-1, 0, 1, 2, 0, 4, 2]


def test_merge_deduplicates_the_shared_prefix():
    ngram, layerskip = FixedDrafter("ngram", *NGRAM), FixedDrafter("layerskip", *LAYERSKIP)
    multi = MultiDrafter([ngram, layerskip], max_nodes=None)
    run = start(multi, [[1, 5]], generators=[torch.Generator().manual_seed(0)], capacity=64)
    draft = multi.propose(request([[1, 5]], [3], run))
    n = int(draft.num_nodes[0])
    assert draft.tokens[0, :n].tolist() == MERGED_TOKENS  # 7 8 shared: fed once
    assert draft.parents[0, :n].tolist() == MERGED_PARENTS
    assert not draft.is_chain and draft.probs is None
    c = multi.counters
    assert c["ngram"]["proposed"] == 3 and c["layerskip"]["proposed"] == 5

    # the target accepts 7 8 1 (merged nodes 0 1 2 6)
    multi.observe(step([[1, 5, 7, 8, 1, 2]], run, torch.tensor([[0, 1, 2, 6, -1, -1, -1]]), torch.tensor([3])))
    nodes, count, _ = ngram.observed[-1]
    assert nodes[0][: count[0] + 1] == [0, 1, 2] and count == [2]  # its 7 8
    nodes, count, _ = layerskip.observed[-1]
    assert nodes[0][: count[0] + 1] == [0, 1, 3, 5] and count == [3]  # its 7 8 1
    assert c["ngram"]["accepted"] == 2 and c["layerskip"]["accepted"] == 3
    assert c["ngram"]["only_accepted"] == 0 and c["layerskip"]["only_accepted"] == 1


def test_merge_of_chains_that_share_everything_stays_a_chain():
    a, b = FixedDrafter("a", *NGRAM), FixedDrafter("b", [5, 7, 8], [-1, 0, 1])
    multi = MultiDrafter([a, b])
    run = start(multi, [[5]], generators=[torch.Generator()], capacity=64)
    draft = multi.propose(request([[5]], [3], run))
    assert draft.is_chain and draft.tokens[0].tolist() == [5, 7, 8, 9]


def test_max_nodes_cuts_later_drafts_first():
    multi = MultiDrafter([FixedDrafter("ngram", *NGRAM), FixedDrafter("layerskip", *LAYERSKIP)], max_nodes=5)
    run = start(multi, [[5]], generators=[torch.Generator()], capacity=64)
    draft = multi.propose(request([[5]], [3], run))
    assert draft.num_nodes.tolist() == [5] and draft.tokens[0].tolist() == [5, 7, 8, 9, 3]
    assert map_to_merged([5, 7, 8, 9, 3], [-1, 0, 1, 2, 0], *LAYERSKIP) == [0, 1, 4, 2, -1, -1]


def test_own_accepted_path_with_duplicate_siblings():
    # a sampled draft may hold the same token twice under one parent: 7 (-> 8) and 7 (-> 2)
    tokens, parents = [5, 7, 7, 8, 2], [-1, 0, 0, 1, 2]
    merged = map_to_merged([5, 7, 8, 2], [-1, 0, 1, 1], tokens, parents)
    assert merged == [0, 1, 1, 2, 3]
    assert own_accepted_path(merged, parents, [0, 1, 3]) == [0, 2, 4]  # through the second 7
    assert own_accepted_path(merged, parents, [0]) == [0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="drafters"):
        MultiDrafter([])
    with pytest.raises(TypeError, match=r"drafters\[1\]"):
        MultiDrafter([NgramDrafter(), object()])
    with pytest.raises(ValueError, match="max_nodes"):
        MultiDrafter([NgramDrafter()], max_nodes=0)
    with pytest.raises(ValueError, match="max_depths"):
        MultiDrafter([NgramDrafter()], max_depths=(1, 2))
    with pytest.raises(ValueError, match="names"):
        MultiDrafter([NgramDrafter(), NgramDrafter()], names=["a", "a"])
    assert MultiDrafter([NgramDrafter(), NgramDrafter()]).names == ["ngram", "ngram-2"]
    # odd types are refused when the drafter is built, not in the first step
    with pytest.raises(TypeError, match="drafters"):
        MultiDrafter(NgramDrafter())
    with pytest.raises(TypeError, match="names"):
        MultiDrafter([NgramDrafter(), NgramDrafter()], names="ab")
    for cap in (2.5, True, "3", float("nan")):
        with pytest.raises(ValueError, match=r"max_depths\[1\]"):
            MultiDrafter([NgramDrafter(), NgramDrafter()], max_depths=[None, cap])
    for nodes in (1.5, True):
        with pytest.raises(ValueError, match="max_nodes"):
            MultiDrafter([NgramDrafter()], max_nodes=nodes)


# ---------------------------------------------------------------------------- tiny model
class Recorder(Drafter):
    """Wraps a drafter, recording the histories it was asked to draft from and its drafts."""

    def __init__(self, inner):
        self.inner, self.name, self.log = inner, inner.name, []

    def propose(self, request):
        d = self.inner.propose(request)
        self.log.append(([list(h) for h in request.histories], list(request.num_draft_tokens), list(request.active), d))
        return d

    def observe(self, result):
        super().observe(result)
        self.inner.observe(result)


@pytest.fixture(scope="module")
def tiny_greedy(tiny):
    return SpeculativeDecoder(tiny[1]).generate(PROMPTS, 20).tokens


@pytest.mark.parametrize("fallback", [False, True], ids=["merged", "fallback"])
@pytest.mark.parametrize("tree", [False, True], ids=["chains", "ngram-tree+layerskip-tree"])
@pytest.mark.parametrize("k", [1, 4], ids=lambda k: f"K{k}")
def test_tiny_greedy_and_layerskip_cache(tiny, tiny_greedy, tree, k, fallback):
    """A ragged batch returns the plain greedy tokens, and the layer-skip sub-drafter drafts
    exactly what a fresh layer-skip drafter drafts from the same history (its cache was
    compacted to its own accepted nodes correctly; with fallback, where it is not asked for
    the sequences prompt lookup drafted for, it catches up on them when next asked)."""
    _, model = tiny
    widths = (2, 2) if tree else None
    # a cache of its own (whose compaction this checks), not the target's
    layerskip = Recorder(LayerSkipDrafter(model, 2, tree_widths=widths, share_target_cache=False))
    multi = MultiDrafter([NgramDrafter(tree=tree), layerskip], fallback=fallback)
    result = SpeculativeDecoder(model, multi).generate(PROMPTS, 20, num_draft_tokens=k)
    assert result.tokens == tiny_greedy
    s = result.stats
    c = s.drafters
    assert set(c) == {"ngram", "layerskip"}
    accepted = [c[n]["accepted"] for n in c]
    assert max(accepted) <= s.accepted_draft_tokens <= sum(accepted)
    assert sum(c[n]["only_accepted"] for n in c) <= s.accepted_draft_tokens
    assert c["layerskip"]["proposed"] > 0 and s.accepted_draft_tokens > 0
    steps = layerskip.log if fallback else layerskip.log[1::3]
    if fallback:  # the steps where it was not asked for some running sequence
        skipped = [log for log in layerskip.log if not all(log[2]) and any(log[2])]
        assert skipped and any(len(h) > 1 for h in skipped[0][0])
    for histories, ks, active, draft in steps:
        fresh = LayerSkipDrafter(model, 2, tree_widths=widths)
        run = start(fresh, histories, generators=[torch.Generator() for _ in histories], capacity=128)
        again = fresh.propose(request(histories, ks, run, active))
        for b, a in enumerate(active):
            if a:
                n = int(draft.num_nodes[b])
                assert int(again.num_nodes[b]) == n
                assert draft.tokens[b, :n].tolist() == again.tokens[b, :n].tolist()


def test_tiny_sampling_keeps_the_target_distribution(tiny):
    """Multi-draft (n-gram tree + a sampling layer-skip chain) at temperature 0.8: each of
    the first 3 tokens follows the target's marginal (chi-square)."""
    _, model = tiny
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    prompt = ngram_friendly_prompt(model, sp)
    B = 3000
    multi = MultiDrafter([NgramDrafter(tree=True), LayerSkipDrafter(model, 2)])
    result = SpeculativeDecoder(model, multi).generate(
        [prompt] * B, 3, num_draft_tokens=3, sampling=sp, seeds=list(range(B))
    )
    out = torch.tensor(result.tokens)
    assert result.stats.accepted_draft_tokens > 0.1 * result.stats.sequence_steps
    for j, marginal in enumerate(exact_marginals(model, prompt, sp, 3)):
        assert chi_square_pvalue(out[:, j], marginal) > P_THRESHOLD, f"token {j}"


# ---------------------------------------------------------------------------- real model
REAL_PROMPTS = [
    "Rename the function add to plus:\n\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Say hello.",
]


@pytest.fixture(scope="module")
def real():
    from specdec_kernels.decoding.loading import load_checkpoint

    config, state_dict, tok = load_checkpoint()
    model = Transformer.from_hf(config, state_dict)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False)
        for t in REAL_PROMPTS
    ]
    plain = SpeculativeDecoder(model, stop_token_ids=[tok.eos_token_id])
    return model, tok, prompts, [plain.generate([p], 16).tokens[0] for p in prompts]


@real_only
def test_real_model_multi_draft_is_greedy(real):
    model, tok, prompts, greedy = real
    multi = MultiDrafter([NgramDrafter(tree=True), LayerSkipDrafter(model, 24, tree_widths=(2,))], max_depths=(None, 2))
    result = SpeculativeDecoder(model, multi, stop_token_ids=[tok.eos_token_id]).generate(
        prompts, 16, num_draft_tokens=4
    )
    assert result.tokens == greedy
    c = result.stats.drafters
    assert c["ngram"]["accepted"] > 0 and c["layerskip"]["accepted"] > 0


# a copying request (prompt lookup's case; both numerics copy the list) and a chat one
COPY_AND_CHAT = ["Copy this exactly: red, green, blue, yellow, orange, purple, pink.", "Say hello."]


def runs_in_both_numerics(real, make_drafter, k):
    """[(numerics, drafter, result, plain greedy tokens)] in float32 and in int8: the real
    model on COPY_AND_CHAT, 40 new tokens, K = k; ``make_drafter(model)`` builds the drafter."""
    model, tok, _, _ = real
    stop = [tok.eos_token_id]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False)
        for t in COPY_AND_CHAT
    ]
    out = []
    for numerics in ("float32", "int8"):
        model.numerics = numerics
        try:
            plain = SpeculativeDecoder(model, stop_token_ids=stop).generate(prompts, 40).tokens
            drafter = make_drafter(model)
            result = SpeculativeDecoder(model, drafter, stop_token_ids=stop).generate(prompts, 40, num_draft_tokens=k)
        finally:
            model.numerics = "float32"
        out.append((numerics, drafter, result, plain))
    return out


@real_only
def test_real_model_fallback_lookup_then_eagle_is_greedy(real):
    """The bench's ngram-eagle-adaptive drafter (prompt lookup with 2+ token matches, else the
    shipped EAGLE head's chain) returns plain greedy's tokens on the real model, in float32
    and in int8, and both drafters' drafts are accepted."""
    from specdec_kernels.decoding.drafters.eagle import EagleDrafter

    def make(model):
        return MultiDrafter([NgramDrafter(min_ngram=2), EagleDrafter(model, tree=False)], fallback=True)

    for numerics, _, result, plain in runs_in_both_numerics(real, make, 4):
        assert result.tokens == plain, numerics
        c = result.stats.drafters
        assert c["ngram"]["accepted"] > 0 and c["eagle"]["accepted"] > 0, (numerics, c)


@real_only
def test_real_model_lookup_and_eagle_tree_16_is_greedy(real):
    """The bench's ngram-eagle-tree-16 drafter (prompt lookup's tree merged with the shipped
    EAGLE head's dynamic tree) returns plain greedy's tokens on the real model, in float32
    and in int8; no draft it hands the target holds more than 16 nodes, root included; both
    sub-drafters' tokens are accepted."""
    from specdec_kernels.bench.e2e_ours import TREE16
    from specdec_kernels.decoding.drafters.eagle import EagleDrafter

    def make(model):
        multi = MultiDrafter([NgramDrafter(tree=True), EagleDrafter(model, **TREE16)], max_nodes=16)
        multi.sizes, propose = [], multi.propose

        def counted(*args, **kwargs):
            draft = propose(*args, **kwargs)
            multi.sizes.extend(draft.num_nodes.tolist())
            return draft

        multi.propose = counted
        return multi

    for numerics, multi, result, plain in runs_in_both_numerics(real, make, 7):
        assert result.tokens == plain, numerics
        assert 8 < max(multi.sizes) <= 16, (numerics, max(multi.sizes))
        c = result.stats.drafters
        assert c["ngram"]["accepted"] > 0 and c["eagle-tree"]["accepted"] > 0, (numerics, c)


class HiddenRecorder(Drafter):
    """Wants the target's hidden state (as Medusa heads do), records it, drafts nothing."""

    name = "hidden"
    wants_hidden = True

    def __init__(self):
        self.seen = []

    def propose(self, request):
        return Draft.from_lists([([h[-1]], [-1]) for h in request.histories])

    def observe(self, result):
        super().observe(result)
        if result.features is not None:
            self.seen.append((result.features.last.clone(), list(result.features.valid)))


def test_hidden_states_reach_the_sub_drafters_that_want_them(tiny):
    _, model = tiny
    alone = HiddenRecorder()
    SpeculativeDecoder(model, alone).generate(PROMPTS, 6)
    inner = HiddenRecorder()
    multi = MultiDrafter([FixedDrafter("none", [0], [-1]), inner])
    assert multi.wants_hidden and not MultiDrafter([NgramDrafter()]).wants_hidden
    SpeculativeDecoder(model, multi).generate(PROMPTS, 6)
    assert len(inner.seen) == len(alone.seen) == 7  # after the prefill, then after each step
    for (h1, a1), (h2, a2) in zip(inner.seen, alone.seen):
        assert a1 == a2
        torch.testing.assert_close(h1, h2)


def test_cli_builds_a_multi_drafter(tiny):
    from specdec_kernels import generate

    _, model = tiny
    args = generate.parse_args(["--prompt", "hi", "--drafter", "multi", "--drafters", "ngram,layerskip", "--tree"])
    assert args.sub_drafters == ["ngram", "layerskip"] and args.adaptive is None and args.typical is None
    drafter = generate.build_drafter(args, model)
    assert isinstance(drafter, MultiDrafter) and drafter.names == ["ngram", "layerskip"]
    assert drafter.drafters[0].tree and drafter.drafters[1].tree_widths == (2, 2)
    assert (
        generate.parse_args(["--prompt", "x", "--no-adaptive", "--typical", "0.09", "--temperature", "0.7"]).adaptive
        is False
    )
    for bad in (
        ["--prompt", "x", "--drafter", "multi", "--drafters", "ngram,nope"],
        ["--prompt", "x", "--typical", "0"],
        ["--prompt", "x", "--drafter", "multi", "--drafters", ""],
    ):
        with pytest.raises(SystemExit):
            generate.parse_args(bad)


def test_each_run_keeps_its_own_per_drafter_statistics(tiny):
    """A second generate() on the same decoder once overwrote the first result's per-drafter
    counters (both pointed at the drafter's one dict)."""
    _, model = tiny
    decoder = SpeculativeDecoder(model, MultiDrafter([NgramDrafter(), LayerSkipDrafter(model, 2)]))
    first = decoder.generate(PROMPTS, 20, num_draft_tokens=4).stats
    snapshot = {name: dict(c) for name, c in first.drafters.items()}
    second = decoder.generate([[1, 2]], 2, num_draft_tokens=4).stats
    assert first.drafters is not second.drafters
    assert first.drafters == snapshot
    assert sum(c["proposed"] for c in snapshot.values()) > sum(c["proposed"] for c in second.drafters.values())


# ---------------------------------------------------------------------------- fallback
class SomeSequences(FixedDrafter):
    """FixedDrafter that drafts only for the sequences in ``rows`` and records the active
    flags it is asked with."""

    def __init__(self, name, tokens, parents, rows):
        super().__init__(name, tokens, parents)
        self.rows, self.asked = set(rows), []

    def propose(self, request):
        self.asked.append(list(request.active))
        mine = [a and b in self.rows for b, a in enumerate(request.active)]
        return super().propose(dataclasses.replace(request, active=mine))


def test_fallback_takes_the_first_drafter_that_drafts():
    """Hand-worked, 3 sequences: the first drafter drafts for sequence 0 only, the second
    for 0 and 1.  Sequence 0 gets the first's chain, 1 the second's tree, 2 nothing; the
    second is asked for sequences 1 and 2 only, and each drafter observes only the path
    through its own draft."""
    first = SomeSequences("first", *NGRAM, rows=[0])
    second = SomeSequences("second", *LAYERSKIP, rows=[0, 1])
    multi = MultiDrafter([first, second], fallback=True)
    histories = [[1, 5], [2, 5], [3, 5]]
    run = start(multi, histories, generators=[torch.Generator() for _ in histories], capacity=64)
    draft = multi.propose(request(histories, [3, 3, 3], run, [True, True, True]))
    assert first.asked == [[True, True, True]] and second.asked == [[False, True, True]]
    n = draft.num_nodes.tolist()
    assert n == [4, 6, 1]
    assert draft.tokens[0, :4].tolist() == NGRAM[0] and draft.parents[0, :4].tolist() == NGRAM[1]
    assert draft.tokens[1, :6].tolist() == LAYERSKIP[0] and draft.parents[1, :6].tolist() == LAYERSKIP[1]
    assert not draft.is_chain
    assert multi.counters["first"]["proposed"] == 3 and multi.counters["second"]["proposed"] == 5
    # sequence 0 accepts 7 8 (its nodes 1 2), sequence 1 accepts 3 6 (nodes 2 4)
    accepted = torch.tensor([[0, 1, 2, -1, -1, -1], [0, 2, 4, -1, -1, -1], [0, -1, -1, -1, -1, -1]])
    after = [[1, 5, 7, 8, 4], [2, 5, 3, 6, 4], [3, 5, 4]]
    multi.observe(step(after, run, accepted, torch.tensor([2, 2, 0]), [True, True, True]))
    nodes, count, seen = first.observed[-1]
    assert count == [2, 0, 0] and nodes[0][:3] == [0, 1, 2] and seen == [True, True, True]
    nodes, count, seen = second.observed[-1]
    assert count == [0, 2, 0] and nodes[1][:3] == [0, 2, 4]
    assert seen == [False, True, True]  # it was not asked for sequence 0
    assert multi.counters["first"]["accepted"] == 2 and multi.counters["second"]["accepted"] == 2


def test_fallback_arguments():
    with pytest.raises(ValueError, match="ensemble and fallback"):
        MultiDrafter([NgramDrafter()], ensemble=True, fallback=True)
    with pytest.raises(TypeError, match="fallback"):
        MultiDrafter([NgramDrafter()], fallback=1)
    with pytest.raises(TypeError, match="ensemble"):
        MultiDrafter([NgramDrafter()], ensemble="yes")


def test_fallback_draft_sources_by_hand():
    """Sequence 0's suffix 1 2 recurs (prompt lookup drafts: source 0), sequence 1's does not
    (the last sub-drafter: source 1), sequence 2 is inactive (the last); without fallback, with
    a sub-drafter before the last that cannot tell, or none: None; a sub-drafter capped at
    depth 0 never drafts."""
    histories, active = [[1, 2, 3, 1, 2], [5, 6, 7], [1, 2, 1, 2]], [True, True, False]
    req = request(histories, 0, run_for(histories), active)  # K is not chosen yet: not read
    second = FixedDrafter("second", *LAYERSKIP)
    assert MultiDrafter([NgramDrafter(min_ngram=2), second], fallback=True).draft_sources(req) == [0, 1, 1]
    capped = MultiDrafter([NgramDrafter(min_ngram=2), second], fallback=True, max_depths=[0, None])
    assert capped.draft_sources(req) == [1, 1, 1]
    # merged: no sources (``draft_sources`` is the fallback's capability alone)
    assert check_draft_sources(MultiDrafter([NgramDrafter(min_ngram=2), second]), req) is None
    assert MultiDrafter([second, NgramDrafter()], fallback=True).draft_sources(req) is None
    assert MultiDrafter([second], fallback=True).draft_sources(req) == [0, 0, 0]


def test_fallback_cost_model_keeps_each_drafters_rates(tiny, tiny_greedy):
    """Prompt lookup else layer-skip under the cost-model policy: the plain greedy tokens, and
    the policy's acceptance counts of each sequence are kept under the source the drafter
    named (each step's counts go to the source that drafted: lookup's only where it drafted)."""
    from specdec_kernels.decoding.engine.adaptive import CostModelPolicy

    _, model = tiny
    ngram = Recorder(NgramDrafter(tree=True))
    layerskip = Recorder(LayerSkipDrafter(model, 2, share_target_cache=False))  # its own cache, as before
    ngram.drafts_for = ngram.inner.drafts_for
    multi = MultiDrafter([ngram, layerskip], fallback=True)
    sources, inner = [], multi.draft_sources

    def recorded(req):
        out = inner(req)
        sources.append(out)
        return out

    multi.draft_sources = recorded
    steps = []  # (the sources the policy chose with, the step's record), step by step

    def on_step(state):
        if state.last_step is not None:
            steps.append((list(state.draft_sources), state.last_step))

    policy = CostModelPolicy(0, 4, warmup=2)
    result = SpeculativeDecoder(model, multi).generate(PROMPTS, 20, num_draft_tokens=policy, on_step=on_step)
    assert result.tokens == tiny_greedy
    assert len(sources) == len(ngram.log) == len(steps)
    for s, (_, ks, active, lookup) in zip(sources, ngram.log):
        for b, a in enumerate(active):
            if a and ks[b] > 0:  # asked at K >= 1: lookup drafts exactly where it was named
                assert (s[b] == 0) == (int(lookup.num_nodes[b]) > 1)
    # the policy's counts, replayed from the records under each step's own sources
    requested = [{} for _ in PROMPTS]
    reached = [{} for _ in PROMPTS]
    for s, rec in steps:
        for b, a in enumerate(rec.active):
            if a:
                req = requested[b].setdefault(s[b], [0] * 5)
                hit = reached[b].setdefault(s[b], [0] * 5)
                for j in range(1, min(rec.ks[b], 4) + 1):
                    req[j] += 1
                    hit[j] += int(rec.num_accepted[b] >= j)
    assert policy.calibration.requested == requested and policy.calibration.reached == reached
    named = {src for row in policy.calibration.requested for src, counts in row.items() if counts[1] > 0}
    assert named == {0, 1}


def test_naming_the_sources_counts_as_drafting(tiny):
    """The time a drafter takes to name its sources is part of the step's draft time."""
    import time

    from specdec_kernels.decoding.engine.adaptive import CostModelPolicy

    class Slow(FixedDrafter):
        def draft_sources(self, request):
            time.sleep(0.02)
            return [0] * len(request.histories)

    _, model = tiny
    records = []
    decoder = SpeculativeDecoder(model, Slow("slow", *NGRAM))
    result = decoder.generate(
        PROMPTS, 4, num_draft_tokens=CostModelPolicy(0, 2), on_step=lambda st: records.append(st.last_step)
    )
    steps = [r for r in records if r is not None]
    assert steps and all(r.draft_time >= 0.02 for r in steps)
    assert result.stats.draft_time >= 0.02 * len(steps)


@pytest.mark.parametrize(
    "sources",
    [[0], [-1] * len(PROMPTS), ["a"] * len(PROMPTS), [True] * len(PROMPTS), 7],
    ids=["short", "negative", "str", "bool", "not-a-list"],
)
def test_bad_draft_sources_name_the_drafter(tiny, sources):
    from specdec_kernels.decoding.engine.adaptive import CostModelPolicy

    class Bad(FixedDrafter):
        def draft_sources(self, request):
            return sources

    _, model = tiny
    with pytest.raises(ValueError, match="'bad': draft_sources"):
        SpeculativeDecoder(model, Bad("bad", *NGRAM)).generate(PROMPTS, 4, num_draft_tokens=CostModelPolicy(0, 2))


@pytest.mark.parametrize("k", [1, 4], ids=lambda k: f"K{k}")
def test_tiny_fallback_is_greedy_and_asks_the_model_drafter_only_where_lookup_has_nothing(tiny, tiny_greedy, k):
    """Prompt lookup first, else layer-skip: a ragged batch returns the plain greedy tokens; the layer-skip drafter is never asked for a sequence that prompt
    lookup drafted for in the same step, and both drafters' drafts get accepted."""
    _, model = tiny
    # (matches of one token: a random-weight model seldom repeats a bigram in 20 tokens)
    ngram = Recorder(NgramDrafter(tree=True))
    layerskip = Recorder(LayerSkipDrafter(model, 2, share_target_cache=False))  # its own cache, as before
    multi = MultiDrafter([ngram, layerskip], fallback=True)
    result = SpeculativeDecoder(model, multi).generate(PROMPTS, 20, num_draft_tokens=k)
    assert result.tokens == tiny_greedy
    assert len(ngram.log) == len(layerskip.log)
    for (_, _, active, lookup), (_, _, asked, _) in zip(ngram.log, layerskip.log):
        for b, a in enumerate(active):
            assert asked[b] == (a and int(lookup.num_nodes[b]) == 1)
    c = result.stats.drafters
    assert c["ngram"]["accepted"] > 0 and c["layerskip"]["accepted"] > 0
    assert c["ngram"]["accepted"] + c["layerskip"]["accepted"] == result.stats.accepted_draft_tokens


def test_tiny_fallback_sampling_keeps_the_target_distribution(tiny):
    """Fallback (prompt lookup, else a sampling layer-skip chain) at temperature 0.8 with the
    recursive rejection sampler: each of the first 3 tokens follows the target's marginal
    (chi-square, P_THRESHOLD as the merged case above).  Which drafter drafts depends on the
    history only, never on the coins, so the one-hot q keeps it lossless."""
    _, model = tiny
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, coupling="rejection")
    prompt = ngram_friendly_prompt(model, sp)
    B = 3000
    multi = MultiDrafter([NgramDrafter(tree=True), LayerSkipDrafter(model, 2)], fallback=True)
    result = SpeculativeDecoder(model, multi).generate(
        [prompt] * B, 3, num_draft_tokens=3, sampling=sp, seeds=list(range(B))
    )
    out = torch.tensor(result.tokens)
    c = result.stats.drafters
    assert c["ngram"]["accepted"] > 0 and c["layerskip"]["accepted"] > 0
    for j, marginal in enumerate(exact_marginals(model, prompt, sp, 3)):
        assert chi_square_pvalue(out[:, j], marginal) > P_THRESHOLD, f"token {j}"


class Budgeted(FixedDrafter):
    """FixedDrafter with a tree budget (as a cost-sized EAGLE drafter has), bound to each run's
    calibration as the run starts (as EAGLE's is), recording the budget's calibration at each
    propose."""

    def __init__(self):
        from specdec_kernels.decoding.engine.adaptive import TreeBudget

        super().__init__("budgeted", [5, 7], [-1, 0])
        self.budget, self.seen = TreeBudget(4), []

    def observe(self, result):
        super().observe(result)
        if result.started:
            self.budget.start(result.batch_size, result.run.calibration)

    def propose(self, request):
        self.seen.append(self.budget.calibration)
        return super().propose(request)


def test_sub_drafters_tree_budgets_read_the_runs_calibration(tiny):
    """A tree budget inside a MultiDrafter reads the run's calibration (the cost-model policy's,
    in its sub-drafter's ``DraftRun``) while it runs, as a drafter's own does; the next run,
    without a cost model, binds none."""
    from specdec_kernels.decoding.engine.adaptive import CostModelPolicy

    _, model = tiny
    inner = Budgeted()
    policy = CostModelPolicy(0, 2)
    decoder = SpeculativeDecoder(model, MultiDrafter([NgramDrafter(min_ngram=3), inner], fallback=True))
    decoder.generate([[1, 2, 3]], 6, num_draft_tokens=policy)
    assert inner.seen and all(c is policy.calibration for c in inner.seen)
    inner.seen.clear()
    decoder.generate([[1, 2, 3]], 6, num_draft_tokens=2)
    assert inner.seen and all(c is None for c in inner.seen) and inner.budget.calibration is None


def test_cli_builds_a_fallback_drafter(tiny):
    from specdec_kernels import generate

    _, model = tiny
    argv = ["--prompt", "hi", "--drafter", "multi", "--drafters", "ngram,layerskip", "--fallback", "--min-ngram", "2"]
    drafter = generate.build_drafter(generate.parse_args(argv), model)
    assert isinstance(drafter, MultiDrafter) and drafter.fallback and not drafter.ensemble
    assert drafter.drafters[0].min_ngram == 2 and drafter.drafters[0].max_ngram == 5
    assert generate.parse_args(["--prompt", "hi"]).min_ngram == 1
    # one drafter's chain per step: no tree unless a drafter drafts trees
    assert not generate.drafts_trees(generate.parse_args(argv))
    assert generate.drafts_trees(generate.parse_args(argv + ["--tree"]))
    assert generate.drafts_trees(generate.parse_args([a for a in argv if a != "--fallback"]))  # merged: a tree
    for bad in (
        ["--prompt", "x", "--fallback"],
        ["--prompt", "x", "--drafter", "multi", "--drafters", "ngram,eagle", "--fallback", "--ensemble"],
        ["--prompt", "x", "--min-ngram", "0"],
        ["--prompt", "x", "--min-ngram", "6"],
        ["--prompt", "x", "--max-ngram", "3", "--min-ngram", "4"],
        ["--prompt", "x", "--drafter", "layerskip", "--min-ngram", "2"],
    ):
        with pytest.raises(SystemExit):
            generate.parse_args(bad)


def test_a_run_that_raises_leaves_its_calibration_to_no_later_run(tiny):
    """Each run binds its own calibration as it starts: after a run whose first on_step raises
    (its budget bound to that run's calibration), the next run, without a cost model, reads
    none."""
    from specdec_kernels.decoding.engine.adaptive import CostModelPolicy

    _, model = tiny

    inner = Budgeted()

    def boom(state):
        assert inner.budget.calibration is not None and inner.budget.calibration is state.draft_run.calibration
        raise RuntimeError("stop")

    decoder = SpeculativeDecoder(model, MultiDrafter([inner, MultiDrafter([NgramDrafter()])]))
    with pytest.raises(RuntimeError, match="stop"):
        decoder.generate([[1, 2, 3]], 4, num_draft_tokens=CostModelPolicy(0, 2), on_step=boom)
    decoder.generate([[1, 2, 3]], 4, num_draft_tokens=2)
    assert inner.seen and all(c is None for c in inner.seen) and inner.budget.calibration is None
