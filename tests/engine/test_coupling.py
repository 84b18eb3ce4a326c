"""The Gumbel coupling (``decoding/coupling.py``): a seeded request's sampled tokens depend
only on its seed, prompt and sampling settings, under every drafter, draft-length policy,
tree policy and batch; the noise is an exact Gumbel-max sampler; and rejection sampling,
whose tokens depend on K, is refused where K is not the caller's."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import (
    CostModelPolicy,
    DraftModelDrafter,
    FixedPolicy,
    HeuristicPolicy,
    LayerSkipDrafter,
    MultiDrafter,
    NgramDrafter,
    SamplingParams,
    SpeculativeDecoder,
)
from specdec_kernels.decoding.coupling import (
    UNIFORM_MAX,
    UNIFORM_MIN,
    GumbelCoupling,
    gumbel_noise,
    gumbel_top_k,
    uniform_to_gumbel,
)
from specdec_kernels.decoding.draft import sample_tokens
from specdec_kernels.decoding.drafters.eagle import EagleDrafter
from tests.engine.test_eagle import random_head
from tests.engine.tiny import PROMPTS, V, exact_marginals, ngram_friendly_prompt, tiny  # noqa: F401 (fixture)
from tests.utils import P_THRESHOLD, chi_square_pvalue

SP = SamplingParams(temperature=0.9, top_k=50, top_p=0.97)


# ---------------------------------------------------------------------------- the noise
def test_noise_depends_on_seed_and_index_only():
    a = gumbel_noise(3, 10, 257)
    assert a.shape == (257,) and a.dtype == torch.float32
    assert torch.equal(a, gumbel_noise(3, 10, 257))
    assert not torch.equal(a, gumbel_noise(3, 11, 257))
    assert not torch.equal(a, gumbel_noise(4, 10, 257))
    c = GumbelCoupling([3, 4], 257)
    assert torch.equal(c.noise(0, 10), a) and torch.equal(c.noise(1, 10), gumbel_noise(4, 10, 257))
    idx = torch.tensor([[10, -1], [11, 10]])
    noise = c.noise_for(idx)
    assert torch.equal(noise[0, 0], a) and torch.equal(noise[0, 1], torch.zeros(257))
    assert torch.equal(noise[1, 0], gumbel_noise(4, 11, 257))
    c.commit(0, 11)  # index 10 is committed: forgotten, recomputed identically
    assert 10 not in c._cache[0] and torch.equal(c.noise(0, 10), a)
    with pytest.raises(ValueError, match="index"):
        gumbel_noise(0, -1, 5)
    with pytest.raises(ValueError, match="vocab_size"):
        gumbel_noise(0, 0, 0)


def test_gumbel_max_samples_the_distribution():
    """argmax(log p + G) over 20k (seed, index) pairs follows p (chi-square, p-value threshold
    of tests.utils: a false alarm once in a thousand runs); p has a zero entry (never drawn) and
    a vocabulary that is not a power of two."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(37, generator=g) ** 3
    p[5] = 0
    p /= p.sum()
    logp = p.log()
    draws = torch.tensor([int((logp + gumbel_noise(s, s % 7, 37)).argmax()) for s in range(20_000)])
    assert (draws != 5).all()
    assert chi_square_pvalue(draws, p) > P_THRESHOLD


def test_gumbel_top_k_is_distinct_and_starts_with_the_max():
    logp = torch.log_softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1)
    noise = gumbel_noise(9, 2, 50)
    vals, idx = gumbel_top_k(logp, noise, 4)
    assert idx.shape == (3, 4)
    assert all(len(set(r)) == 4 for r in idx.tolist())
    assert torch.equal(idx[:, 0], (logp + noise).argmax(-1))


# ---------------------------------------------------------------------------- the ends of the uniforms
BELOW_ONE = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()  # the largest float32 below 1


