"""rejection_sample, Triton kernel: token-exact parity with the reference for the same randoms,
distribution tests on the kernel itself, invariants, use of each random number, edge cases,
and the torch.library registration (opcheck)."""

import pytest
import torch

from specdec_kernels.ops import rejection_sample as op
from specdec_kernels.ops.sampling_probs import sampling_probs
from specdec_kernels.reference.rejection_sample import rejection_sample as reference_rejection_sample
from tests.ops import sampling
from tests.ops.sampling import TARGETS, TILINGS, random_probs
from tests.utils import DRAWS, assert_follows, assert_same, each_dtype, gen, requires_triton, to_device

pytestmark = requires_triton("rejection_sample")


def kernel(*args, **kwargs):
    return op.rejection_sample(*args, backend="triton", **kwargs)


ARGS = ("target_probs", "draft_probs", "draft_tokens", "num_draft_tokens")


def chain_case(B, K, V, *, sampled, seed=0, dtype=torch.float32, ragged=True, index_dtype=torch.int64):
    """Target/draft rows that overlap enough for a mix of accepted and rejected drafts."""
    g = gen(seed)
    target = random_probs((B, K + 1, V), g)
    if sampled:
        draft = 0.5 * random_probs((B, K, V), g) + 0.5 * target[:, :K]
        flat = draft.reshape(-1, V)
        tokens = torch.multinomial(flat, 1, generator=g).reshape(B, K) if flat.numel() else torch.zeros(B, K).long()
    else:
        draft = None
        likely = target[:, :K].argmax(-1) if K else torch.zeros(B, 0, dtype=torch.long)
        tokens = torch.where(torch.rand(B, K, generator=g) < 0.6, likely, torch.randint(0, V, (B, K), generator=g))
    counts = torch.randint(0, K + 1, (B,), generator=g) if ragged else torch.full((B,), K)
    coins = torch.rand(B, K, generator=g)
    final = torch.rand(B, generator=g)
    return dict(
        target_probs=target.to(dtype),
        draft_probs=None if draft is None else draft.to(dtype),
        draft_tokens=tokens.to(index_dtype),
        num_draft_tokens=counts,
        uniform_samples=coins,
        sample_uniforms=final,
    )


def call_case(fn, c, **kwargs):
    """``fn`` (the public op or the reference) on a case of ``chain_case``, its randoms given."""
    return fn(
        c["target_probs"],
        c["draft_probs"],
        c["draft_tokens"],
        c["num_draft_tokens"],
        uniform_samples=c["uniform_samples"],
        sample_uniforms=c["sample_uniforms"],
        **kwargs,
    )


def run_both(case, device):
    """(kernel result, reference result), both on CPU, for the same inputs and randoms."""
    return sampling.kernel_and_reference(kernel, reference_rejection_sample, ARGS, case, device)


# ---------------------------------------------------------------------------------------------
# parity with the reference for the same randoms

SHAPES = [(1, 0, 1), (1, 1, 7), (3, 3, 111), (8, 5, 1000), (3, 8, 111), (8, 7, 7), (1, 16, 1000), (8, 2, 1)]


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
@pytest.mark.parametrize("B,K,V", SHAPES, ids=[f"B{b}-K{k}-V{v}" for b, k, v in SHAPES])
def test_matches_reference(device, B, K, V, sampled):
    for seed in range(2):
        assert_same(*run_both(chain_case(B, K, V, sampled=sampled, seed=seed), device))


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
@each_dtype
def test_matches_reference_low_precision_and_int32_ids(device, dtype, sampled):
    case = chain_case(5, 4, 111, sampled=sampled, seed=3, dtype=dtype, index_dtype=torch.int32)
    assert_same(*run_both(case, device))


@pytest.mark.parametrize("V", [49152, 128256, 151936])
def test_matches_reference_at_real_vocabulary_sizes(device, V):
    for sampled in (True, False):
        assert_same(*run_both(chain_case(2, 3, V, sampled=sampled, seed=V, ragged=False), device))


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
@pytest.mark.parametrize("tiling", TILINGS, ids=[f"BB{b}-BV{v}-S{s}" for b, v, s in TILINGS])
def test_vocabulary_chunks_match_reference(device, tiling, sampled):
    """Every chunking of the vocabulary gives the reference's tokens: the chunk that holds
    u * total is found from the chunk masses, and the search runs inside it only (rows of one
    program land in different chunks)."""
    from functools import partial
    from unittest import mock

    from specdec_kernels.ops._triton import rejection_sample as kernels

    block_b, block_v, splits = tiling
    tiled = partial(kernels.launch_config, tile=(block_b, block_v), num_splits=splits)
    with mock.patch.object(kernels, "launch_config", tiled):
        for B, K, V in [(1, 4, 111), (5, 3, 200), (3, 0, 37)] + ([(2, 6, 1000)] if block_v > 16 else []):
            assert_same(*run_both(chain_case(B, K, V, sampled=sampled, seed=B), device))


