"""Typical acceptance (Medusa's posterior threshold, lossy): thresholds and accepted paths
computed by hand on a tiny tree and a chain, off by default in the engine, no effect on
greedy runs, and one engine step equal to the op applied to the target's own distributions.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import LayerSkipDrafter, SamplingParams, SpeculativeDecoder
from specdec_kernels.decoding.engine import verify as engine_module
from specdec_kernels.decoding.engine.typical import typical_acceptance, typical_thresholds
from specdec_kernels.ops.sampling_probs import sampling_probs
from specdec_kernels.tree import ancestor_mask, tree_depths
from tests.engine.drive import request, start
from tests.engine.tiny import PROMPTS, tiny  # noqa: F401 (fixture)
from tests.utils import one_thread  # noqa: F401 (fixture)

# A tree over a vocabulary of 4: root; 1 (token 1), 2 (token 2) below it; 3 (token 0) below 1;
# 4 (token 3) below 2; 5 (token 1) below 4.  Row i: the target's distribution after node i.
PARENTS = [-1, 0, 0, 1, 2, 4]
TOKENS = [0, 1, 2, 0, 3, 1]
P = [
    [0.5, 0.3, 0.15, 0.05],  # H = 1.14212, 0.3 e^-H = 0.09574
    [0.04, 0.9, 0.03, 0.03],  # H = 0.43398, 0.3 e^-H = 0.19438
    [0.25, 0.25, 0.25, 0.25],  # H = ln 4,   0.3 e^-H = 0.075
    [0.6, 0.2, 0.1, 0.1],  # (node 3: a leaf)
    [0.1, 0.08, 0.02, 0.8],  # H = 0.68907, 0.3 e^-H = 0.15062
    [0.7, 0.1, 0.1, 0.1],
]


def test_thresholds_by_hand():
    thr = typical_thresholds(torch.tensor(P), 0.09, 0.3)
    assert thr[[0, 1, 2, 4]].tolist() == pytest.approx([0.09, 0.09, 0.075, 0.09])
    thr = typical_thresholds(torch.tensor(P), 0.3, 0.3)  # the entropy term decides
    assert thr[[0, 1, 2, 4]].tolist() == pytest.approx([0.09574, 0.19438, 0.075, 0.15062], abs=1e-5)


@pytest.mark.parametrize(
    "epsilon,alpha,path,out",
    [
        # thresholds 0.09 / 0.09 / 0.075 / 0.09: 1 (0.3) and 2 (0.15) pass at the root; 3
        # (0.04) fails; 4 (0.25 > 0.075) passes; 5 (0.08 < 0.09) fails.  Deepest: 0 2 4;
        # the bonus from row 4 with u = 0.5: CDF 0.1 0.18 0.2 1.0 -> token 3.
        (0.09, None, [0, 2, 4], [2, 3, 3]),
        # epsilon 0.05 (alpha 0.2236): thresholds 0.05 everywhere; 5 (0.08) passes now; the
        # bonus from row 5 (CDF 0.7 ...) -> token 0.
        (0.05, None, [0, 2, 4, 5], [2, 3, 1, 0]),
        # epsilon 0.3, alpha 0.3: 0.0957 / 0.1944 / 0.075 / 0.1506: the same path as the first
        (0.3, 0.3, [0, 2, 4], [2, 3, 3]),
    ],
    ids=["eps0.09", "eps0.05", "eps0.3-alpha0.3"],
)
def test_tree_by_hand(epsilon, alpha, path, out):
    probs = torch.tensor([P])
    o, nodes, n = typical_acceptance(
        probs,
        torch.tensor([TOKENS]),
        torch.tensor(PARENTS),
        posterior_threshold=epsilon,
        posterior_alpha=alpha,
        sample_uniforms=torch.tensor([0.5]),
    )
    assert n.tolist() == [len(path) - 1]
    assert nodes[0].tolist() == path + [-1] * (6 - len(path))
    assert o[0].tolist() == out + [-1] * (6 - len(out))


def test_chain_and_padding_by_hand():
    """Batch of two: the tree above, and a chain 0 1 (p 0.5 then 0.9: accepted) whose third
    node (token 3 after row 2, p 0.25 > 0.075) lies past num_nodes = 3 and is ignored."""
    probs = torch.tensor([P, P])
    tokens = torch.tensor([TOKENS, [0, 0, 1, 3, 0, 0]])
    parents = torch.tensor([PARENTS, [-1, 0, 1, 2, 3, 4]])
    o, nodes, n = typical_acceptance(
        probs, tokens, parents, torch.tensor([6, 3]), sample_uniforms=torch.tensor([0.5, 0.3])
    )
    assert n.tolist() == [2, 2]
    assert nodes[1].tolist() == [0, 1, 2, -1, -1, -1]
    assert o[1].tolist() == [0, 1, 1, -1, -1, -1]  # bonus from row 2 (uniform), u = 0.3 -> 1


def test_bad_arguments():
    probs, tokens, parents = torch.tensor([P]), torch.tensor([TOKENS]), torch.tensor(PARENTS)
    with pytest.raises(ValueError, match="posterior_threshold"):
        typical_acceptance(probs, tokens, parents, posterior_threshold=0.0)
    with pytest.raises(ValueError, match="posterior_alpha"):
        typical_acceptance(probs, tokens, parents, posterior_alpha=-1.0)
    with pytest.raises(ValueError, match="tree_tokens"):
        typical_acceptance(probs, tokens[:, :3], parents)
    with pytest.raises(ValueError, match="sample_uniforms"):
        typical_acceptance(probs, tokens, parents, sample_uniforms=torch.tensor([1.0]))


# ---------------------------------------------------------------------------- the engine
def test_off_by_default(tiny, monkeypatch):
    _, model = tiny
    calls = []
    real = engine_module.typical_acceptance
    monkeypatch.setattr(engine_module, "typical_acceptance", lambda *a, **k: calls.append(1) or real(*a, **k))
    sp = SamplingParams(temperature=0.8)
    decoder = SpeculativeDecoder(model, LayerSkipDrafter(model, 2))
    assert decoder.typical is None
    decoder.generate(PROMPTS, 6, num_draft_tokens=3, sampling=sp, seeds=0)
    assert calls == []
    SpeculativeDecoder(model, LayerSkipDrafter(model, 2), typical=0.09).generate(
        PROMPTS, 6, num_draft_tokens=3, sampling=sp, seeds=0
    )
    assert calls
    with pytest.raises(ValueError, match="typical"):
        SpeculativeDecoder(model, typical=1.5)
    with pytest.raises(ValueError, match="typical_alpha"):
        SpeculativeDecoder(model, typical_alpha=0.3)


def test_greedy_unaffected(tiny):
    _, model = tiny
    greedy = SpeculativeDecoder(model).generate(PROMPTS, 12).tokens
    assert (
        SpeculativeDecoder(model, LayerSkipDrafter(model, 2), typical=0.09)
        .generate(PROMPTS, 12, num_draft_tokens=3)
        .tokens
        == greedy
    )


@pytest.mark.parametrize("widths", [None, (2, 2)], ids=["chain", "tree"])
def test_engine_step_applies_the_rule(tiny, widths):
    """One engine step (a deterministic layer-skip draft at temperature 0.7) emits what the op
    gives on the target's own distributions over that draft, with the sequence's uniform."""
    _, model = tiny
    prompt, seed, eps = PROMPTS[0], 5, 0.2
    drafter = LayerSkipDrafter(model, 1, tree_widths=widths, deterministic=True)
    sp = SamplingParams(temperature=0.7)
    decoder = SpeculativeDecoder(model, drafter, typical=eps)
    state = decoder.start([prompt], 10, sp, seeds=[seed])
    draft = drafter.propose(request(state.histories, [3], state.draft_run))
    start(drafter, state.histories, run=state.draft_run)  # propose again in step
    emitted = decoder.step(state, 3)

    n = int(draft.num_nodes[0])
    tokens, parents = draft.tokens[:, :n], draft.parents[:, :n]
    with torch.inference_mode():
        ctx = torch.tensor([prompt[:-1]])
        cache = model.new_kv_cache(1, 64)
        model(ctx, torch.arange(ctx.shape[1])[None], cache, torch.zeros(1, dtype=torch.int32))
        seqlens = torch.tensor([ctx.shape[1]], dtype=torch.int32)
        logits = model(tokens, ctx.shape[1] + tree_depths(parents), cache, seqlens, ancestor_mask(parents))
    probs = sampling_probs(logits, sp.temperature)
    g = torch.Generator().manual_seed(seed)
    torch.rand(n - 1, generator=g)  # the acceptance coins, unused by typical acceptance
    u = torch.rand(1, generator=g)
    out, _, k = typical_acceptance(probs, tokens, parents, posterior_threshold=eps, sample_uniforms=u)
    assert emitted[0] == out[0, : int(k[0]) + 1].tolist()
    assert int(k[0]) >= 1  # a draft token was accepted (this seed and draft: one)
