"""Lookahead (Jacobi) decoding (``decoding.drafters.lookahead``): the target's argmax the engine
hands to ``observe`` against a teacher-forced pass, the Jacobi step and the n-gram pool by hand, greedy identity
(tiny model: ragged batch, K 0..7, paged cache, inside MultiDrafter; the real model), the
target distribution at temperature > 0 (chi-square)."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import Draft, Drafter, MultiDrafter, NgramDrafter, SamplingParams, SpeculativeDecoder
from specdec_kernels.decoding.drafters.lookahead import LookaheadDrafter
from specdec_kernels.tree import path_to
from tests.engine.drive import request, start, step
from tests.engine.heads import PROMPTS, tiny  # noqa: F401 (fixture)
from tests.engine.tiny import exact_marginals, real_only
from tests.utils import P_THRESHOLD, chi_square_pvalue, one_thread  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")


class TreeRecorder(Drafter):
    """Proposes a fixed tree below each root and records the target's argmax tokens."""

    name = "recorder"
    wants_target_argmax = True

    def __init__(self, tokens, parents):
        self.tree, self.seen = (tokens, parents), []

    def propose(self, request):
        t, p = self.tree
        return Draft.from_lists([([h[-1]] + t, p) for h in request.histories])

    def observe(self, result):
        super().observe(result)
        if not result.started:
            self.seen.append((result.target_argmax.clone(), result.num_nodes.clone()))


def test_the_engine_hands_over_the_targets_argmax_at_every_node(tiny):
    tokens, parents = [7, 9, 4, 4], [-1, 0, 0, 1, 2]
    rec = TreeRecorder(tokens, parents)
    prompt = PROMPTS[0]
    SpeculativeDecoder(tiny, rec).generate([prompt], 1, num_draft_tokens=2)
    argmax, n = rec.seen[0]
    assert n.tolist() == [5]
    nodes = [prompt[-1]] + tokens
    for i in range(5):
        ctx = prompt[:-1] + [nodes[j] for j in path_to(parents, i)]
        with torch.inference_mode():
            T = len(ctx)
            logits = tiny(
                torch.tensor([ctx]), torch.arange(T)[None], tiny.new_kv_cache(1, T), torch.zeros(1, dtype=torch.int32)
            )
        assert int(argmax[0, i]) == int(logits[0, -1].argmax()), i


def test_jacobi_step_and_pool_by_hand():
    d = LookaheadDrafter(window=4, ngram=3, guesses=2, max_nodes=32)
    h = [10, 11, 12, 13]
    run = start(d, [h], SamplingParams(), [torch.Generator().manual_seed(0)], capacity=64)
    draft = d.propose(request([h], [6], run))
    y = d._windows[0]
    assert len(y) == 4 and set(y) <= set(h)  # fresh guesses come from the history
    nodes = d._window_nodes[0]
    assert len(nodes) == 5 and nodes[0] == 0
    toks = draft.tokens[0].tolist()
    assert [toks[n] for n in nodes] == [13] + y
    # the target's argmax at the root and the window's nodes: o_0..o_4 = 50..54
    argmax = torch.zeros(1, int(draft.num_nodes[0]), dtype=torch.int64)
    for i, n in enumerate(nodes):
        argmax[0, n] = 50 + i
    # two drafts accepted, then the bonus: the root moves 3 positions
    h2 = h + [y[0], y[1], 77]
    d.observe(step([h2], run, [[0, 1, 2, -1, -1]], [2], num_nodes=draft.num_nodes, target_argmax=argmax))
    # n-grams (y_i, y_{i+1}, o_{i+1}) for i = 0..3, y_0 the root 13
    # (newest first, at most G = 2 per first token, a repeated n-gram moves to the front)
    seq = [13] + y
    want = {}
    for i in range(4):
        pool = want.setdefault(seq[i], [])
        if (seq[i + 1], 51 + i) in pool:
            pool.remove((seq[i + 1], 51 + i))
        pool.insert(0, (seq[i + 1], 51 + i))
        del pool[2:]
    assert d.pools[0] == want
    assert (y[0], 51) in d.pools[0][13]
    # the window keeps o_3, o_4 and draws 2 fresh guesses
    d.propose(request([h2], [6], run))
    assert d._windows[0][:2] == [53, 54] and len(d._windows[0]) == 4