def test_every_count_of_accepted_drafts_occurs_and_matches(device):
    # drafts equal to the target's argmax with coins spread over [0, 1): the batch covers
    # rejections at every position as well as fully accepted rows (bonus token)
    B, K, V = 64, 6, 13
    case = chain_case(B, K, V, sampled=False, seed=11, ragged=False)
    case["draft_tokens"] = case["target_probs"][:, :K].argmax(-1)
    case["uniform_samples"] = case["uniform_samples"] ** 4  # mostly small coins: long accepted runs
    got, want = run_both(case, device)
    assert_same(got, want)
    assert set(got[1].tolist()) >= {0, K}, got[1].tolist()


def test_strided_inputs(device):
    # a batch stride of 0 (one row shared by the batch) and a non-contiguous vocabulary
    g = gen(5)
    target = random_probs((1, 4, 37), g).expand(6, 4, 37)
    draft_full = random_probs((6, 3, 74), g)
    draft = draft_full[..., ::2]  # last-dim stride 2: the launcher makes it contiguous
    tokens = torch.randint(0, 37, (6, 3), generator=g)
    case = dict(
        target_probs=target,
        draft_probs=draft,
        draft_tokens=tokens,
        num_draft_tokens=None,
        **sampling.random_uniforms(6, 3, g),
    )
    assert_same(*run_both(case, device))


# ---------------------------------------------------------------------------------------------
# invariants


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
def test_invariants(device, sampled):
    B, K, V = 32, 6, 50
    case = chain_case(B, K, V, sampled=sampled, seed=21)
    c = to_device(case, device)
    out, acc = (t.cpu() for t in call_case(kernel, c))
    target, tokens, counts = case["target_probs"], case["draft_tokens"], case["num_draft_tokens"]
    assert out.shape == (B, K + 1) and acc.shape == (B,)
    for b in range(B):
        n = int(acc[b])
        assert 0 <= n <= int(counts[b])
        assert (out[b] != -1).sum() == n + 1  # emitted = accepted + 1
        assert (out[b, n + 1 :] == -1).all()  # -1 padding
        assert torch.equal(out[b, :n], tokens[b, :n])  # accepted drafts are the drafts
        for j in range(n):
            assert target[b, j, tokens[b, j]] > 0  # a zero-probability draft is never accepted
        assert 0 <= out[b, n] < V and target[b, n, out[b, n]] > 0  # nor sampled


# ---------------------------------------------------------------------------------------------
# each random number is used at most once, and for one purpose


def test_coins_after_the_first_rejection_and_past_the_count_are_unused(device):
    B, K, V = 24, 6, 20
    case = chain_case(B, K, V, sampled=True, seed=31)
    got, _ = run_both(case, device)
    acc = got[1]
    # coin j is used iff j <= num_accepted and j < count; redraw every other coin
    cols = torch.arange(K)[None, :]
    used = (cols <= acc[:, None]) & (cols < case["num_draft_tokens"][:, None])
    perturbed = dict(
        case, uniform_samples=torch.where(used, case["uniform_samples"], torch.rand(B, K, generator=gen(99)))
    )
    again, _ = run_both(perturbed, device)
    assert_same(again, got)


def test_the_sample_uniform_only_moves_the_sampled_token(device):
    case = chain_case(16, 4, 30, sampled=True, seed=41)
    sampling.assert_only_the_sampled_token_moves(run_both, case, device, (0.01, 0.3, 0.6, 0.99))


def test_coin_and_sample_uniform_are_distinct_inputs(device):
    # one draft, p(x) = 0.5 = q(x) * 0.5: coin 0.7 rejects; the residual is then drawn with the
    # sample uniform, so the same value in both inputs cannot be what couples them
    target = torch.tensor([[[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]]])
    draft = torch.tensor([[[1.0, 0.0, 0.0]]])
    tokens = torch.tensor([[0]])
    outs = {}
    for coin, u in [(0.7, 0.1), (0.7, 0.9), (0.2, 0.1), (0.2, 0.9)]:
        c = to_device(dict(target_probs=target, draft_probs=draft, draft_tokens=tokens), device)
        out, acc = kernel(
            c["target_probs"],
            c["draft_probs"],
            c["draft_tokens"],
            uniform_samples=torch.tensor([[coin]], device=device),
            sample_uniforms=torch.tensor([u], device=device),
        )
        outs[(coin, u)] = (out.cpu().tolist(), acc.cpu().tolist())
    # rejected (0.7 * 1 >= 0.5): residual [0, .25, .25], u picks token 1 or 2
    assert outs[(0.7, 0.1)] == ([[1, -1]], [0]) and outs[(0.7, 0.9)] == ([[2, -1]], [0])
    # accepted (0.2 < 0.5): the bonus row is one-hot at 0 whatever u
    assert outs[(0.2, 0.1)] == outs[(0.2, 0.9)] == ([[0, 0]], [1])


