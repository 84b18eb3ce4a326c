"""What a drafter is handed it cannot use against the engine: the histories, active flags and
depths are the engine's copies (tuples), the result's tensors are copies, and ``Draft.probs``
must hold distributions under which every drafted token has q > 0 (a hostile-input trial found
each of these open: a flipped active flag hung ``generate``, an edited history changed the
output, probs of zeros had rejection sampling accept every draft)."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import Draft, Drafter, SamplingParams, SpeculativeDecoder
from tests.engine.tiny import PROMPTS, V, tiny  # noqa: F401 (fixture)


class Lookup(Drafter):
    """A chain: the token after the root's last earlier occurrence, repeated k times."""

    name = "lookup"

    def propose(self, request):
        trees = []
        for h, k, a in zip(request.histories, request.num_draft_tokens, request.active):
            seen = [i for i in range(len(h) - 1) if h[i] == h[-1]]
            n = k if a and seen else 0
            trees.append(([h[-1]] + [h[seen[-1] + 1]] * n if n else [h[-1]], list(range(-1, n))))
        return Draft.from_lists(trees)


def test_the_drafter_is_handed_copies_it_cannot_change(tiny):  # noqa: F811 (fixture)
    _, model = tiny
    plain = SpeculativeDecoder(model).generate(PROMPTS, 12).tokens
    seen = []

    class Editor(Lookup):
        def propose(self, request):
            seen.append(request)
            assert all(isinstance(h, tuple) for h in request.histories)
            assert isinstance(request.active, tuple) and isinstance(request.num_draft_tokens, tuple)
            for edit in (
                lambda: request.histories[0].append(1),
                lambda: request.active.__setitem__(0, False),
                lambda: request.num_draft_tokens.__setitem__(0, 9),
            ):
                with pytest.raises((AttributeError, TypeError)):
                    edit()
            mine = [list(h) for h in request.histories]  # a drafter's own copy is its own
            mine[0][0] = 1
            return super().propose(request)

        def observe(self, result):
            super().observe(result)
            assert all(isinstance(h, tuple) for h in result.histories) and isinstance(result.active, tuple)
            if not result.started:
                result.num_accepted.fill_(7)  # the result's tensors are copies
                result.accepted_nodes.fill_(-1)

    result = SpeculativeDecoder(model, Editor()).generate(PROMPTS, 12, num_draft_tokens=3)
    assert result.tokens == plain and seen
    lookup = SpeculativeDecoder(model, Lookup()).generate(PROMPTS, 12, num_draft_tokens=3)
    assert result.stats.accepted_draft_tokens == lookup.stats.accepted_draft_tokens  # counts not touched


def _sampler(probs_of):
    """A drafter that drafts one token below each root with the Draft.probs ``probs_of(B, N)``."""

    class Sampler(Drafter):
        name = "bad-probs"

        def propose(self, request):
            B = len(request.histories)
            draft = Draft.from_lists([([h[-1], 5], [-1, 0]) for h in request.histories])
            draft.probs = probs_of(B, 2)
            return draft

    return Sampler()


@pytest.mark.parametrize(
    "probs_of, error, match",
    [
        (lambda B, N: torch.zeros(B, N, V), ValueError, "q > 0"),
        (lambda B, N: torch.full((B, N, V), float("nan")), ValueError, "finite values >= 0"),
        (lambda B, N: torch.full((B, N, V), -1.0 / V), ValueError, "finite values >= 0"),
        (lambda B, N: torch.full((B, N, V), float("inf")), ValueError, "finite values >= 0"),
        (lambda B, N: torch.full((B, N, V), 1.0 / V, dtype=torch.float64), TypeError, "float32, float16"),
    ],
    ids=["zeros", "nan", "negative", "inf", "float64"],
)
def test_probs_that_are_not_distributions_are_refused_by_name(tiny, probs_of, error, match):  # noqa: F811
    _, model = tiny
    decoder = SpeculativeDecoder(model, _sampler(probs_of))
    sampling = SamplingParams(temperature=0.8, coupling="rejection")
    with pytest.raises(error, match=f"bad-probs.*{match}"):
        decoder.generate(PROMPTS, 6, num_draft_tokens=1, sampling=sampling, seeds=0)


def test_uniform_probs_pass_and_stay_lossless_in_distribution_terms(tiny):  # noqa: F811 (fixture)
    """The same drafter with a real distribution (uniform: q(5) = 1 / V > 0) runs."""
    _, model = tiny
    decoder = SpeculativeDecoder(model, _sampler(lambda B, N: torch.full((B, N, V), 1.0 / V)))
    sampling = SamplingParams(temperature=0.8, coupling="rejection")
    out = decoder.generate(PROMPTS, 6, num_draft_tokens=1, sampling=sampling, seeds=0)
    assert [len(t) for t in out.tokens] == [6, 6, 6]


def test_old_contract_with_defaults_and_a_missing_propose_are_named(tiny):  # noqa: F811 (fixture)
    _, model = tiny

    class OldWithDefaults(Drafter):
        name = "old-defaults"

        def propose(self, histories, num_draft_tokens=None, active=None):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="old-defaults.*propose must take one argument"):
        SpeculativeDecoder(model, OldWithDefaults())

    class NoPropose(Drafter):
        name = "no-propose"

    with pytest.raises(NotImplementedError, match="NoPropose must implement propose"):
        SpeculativeDecoder(model, NoPropose()).generate(PROMPTS, 4, num_draft_tokens=2)


def test_a_finished_sequences_draft_tokens_are_checked_too(tiny):  # noqa: F811 (fixture)
    """A finished sequence's row is cut to its root, but its other declared nodes can ride in the
    pass as padding when another row is wider: a token outside the vocabulary there is refused
    by name (not an index error in the embedding), while the same draft with valid tokens is
    lossless."""
    _, model = tiny
    plain = SpeculativeDecoder(model).generate(PROMPTS, [6, 0, 6]).tokens

    def drafter(junk):
        class Junk(Lookup):
            name = "junk"

            def propose(self, request):
                pairs = zip(request.histories, request.active)
                return Draft.from_lists([([h[-1], 5] if a else [h[-1], junk], [-1, 0]) for h, a in pairs])

        return Junk()

    assert SpeculativeDecoder(model, drafter(7)).generate(PROMPTS, [6, 0, 6], num_draft_tokens=1).tokens == plain
    with pytest.raises(ValueError, match="junk.*outside the vocabulary"):
        SpeculativeDecoder(model, drafter(10**6)).generate(PROMPTS, [6, 0, 6], num_draft_tokens=1)