def test_pooled_ngrams_that_start_with_the_root_are_verified():
    d = LookaheadDrafter(window=2, ngram=3, guesses=2, max_nodes=32)
    h = [1, 2, 3]
    run = start(d, [h], SamplingParams(), [torch.Generator().manual_seed(0)], capacity=64)
    d.pools[0][3] = [(8, 9), (6, 5)]
    draft = d.propose(request([h], [4], run))
    n = int(draft.num_nodes[0])
    toks, par = draft.tokens[0, :n].tolist(), draft.parents[0, :n].tolist()
    paths = {tuple(toks[j] for j in path_to(par, i)[1:]) for i in range(n)}
    assert (8, 9) in paths and (6, 5) in paths and tuple(d._windows[0]) in paths


def test_bad_arguments():
    for kw in ({"window": 0}, {"ngram": 1}, {"guesses": -1}, {"max_nodes": 1}, {"window": 2.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            LookaheadDrafter(**kw)
    for kw in ({"window_first": "no"}, {"pool_from_history": 1}):
        with pytest.raises(TypeError, match=next(iter(kw))):
            LookaheadDrafter(**kw)


def _one_node(d, h, pools):
    run = start(d, [h], SamplingParams(), [torch.Generator().manual_seed(0)], capacity=64)
    d.pools[0].update(pools)
    draft = d.propose(request([h], [1], run))
    n = int(draft.num_nodes[0])
    return draft.tokens[0, :n].tolist(), draft.parents[0, :n].tolist()


def test_one_draft_node_holds_the_likeliest_ngram_by_hand():
    """max_nodes=2 with window_first=False: a recurring 3-token suffix's continuation first,
    then the pool's newest n-gram for the root, then a short history match, the Jacobi window
    only when there is none; with window_first=True the window keeps the node."""
    d = LookaheadDrafter(1, 2, 3, max_nodes=2, pool_from_history=True, window_first=False)
    strong = [1, 2, 3, 9, 5, 1, 2, 3]  # (1, 2, 3) recurs: 9 followed it
    assert _one_node(d, strong, {3: [(7,)]}) == ([3, 9], [-1, 0])
    assert _one_node(d, [4, 3, 8, 6, 3], {3: [(7,), (5,)]}) == ([3, 7], [-1, 0])  # the pool beats the 1-token match (8)
    assert _one_node(d, [4, 3, 8, 6, 3], {}) == ([3, 8], [-1, 0])
    assert d._window_nodes[0] == [0] and d._fed[0] == []  # the window was cut: only the root's argmax is kept
    d.observe(step([[4, 3, 8, 6, 3, 8]], d.run, [[0, 1]], [1], num_nodes=[2], target_argmax=[[11, 12]]))
    assert d.pools[0][3] == [(11,)]  # (root, o_0): what the target said after the root
    toks, _ = _one_node(d, [10, 11, 12], {})  # nothing recurs: the window's fresh guess
    assert toks[0] == 12 and len(toks) == 2 and toks[1] in (10, 11, 12)
    w = LookaheadDrafter(1, 2, 3, max_nodes=2, pool_from_history=True)
    toks, _ = _one_node(w, strong, {3: [(7,)]})
    assert toks[1] == w._windows[0][0]  # the window keeps the node


@pytest.mark.parametrize("k", [0, 1, 3, 7], ids=lambda k: f"K{k}")
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"window": 7, "ngram": 5, "guesses": 7, "max_nodes": 64},
        {"pool_from_history": True, "ngram": 2},
        {"window": 1, "ngram": 2, "guesses": 3, "max_nodes": 2, "pool_from_history": True, "window_first": False},
    ],
    ids=["default", "spec-bench", "history", "one-node"],
)
def test_greedy_equals_plain_greedy(tiny, k, config):
    plain = SpeculativeDecoder(tiny, stop_token_ids=[3]).generate(PROMPTS, 24)
    d = LookaheadDrafter(**config)
    result = SpeculativeDecoder(tiny, d, stop_token_ids=[3]).generate(PROMPTS, 24, num_draft_tokens=k)
    assert result.tokens == plain.tokens
    if k and min(d.window, k) >= d.ngram - 2:  # a window long enough for one n-gram
        assert d.ngrams_added > 0
    else:
        assert d.ngrams_added == 0


