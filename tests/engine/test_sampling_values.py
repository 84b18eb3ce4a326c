"""Sampling values checked exactly as given, before any cast (issue #39 items 1 and 6a), over
every entry point that takes them: ``sampling_probs`` (numbers, and float64 tensors),
``SamplingParams`` and the engine, ``speculative_generate``, typical acceptance, and
``tree_attention``'s ``sm_scale``.  The CLI's flags: tests/engine/test_cli.py.

Class 1: a value inside the documented range that a cast to float32 / int64 would carry out of
it (top_p 1e-50 -> 0.0, temperature 1e50 -> inf, top_k 2**70 -> overflow) keeps its meaning
everywhere, instead of failing the range check after the cast, or passing construction and
failing mid-run.  Class 2: a value of the wrong kind (NaN, inf, a bool, a float top_k) is
refused where it is given, naming the argument.
"""

from __future__ import annotations

import math

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels.checks import FLOAT32_MAX, integer_at_least
from specdec_kernels.decoding import LayerSkipDrafter, NgramDrafter, SamplingParams, SpeculativeDecoder
from specdec_kernels.decoding.engine.typical import typical_acceptance
from tests.engine.tiny import PROMPTS, tiny  # noqa: F401 (fixture)
from tests.utils import runnable_backends

TINY_TOP_P = [1e-50, 1e-45, 1e-39]  # below float32's smallest normal; the first two round to 0.0


def _logits(rows: int = 3, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(7)) * 3


# ---------------------------------------------------------------- class 1: lossy casts
@pytest.mark.parametrize("backend", runnable_backends("sampling_probs", "cpu"))
def test_sampling_probs_keeps_the_meaning_of_values_a_cast_would_break(backend):
    logits = _logits()
    greedy = sk.sampling_probs(logits, 0.0, backend=backend)
    B = logits.shape[0]
    for p in TINY_TOP_P:  # the nucleus of the one most probable token: the argmax
        for top_p in (p, torch.full((B,), p, dtype=torch.float64)):
            got = sk.sampling_probs(logits, 0.7, top_p=top_p, backend=backend)
            assert torch.equal(got, greedy), (backend, p)
    for t in (1e-50, torch.full((B,), 1e-50, dtype=torch.float64)):  # rounds to 0: greedy
        assert torch.equal(sk.sampling_probs(logits, t, backend=backend), greedy)
    hottest = sk.sampling_probs(logits, FLOAT32_MAX, top_k=5, backend=backend)
    for t in (1e50, 10**400, torch.full((B,), 1e50, dtype=torch.float64)):  # finite: float32's largest
        got = sk.sampling_probs(logits, t, top_k=5, backend=backend)
        assert torch.equal(got, hottest)
        assert ((got > 0).sum(-1) == 5).all()  # top-k still cuts: not the uniform row of inf
    plain = sk.sampling_probs(logits, 0.7, backend=backend)
    assert torch.equal(sk.sampling_probs(logits, 0.7, top_k=2**70, backend=backend), plain)


def test_engine_decodes_with_values_a_cast_would_break(tiny):
    """SamplingParams takes top_p 1e-50 and temperature 1e-50 (accepted, then the run died
    mid-way with the float32 range check); both decode the argmax, so they give greedy's
    tokens, with a drafter that samples (layer-skip) and one that does not (n-gram)."""
    _, model = tiny
    assert SamplingParams(1e-50).greedy and not SamplingParams(1e-40).greedy
    assert SamplingParams(1e50).temperature == 1e50  # kept as given; the kernels take float32's largest
    for drafter in (NgramDrafter(), LayerSkipDrafter(model, 2)):
        decoder = SpeculativeDecoder(model, drafter, threads=None)
        want = decoder.generate(PROMPTS, 10, num_draft_tokens=3).tokens
        for sp in (SamplingParams(0.7, top_p=1e-50), SamplingParams(1e-50), SamplingParams(0.7, 5, 1e-45)):
            assert decoder.generate(PROMPTS, 10, num_draft_tokens=3, sampling=sp, seeds=3).tokens == want, sp
        hot = decoder.generate(PROMPTS, 10, num_draft_tokens=3, sampling=SamplingParams(1e50, top_k=2**70), seeds=3)
        assert all(len(t) == 10 for t in hot.tokens)


def test_speculative_generate_decodes_with_values_a_cast_would_break():
    pytest.importorskip("transformers")
    from specdec_kernels.integrations.transformers import speculative_generate
    from tests.engine.tiny import tiny_llama

    hf = tiny_llama()
    ids = torch.tensor([PROMPTS[0]])
    greedy = speculative_generate(hf, ids, max_new_tokens=8, prompt_lookup_num_tokens=3, eos_token_id=[])
    for kw in (dict(temperature=0.7, top_p=1e-50), dict(temperature=1e-50)):
        out = speculative_generate(
            hf, ids, max_new_tokens=8, prompt_lookup_num_tokens=3, eos_token_id=[], do_sample=True, seed=1, **kw
        )
        assert torch.equal(out, greedy), kw


def test_sm_scale_is_checked_as_given():
    """tree_attention's sm_scale: any finite float32-sized number; one that float32 would make
    inf, NaN or not a number is refused naming it (it went through float() unchecked)."""
    q = torch.randn(1, 2, 2, 16)
    cache = torch.randn(1, 2, 8, 16)
    lens = torch.tensor([3])
    out = sk.tree_attention(q, cache, cache, lens, sm_scale=1e-50)  # float32 0: uniform weights
    assert out.isfinite().all()
    for bad, err in ((1e50, ValueError), (math.inf, ValueError), (math.nan, ValueError), ("0.1", TypeError)):
        with pytest.raises(err, match="sm_scale"):
            sk.tree_attention(q, cache, cache, lens, sm_scale=bad)