def test_uniform_to_gumbel_is_finite_at_the_ends():
    """u = 0 (which torch.rand returns about once in 2**24 draws), the largest float32 below 1
    and 1 itself give finite noise, ordered like u; every other uniform torch.rand returns
    keeps the noise of the plain formula -log(-log(u)), bit for bit."""
    assert UNIFORM_MAX == BELOW_ONE and UNIFORM_MIN == torch.finfo(torch.float32).tiny
    ends = torch.tensor([0.0, UNIFORM_MIN, 2.0**-24, 0.5, BELOW_ONE, 1.0])
    g = uniform_to_gumbel(ends)
    assert g.dtype == torch.float32 and torch.isfinite(g).all(), g
    assert g[0] == g[1] and g[4] == g[5] and bool((g[1:5].diff() > 0).all())
    u = torch.rand(1_000_000, generator=torch.Generator().manual_seed(0))
    u = u[u > 0]
    assert torch.equal(uniform_to_gumbel(u), torch.log(-torch.log(u)).neg_())
    with pytest.raises(TypeError, match="floating-point"):
        uniform_to_gumbel(torch.zeros(3, dtype=torch.int64))


def test_a_uniform_of_zero_cannot_emit_a_token_of_probability_zero():
    """The noise of seed 12802, index 5 at V = 111 holds a uniform of exactly 0 (the issue's
    reproduction): with a one-token nucleus at that token, argmax(log p + G) must be that
    token; with -inf noise every score was -inf and argmax returned token 0 (p = 0).  The same
    holds for a nucleus at any token, and for the Gumbel-top-k's first pick."""
    noise = gumbel_noise(12802, 5, 111)
    assert torch.isfinite(noise).all()
    at_zero = (noise == uniform_to_gumbel(torch.zeros(1))).nonzero().flatten().tolist()
    assert len(at_zero) == 1 and at_zero[0] != 0  # the reproduction exercises the u = 0 case
    for j in range(111):
        logp = torch.full((111,), -float("inf"))
        logp[j] = 0.0
        assert int((logp + noise).argmax()) == j
        assert int(gumbel_top_k(logp, noise, 1)[1][0]) == j