# ---------------------------------------------------------------------------------------------
# edge cases


def test_zero_drafts_samples_the_bonus(device):
    case = chain_case(7, 0, 111, sampled=True, seed=51)
    got, want = run_both(case, device)
    assert_same(got, want)
    assert got[0].shape == (7, 1) and (got[1] == 0).all()


def test_empty_batch(device):
    for K in (0, 3):
        out, acc = kernel(
            torch.rand(0, K + 1, 11, device=device),
            torch.rand(0, K, 11, device=device),
            torch.zeros(0, K, dtype=torch.long, device=device),
        )
        assert out.shape == (0, K + 1) and acc.shape == (0,) and out.dtype == acc.dtype == torch.int64


def test_residual_without_mass_samples_from_the_target(device):
    # q == p and every draft outside the support: rejected, max(0, p - q) == 0, sample from p
    B = 6
    case = sampling.without_mass_at(4, (B, 2, 9), seed=61)
    case.update(
        draft_probs=case["target_probs"][:, :1].clone(), draft_tokens=torch.full((B, 1), 4), num_draft_tokens=None
    )
    got, want = run_both(case, device)
    assert_same(got, want)
    assert (got[1] == 0).all() and (got[0][:, 0] != 4).all()


def test_unnormalised_rows_follow_the_documented_behaviour(device):
    # rows are used as given: the accept test compares raw values (p(x) = 3 * 0.4 = 1.2 >= q
    # always accepts), and the sampled token is proportional to the weights
    B, V = 8, 5
    base = torch.tensor([0.4, 0.1, 0.2, 0.3, 0.0])
    target = (base * 3).expand(B, 2, V).clone()
    case = dict(
        target_probs=target,
        draft_probs=torch.full((B, 1, V), 0.9),
        draft_tokens=torch.zeros(B, 1, dtype=torch.long),
        num_draft_tokens=None,
        uniform_samples=torch.rand(B, 1, generator=gen(71)),
        sample_uniforms=torch.linspace(0.05, 0.95, B),
    )
    got, want = run_both(case, device)
    assert_same(got, want)
    assert (got[1] == 1).all()  # 1.2 > u * 0.9 for every u
    # bonus weights 3 * base: thresholds u * 3 over the CDF [1.2, 1.5, 2.1, 3.0]
    expected = [
        0 if u * 3 < 1.2 else 1 if u * 3 < 1.5 else 2 if u * 3 < 2.1 else 3
        for u in torch.linspace(0.05, 0.95, B).tolist()
    ]
    assert got[0][:, 1].tolist() == expected
    # a one-hot draft x with p(x) = 0.5 and no other mass: rejected when u >= 0.5, the residual
    # max(0, p - onehot(x)) has no mass, so the token comes from p itself: x again
    target = torch.zeros(2, 2, V)
    target[:, 0, 2] = 0.5
    target[:, 1] = 1.0
    case = dict(
        target_probs=target,
        draft_probs=None,
        draft_tokens=torch.full((2, 1), 2),
        num_draft_tokens=None,
        uniform_samples=torch.tensor([[0.3], [0.7]]),
        sample_uniforms=torch.tensor([0.5, 0.5]),
    )
    got, want = run_both(case, device)
    assert_same(got, want)
    assert got[0].tolist() == [[2, 2], [2, -1]] and got[1].tolist() == [1, 0]


def test_nan_and_negative_probabilities_carry_no_mass(device):
    B, K, V = 6, 3, 17
    case = chain_case(B, K, V, sampled=True, seed=81, ragged=False)
    t = case["target_probs"]
    t[:, :, ::3] = float("nan")
    t[:, :, 1::5] = -0.5
    case["draft_probs"][:, :, 2::4] = float("nan")
    case["draft_tokens"][:, 0] = 0  # NaN target probability: never accepted
    got, want = run_both(case, device)
    assert_same(got, want)
    assert (got[1] == 0).all()
    for b in range(B):
        tok = int(got[0][b, 0])
        assert 0 <= tok < V and (t[b, 0, tok] > 0)
    # a row with no mass at all samples token 0 (documented)
    t2 = torch.full((2, 1, V), float("nan"))
    t2[1] = -1.0
    c = to_device(dict(t=t2), device)
    out, _ = kernel(
        c["t"],
        None,
        torch.zeros(2, 0, dtype=torch.long, device=device),
        uniform_samples=torch.zeros(2, 0, device=device),
        sample_uniforms=torch.tensor([0.5, 0.9], device=device),
    )
    assert out.cpu().tolist() == [[0], [0]]


