"""Inputs read in place (issue #39, class 3): every native CPU op that takes a large tensor
reads views, strided and expanded (stride-0) inputs where they lie, never copying them into a
contiguous tensor.  (verify_greedy on one 192 KiB row expanded to 4 GiB used to peak at
4.2 GiB and take 23 s.)

Two checks per op:

- layouts: the op on a view (every other element of a wider buffer padded with NaN, the
  leading dimensions transposed in memory, the batch or the vocabulary expanded with stride 0)
  returns the reference's tokens on that view (probabilities and attention within the
  documented tolerance) and bit for bit what it returns on a contiguous copy of the view;
- no copy: on one row expanded over a large batch (64 MiB to 1.1 GiB nominal, with
  per-sequence drafts and random numbers repeating every P sequences, so the reference on P
  sequences gives the expected output of all), the results are right and the process's peak
  resident memory grows by less than the outputs plus 24 MiB, where one copy of the input
  would add its whole expanded size.
"""

from __future__ import annotations

import gc

import pytest
import torch

import specdec_kernels as sk
from tests.utils import TOLERANCES, gen

P = 4  # period of the per-sequence inputs of the large cases
SLACK = 24 << 20  # bytes of peak memory growth allowed besides the outputs


def _status_mib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_growth(fn):
    """(fn(), bytes by which the process's peak resident memory exceeded its resident memory at
    the start).  Linux resets the peak (VmHWM) on writing 5 to /proc/self/clear_refs."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("measuring the peak memory needs Linux's /proc/self/clear_refs")
    before = _status_mib("VmRSS")
    out = fn()
    return out, _status_mib("VmHWM") - before


def layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A view of ``t``'s shape in another memory layout (the expanded kinds change the values)."""
    if kind == "sliced":  # inner stride 2, NaN in between: a wrong stride reads NaN
        wide = torch.full(t.shape[:-1] + (2 * t.shape[-1],), float("nan"), dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if kind == "transposed":  # the first two dimensions swapped in memory
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if kind == "batch-expanded":
        return t[:1].expand(t.shape)
    if kind == "vocab-expanded":
        return t[..., :1].expand(t.shape)
    raise ValueError(kind)


def _randn(shape, seed, scale=1.0):
    return torch.randn(*shape, generator=gen(seed)) * scale


def _probs(shape, seed, dtype=torch.float32):
    return torch.softmax(torch.randn(*shape, generator=gen(seed)) * 2, dim=-1).to(dtype)


# A builder takes ``lay(make, shape, seed)``, which makes its large tensors (``make(shape,
# seed)`` draws one) in the layout under test, and (B, V); it returns (call(backend) -> the
# op's outputs, one large input).  The per-sequence inputs repeat every P sequences (B a
# multiple of P), so the reference on P sequences gives every sequence's expected output.
def _rep(t: torch.Tensor, B: int) -> torch.Tensor:
    return t[:P].repeat(B // P, *([1] * (t.dim() - 1)))


def build_verify_greedy(lay, B, V, K=8):
    logits = lay(_randn, (B, K + 1, V), 1)
    drafts = logits[:P].float().argmax(-1)[:, :K].clone()
    drafts[1, 2] = (drafts[1, 2] + 1) % V
    drafts[3, 0] = (drafts[3, 0] + 1) % V
    return (lambda be: sk.verify_greedy(logits, _rep(drafts, B), backend=be)), logits


PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3])


def build_verify_tree_greedy(lay, B, V, N=8):
    logits = lay(_randn, (B, N, V), 3)
    am = logits[:P].float().argmax(-1)
    tokens = am[:, PARENTS.clamp(min=0)].clone()  # node i's token: the argmax at its parent
    tokens[1:, 1] = (tokens[1:, 1] + 1) % V
    tokens[2, 3] = (tokens[2, 3] + 1) % V
    return (lambda be: sk.verify_tree_greedy(logits, _rep(tokens, B), PARENTS, backend=be)), logits


