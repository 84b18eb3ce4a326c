"""The EAGLE drafter's CPU paths.

1. Q8_0 head weights (``packed.quantize_scaled8``, ``EagleHead.quantized``,
   ``EagleDrafter(quantize_head=...)``): the rounding by hand, its error bound and packing over
   odd shapes, the copy leaving the head passed in alone, the drafter's choice and its products
   following the target's numerics, greedy identity.
2. A chain's head layer in one native call per draft step (``specdec_engine::decoder_layer``, as the
   target's layers): the same drafts and chain distributions as the head's Python ops
   ($SPECDEC_FUSED_LAYER=0), over ragged batches and the sliding window."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import SamplingParams, SpeculativeDecoder, packed
from specdec_kernels.decoding.drafters.eagle import EagleDrafter
from specdec_kernels.decoding.model import FUSED_ENV, linear_path
from tests.engine import drive
from tests.engine.heads import PROMPTS, committed, final_hidden, tiny  # noqa: F401 (fixture)
from tests.engine.test_eagle import random_head, tiny_rows, trained  # noqa: F401 (fixtures)
from tests.engine.tiny import V

pytestmark = pytest.mark.requires_native_op("packed_linear")  # skipped without the extension, failed in CI

SHAPES = [(1, 32), (3, 64), (37, 96), (577, 160)]


# ---------------------------------------------------------------------------- the rounding
def test_rounding_by_hand():
    """One block whose largest magnitude is 1.0: d = fp16(1 / 127) = 0.00787353515625, so
    0.3 -> 38 d (38.10), -0.5 -> -64 d (-63.50 plus: 0.5 / d = 63.504), 0.001 -> 0, 1.0 -> 127 d;
    the second block is all zeros (scale 0)."""
    w = torch.zeros(1, 64)
    w[0, :4] = torch.tensor([1.0, 0.3, -0.5, 0.001])
    out = packed.quantize_scaled8(w)
    d = 0.00787353515625
    assert out[0, :4].tolist() == [127 * d, 38 * d, -64 * d, 0.0]
    assert out[0, 4:].eq(0).all()
    assert w[0, 1].item() == pytest.approx(0.3)  # the input is not changed


def test_a_q8_0_weight_comes_back_unchanged():
    """Codes times a scale that is exact in fp16 with |q| = 127 in every block: the fixed points."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (5, 3, 32), generator=g).float()
    codes[..., 7] = 127
    d = 2.0 ** torch.randint(-12, -2, (5, 3, 1), generator=g).float()
    w = (codes * d).reshape(5, 96)
    assert torch.equal(packed.quantize_scaled8(w), w)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rounding_packs_and_stays_within_half_a_step(shape):
    O, I = shape
    g = torch.Generator().manual_seed(O * I)
    w = torch.randn(O, I, generator=g) * torch.rand(O, 1, generator=g)
    if I > 32:
        w[0, :32] = 0  # a zero block (a weight of zeros alone would be a Q4_1 form too)
    out = packed.quantize_scaled8(w)
    form = packed.pack_weight(out)
    assert form is not None and form.kind == packed.SCALED8
    assert torch.equal(form.dequantize(), out)
    assert torch.equal(packed.quantize_scaled8(out), out)  # idempotent
    blocks_w, blocks_o = w.view(O, I // 32, 32), out.view(O, I // 32, 32)
    step = blocks_w.abs().amax(-1, keepdim=True) / 127
    # half a code step, the scale's own fp16 rounding (2^-11 relative) on top
    assert ((blocks_o - blocks_w).abs() <= step * (0.5 + 127 * 2.0**-11)).all()
    assert out[0, :32].eq(0).all() or I == 32


@pytest.mark.parametrize("amax", [1.13e-5, 3e-6, 7.7e-3, 7.8e-3, 1.0])
def test_no_code_clamps_even_with_subnormal_scales(amax):
    """Where amax / 127 lies below fp16's normal range (6.1e-5 x 127 = 7.75e-3) the fp16 scale
    rounded to nearest can give amax a code past 127; the scale then goes one fp16 step up, so
    every element moves by at most half a step and none is clamped (a clamp moved 1.13e-5 by a
    third)."""
    g = torch.Generator().manual_seed(int(amax * 1e9) % 1000)
    w = (torch.rand(4, 64, generator=g) * 2 - 1) * amax
    w[:, 0] = amax
    w[:, 33] = -amax
    out = packed.quantize_scaled8(w)
    # the scale is amax / 127 rounded up by at most two fp16 steps: 2^-10 relative in the normal
    # range, 2^-24 absolute below it; an element moves by half of it at most
    scale = amax / 127 * (1 + 2.0**-10) + 2.0**-24
    assert ((out - w).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert ((out[:, 0] - amax).abs() <= scale / 2 * (1 + 1e-6)).all()  # not clamped: a third off before


@pytest.mark.parametrize(
    "bad, err",
    [
        ([[1.0] * 32], TypeError),
        (torch.ones(2, 33), ValueError),
        (torch.ones(2, 32, dtype=torch.float64), ValueError),
        (torch.ones(64), ValueError),
        (torch.full((1, 32), float("nan")), ValueError),
        (torch.full((1, 32), 1e8), ValueError),  # a scale beyond fp16's range
    ],
    ids=["list", "width33", "float64", "1d", "nan", "too-large"],
)
def test_rounding_refuses_bad_weights(bad, err):
    with pytest.raises(err, match="weight"):
        packed.quantize_scaled8(bad)


# ---------------------------------------------------------------------------- the head's copy
@pytest.mark.parametrize("layers", [(), (2, 0)], ids=["eagle", "eagle3"])
def test_quantized_copy(layers):
    head = random_head(scale=0.2)
    if layers:  # an EAGLE-3 head with a fusion far from the identity
        head = head.with_feature_layers(layers)
        with torch.no_grad():
            head.fuse.copy_(torch.randn(head.fuse.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    with torch.inference_mode():  # as a drafter built under inference mode makes it
        q = head.quantized()
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items())  # the head is not changed
    want = ["fc", "wqkv", "wo", "w13", "w2"] + (["fuse"] if layers else [])
    assert q.quantized_matrices == want and q.config["quantized"] == "q8_0" and "quantized" not in head.config
    for name, p in q.named_parameters():
        if name in want:
            form = packed.packed_form(p)
            assert form is not None and form.kind == packed.SCALED8 and torch.equal(form.dequantize(), p)
            assert linear_path(1, p, "int8") == "int8" and linear_path(1, p, "float32") == "packed"
        else:  # norms and the bias stay as they were
            assert torch.equal(p, before[name])
    # the copy computes nearly what the head does: each weight is off by at most 1/254 of its
    # block's largest, about 0.2 % of a product on average; 2 % leaves room for the attention
    # (``test_eagle3.fused_head``, with its attention weights scaled up, amplifies it to 6 %)
    H = head.hidden_size
    g = torch.Generator().manual_seed(1)
    f = torch.randn(2, 5, (1 + len(layers)) * H, generator=g)
    e = torch.randn(2, 5, H, generator=g)
    with torch.no_grad():
        a, b = head(f, e), q(f, e)
    assert ((a - b).norm() / a.norm()).item() < 0.02


def test_quantized_refuses_what_has_no_packed_product(monkeypatch):
    with pytest.raises(ValueError, match="float32 head on CPU"):
        random_head().double().quantized()
    monkeypatch.setattr(packed, "has_kernel", lambda name="packed_linear": False)
    with pytest.raises(ValueError, match="without the extension"):
        random_head().quantized()


# ---------------------------------------------------------------------------- the drafter
def test_drafter_choice(tiny, monkeypatch):
    head = random_head()
    d = EagleDrafter(tiny, head)
    assert d.head_quantized and d.head is not head and d.head.quantized_matrices
    assert EagleDrafter(tiny, head, quantize_head=False).head is head
    with pytest.raises(TypeError, match="quantize_head"):
        EagleDrafter(tiny, head, quantize_head="q8_0")
    with pytest.raises(TypeError, match="quantize_head"):
        EagleDrafter(tiny, head, quantize_head=1)
    monkeypatch.setattr(packed, "has_kernel", lambda name="packed_linear": False)
    assert not EagleDrafter(tiny, head).head_quantized  # the default: only where it packs
    with pytest.raises(ValueError, match="without the extension"):
        EagleDrafter(tiny, head, quantize_head=True)


@pytest.mark.parametrize("numerics", ["float32", "int8"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_equals_plain_greedy_with_the_quantized_head(tiny, trained, tree, numerics):
    """The quantized copy's products follow the target's numerics from ``start``; the output
    is plain greedy decoding's in the same numerics, and drafts are accepted."""
    head, _ = trained
    tiny.numerics = numerics
    try:
        plain = SpeculativeDecoder(tiny, stop_token_ids=[3]).generate(PROMPTS, 20)
        drafter = EagleDrafter(tiny, head, tree=tree, top_k=3, max_nodes=12, max_depth=4, quantize_head=True)
        result = SpeculativeDecoder(tiny, drafter, stop_token_ids=[3]).generate(PROMPTS, 20, num_draft_tokens=3)
        assert drafter.head.numerics == numerics and head.numerics == "float32"
    finally:
        tiny.numerics = "float32"
    assert result.tokens == plain.tokens
    assert result.stats.accepted_draft_tokens > 0


# ---------------------------------------------------------------------------- the one-call chain step
def histories_for(seed):
    """A ragged batch: 2, 9 and 30 tokens (30 exceeds the head's window of 16)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (2, 9, 30)]


@pytest.mark.requires_native_op("decoder_layer")
@pytest.mark.parametrize("quantize_head", [False, True], ids=["float32-head", "q8-head"])
@pytest.mark.parametrize("k", [1, 2, 5], ids=lambda k: f"K{k}")
def test_one_call_chain_drafts_as_the_python_ops(tiny, monkeypatch, quantize_head, k):
    head = random_head(window=16, scale=0.25, seed=k)
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv(FUSED_ENV, fused)
        drafter = EagleDrafter(tiny, head, tree=False, max_depth=5, quantize_head=quantize_head)
        with torch.inference_mode():
            histories = histories_for(k)
            committed(drafter, tiny, histories)
            draft = drafter.propose(drive.request(histories, [k, k - 1, k], drafter.run))
        assert (drafter._fused_layer() is not None) == (fused == "1")
        runs[fused] = (draft, drafter.path_logprobs)
    (a, lp_a), (b, lp_b) = runs["1"], runs["0"]
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert a.num_nodes.tolist() == b.num_nodes.tolist() == [k + 1, k, k + 1]  # K, K - 1, K drafts
    # the path log-probabilities: float32 rounding of two orders of the same sums, compounded
    # over up to 5 steps of a random head at scale 0.25, which amplifies it.  Over 40 cases (20
    # random heads, each at its K in 1..5, float32 and q8) the two paths differ by at most
    # 1.1e-3, here at K = 5, q8 head, depth 5 (the rest at most 1.7e-4); the C++ attention's
    # summation order (494042f) moved that case from 4.1e-4 to 1.1e-3 while its error against
    # float64 stayed the same (mean 6.8e-7 against 6.6e-7, head dim 64).  The tokens above are
    # compared exactly.
    for x, y in zip(lp_a, lp_b):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=2e-3, rtol=1e-4)


@pytest.mark.requires_native_op("decoder_layer")
def test_one_call_chain_distributions_match_the_python_ops(tiny, monkeypatch):
    """``chain_begin`` / ``chain_extend`` (the sampling chain): the head's distribution at each
    depth, fed the same tokens, within float32 rounding of the Python ops', and the same
    continuation flags; extended past ``max_depth`` (2) as a ``MultiDrafter`` ensemble does."""
    head = random_head(window=16, scale=0.2, seed=4)
    sampling = SamplingParams(temperature=0.8)
    out = {}
    for fused in ("1", "0"):
        monkeypatch.setenv(FUSED_ENV, fused)
        drafter = EagleDrafter(tiny, head, tree=False, max_depth=2)
        histories = histories_for(9)
        with torch.inference_mode():
            committed(drafter, tiny, histories, sampling=sampling)
            probs, going = drafter.chain_begin(drive.request(histories, [4, 1, 6], drafter.run), V)
            steps, flags = [probs], [going]
            for d in range(5):  # past max_depth: an ensemble's longer chain keeps asking (MultiDrafter)
                tokens = torch.tensor([7 + d, 3, 50 + d])
                probs, going = drafter.chain_extend(tokens)
                steps.append(probs)
                flags.append(going)
        out[fused] = (steps, flags)
    # the two layers' RMSNorms differ by an ulp or so (float64 against float32 sums), and six
    # chained steps of a random head amplify it to about 3e-5 of a probability
    for p, q in zip(out["1"][0], out["0"][0]):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-3)
    assert [f.tolist() for f in out["1"][1]] == [f.tolist() for f in out["0"][1]]


# ---------------------------------------------------------------------------- features wait for a draft
@pytest.mark.parametrize("fused", ["1", "0"], ids=["one-call", "python"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_steps_without_drafts_leave_the_features_pending(tiny, tree, fused, monkeypatch):
    """A drafter asked for K = 0 ingests nothing; when it drafts again, its drafts equal those
    of a drafter that ingested every step.  44 positions in blocks of 1-5 pass the head's
    window (16), so blocks that fall out of it are dropped while they wait.  The lazy drafter
    then ingests 16 rows at once, beyond ``FUSED_INGEST_ROWS``: with the one-call layer their
    keys come from ``project`` (the eager drafter's from the one-call layer: equal up to
    float32 rounding); with the Python ops both come from ``project``, bit for bit."""
    monkeypatch.setenv(FUSED_ENV, fused)
    head = random_head(window=16, scale=0.2, seed=5)
    g = torch.Generator().manual_seed(5)
    history = torch.randint(0, V, (45,), generator=g).tolist()
    feats = final_hidden(tiny, history)
    lazy, eager = (EagleDrafter(tiny, head, tree=tree, top_k=2, max_nodes=8, max_depth=4) for _ in range(2))
    for d in (lazy, eager):
        drive.start(d, [history[:3]])
    last = torch.zeros(1, feats.shape[1])  # the drafter reads the context alone
    first, sizes, ingested = 0, [2, 5, 1, 3, 4, 5, 2, 5, 1, 4, 3, 5, 4], []
    with torch.inference_mode():
        for n in sizes:
            h = history[: first + n + 1]
            for d, k in ((lazy, 0), (eager, 1)):
                d.observe(
                    drive.step([h], d.run, features=drive.features(last, [True], [feats[first : first + n]], [first]))
                )
                d.propose(drive.request([h], [k], d.run))
            ingested.append(lazy._end[0])
            first += n
        assert set(ingested) == {-1}  # nothing ingested while K = 0
        assert len(lazy._pending[0]) < len(sizes)  # old blocks dropped
        h = history[: first + 1]
        a, b = lazy.propose(drive.request([h], [4], lazy.run)), eager.propose(drive.request([h], [4], eager.run))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert a.num_nodes.tolist() == b.num_nodes.tolist() and int(a.num_nodes[0]) > 1
    assert lazy._end[0] == eager._end[0] == first - 1 and lazy._keys[0].shape[0] == 16
    if fused == "0":
        assert lazy.path_logprobs == eager.path_logprobs and torch.equal(lazy._keys[0], eager._keys[0])
    else:
        torch.testing.assert_close(torch.tensor(lazy.path_logprobs[0]), torch.tensor(eager.path_logprobs[0]))
        torch.testing.assert_close(lazy._keys[0], eager._keys[0])
        torch.testing.assert_close(lazy._values[0], eager._values[0])


@pytest.mark.requires_native_op("decoder_layer")
def test_an_ensemble_with_a_shallow_eagle_chain_samples_as_the_python_ops(tiny, monkeypatch):
    """The ensemble keeps extending every member's chain to its longest K (the n-gram drafter's
    6) past the EAGLE drafter's max_depth (2): the one-call chain gives the Python ops' tokens."""
    from specdec_kernels.decoding import MultiDrafter, NgramDrafter

    prompt = [5, 6, 7, 8] * 3 + [5, 6, 7]
    out = {}
    for fused in ("1", "0"):
        monkeypatch.setenv(FUSED_ENV, fused)
        head = random_head(window=16, scale=0.2, seed=3)
        drafter = MultiDrafter(
            [EagleDrafter(tiny, head, tree=False, max_depth=2), NgramDrafter(tokens_per_match=None)], ensemble=True
        )
        r = SpeculativeDecoder(tiny, drafter).generate(
            [prompt], 20, num_draft_tokens=6, sampling=SamplingParams(temperature=0.8), seeds=[1]
        )
        out[fused] = r.tokens
    assert out["1"] == out["0"]
