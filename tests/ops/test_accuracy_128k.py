"""Accuracy at V = 128k (issue #39, class 4): each native CPU path holds its documented
tolerance against the reference (docs/API.md, "Tolerances") at a 131072-token vocabulary,
and stays bit-identical call to call and row-independent.

The native sampling_probs used to sum a row's softmax sequentially in float32: rows summed to
1 only within 5.8e-5 at V = 49152 and its top-p nucleus differed from the reference's in 3 of
160 rows at top_p = 0.9.  Every vocabulary sum is now a float64 sum, rounded once to float32
where the reference rounds (the reference's softmax denominator too)."""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.utils import gen

V = 131072
pytestmark = pytest.mark.requires_native_op("sampling_probs")

SAMPLING = {
    "plain": {},
    "top_p 0.9": {"top_p": 0.9},
    "top_k 1000, top_p 0.9": {"top_k": 1000, "top_p": 0.9},
    "temperature 0.7, top_p 0.95": {"temperature": 0.7, "top_p": 0.95},
}


def _sampling_case(kw):
    logits = torch.randn(32, V, generator=gen(39)) * 3
    got = sk.sampling_probs(logits, backend="native", **kw)
    want = sk.sampling_probs(logits, backend="reference", **kw)
    # rows sum to 1 within a few float32 ulps (float64 sums, one rounding)
    assert (got.double().sum(-1) - 1).abs().max() < 1e-6
    assert (want.double().sum(-1) - 1).abs().max() < 1e-6
    # the documented tolerance: the same kept set, each probability within 5e-7 relative
    assert torch.equal(got > 0, want > 0), f"kept sets differ in {int(((got > 0) != (want > 0)).any(-1).sum())} rows"
    torch.testing.assert_close(got, want, rtol=5e-7, atol=0.0)
    # bit-identical call to call, and a row alone gives the bits it gives in the batch
    assert torch.equal(got, sk.sampling_probs(logits, backend="native", **kw))
    assert torch.equal(got[5:6], sk.sampling_probs(logits[5:6], backend="native", **kw))


def _chain_case(flat: bool):
    B, K = 16, 4
    target = torch.softmax(torch.randn(B, K + 1, V, generator=gen(40)) * 3, -1)
    draft = torch.softmax(torch.randn(B, K, V, generator=gen(41)) * 3 + target[:, :K].log() * 0.5, -1)
    drafts = torch.multinomial(draft.reshape(-1, V), 1, generator=gen(42)).view(B, K)
    u, s = torch.rand(B, K, generator=gen(43)), torch.rand(B, generator=gen(44))
    if flat:
        args = (target.reshape(-1, V), draft.reshape(-1, V), drafts.reshape(-1), torch.arange(1, B + 1) * K)
        kw = dict(max_spec_len=K, uniform_samples=u.reshape(-1), sample_uniforms=s)
        run = lambda be: sk.rejection_sample_flattened(*args, backend=be, **kw)  # noqa: E731
    else:
        run = lambda be: sk.rejection_sample(  # noqa: E731
            target, draft, drafts, uniform_samples=u, sample_uniforms=s, backend=be
        )
    got, want = run("native"), run("reference")
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert all(torch.equal(a, b) for a, b in zip(got, run("native")))


def _tree_case():
    B, N = 8, 8
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3])
    target = torch.softmax(torch.randn(B, N, V, generator=gen(45)) * 3, -1)
    draft = torch.softmax(torch.randn(B, N, V, generator=gen(46)) * 3, -1)
    tokens = torch.multinomial(draft[:, parents.clamp(min=0)].reshape(-1, V), 1, generator=gen(47)).view(B, N)
    u, s = torch.rand(B, N - 1, generator=gen(48)), torch.rand(B, generator=gen(49))
    for q in (draft, None):
        run = lambda be: sk.tree_rejection_sample(  # noqa: E731
            target, tokens, parents, q, uniform_samples=u, sample_uniforms=s, backend=be
        )
        got, want = run("native"), run("reference")
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def _verify_case():
    B, K = 8, 6
    logits = torch.randn(B, K + 1, V, generator=gen(50))
    drafts = logits.argmax(-1)[:, :K].clone()
    drafts[::2, 3] = (drafts[::2, 3] + 1) % V
    for g, w in zip(sk.verify_greedy(logits, drafts, backend="native"), reference.verify_greedy(logits, drafts)):
        assert torch.equal(g, w)
    parents = torch.tensor([-1, 0, 0, 1, 2, 2, 3])
    tokens = logits.argmax(-1)[:, parents.clamp(min=0)]
    for g, w in zip(
        sk.verify_tree_greedy(logits, tokens, parents, backend="native"),
        reference.verify_tree_greedy(logits, tokens, parents),
    ):
        assert torch.equal(g, w)


CASES = {
    **{f"sampling_probs {name}": (lambda kw=kw: _sampling_case(kw)) for name, kw in SAMPLING.items()},
    "rejection_sample": lambda: _chain_case(flat=False),
    "rejection_sample_flattened": lambda: _chain_case(flat=True),
    "tree_rejection_sample": _tree_case,
    "verify_greedy and verify_tree_greedy": _verify_case,
}


@pytest.mark.parametrize("case", list(CASES))
def test_native_paths_hold_their_documented_tolerance_at_128k(case):
    CASES[case]()