@pytest.mark.parametrize("block_size", [None, 4], ids=["dense", "paged"])
def test_greedy_inside_a_multi_drafter(tiny, block_size):
    plain = SpeculativeDecoder(tiny, stop_token_ids=[3]).generate(PROMPTS, 24)
    la = LookaheadDrafter()
    multi = MultiDrafter([NgramDrafter(), la], max_nodes=12)
    result = SpeculativeDecoder(tiny, multi, stop_token_ids=[3], block_size=block_size).generate(
        PROMPTS, 24, num_draft_tokens=4
    )
    assert result.tokens == plain.tokens
    assert la.ngrams_added > 0


@pytest.mark.parametrize("multi", [False, True], ids=["alone", "multi"])
def test_a_draft_cut_by_the_engine_leaves_the_cut_nodes_unknown(tiny, multi):
    """max_draft_nodes below the window: the engine feeds only the first nodes, and the
    argmax of the nodes it cut is unknown (not read past the block)."""
    plain = SpeculativeDecoder(tiny, stop_token_ids=[3]).generate(PROMPTS, 20)
    la = LookaheadDrafter(window=6, ngram=3, guesses=2)
    drafter = MultiDrafter([NgramDrafter(), la], max_nodes=None) if multi else la
    result = SpeculativeDecoder(tiny, drafter, stop_token_ids=[3], max_draft_nodes=3).generate(
        PROMPTS, 20, num_draft_tokens=6
    )
    assert result.tokens == plain.tokens
    assert len(result.stats.proposed_at) <= 2  # depth at most 2: root + 2 nodes fed


def test_sampling_keeps_the_target_distribution(tiny):
    """Deterministic drafts (q one-hot): the first 3 emitted tokens follow the target's
    marginals over 3000 seeds (P_THRESHOLD 1e-3 per token)."""
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    prompt = PROMPTS[2]
    B = 3000
    result = SpeculativeDecoder(tiny, LookaheadDrafter(pool_from_history=True, ngram=2)).generate(
        [prompt] * B, 3, num_draft_tokens=3, sampling=sp, seeds=list(range(B))
    )
    out = torch.tensor(result.tokens)
    assert result.stats.accepted_draft_tokens > 0
    for j, marginal in enumerate(exact_marginals(tiny, prompt, sp, 3)):
        assert chi_square_pvalue(out[:, j], marginal) > P_THRESHOLD, f"token {j}"


@real_only
def test_real_greedy_equals_plain_greedy():
    from specdec_kernels.decoding import load_smollm2
    from specdec_kernels.decoding.training.data import chat_ids

    model, tok = load_smollm2()
    prompts = [chat_ids(tok, "Write a short poem about autumn leaves."), chat_ids(tok, "List the days of the week.")]
    plain = SpeculativeDecoder(model, stop_token_ids=[tok.eos_token_id])
    greedy = [plain.generate([p], 32).tokens[0] for p in prompts]
    d = LookaheadDrafter()
    result = SpeculativeDecoder(model, d, stop_token_ids=[tok.eos_token_id]).generate(prompts, 32, num_draft_tokens=4)
    assert result.tokens == greedy
    assert d.ngrams_added > 0
    # bench.e2e's lookahead-one-node: one draft node a step, the n-grams before the window
    one = LookaheadDrafter(1, 2, 3, max_nodes=2, pool_from_history=True, window_first=False)
    result = SpeculativeDecoder(model, one, stop_token_ids=[tok.eos_token_id]).generate(prompts, 32, num_draft_tokens=1)
    assert result.tokens == greedy
    assert result.stats.accepted_draft_tokens > 0
