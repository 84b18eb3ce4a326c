"""Ensemble averaging in ``MultiDrafter(ensemble=True)``: the draft's q is the weighted
mixture of the members' distributions and the tokens are drawn from exactly that q (the
B01/B02 fault class: q must be what was sampled), greedy identity, the target distribution
at temperature > 0 (chi-square), weights learnt from the committed tokens, each member's
chain distributions against its own drafts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec_kernels.decoding import (
    Drafter,
    LayerSkipDrafter,
    MedusaDrafter,
    MultiDrafter,
    NgramDrafter,
    SamplingParams,
    SpeculativeDecoder,
)
from specdec_kernels.decoding.draft import TargetFeatures
from specdec_kernels.decoding.drafters.eagle import EagleDrafter
from specdec_kernels.decoding.drafters.model_drafter import DraftModelDrafter
from specdec_kernels.decoding.drafters.ngram import ngram_next_counts
from tests.engine.drive import request, start
from tests.engine.heads import PROMPTS, final_hidden, tiny, train_prompts  # noqa: F401 (fixture)
from tests.engine.test_eagle import random_head, tiny_rows, trained  # noqa: F401 (fixtures)
from tests.engine.test_medusa import random_heads
from tests.engine.tiny import V, exact_marginals, real_only
from tests.utils import P_THRESHOLD, chi_square_pvalue, one_thread  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")
SP = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)


def members(tiny, head, draft_vocab=None):
    return [EagleDrafter(tiny, head, tree=False, draft_vocab=draft_vocab), NgramDrafter(), LayerSkipDrafter(tiny, 2)]


def started(drafters, histories, sampling, tiny):
    """Start every drafter on these histories (its run: ``d.run``) and hand the Medusa / EAGLE
    ones the teacher-forced features of the committed positions, as the engine does after its
    prefill."""
    for d in drafters:
        features = None
        if d.wants_hidden:
            feats = [final_hidden(tiny, h) for h in histories]
            context = firsts = None
            if d.context_window:
                firsts = [max(0, len(h) - 1 - d.context_window) for h in histories]
                context = [f[a : len(h) - 1] for f, a, h in zip(feats, firsts, histories)]
            features = TargetFeatures(
                torch.stack([f[len(h) - 2] for f, h in zip(feats, histories)]),
                [len(h) > 1 for h in histories],
                context,
                firsts,
            )
        gens = [torch.Generator().manual_seed(b) for b in range(len(histories))]
        start(d, histories, sampling, gens, capacity=256, features=features)
    return drafters


def test_ngram_next_counts_by_hand():
    assert ngram_next_counts([1, 2, 3, 1, 2, 4, 1, 2]) == {3: 1, 4: 1}  # "1 2" recurs twice
    assert ngram_next_counts([5, 6, 7, 5, 6, 7, 5, 6]) == {7: 1}  # the longest recurring suffix (5 tokens) once
    assert ngram_next_counts([4, 4, 4, 4], max_ngram=2) == {4: 2}
    assert ngram_next_counts([1, 2, 3]) is None
    assert ngram_next_counts([9]) is None


@pytest.mark.parametrize("kind", ["eagle", "layerskip", "medusa", "hydra"])
def test_chain_distributions_follow_each_drafters_own_chain(tiny, trained, kind):
    """Fed its own argmax at each depth, a model member's chain distributions reproduce its
    own greedy chain draft (the same computation, one depth at a time).  (The n-gram
    member's distribution re-matches the grown suffix at every depth, where its own drafts
    copy one match: ``ngram_next_counts`` is checked by hand instead.)"""
    head, _ = trained
    d = {
        "eagle": lambda: EagleDrafter(tiny, head, tree=False),
        "layerskip": lambda: LayerSkipDrafter(tiny, 2),
        "medusa": lambda: MedusaDrafter(tiny, random_heads(3)),
        "hydra": lambda: MedusaDrafter(tiny, random_heads(3, conditioned=True)),
    }[kind]
    hist = [PROMPTS[0] + [5, 17, 33, 2], PROMPTS[2]]
    ks = [3, 2]
    a, b = started([d(), d()], hist, SamplingParams(), tiny)
    with torch.inference_mode():
        draft = a.propose(request(hist, ks, a.run, [True, True]))
        probs, has = b.chain_begin(request(hist, ks, b.run, [True, True]), V)
        chain = [[] for _ in hist]
        for depth in range(1, max(ks) + 1):
            tok = probs.argmax(-1)
            for s in range(len(hist)):
                if has[s]:
                    assert torch.allclose(probs[s].sum(), torch.tensor(1.0), atol=1e-5)
                    chain[s].append(int(tok[s]))
            if depth < max(ks):
                probs, has = b.chain_extend(tok)
    for s in range(len(hist)):
        n = int(draft.num_nodes[s])
        assert chain[s][: n - 1] == draft.tokens[s, 1:n].tolist()


def test_medusa_without_aligned_context_has_no_opinion(tiny):
    """A context layer whose kept rows do not end just before the root: no drafts from
    propose, and no opinion (not an error) from chain_begin."""
    d = MedusaDrafter(tiny, random_heads(3, context=4))
    hist = [PROMPTS[0]]
    run = start(
        d,
        hist,
        SamplingParams(),
        None,
        capacity=64,
        features=TargetFeatures(final_hidden(tiny, hist[0])[-2:-1], [True]),
    )
    assert int(d.propose(request(hist, [3], run)).num_nodes[0]) == 1
    probs, has = d.chain_begin(request(hist, [3], run), V)
    assert not bool(has.any())


@pytest.mark.parametrize("draft_vocab", [None, 40], ids=["full", "eagle-vocab40"])
def test_the_drafts_q_is_the_weighted_mixture_and_what_was_sampled(tiny, trained, draft_vocab):
    """Row d of Draft.probs is sum_i w_i q_i / sum_i w_i of the members' distributions
    given the chain so far (recomputed with fresh members fed the sampled tokens), and the
    first draft token over 4000 generators follows that row (chi-square); with the EAGLE
    member on a 40-token draft vocabulary too (its q is 0 elsewhere)."""
    head, _ = trained
    hist = [train_prompts()[0] + [105, 106, 52, 29]]
    weights = [0.5, 0.2, 0.3]
    multi = MultiDrafter(members(tiny, head, draft_vocab), ensemble=True, weights=weights)
    started([multi], hist, SP, tiny)
    with torch.inference_mode():
        multi.log_weights[:] = torch.tensor(weights, dtype=torch.float64).log()  # started() resets them: fixed
        draft = multi.propose(request(hist, [3], multi.run))
        assert draft.is_chain and draft.probs is not None and int(draft.num_nodes[0]) == 4
        fresh = started(members(tiny, head, draft_vocab), hist, SP, tiny)
        toks = draft.tokens[0].tolist()
        for depth in range(1, 4):
            qs, hs = zip(
                *[
                    m.chain_begin(request(hist, [3], m.run), V)
                    if depth == 1
                    else m.chain_extend(torch.tensor([toks[depth - 1]]))
                    for m in fresh
                ]
            )
            w = torch.tensor(weights) * torch.tensor([bool(h[0]) for h in hs])
            want = sum(wi * q[0] for wi, q in zip(w, qs)) / w.sum()
            torch.testing.assert_close(draft.probs[0, depth - 1], want, atol=1e-6, rtol=1e-5)
            assert draft.probs[0, depth - 1, toks[depth]] > 0  # the token was drawn where q > 0
    # the first token is drawn from row 0: many independent generators
    q0 = draft.probs[0, 0]
    firsts = []
    for seed in range(4000):
        multi.run = dataclasses.replace(multi.run, generators=[torch.Generator().manual_seed(10_000 + seed)])
        multi._ensemble_last = None
        firsts.append(int(multi.propose(request(hist, [1], multi.run)).tokens[0, 1]))
    assert chi_square_pvalue(torch.tensor(firsts), q0) > P_THRESHOLD


@pytest.mark.parametrize("k", [0, 1, 3, 6], ids=lambda k: f"K{k}")
def test_greedy_equals_plain_greedy(tiny, trained, k):
    head, _ = trained
    plain = SpeculativeDecoder(tiny, stop_token_ids=[3]).generate(PROMPTS, 20)
    multi = MultiDrafter(members(tiny, head), ensemble=True)
    result = SpeculativeDecoder(tiny, multi, stop_token_ids=[3]).generate(PROMPTS, 20, num_draft_tokens=k)
    assert result.tokens == plain.tokens
    if k:
        assert result.stats.accepted_draft_tokens > 0
        assert set(result.stats.drafters) == {"eagle", "ngram", "layerskip"}


@pytest.mark.parametrize(
    "block_size, coupling", [(None, "rejection"), (4, "rejection"), (None, "gumbel")], ids=["dense", "paged", "gumbel"]
)
def test_sampling_keeps_the_target_distribution(tiny, trained, block_size, coupling):
    """The mixture q goes to rejection sampling (or, with the Gumbel coupling, its Gumbel-max
    is the draft): each of the first 3 emitted tokens follows the target's marginal over 3000
    seeds (P_THRESHOLD 1e-3 per token and test)."""
    head, _ = trained
    sp = SamplingParams(temperature=SP.temperature, top_k=SP.top_k, top_p=SP.top_p, coupling=coupling)
    prompt = train_prompts()[0]
    prompt = prompt + SpeculativeDecoder(tiny).generate([prompt], 5).tokens[0]
    B = 3000
    multi = MultiDrafter(members(tiny, head), ensemble=True)
    result = SpeculativeDecoder(tiny, multi, block_size=block_size).generate(
        [prompt] * B, 3, num_draft_tokens=3, sampling=sp, seeds=list(range(B))
    )
    out = torch.tensor(result.tokens)
    assert result.stats.accepted_draft_tokens > 0.3 * result.stats.sequence_steps
    for j, marginal in enumerate(exact_marginals(tiny, prompt, sp, 3)):
        assert chi_square_pvalue(out[:, j], marginal) > P_THRESHOLD, f"token {j}"


def test_learnt_weights_move_to_the_member_that_predicts_the_target(tiny):
    """A draft model that is the target itself (q_i = p exactly) against a random EAGLE head:
    after a run the weights favour the first, and the ensemble accepts more than the random
    member alone."""
    perfect, poor = DraftModelDrafter(tiny), EagleDrafter(tiny, random_head(window=16, scale=0.2), tree=False)
    multi = MultiDrafter([perfect, poor], ensemble=True)
    dec = SpeculativeDecoder(tiny, multi)
    r = dec.generate([train_prompts()[1]], 24, num_draft_tokens=3, sampling=SP, seeds=[0])
    w = multi.mixture_weights()[0]
    assert w[0] > 0.9, w
    c = r.stats.drafters
    assert c["draft-model"]["weight"] > c["eagle"]["weight"]
    alone = SpeculativeDecoder(tiny, EagleDrafter(tiny, random_head(window=16, scale=0.2), tree=False)).generate(
        [train_prompts()[1]], 24, num_draft_tokens=3, sampling=SP, seeds=[0]
    )
    assert r.stats.mean_accepted_length > alone.stats.mean_accepted_length


def test_fixed_weights_stay_fixed(tiny, trained):
    head, _ = trained
    multi = MultiDrafter(members(tiny, head), ensemble=True, weights=[1, 1, 2])
    SpeculativeDecoder(tiny, multi).generate(PROMPTS, 12, num_draft_tokens=3)
    torch.testing.assert_close(
        multi.mixture_weights(), torch.tensor([[0.25, 0.25, 0.5]] * len(PROMPTS), dtype=torch.float64)
    )


def test_bad_arguments(tiny, trained):
    head, _ = trained

    class Plain(Drafter):
        name = "plain"

        def propose(self, request):
            raise AssertionError

    with pytest.raises(TypeError, match="chain distributions"):
        MultiDrafter([EagleDrafter(tiny, head), Plain()], ensemble=True)
    with pytest.raises(ValueError, match="vocabulary size"):
        MultiDrafter([NgramDrafter()], ensemble=True)
    for w in ([1.0], [1, -1, 1], [0, 0, 0], [1, float("nan"), 1]):
        with pytest.raises(ValueError, match="weights"):
            MultiDrafter(members(tiny, head), ensemble=True, weights=w)
    with pytest.raises(ValueError, match="ensemble"):
        MultiDrafter(members(tiny, head), weights=[1, 1, 1])


@real_only
def test_real_greedy_equals_plain_greedy():
    from specdec_kernels.decoding import load_smollm2
    from specdec_kernels.decoding.training.data import chat_ids

    model, tok = load_smollm2()
    prompts = [
        chat_ids(tok, "Rename the variable x to count: x = 0\nfor i in range(3):\n    x += i\nprint(x)"),
        chat_ids(tok, "Give three tips for staying healthy."),
    ]
    plain = SpeculativeDecoder(model, stop_token_ids=[tok.eos_token_id])
    greedy = [plain.generate([p], 32).tokens[0] for p in prompts]
    multi = MultiDrafter([EagleDrafter(model, tree=False), NgramDrafter()], ensemble=True)
    result = SpeculativeDecoder(model, multi, stop_token_ids=[tok.eos_token_id]).generate(
        prompts, 32, num_draft_tokens=5
    )
    assert result.tokens == greedy
    assert result.stats.accepted_draft_tokens > 0
