"""Settings, cases and checks shared by the tests of the samplers (rejection_sample,
tree_rejection_sample, their flattened layout)."""

import torch

from tests.utils import assert_follows, assert_same, chi_square_pvalue, gen, to_device


def random_probs(shape, g, zero_frac=0.3):
    """Rows of random probabilities with some exact zeros, normalised (float32); every row keeps
    some mass at token 0."""
    x = torch.rand(shape, generator=g)
    x = torch.where(torch.rand(shape, generator=g) < zero_frac, torch.zeros_like(x), x)
    x[..., 0] += 1e-3
    return x / x.sum(-1, keepdim=True)


# vocabulary chunks (the batch-1 split): (BLOCK_B, BLOCK_V, chunks per row); chunk counts above
# the tile count are clamped, several tiles per chunk and an uneven last chunk occur
TILINGS = [(1, 16, 2), (2, 16, 3), (4, 32, 5), (1, 16, 64), (8, 16, 7)]

# the target distributions of the distribution tests (sampling_probs settings)
TARGETS = {
    "t1.0": dict(temperature=1.0),
    "t0.6": dict(temperature=0.6),
    "t1.0_topk8": dict(temperature=1.0, top_k=8),
    "t0.6_topp0.8": dict(temperature=0.6, top_p=0.8),
}


def random_uniforms(B, coins, g):
    """The randoms of a batch of ``B`` as keyword arguments: uniform_samples [B, coins] and
    sample_uniforms [B], drawn from ``g`` in that order."""
    return dict(uniform_samples=torch.rand(B, coins, generator=g), sample_uniforms=torch.rand(B, generator=g))


def without_mass_at(token, shape, seed):
    """A case of a residual without mass: target_probs [B, R, V] without zeros (float32,
    normalised) except that every sequence's first row has no mass at ``token``, and the randoms
    for R - 1 coins a sequence."""
    g = gen(seed)
    p = random_probs(shape, g, zero_frac=0.0)
    p[:, 0, token] = 0.0
    return dict(target_probs=p / p.sum(-1, keepdim=True), **random_uniforms(shape[0], shape[1] - 1, g))


def kernel_and_reference(kernel, reference, inputs, case, device):
    """(kernel result, reference result), both on CPU, for the same inputs and randoms: the
    entries of ``case`` named by ``inputs`` positionally, its uniform_samples and
    sample_uniforms by keyword; the kernel runs on ``device``, the reference on CPU."""
    randoms = ("uniform_samples", "sample_uniforms")
    on = to_device(case, device)
    got = kernel(*(on[a] for a in inputs), **{r: on[r] for r in randoms})
    want = reference(*(case[a] for a in inputs), **{r: case[r] for r in randoms})
    return tuple(t.cpu() for t in got), want


def assert_only_the_sampled_token_moves(run_both, case, device, uniforms):
    """The acceptance coins decide the accepted prefix; the separate sample uniform only picks
    the residual / bonus token.  With every sample uniform in ``uniforms``, ``run_both(case,
    device)`` (kernel and reference results, tokens first and the accepted count last) still
    agree, every output but the token after the accepted prefix stays, and that token does
    change with the uniform."""
    base, _ = run_both(case, device)
    B, accepted = base[0].shape[0], base[-1]
    rows, prefix = torch.arange(B), torch.arange(base[0].shape[1])[None, :] < accepted[:, None]
    finals = set()
    for u in uniforms:
        moved, want = run_both(dict(case, sample_uniforms=torch.full((B,), u)), device)
        assert_same(moved, want)
        assert all(torch.equal(m, b) for m, b in zip(moved[1:], base[1:]))
        assert torch.equal(torch.where(prefix, moved[0], 0), torch.where(prefix, base[0], 0))
        finals.add(tuple(moved[0][rows, accepted].tolist()))
    assert len(finals) > 1  # the final token does depend on the sample uniform


def assert_residual_matters(out, accepted, p, g):
    """Negative control of the distribution tests: the first tokens ``out[:, 0]`` follow ``p``,
    while the same tokens with the rejected rows' (``accepted == 0``) resampled from ``p`` itself
    (what a kernel that ignores the residual emits) fail the test by far."""
    assert_follows(out[:, 0], p)
    wrong = out[:, 0].clone()
    rejected = accepted == 0
    wrong[rejected] = torch.multinomial(p, int(rejected.sum()), replacement=True, generator=g)
    assert chi_square_pvalue(wrong, p) < 1e-6