def _flat_drafts(rows: torch.Tensor, K: int, B: int, seed: int) -> torch.Tensor:
    """[B * K] drafts repeating every P requests: random, every other one the argmax of its row
    (request r's rows are r * (K + 1) + j, the bonus rows inline)."""
    am = rows[: P * (K + 1)].float().argmax(-1).view(P, K + 1)[:, :K]
    d = torch.randint(0, rows.shape[-1], (P, K), generator=gen(seed))
    d[:, ::2] = am[:, ::2]
    return _rep(d, B).reshape(-1)


def build_verify_greedy_flattened(lay, B, V, K=8):
    logits = lay(_randn, (B * K + B, V), 5)
    drafts = _flat_drafts(logits, K, B, 6)
    cu = torch.arange(1, B + 1) * K
    return (lambda be: sk.verify_greedy_flattened(logits, drafts, cu, max_spec_len=K, backend=be)), logits


def build_rejection_sample(lay, B, V, K=8):
    p = lay(_probs, (B, K + 1, V), 7)
    q = lay(lambda shape, seed: _probs(shape, seed, torch.float16), (B, K, V), 8)  # mixed dtypes
    drafts = torch.multinomial(q[:P].float().reshape(-1, V) + 1e-6, 1, generator=gen(9)).view(P, K)
    u, s = torch.rand(P, K, generator=gen(10)), torch.rand(P, generator=gen(11))
    return (
        lambda be: sk.rejection_sample(
            p, q, _rep(drafts, B), uniform_samples=_rep(u, B), sample_uniforms=_rep(s, B), backend=be
        )
    ), p


def build_rejection_sample_flattened(lay, B, V, K=8):
    p = lay(_probs, (B * K + B, V), 12)
    q = lay(_probs, (B * K, V), 13)
    drafts = _flat_drafts(p, K, B, 14)
    cu = torch.arange(1, B + 1) * K
    u, s = torch.rand(P, K, generator=gen(15)), torch.rand(P, generator=gen(16))
    return (
        lambda be: sk.rejection_sample_flattened(
            p,
            q,
            drafts,
            cu,
            max_spec_len=K,
            uniform_samples=_rep(u, B).reshape(-1),
            sample_uniforms=_rep(s, B),
            backend=be,
        )
    ), p


def build_tree_rejection_sample(lay, B, V, N=8):
    p = lay(_probs, (B, N, V), 17)
    q = lay(_probs, (B, N, V), 18)
    # node i drawn from its parent's draft distribution
    rows = q[:P].float()[:, PARENTS.clamp(min=0)].reshape(-1, V)
    tokens = torch.multinomial(rows + 1e-6, 1, generator=gen(19)).view(P, N)
    u, s = torch.rand(P, N - 1, generator=gen(20)), torch.rand(P, generator=gen(21))
    return (
        lambda be: sk.tree_rejection_sample(
            p, _rep(tokens, B), PARENTS, q, uniform_samples=_rep(u, B), sample_uniforms=_rep(s, B), backend=be
        )
    ), p


def build_sampling_probs(lay, B, V, R=2):
    logits = lay(lambda shape, seed: _randn(shape, seed, 3.0), (B, R, V), 22)
    t = _rep(torch.tensor([0.7, 1.0, 0.0, 1.3]), B)
    k = _rep(torch.tensor([0, 50, 0, 7]), B)
    top_p = _rep(torch.tensor([0.9, 1.0, 0.5, 0.95]), B)
    return (lambda be: sk.sampling_probs(logits, t, k, top_p, backend=be)), logits