def test_seeded_top_k_1_sampling_emits_the_nucleus_at_a_zero_uniform(tiny):
    """End to end: a 5-token prompt whose greedy next token is the one whose uniform is 0 at
    seed 12802 (found among random prompts), sampled with top_k=1 under the Gumbel coupling,
    emits that token (it emitted token 0, of probability 0, before the clamp)."""
    _, model = tiny
    noise = gumbel_noise(12802, 5, 111)
    j = int((noise == uniform_to_gumbel(torch.zeros(1))).nonzero()[0, 0])
    R, T = 2000, 5
    ctx = torch.randint(0, V, (R, T), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model(ctx, torch.arange(T).expand(R, T), model.new_kv_cache(R, T), torch.zeros(R, dtype=torch.int32))
    hits = (logits[:, -1].argmax(-1) == j).nonzero().flatten()
    assert len(hits) > 0, "no random prompt predicts the token; widen the search"
    prompt = ctx[int(hits[0])].tolist()
    sp = SamplingParams(temperature=1.0, top_k=1)
    for drafter in (None, NgramDrafter()):
        out = SpeculativeDecoder(model, drafter).generate([prompt], 2, 2, sampling=sp, seeds=[12802]).tokens[0]
        assert out[0] == j, out


def test_sample_tokens_never_returns_a_token_of_probability_zero(monkeypatch):
    """The drafters' sampler (sample_tokens, over torch.multinomial) redraws a draw of
    probability 0, as torch.multinomial returns for a uniform of exactly 0 (token 0 when
    p(0) = 0): a multinomial forced to return zero-probability tokens is corrected, and the
    draws of a sound one are kept unchanged."""
    q = torch.zeros(40)
    q[7], q[20], q[33] = 0.5, 0.3, 0.2
    real = torch.multinomial
    kept = sample_tokens(q, 500, torch.Generator().manual_seed(1))
    assert torch.equal(kept, real(q, 500, replacement=True, generator=torch.Generator().manual_seed(1)))

    def faulty(probs, num_samples, replacement=False, generator=None):
        out = real(probs, num_samples, replacement=replacement, generator=generator)
        out[::2] = 0  # every other draw lands on token 0, of probability 0
        return out

    monkeypatch.setattr(torch, "multinomial", faulty)
    for n in (1, 5, 500):
        picks = sample_tokens(q, n, torch.Generator().manual_seed(n))
        assert picks.shape == (n,) and picks.dtype == torch.int64
        assert bool((q[picks] > 0).all()), picks
    rows = torch.stack([q, q.roll(3), q.flip(0)])  # (R, V): each row's draws checked against that row
    picks = sample_tokens(rows, 7, torch.Generator().manual_seed(2))
    assert picks.shape == (3, 7) and bool((rows.gather(1, picks) > 0).all()), picks


@pytest.mark.parametrize(
    "make",
    [
        lambda m: LayerSkipDrafter(m, 2, tree_widths=(3, 2)),
        lambda m: MultiDrafter([LayerSkipDrafter(m, 1), LayerSkipDrafter(m, 2)], ensemble=True),
    ],
)
def test_sampling_drafters_never_draft_a_token_of_probability_zero(tiny, monkeypatch, make):
    """With coupling="rejection" a drafter that samples hands over q; a draft x with q(x) = 0
    would be accepted whenever p(x) > 0 (u q(x) < p(x)), biasing the output.  With a
    torch.multinomial that always returns token 0 (which top_k=5 leaves at probability 0 on
    these prompts), every drafted token still has q > 0 at its parent."""
    _, model = tiny
    real = torch.multinomial

    def faulty(probs, num_samples, replacement=False, generator=None):
        out = real(probs, num_samples, replacement=replacement, generator=generator)
        return torch.zeros_like(out)

    monkeypatch.setattr(torch, "multinomial", faulty)
    drafter = make(model)
    checked = []
    propose = drafter.propose

    def checking(request):
        draft = propose(request)
        for b in range(draft.tokens.shape[0]):
            for i in range(1, int(draft.num_nodes[b])):
                row = int(draft.parents[b, i]) if not draft.is_chain else i - 1
                assert float(draft.probs[b, row, int(draft.tokens[b, i])]) > 0, (b, i)
                checked.append(int(draft.tokens[b, i]))
        return draft

    drafter.propose = checking
    sp = SamplingParams(temperature=1.0, top_k=5, coupling="rejection")
    SpeculativeDecoder(model, drafter).generate(PROMPTS, 6, 3, sampling=sp, seeds=[1, 2, 3])
    assert checked  # drafts were made and checked


# ---------------------------------------------------------------------------- invariance
DRAFTERS = {
    "ngram-chain": lambda m: NgramDrafter(),
    "ngram-tree": lambda m: NgramDrafter(tree=True),
    "layerskip-chain-sampled": lambda m: LayerSkipDrafter(m, 2),
    "layerskip-tree-sampled": lambda m: LayerSkipDrafter(m, 2, tree_widths=(3, 2)),
    "draftmodel-tree-deterministic": lambda m: DraftModelDrafter(
        m.truncated(2), tree_widths=(2, 2), deterministic=True
    ),
    "multi-ensemble": lambda m: MultiDrafter([LayerSkipDrafter(m, 1), LayerSkipDrafter(m, 2)], ensemble=True),
    "eagle-2-dynamic-tree": lambda m: EagleDrafter(m, random_head(), tree=True),
}

POLICIES = {
    "fixed-3": lambda: FixedPolicy(3),
    "heuristic": lambda: HeuristicPolicy(k_max=5),
    "cost-model-measured": lambda: CostModelPolicy(0, 5, warmup=1),
    # costs that make K swing with the batch's acceptance (the batch prior is shared)
    "cost-model-fixed-costs": lambda: CostModelPolicy(0, 6, warmup=1, draft_cost=(0, 0.05), verify_cost=(1, 0.02)),
}


@pytest.fixture(scope="module")
def plain_tokens(tiny):
    """Each prompt sampled alone without drafts, seed 100 + b: the reference."""
    _, model = tiny
    decoder = SpeculativeDecoder(model, None)
    return [decoder.generate([p], 14, 0, sampling=SP, seeds=[100 + b]).tokens[0] for b, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_seeded_tokens_do_not_depend_on_drafter_policy_or_batch(tiny, plain_tokens, drafter, policy):
    """Sequence 0 alone, inside a batch of 2 and inside a batch of 4 (other neighbours, other
    order) gives the tokens of plain sampling with its seed, and so does every neighbour."""
    _, model = tiny
    decoder = SpeculativeDecoder(model, DRAFTERS[drafter](model))
    target = PROMPTS[0]
    neighbours = [PROMPTS[1], PROMPTS[2], target[2:], PROMPTS[2][:5]]
    alone = decoder.generate([target], 14, POLICIES[policy](), sampling=SP, seeds=[100]).tokens
    assert alone == [plain_tokens[0]]
    pair = decoder.generate([PROMPTS[2], target], 14, POLICIES[policy](), sampling=SP, seeds=[102, 100]).tokens
    assert pair == [plain_tokens[2], plain_tokens[0]]
    four = decoder.generate(
        [neighbours[2], neighbours[0], target, neighbours[3]],
        14,
        POLICIES[policy](),
        sampling=SP,
        seeds=[5, 101, 100, 6],
    )
    assert four.tokens[1:3] == [plain_tokens[1], plain_tokens[0]]
    assert four.stats.draft_tokens > 0  # the drafter was consulted
    if drafter.startswith(("layerskip", "draftmodel", "multi")):
        assert four.stats.accepted_draft_tokens > 0  # and its drafts shaped the steps


def test_tokens_do_not_depend_on_measured_timing(tiny, plain_tokens, monkeypatch):
    """A cost-model run whose clock is scrambled (so its K choices change) keeps the tokens."""
    import specdec_kernels.decoding.engine.loop as loop

    _, model = tiny
    ticks = iter(torch.rand(100_000, generator=torch.Generator().manual_seed(3)).cumsum(0).tolist())
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(ticks))
    decoder = SpeculativeDecoder(model, LayerSkipDrafter(model, 2))
    result = decoder.generate(PROMPTS, 14, CostModelPolicy(0, 6, warmup=0), sampling=SP, seeds=[100, 101, 102])
    assert result.tokens == plain_tokens
    assert result.stats.accepted_draft_tokens > 0


@pytest.mark.parametrize("coupling", ["gumbel", "rejection"])
def test_sampled_drafts_keep_the_target_distribution(tiny, coupling):
    """Both couplings with a sampling tree drafter: each of the first 3 tokens follows the
    target's marginal over 3000 seeds (chi-square at the suite's threshold)."""
    _, model = tiny
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, coupling=coupling)
    prompt = ngram_friendly_prompt(model, sp)
    B = 3000
    decoder = SpeculativeDecoder(model, LayerSkipDrafter(model, 2, tree_widths=(2, 2)))
    result = decoder.generate([prompt] * B, 3, num_draft_tokens=3, sampling=sp, seeds=list(range(B)))
    out = torch.tensor(result.tokens)
    assert result.stats.accepted_draft_tokens > 0.1 * result.stats.sequence_steps
    for j, marginal in enumerate(exact_marginals(model, prompt, sp, 3)):
        assert chi_square_pvalue(out[:, j], marginal) > P_THRESHOLD, f"token {j}"


def test_rejection_coupling_needs_a_fixed_k(tiny):
    _, model = tiny
    sp = SamplingParams(temperature=1.0, coupling="rejection")
    decoder = SpeculativeDecoder(model, NgramDrafter(), policy="cost-model")
    with pytest.raises(ValueError, match="coupling='rejection' needs a fixed draft length"):
        decoder.generate([PROMPTS[0]], 4, sampling=sp, seeds=[1])
    with pytest.raises(ValueError, match="fixed draft length"):
        decoder.generate([PROMPTS[0]], 4, HeuristicPolicy(), sampling=sp, seeds=[1])
    # a fixed K, or no drafter, is the caller's choice: batch-independent as documented
    batch = decoder.generate(PROMPTS, 8, 3, sampling=sp, seeds=[7, 8, 9]).tokens
    alone = [decoder.generate([p], 8, 3, sampling=sp, seeds=[s]).tokens[0] for p, s in zip(PROMPTS, [7, 8, 9])]
    assert batch == alone
    SpeculativeDecoder(model, None, policy="auto").generate([PROMPTS[0]], 4, sampling=sp, seeds=[1])
    with pytest.raises(ValueError, match="coupling"):
        SamplingParams(temperature=1.0, coupling="maximal")