def test_out_of_range_draft_ids_are_rejected_without_reading_outside(device):
    B, K, V = 6, 3, 11
    case = chain_case(B, K, V, sampled=True, seed=91, ragged=False)
    # the tensors are windows of larger buffers whose surroundings hold huge weights: a read
    # outside the window (an unclamped id) would accept the draft or pull the sample there
    big_t = torch.full((B, K + 1, V + 20), 1e30)
    big_t[:, :, 10 : 10 + V] = case["target_probs"]
    big_q = torch.full((B, K, V + 20), 1e-30)
    big_q[:, :, 10 : 10 + V] = case["draft_probs"]
    case["target_probs"], case["draft_probs"] = big_t[:, :, 10 : 10 + V], big_q[:, :, 10 : 10 + V]
    case["draft_tokens"][:, 0] = torch.tensor([-1, V, V + 5, -10, 2**40, -(2**40)])
    for sampled in (True, False):
        c = case if sampled else dict(case, draft_probs=None)
        got, want = run_both(c, device)
        assert_same(got, want)
        assert (got[1] == 0).all() and ((got[0][:, 0] >= 0) & (got[0][:, 0] < V)).all()


# ---------------------------------------------------------------------------------------------
# distribution of the kernel's output


def distribution_targets(V, seed):
    """(target probs [3, V], draft probs [2, V]) for a few settings of sampling_probs (Triton)."""
    g = gen(seed)
    logits_p = torch.randn(3, V, generator=g) * 1.5
    logits_q = logits_p + torch.randn(3, V, generator=g)
    return logits_p, logits_q[:2]


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
@pytest.mark.parametrize("setting", list(TARGETS), ids=list(TARGETS))
def test_distribution_matches_target(device, setting, sampled):
    V, K = 23, 2
    logits_p, logits_q = distribution_targets(V, seed=101)
    p = sampling_probs(logits_p.to(device), backend="triton", **TARGETS[setting])
    q = sampling_probs(logits_q.to(device), temperature=1.0, backend="triton")
    g = gen(202)
    if sampled:
        drafts = torch.multinomial(q.cpu(), DRAWS, replacement=True, generator=g).T.contiguous()
        draft_probs = q.expand(DRAWS, K, V)
    else:
        # deterministic drafts, the same in every row: the target's own argmax (a greedy drafter
        # that often agrees), so that enough rows reach the second position
        drafts = p[:K].cpu().argmax(-1).expand(DRAWS, K).contiguous()
        draft_probs = None
    out, acc = kernel(p.expand(DRAWS, K + 1, V), draft_probs, drafts.to(device), generator=gen(303))
    out, acc = out.cpu(), acc.cpu()
    p = p.cpu()
    assert_follows(out[:, 0], p[0])
    # given an accepted first draft, the second token follows the second row
    second = out[acc >= 1, 1]
    assert second.numel() > 1000
    assert_follows(second, p[1])


def test_distribution_of_the_bonus_from_an_unnormalised_row(device):
    # K = 0: every row emits the bonus token; weights 3 * p sample like p
    V = 11
    p = torch.softmax(torch.randn(V, generator=gen(111)), -1)
    p[3] = 0.0
    target = (3 * p).expand(DRAWS, 1, V).to(device)
    out, _ = kernel(target, None, torch.zeros(DRAWS, 0, dtype=torch.long, device=device), generator=gen(112))
    assert_follows(out.cpu()[:, 0], p)


def test_distribution_negative_control(device):
    # the chi-square test does detect a sampler that ignores the residual: sampling the token
    # after a rejection from p instead of max(0, p - q) is visibly wrong at this sample size
    V, K = 23, 1
    logits_p, logits_q = distribution_targets(V, seed=101)
    p = torch.softmax(logits_p[:2], -1)
    q = torch.softmax(logits_q[:1], -1)
    g = gen(7)
    drafts = torch.multinomial(q, DRAWS, replacement=True, generator=g).T.contiguous()
    out, acc = kernel(
        p.expand(DRAWS, 2, V).to(device), q.expand(DRAWS, 1, V).to(device), drafts.to(device), generator=gen(8)
    )
    sampling.assert_residual_matters(out.cpu(), acc.cpu(), p[0], g)


# ---------------------------------------------------------------------------------------------
# torch.library registration


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
def test_opcheck(device, sampled):
    case = to_device(chain_case(3, 4, 19, sampled=sampled, seed=121), device)
    args = (
        case["target_probs"],
        case["draft_probs"],
        case["draft_tokens"],
        case["num_draft_tokens"],
        case["uniform_samples"],
        case["sample_uniforms"],
    )
    # the Triton launcher is no op of its own: the public op's Triton branch is what is checked
    torch.library.opcheck(torch.ops.specdec.rejection_sample.default, args, {"backend": "triton"})