def build_tree_attention(lay, B, S, N=4, H=4, Hkv=2, D=64):
    """``S`` is the cache capacity here (the large dimension of the caches)."""
    k = lay(_randn, (B, Hkv, S, D), 23)
    v = lay(_randn, (B, Hkv, S, D), 24)
    q = _rep(_randn((P, N, H, D), 25), B)
    lens = _rep(torch.tensor([S - N, S // 3, 1, S // 2]), B)
    mask = torch.tril(torch.ones(N, N, dtype=torch.bool))
    mask[3, 1] = False
    mask = mask.expand(B, N, N)  # one mask for the batch, expanded
    return (lambda be: sk.tree_attention(q, k, v, lens, mask, backend=be)), k


BUILDERS = {
    "verify_greedy": build_verify_greedy,
    "verify_tree_greedy": build_verify_tree_greedy,
    "verify_greedy_flattened": build_verify_greedy_flattened,
    "rejection_sample": build_rejection_sample,
    "rejection_sample_flattened": build_rejection_sample_flattened,
    "tree_rejection_sample": build_tree_rejection_sample,
    "sampling_probs": build_sampling_probs,
    "tree_attention": build_tree_attention,
}
# (B, V) of the large cases (tree_attention: (B, S)); the expanded inputs' nominal sizes
LARGE = {
    "verify_greedy": (2048, 16384),  # 1.1 GiB of logits
    "verify_tree_greedy": (2048, 16384),  # 1 GiB
    "verify_greedy_flattened": (2048, 16384),  # 1.1 GiB
    "rejection_sample": (2048, 16384),  # 1.1 GiB of target, 0.5 GiB of fp16 draft probabilities
    "rejection_sample_flattened": (1024, 16384),  # 0.6 + 0.5 GiB
    "tree_rejection_sample": (512, 16384),  # 2 x 256 MiB
    "sampling_probs": (256, 32768),  # 64 MiB of logits, 64 MiB of output
    "tree_attention": (64, 4096),  # 2 x 128 MiB of cache
}


def _check_same(op, got, want, exact=False):
    if not isinstance(got, tuple):
        got, want = (got,), (want,)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if exact or g.dtype == torch.int64:
            assert torch.equal(g.nan_to_num(-1.0), w.nan_to_num(-1.0)), (op, g, w)
        elif op == "tree_attention":
            torch.testing.assert_close(g, w, **TOLERANCES[torch.float32])
        else:  # sampling_probs: the same kept sets, the documented tolerance
            assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g > 0, w > 0)
            torch.testing.assert_close(g, w, equal_nan=True, rtol=5e-7, atol=0.0)


LAYOUTS = ["sliced", "transposed", "batch-expanded", "vocab-expanded"]


@pytest.mark.requires_native_op("verify_greedy")
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("op", list(BUILDERS))
def test_views_are_read_in_place_and_agree_with_the_reference(op, kind):
    def lay(make, shape, seed):
        return layout(make(shape, seed), kind)

    def lay_copied(make, shape, seed):
        return layout(make(shape, seed), kind).contiguous()

    call, x = BUILDERS[op](lay, P, 96 if op == "tree_attention" else 257)
    copied, _ = BUILDERS[op](lay_copied, P, 96 if op == "tree_attention" else 257)
    assert not x.is_contiguous()
    native = call("native")
    _check_same(op, native, copied("native"), exact=True)  # bit for bit the contiguous copy's
    _check_same(op, native, call("reference"))


def expanded_batch(make, shape, seed):
    """Only the first sequence's rows stored, expanded over the batch (stride 0)."""
    return make((1,) + tuple(shape[1:]), seed).expand(shape)


@pytest.mark.requires_native_op("verify_greedy")
@pytest.mark.parametrize("op", list(BUILDERS))
def test_an_expanded_input_is_never_copied(op):
    B, V = LARGE[op]
    call, big = BUILDERS[op](expanded_batch, B, V)
    nominal = big.numel() * big.element_size()
    assert big.stride(0) == 0 and nominal >= 64 << 20 > 2 * SLACK  # one copy would exceed SLACK
    got, growth = peak_growth(lambda: call("native"))
    outs = got if isinstance(got, tuple) else (got,)
    out_bytes = sum(o.numel() * o.element_size() for o in outs)
    assert growth < out_bytes + SLACK, f"{op}: peak memory grew by {growth >> 20} MiB on a {nominal >> 20} MiB input"
    # the expected output: the reference on the first P sequences, repeated
    small, _ = BUILDERS[op](expanded_batch, P, V)
    want = small("reference")
    want = tuple(_rep(w, B) for w in want) if isinstance(want, tuple) else _rep(want, B)
    _check_same(op, got, want)