# ---------------------------------------------------------------- class 2: kinds of values
BAD_SAMPLING = [
    (dict(temperature=math.nan), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature="0.7"), TypeError, "temperature"),
    (dict(temperature=True), TypeError, "temperature"),
    (dict(top_k=True), TypeError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(top_k=2.0), TypeError, "top_k"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_p=math.nan), ValueError, "top_p"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.0000001), ValueError, "top_p"),
    (dict(top_p=True), TypeError, "top_p"),
]


@pytest.mark.parametrize("kw,err,name", BAD_SAMPLING, ids=[repr(kw) for kw, _, _ in BAD_SAMPLING])
def test_bad_sampling_values_are_refused_where_given(kw, err, name, tiny):
    """The same value is refused, naming the argument, by SamplingParams at construction (it
    was accepted and failed in generate after the prefill), by sampling_probs, and by
    speculative_generate; an infinite temperature by SamplingParams (sampling_probs takes inf:
    a uniform row)."""
    from specdec_kernels.integrations.transformers import speculative_generate
    from tests.engine.tiny import tiny_llama

    with pytest.raises(err, match=name):
        SamplingParams(**{"temperature": 0.7, **kw})
    with pytest.raises(err, match=name):
        sk.sampling_probs(_logits(), **kw)
    hf = tiny_llama()
    with pytest.raises(err, match=name):
        speculative_generate(
            hf, torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=True, **{"temperature": 0.7, **kw}
        )
    for bad in (math.inf, -math.inf):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(bad)


def test_typical_acceptance_values_are_checked_as_given(tiny):
    _, model = tiny
    for kw, err, name in (
        (dict(typical=True), TypeError, "typical"),
        (dict(typical=math.nan), ValueError, "typical"),
        (dict(typical=0.1, typical_alpha=math.nan), ValueError, "typical_alpha"),
        (dict(typical=0.1, typical_alpha=math.inf), ValueError, "typical_alpha"),
    ):
        with pytest.raises(err, match=name):
            SpeculativeDecoder(model, **kw)
    probs = torch.softmax(_logits(1, 20), -1)[:, None].expand(1, 2, 20).contiguous()
    tokens, parents = torch.tensor([[0, 1]]), torch.tensor([-1, 0])
    for kw, err, name in (
        (dict(posterior_threshold=True), TypeError, "posterior_threshold"),
        (dict(posterior_threshold=math.nan), ValueError, "posterior_threshold"),
        (dict(posterior_alpha=math.inf), ValueError, "posterior_alpha"),
    ):
        with pytest.raises(err, match=name):
            typical_acceptance(probs, tokens, parents, **kw)
    typical_acceptance(probs, tokens, parents, posterior_threshold=1e-50)  # in (0, 1]: float64 math, no cast


def test_a_temperature_that_overflows_the_division_is_one_hot_at_the_largest_logit():
    """temperature 1e-40 is a positive float32 (subnormal): logits / T overflow to +inf for
    several tokens, and the row must be the limit of T -> 0, one-hot at the largest logit, not
    at the first logit that overflowed (token 0 of row 0), on every backend that runs here."""
    from tests.utils import runnable_backends

    logits = torch.tensor([[1.0, 2.0, 0.5, -3.0, 1.5], [0.25, -1.0, 0.75, 0.75, 0.1]])
    want = torch.nn.functional.one_hot(torch.tensor([1, 2]), 5).float()
    backends = runnable_backends("sampling_probs", "cpu")
    assert {"reference", "native"} <= set(backends)
    for backend in backends:
        out = sk.sampling_probs(logits, temperature=1e-40, backend=backend)
        assert torch.equal(out, want), backend


@pytest.mark.parametrize("value, low, want", [(3, 1, 3), (0, 0, 0), (2.0, 1, 2), (torch.tensor(5), 5, 5)])
def test_integer_at_least_accepts(value, low, want):
    got = integer_at_least("window", value, low)
    assert got == want and type(got) is int


@pytest.mark.parametrize("value", [0, -1, True, False, 1.5, "3", None, float("nan"), torch.tensor([1, 2])])
def test_integer_at_least_refuses_naming_the_argument(value):
    with pytest.raises(ValueError, match=r"^window must be an integer >= 1, got "):
        integer_at_least("window", value, 1)


@pytest.mark.parametrize(
    "layers,n,want",
    [((), None, ()), ([2, 0], 3, (2, 0)), (torch.tensor([1, 5]), None, (1, 5)), ((torch.tensor(1),), 2, (1,))],
)
def test_layer_indices_accepts_in_the_order_given(layers, n, want):
    from specdec_kernels.checks import layer_indices

    got = layer_indices("feature_layers", layers, n)
    assert got == want and all(type(i) is int for i in got)


@pytest.mark.parametrize(
    "layers,n,err,message",
    [
        ([3], 3, ValueError, "feature_layers: layer 3 is not an index >= 0 and below the 3 layers"),
        ([-1], None, ValueError, "feature_layers: layer -1 is not an index >= 0"),
        ([1, 1], None, ValueError, "feature_layers repeats a layer"),
        ("12", None, TypeError, "feature_layers must be a sequence"),
        (7, None, TypeError, "feature_layers must be a sequence"),
        ([1.0], None, TypeError, r"feature_layers\[0\] must be an int"),
        ([True], None, TypeError, r"feature_layers\[0\] must be an int"),
        (torch.tensor([0.5]), None, TypeError, "feature_layers must hold integers"),
    ],
)
def test_layer_indices_refuses_naming_the_argument(layers, n, err, message):
    from specdec_kernels.checks import layer_indices

    with pytest.raises(err, match=message):
        layer_indices("feature_layers", layers, n)
