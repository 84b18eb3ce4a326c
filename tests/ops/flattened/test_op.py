"""verify_greedy_flattened / rejection_sample_flattened (vLLM v1 layout) and the details outputs.

The oracle is the padded op's reference on the same data padded to K = max_spec_len: every
backend's flattened result must equal it token for token, for ragged batches (zero-draft
requests, all-zero, batch 1, K_b in 0..16), vocabularies that are not powers of two and every
probability dtype.  The outputs are integer tokens, so they are compared exactly: both sides
read the same low-precision values and compute in float32/float64 alike, which is why the
tolerance table of tests/utils.py has nothing to loosen here (the dtypes are still swept).
Then: [T + B, V] rows against [T, V] + bonus_token_ids, hand-worked cases, -1 padding, guard
buffers around every flat input, the same generator / seeds giving the padded op's tokens, a
chi-square test of losslessness, the FlashInfer-style details, bad input, opcheck.
"""

import re

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.ops.sampling import random_probs
from tests.utils import (
    DRAWS,
    NAN,
    P_THRESHOLD,
    assert_follows,
    bad_input_test,
    chi_square_pvalue,
    each_dtype,
    gen,
    over_bad_inputs,
    runnable_backends,
)

GREEDY_BACKENDS = runnable_backends("verify_greedy_flattened")
SAMPLE_BACKENDS = runnable_backends("rejection_sample_flattened")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# draft counts K_b per request (ids name the case)
COUNTS = {
    "ragged": [3, 0, 5, 1, 0, 2],
    "all_zero": [0, 0, 0],
    "B1": [4],
    "B1_zero": [0],
    "K16": [16, 7, 0, 16, 1],
    "K0_to_16": [5, 16, 0, 9, 2, 13, 1, 7, 11, 3, 15, 4, 8, 14, 6, 12, 10],
}


def dev(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


def cpu(result):
    return type(result)(*(t.cpu() for t in result)) if hasattr(result, "_fields") else tuple(t.cpu() for t in result)


def run(fn, *args, **kwargs):
    """Call ``fn`` with tensors on the test device; results back on CPU."""
    return cpu(fn(*(dev(a) for a in args), **{k: dev(v) for k, v in kwargs.items()}))


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        assert torch.equal(g, w), f"{g.tolist()} != {w.tolist()}"


# --------------------------------------------------------------------------- building cases


def starts_of(counts):
    return [sum(counts[:b]) for b in range(len(counts))]


def flat_case(counts, V, *, seed=0, dtype=torch.float32, sampled=True, id_dtype=torch.int64):
    """A flattened batch: logits and probs [T + B, V], draft probs [T, V], drafts [T] that
    often equal the target's argmax (long accepted runs), coins [T], sample uniforms [B]."""
    g = gen(seed)
    B, T = len(counts), sum(counts)
    cu = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(id_dtype)
    logits = torch.randn(T + B, V, generator=g)
    probs = random_probs((T + B, V), g)
    draft = 0.5 * random_probs((T, V), g)
    drafts = torch.randint(0, V, (T,), generator=g)
    for b, s in enumerate(starts_of(counts)):
        rows = torch.arange(s + b, s + b + counts[b])
        likely = torch.rand(counts[b], generator=g) < 0.75
        drafts[s : s + counts[b]] = torch.where(likely, logits[rows].argmax(-1), drafts[s : s + counts[b]])
        draft[s : s + counts[b]] += 0.5 * probs[rows]
        if sampled:  # drafts drawn from the draft distribution, which overlaps the target's
            pick = torch.multinomial(draft[s : s + counts[b]], 1, generator=g)[:, 0] if counts[b] else drafts[:0]
            drafts[s : s + counts[b]] = torch.where(likely, pick, drafts[s : s + counts[b]])
    return dict(
        counts=counts,
        cu=cu,
        logits=logits.to(dtype),
        probs=probs.to(dtype),
        draft=draft.to(dtype) if sampled else None,
        drafts=drafts.to(id_dtype),
        coins=torch.rand(T, generator=g) ** 2,
        final=torch.rand(B, generator=g),
    )


def padded(case, K=None, seed=1):
    """The same data padded to [B, K + 1, V]; padding rows, ids and coins hold random junk."""
    counts = case["counts"]
    B, K = len(counts), (max(counts, default=0) if K is None else K)
    g = gen(seed)
    V = case["logits"].shape[1]
    out = dict(
        logits=torch.randn(B, K + 1, V, generator=g).to(case["logits"].dtype),
        probs=random_probs((B * (K + 1), V), g).reshape(B, K + 1, V).to(case["probs"].dtype),
        draft=None if case["draft"] is None else random_probs((B * K, V), g).reshape(B, K, V).to(case["draft"].dtype),
        drafts=torch.randint(0, V, (B, K), generator=g),
        coins=torch.rand(B, K, generator=g),
        n=torch.tensor(counts, dtype=torch.int64),
    )
    for b, s in enumerate(starts_of(counts)):
        k = counts[b]
        out["logits"][b, : k + 1] = case["logits"][s + b : s + b + k + 1]
        out["probs"][b, : k + 1] = case["probs"][s + b : s + b + k + 1]
        if case["draft"] is not None:
            out["draft"][b, :k] = case["draft"][s : s + k]
        out["drafts"][b, :k] = case["drafts"][s : s + k]
        out["coins"][b, :k] = case["coins"][s : s + k]
    return out


def flat_inputs(case, probs=None):
    """rejection_sample_flattened's tensor inputs of a flattened case: the target rows (``probs``
    in place of the case's when given), draft probs, draft ids, cu_num_draft_tokens."""
    return (case["probs"] if probs is None else probs, case["draft"], case["drafts"], case["cu"])


def padded_inputs(p):
    """rejection_sample's tensor inputs of the padded case: target, draft probs, draft ids, counts."""
    return (p["probs"], p["draft"], p["drafts"], p["n"])


def given_uniforms(case, coins=None):
    """The case's randoms as keyword arguments: the acceptance coins (``coins`` in place of the
    flat ones when given, the padded case's for the padded op) and the sample uniforms."""
    return dict(uniform_samples=case["coins"] if coins is None else coins, sample_uniforms=case["final"])


def padded_reference(case, p):
    """The padded reference's tokens for a flattened case and its padded form, same randoms."""
    return reference.rejection_sample(*padded_inputs(p), **given_uniforms(case, p["coins"]))


def without_bonus_rows(x, counts):
    """[T + B, V] -> the [T, V] draft rows (the bonus rows removed)."""
    keep = torch.ones(x.shape[0], dtype=torch.bool)
    for b, s in enumerate(starts_of(counts)):
        keep[s + b + counts[b]] = False
    return x[keep]


def one_hot_bonus_rows(x, counts, bonus, value):
    """[T + B, V] whose bonus rows are one-hot at ``bonus`` (``value`` there, 0 elsewhere)."""
    x = x.clone()
    for b, s in enumerate(starts_of(counts)):
        row = s + b + counts[b]
        x[row] = 0
        x[row, bonus[b]] = value
    return x


# --------------------------------------------------------------------------- parity with padded


@each_dtype
@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("backend", GREEDY_BACKENDS)
def test_greedy_equals_padded(backend, counts, dtype):
    for seed, (V, id_dtype) in enumerate(((111, torch.int32), (7, torch.int64))):
        c = flat_case(counts, V, seed=seed, dtype=dtype, id_dtype=id_dtype)
        p = padded(c)
        want = reference.verify_greedy(p["logits"], p["drafts"], p["n"])
        got = run(sk.verify_greedy_flattened, c["logits"], c["drafts"], c["cu"], backend=backend)
        assert_same(got, want)
        out, acc = got
        assert out.shape == (len(counts), max(counts) + 1)
        assert torch.equal((out >= 0).sum(1), acc + 1) and (out[out < 0] == -1).all()  # -1 padding after the tokens


@each_dtype
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_rejection_equals_padded(backend, counts, sampled, dtype):
    for seed, (V, id_dtype) in enumerate(((111, torch.int32), (7, torch.int64))):
        c = flat_case(counts, V, seed=seed, dtype=dtype, sampled=sampled, id_dtype=id_dtype)
        want = padded_reference(c, padded(c))
        got = run(sk.rejection_sample_flattened, *flat_inputs(c), **given_uniforms(c), backend=backend)
        assert_same(got, want)
        out, acc = got
        assert torch.equal((out >= 0).sum(1), acc + 1) and (out[out < 0] == -1).all()


@pytest.mark.parametrize("bonus_ids", [False, True], ids=["bonus_rows", "bonus_ids"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
def test_rejection_equals_padded_over_vocabulary_chunks(sampled, bonus_ids):
    """The Triton kernel with the vocabulary cut into chunks (the batch-1 split), several
    requests per program: the flattened layout still equals the padded reference."""
    if "triton" not in SAMPLE_BACKENDS:
        pytest.skip("Triton cannot run here")
    from functools import partial
    from unittest import mock

    from specdec_kernels.ops._triton import rejection_sample as kernels

    counts = COUNTS["ragged"]
    with mock.patch.object(kernels, "launch_config", partial(kernels.launch_config, tile=(2, 16), num_splits=4)):
        for seed, V in enumerate((111, 37)):
            c = flat_case(counts, V, seed=seed, sampled=sampled)
            want = padded_reference(c, padded(c))
            probs = c["probs"]
            kwargs = {}
            if bonus_ids:
                # the [T, V] layout: drop each request's bonus row, pass the reference's bonus tokens
                probs = without_bonus_rows(probs, counts)
                kwargs["bonus_token_ids"] = want[0].gather(1, want[1][:, None])[:, 0]
            got = run(
                sk.rejection_sample_flattened,
                *flat_inputs(c, probs),
                **given_uniforms(c),
                backend="triton",
                **kwargs,
            )
            assert_same(got, want)  # with bonus ids, full acceptances take the given (reference's) bonus


def test_the_parity_cases_cover_every_outcome():
    """The random cases reject at the first draft, in the middle, accept all, and hold
    zero-draft requests (so the parity tests above are not vacuous)."""
    seen = set()
    for sampled in (True, False):
        c = flat_case(COUNTS["K0_to_16"], 111, sampled=sampled)
        _, acc = reference.rejection_sample_flattened(
            c["probs"], c["draft"], c["drafts"], c["cu"], uniform_samples=c["coins"], sample_uniforms=c["final"]
        )
        _, gacc = reference.verify_greedy_flattened(c["logits"], c["drafts"], c["cu"])
        for a, n in zip(acc.tolist() + gacc.tolist(), c["counts"] * 2):
            seen.add("none" if n == 0 else "first" if a == 0 else "all" if a == n else "middle")
    assert seen == {"none", "first", "middle", "all"}


@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_wider_max_spec_len_pads_with_minus_one(backend):
    c = flat_case(COUNTS["ragged"], 37, seed=3)
    p = padded(c, K=9)
    want = padded_reference(c, p)
    got = run(sk.rejection_sample_flattened, *flat_inputs(c), max_spec_len=9, **given_uniforms(c), backend=backend)
    assert_same(got, want)
    assert got[0].shape == (6, 10) and (got[0][:, 6:] == -1).all()
    if backend in GREEDY_BACKENDS:
        g = run(sk.verify_greedy_flattened, c["logits"], c["drafts"], c["cu"], max_spec_len=9, backend=backend)
        assert_same(g, reference.verify_greedy(p["logits"], p["drafts"], p["n"]))


# --------------------------------------------------------------------------- [T + B, V] vs [T, V] + bonus ids


@pytest.mark.parametrize(
    "counts", [COUNTS["ragged"], COUNTS["all_zero"], COUNTS["K16"]], ids=["ragged", "all_zero", "K16"]
)
@pytest.mark.parametrize("backend", GREEDY_BACKENDS)
def test_greedy_bonus_token_ids_equal_one_hot_bonus_rows(backend, counts):
    c = flat_case(counts, 23, seed=4)
    bonus = torch.randint(0, 23, (len(counts),), generator=gen(5))
    rows = one_hot_bonus_rows(c["logits"], counts, bonus, 10.0)  # the bonus row's argmax is the bonus id
    want = run(sk.verify_greedy_flattened, rows, c["drafts"], c["cu"], backend=backend)
    draft_rows = without_bonus_rows(c["logits"], counts)
    for ids in (bonus, bonus.int(), bonus[:, None]):  # [B] int64 / int32, and vLLM's [B, 1]
        got = run(sk.verify_greedy_flattened, draft_rows, c["drafts"], c["cu"], ids, backend=backend)
        assert_same(got, want)


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
@pytest.mark.parametrize(
    "counts", [COUNTS["ragged"], COUNTS["all_zero"], COUNTS["K16"]], ids=["ragged", "all_zero", "K16"]
)
@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_rejection_bonus_token_ids_equal_one_hot_bonus_rows(backend, counts, sampled):
    c = flat_case(counts, 23, seed=6, sampled=sampled)
    bonus = torch.randint(0, 23, (len(counts),), generator=gen(7))
    rows = one_hot_bonus_rows(c["probs"], counts, bonus, 1.0)  # sampling it gives the bonus id for any u
    kw = dict(given_uniforms(c), backend=backend)
    want = run(sk.rejection_sample_flattened, rows, c["draft"], c["drafts"], c["cu"], **kw)
    draft_rows = without_bonus_rows(c["probs"], counts)
    got = run(sk.rejection_sample_flattened, draft_rows, c["draft"], c["drafts"], c["cu"], bonus, **kw)
    assert_same(got, want)
    # the bonus is the caller's: it does not consume or depend on the sample uniform
    moved = run(
        sk.rejection_sample_flattened,
        draft_rows,
        c["draft"],
        c["drafts"],
        c["cu"],
        bonus,
        **dict(kw, sample_uniforms=torch.rand(len(counts), generator=gen(8))),
    )
    full = got[1] == torch.tensor(counts)
    assert torch.equal(moved[0][full], got[0][full])


# --------------------------------------------------------------------------- hand-worked cases

P0, P1, P2 = [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 1.0, 0.0]


def _logit_rows(*argmaxes, V=10):
    rows = torch.zeros(len(argmaxes), V)
    for r, a in enumerate(argmaxes):
        rows[r, a] = 5.0
    return rows


@pytest.mark.parametrize("backend", GREEDY_BACKENDS)
def test_greedy_golden(backend):
    # request 0: two drafts (rows 0, 1) and its bonus row 2; request 1: no draft, bonus row 3;
    # request 2: one draft (row 4) and bonus row 5.  Row argmaxes 1, 2, 3 | 0 | 2, 1.
    logits = _logit_rows(1, 2, 3, 0, 2, 1)
    cu = torch.tensor([2, 2, 3], dtype=torch.int32)
    # drafts 1, 3 | - | 0: request 0 accepts 1 then 3 != 2 -> correction 2; request 1 emits its
    # bonus 0; request 2 rejects 0 != 2 -> correction 2
    out, acc = run(sk.verify_greedy_flattened, logits, torch.tensor([1, 3, 0], dtype=torch.int32), cu, backend=backend)
    assert out.tolist() == [[1, 2, -1], [0, -1, -1], [2, -1, -1]] and acc.tolist() == [1, 0, 0]
    # drafts 1, 2 | - | 2 all accepted; max_spec_len 4 pads the output to 5 columns
    out, acc = run(sk.verify_greedy_flattened, logits, torch.tensor([1, 2, 2]), cu, max_spec_len=4, backend=backend)
    assert out.tolist() == [[1, 2, 3, -1, -1], [0, -1, -1, -1, -1], [2, 1, -1, -1, -1]] and acc.tolist() == [2, 0, 1]
    # [T, V] rows 0, 1, 4 and caller-sampled bonus tokens (copied as given, here outside V)
    for drafts, tokens, accepted in (
        ([1, 2, 2], [[1, 2, 19], [18, -1, -1], [2, 17, -1]], [2, 0, 1]),
        ([1, 3, 0], [[1, 2, -1], [18, -1, -1], [2, -1, -1]], [1, 0, 0]),
    ):
        bonus = torch.tensor([19, 18, 17])
        out, acc = run(sk.verify_greedy_flattened, logits[[0, 1, 4]], torch.tensor(drafts), cu, bonus, backend=backend)
        assert out.tolist() == tokens and acc.tolist() == accepted


def _golden_probs():
    # request 0: drafts 1, 3 on rows P0, P1, bonus row P2; request 1: no draft, bonus row P0;
    # request 2: draft 2 on row P2, bonus row P1
    return torch.tensor([P0, P1, P2, P0, P2, P1]), torch.tensor([1, 3, 2]), torch.tensor([2, 2, 3])


def _hand_randoms_with_details(coins, sample_uniforms, backend):
    """Keyword arguments of a hand-worked call: the given coins and sample uniforms, the
    backend, details requested."""
    return dict(
        uniform_samples=torch.tensor(coins),
        sample_uniforms=torch.tensor(sample_uniforms),
        backend=backend,
        return_details=True,
    )


@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_rejection_golden(backend):
    target, drafts, cu = _golden_probs()
    # request 0: 0.5 * 1 < 0.6 accepts 1; 0.3 >= 0.25 rejects 3: residual P1 - onehot(3) =
    #   [.25, .25, .25, 0], threshold 0.5 * 0.75 = 0.375 -> token 1
    # request 1: bonus from P0 with u = 0.75: CDF [.1, .7, .9, 1] -> token 2
    # request 2: 0.99 < 1 accepts 2; bonus from P1 with u = 0.3: CDF [.25, .5, ..] -> token 1
    kw = _hand_randoms_with_details([0.5, 0.3, 0.99], [0.5, 0.75, 0.3], backend)
    d = run(sk.rejection_sample_flattened, target, None, drafts, cu, **kw)
    assert d.output_tokens.tolist() == [[1, 1, -1], [2, -1, -1], [2, 1, -1]]
    assert d.num_accepted.tolist() == d.emitted_counts.tolist() == [1, 0, 1]
    assert d.accepted_counts.tolist() == [1, 0, 1] and d.valid.tolist() == [True, True, True]
    # with bonus ids on the [T, V] rows: request 2 emits its bonus 3 instead of sampling P1
    d = run(sk.rejection_sample_flattened, target[[0, 1, 4]], None, drafts, cu, torch.tensor([0, 3, 3]), **kw)
    assert d.output_tokens.tolist() == [[1, 1, -1], [3, -1, -1], [2, 3, -1]]
    # draft distributions: q0 = [.1, .9, 0, 0], 0.7 * 0.9 = 0.63 >= 0.6 rejects 1: residual
    # max(0, P0 - q0) = [0, 0, .2, .1], threshold 0.7 * 0.3 = 0.21 -> token 3
    q = torch.tensor([[0.1, 0.9, 0, 0], P1, [0, 0, 1.0, 0]])
    out, acc = run(
        sk.rejection_sample_flattened,
        target,
        q,
        drafts,
        cu,
        uniform_samples=torch.tensor([0.7, 0.0, 0.5]),
        sample_uniforms=torch.tensor([0.7, 0.05, 0.9]),
        backend=backend,
    )
    # request 1: CDF of P0 at 0.05 -> token 0; request 2: 0.5 * 1 < 1 accepts, P1 at 0.9 -> 3
    assert out.tolist() == [[3, -1, -1], [0, -1, -1], [2, 3, -1]] and acc.tolist() == [0, 0, 1]


# --------------------------------------------------------------------------- details


@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_details_by_hand_counts_tests_after_a_rejection_and_flags_nan_rows(backend):
    target, _, cu = _golden_probs()
    drafts = torch.tensor([3, 1, 2])
    # request 0: draft 3 on P0: 0.5 * 1 >= 0.1 rejects (num_accepted 0), but draft 1 on P1 would
    # pass (0.1 < 0.25): accepted_counts 1 > emitted 0 (FlashInfer's accepted count)
    kw = _hand_randoms_with_details([0.5, 0.1, 0.2], [0.5, 0.5, 0.5], backend)
    d = run(sk.rejection_sample_flattened, target, None, drafts, cu, **kw)
    assert isinstance(d, sk.RejectionSampleDetails)
    assert d.num_accepted.tolist() == d.emitted_counts.tolist() == [0, 0, 1]
    assert d.accepted_counts.tolist() == [1, 0, 1] and d.valid.tolist() == [True, True, True]
    # NaN in request 1's bonus row and in request 2's draft row: only those requests are invalid
    t = target.clone()
    t[3, 2] = NAN
    q = torch.tensor([P1, P1, P2])
    q[2, 0] = NAN
    d = run(sk.rejection_sample_flattened, t, q, drafts, cu, **kw)
    assert d.valid.tolist() == [True, False, False]
    # the same NaN in request 0's first target row
    t = target.clone()
    t[0, 3] = NAN
    assert run(sk.rejection_sample_flattened, t, None, drafts, cu, **kw).valid.tolist() == [False, True, True]


def _hand_details(case, coins, bonus_rows=True):
    """accepted_counts and valid by a plain loop over requests and drafts."""
    counts, V = case["counts"], case["probs"].shape[1]
    accepted, valid = [], []
    for b, s in enumerate(starts_of(counts)):
        k, r0 = counts[b], s + (b if bonus_rows else 0)
        n_pass, ok = 0, True
        for j in range(k):
            x = int(case["drafts"][s + j])
            p = float(case["probs"][r0 + j, x].float())
            q = float(case["draft"][s + j, x].float()) if case["draft"] is not None else 1.0
            n_pass += int(float(torch.tensor(float(coins[s + j])) * torch.tensor(q)) < p and 0 <= x < V)
            ok &= not bool(torch.isnan(case["probs"][r0 + j]).any())
            ok &= case["draft"] is None or not bool(torch.isnan(case["draft"][s + j]).any())
        if bonus_rows:
            ok &= not bool(torch.isnan(case["probs"][r0 + k]).any())
        accepted.append(n_pass)
        valid.append(ok)
    return accepted, valid


@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_details_against_a_hand_loop_and_the_padded_front(backend):
    c = flat_case(COUNTS["K0_to_16"], 29, seed=9)
    c["probs"][[5, 40], 3] = NAN  # two requests' target rows
    c["draft"][70, 0] = NAN  # one request's draft row
    d = run(sk.rejection_sample_flattened, *flat_inputs(c), **given_uniforms(c), return_details=True, backend=backend)
    accepted, valid = _hand_details(c, c["coins"])
    assert d.accepted_counts.tolist() == accepted and d.valid.tolist() == valid
    assert 0 < sum(valid) < len(valid) and (d.accepted_counts >= d.num_accepted).all()
    assert (d.accepted_counts > d.num_accepted).any()  # some draft passes after a rejection
    # the padded front's details on the same data (NaN in padding rows is not the request's)
    p = padded(c)
    p["probs"][p["n"] < max(c["counts"]), -1, 0] = NAN  # only rows that are pure padding
    kw = dict(given_uniforms(c, p["coins"]), backend=backend)
    want = run(sk.rejection_sample, *padded_inputs(p), return_details=True, **kw)
    assert type(want) is sk.RejectionSampleDetails
    assert_same(d, want)
    # the default path still returns the plain pair
    plain = run(sk.rejection_sample, *padded_inputs(p), **kw)
    assert type(plain) is tuple and len(plain) == 2


def test_details_with_bonus_ids_own_no_bonus_row():
    c = flat_case(COUNTS["ragged"], 13, seed=10)
    rows = without_bonus_rows(c["probs"], c["counts"])
    c2 = dict(c, probs=rows)
    rows[2, 1] = NAN  # request 0's third draft row
    d = sk.rejection_sample_flattened(
        *flat_inputs(c, rows),
        torch.zeros(6, dtype=torch.long),
        **given_uniforms(c),
        return_details=True,
        backend="reference",
    )
    accepted, valid = _hand_details(c2, c["coins"], bonus_rows=False)
    assert d.accepted_counts.tolist() == accepted and d.valid.tolist() == valid == [False] + [True] * 5


# --------------------------------------------------------------------------- guard buffers


def _guarded(x, fill, pad=5):
    """``x`` as a view into a larger ``fill``-filled buffer: rows (and columns of 2-D tensors)
    on both sides, so that a read outside ``x`` picks up ``fill``."""
    if x.dim() == 1:
        big = torch.full((x.shape[0] + 2 * pad,), fill, dtype=x.dtype)
        big[pad : pad + x.shape[0]] = x
        return big[pad : pad + x.shape[0]]
    R, V = x.shape
    big = torch.full((R + 2 * pad, V + 2 * pad), fill, dtype=x.dtype)
    big[pad : pad + R, pad : pad + V] = x
    return big[pad : pad + R, pad : pad + V]


def _guarded_rows(x, fill, pad=5):
    """Rows only (a contiguous view with neighbours before and after)."""
    big = torch.full((x.shape[0] + 2 * pad, x.shape[1]), fill, dtype=x.dtype)
    big[pad : pad + x.shape[0]] = x
    return big[pad : pad + x.shape[0]]


def _guarded_ids(drafts, cu, bonus=None):
    """Draft ids, cu_num_draft_tokens and bonus ids (None stays None) in guard buffers: an id read
    past a span is 0, a cu entry read before cu[0] is 1."""
    return _guarded(drafts, 0), _guarded(cu, 1), None if bonus is None else _guarded(bonus, 0)


def _small_case_rows(seed, rows, bonus_ids):
    """A small ragged case, its target ``rows`` ("logits" or "probs") and bonus ids: the
    [T + B, V] rows and None, or with ``bonus_ids`` the [T, V] rows and ids 3..7."""
    counts = [2, 0, 4, 1, 0]
    c = flat_case(counts, 19, seed=seed)
    if bonus_ids:
        return c, without_bonus_rows(c[rows], counts), torch.tensor([3, 4, 5, 6, 7])
    return c, c[rows], None


@pytest.mark.parametrize("guard", [_guarded, _guarded_rows], ids=["rows_and_columns", "rows"])
@pytest.mark.parametrize("bonus_ids", [False, True], ids=["bonus_rows", "bonus_ids"])
@pytest.mark.parametrize("backend", GREEDY_BACKENDS)
def test_greedy_reads_nothing_outside_its_inputs(backend, bonus_ids, guard):
    c, logits, bonus = _small_case_rows(11, "logits", bonus_ids)
    clean = run(sk.verify_greedy_flattened, logits, c["drafts"], c["cu"], bonus, backend=backend)
    # NaN counts as the maximum: any logit read outside the view would become the argmax; a
    # cu entry read before cu[0] would shift request 0; ids past a span would be compared
    got = run(
        sk.verify_greedy_flattened, guard(logits, NAN), *_guarded_ids(c["drafts"], c["cu"], bonus), backend=backend
    )
    assert_same(got, clean)


@pytest.mark.parametrize("fill", [NAN, 1e30], ids=["nan", "huge"])
@pytest.mark.parametrize("bonus_ids", [False, True], ids=["bonus_rows", "bonus_ids"])
@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_rejection_reads_nothing_outside_its_inputs(backend, bonus_ids, fill):
    c, probs, bonus = _small_case_rows(12, "probs", bonus_ids)
    kw = dict(given_uniforms(c), backend=backend)
    for draft in (c["draft"], None):
        clean = run(sk.rejection_sample_flattened, probs, draft, c["drafts"], c["cu"], bonus, **kw)
        # a target value read outside the view (NaN: rejected, huge: accepted and dominating
        # the sampled row) or a draft probability (tiny: accepted) would change the tokens
        got = run(
            sk.rejection_sample_flattened,
            _guarded(probs, fill),
            None if draft is None else _guarded(draft, 1e-30),
            *_guarded_ids(c["drafts"], c["cu"], bonus),
            **dict(kw, uniform_samples=_guarded(c["coins"], 0.0)),
        )
        assert_same(got, clean)


@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_garbage_cu_without_validation_stays_in_bounds(backend):
    """validate=False: a negative, decreasing or too large cu is clamped by the documented rule
    (specdec_kernels/_flattened.py), the same on every backend, inside guarded inputs."""
    counts = [2, 3, 1]
    c = flat_case(counts, 11, seed=13)
    for bad in ([-4, 2, 99], [5, 1, 6], [2, 2, 2], [7, 8, 9]):
        cu = torch.tensor(bad)
        kw = dict(given_uniforms(c), max_spec_len=4, validate=False)
        want = sk.rejection_sample_flattened(c["probs"], c["draft"], c["drafts"], cu, backend="reference", **kw)
        got = run(
            sk.rejection_sample_flattened,
            _guarded(c["probs"], NAN),
            _guarded(c["draft"], 1e-30),
            *_guarded_ids(c["drafts"], cu),
            backend=backend,
            **kw,
        )
        assert_same(got, want)
        assert ((got[0] >= -1) & (got[0] < 11)).all() and (got[1] <= 4).all()
        if backend in GREEDY_BACKENDS:
            g = run(
                sk.verify_greedy_flattened,
                _guarded(c["logits"], NAN),
                *_guarded_ids(c["drafts"], cu),
                max_spec_len=4,
                validate=False,
                backend=backend,
            )
            assert_same(
                g,
                sk.verify_greedy_flattened(
                    c["logits"], c["drafts"], cu, max_spec_len=4, validate=False, backend="reference"
                ),
            )


# --------------------------------------------------------------------------- same randoms as padded


RANDOM_MODES = ["generator", "list", "dict", "seeds", "explicit_coins_generator_uniform"]


def _random_kwargs(mode, B, seed, flat_coins, padded_coins):
    """Keyword arguments of the flattened and of the padded front drawing the same numbers
    (fresh generators on each call)."""
    if mode == "generator":
        return dict(generator=gen(seed))
    if mode == "list":
        return dict(generator=[gen(seed + b) for b in range(B)])
    if mode == "dict":  # gaps: rows 0, 3, 4, 5 draw from the default generator, in row order
        return dict(generator={1: gen(seed), 2: gen(seed + 1)})
    if mode == "seeds":
        return dict(seeds=torch.arange(B) * 7 + seed, offsets=torch.arange(B) * 100)
    coins = flat_coins if flat_coins is not None else padded_coins  # the sample uniforms from a generator
    return dict(uniform_samples=coins, generator=gen(seed))


@pytest.mark.parametrize("mode", RANDOM_MODES)
@pytest.mark.parametrize("backend", SAMPLE_BACKENDS)
def test_same_generator_or_seeds_give_the_padded_tokens(backend, mode):
    counts = COUNTS["ragged"]
    c = flat_case(counts, 17, seed=14)
    for K in (None, 8):  # max_spec_len from cu, or wider: the padded op then pads to K = 8 too
        p = padded(c, K=K)
        torch.manual_seed(22)  # the default generator, for the rows of a dict without one
        got = run(
            sk.rejection_sample_flattened,
            *flat_inputs(c),
            max_spec_len=K,
            backend=backend,
            **_random_kwargs(mode, len(counts), 21, c["coins"], None),
        )
        torch.manual_seed(22)
        want = run(
            sk.rejection_sample,
            *padded_inputs(p),
            backend="reference",
            **_random_kwargs(mode, len(counts), 21, None, p["coins"]),
        )
        assert_same(got, want)


def test_a_request_alone_equals_the_request_in_a_ragged_batch_with_seeds():
    """Philox numbers depend on (seed, offset, position) only: request 2 decoded alone (B = 1)
    gives the tokens it gets inside the ragged batch."""
    counts = COUNTS["ragged"]
    c = flat_case(counts, 17, seed=15)
    seeds, offsets = torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([0, 3, 60, 9, 12, 15])
    out, acc = sk.rejection_sample_flattened(c["probs"], c["draft"], c["drafts"], c["cu"], seeds=seeds, offsets=offsets)
    s, k = starts_of(counts)[2], counts[2]
    alone = sk.rejection_sample_flattened(
        c["probs"][s + 2 : s + 2 + k + 1],
        c["draft"][s : s + k],
        c["drafts"][s : s + k],
        torch.tensor([k]),
        seeds=seeds[2:3],
        offsets=offsets[2:3],
    )
    assert alone[0][0].tolist() == out[2, : k + 1].tolist() and int(alone[1][0]) == int(acc[2])


# --------------------------------------------------------------------------- losslessness


def test_flattened_rejection_sampling_is_lossless():
    """20,000 requests with K_b cycling over 0..3 share per-position targets P_j and draft
    distributions q_j (drafts sampled from q_j): the first emitted token of every request
    follows P_0 (zero-draft requests sample it as their bonus), and given an accepted first
    draft the second follows P_1.  Threshold: with fixed seeds each p-value is deterministic;
    under a correct sampler it is uniform on [0, 1], so p > 1e-3 fails a correct implementation
    for 0.1% of seeds, while at 20,000 draws over 12 tokens an error of a few percent in total
    variation (a wrong residual, a coin taken from another request's span, a bonus row of the
    neighbour) gives p-values far below it; the negative control (the drafts themselves taken
    as the output, i.e. q instead of P) must fail, showing the test has that power."""
    V, R = 12, DRAWS
    g = gen(16)
    P = torch.softmax(torch.randn(4, V, generator=g) * 1.5, -1)
    Q = torch.softmax(torch.log(P[:3]) + torch.randn(3, V, generator=g), -1)
    counts = [r % 4 for r in range(R)]
    rows_p = torch.cat([P[: k + 1] for k in range(4)] * (R // 4))
    rows_q = torch.cat([Q[:k] for k in range(4)] * (R // 4))
    drafts = torch.multinomial(rows_q, 1, generator=g)[:, 0]
    cu = torch.tensor(counts).cumsum(0)
    for backend in SAMPLE_BACKENDS:
        out, acc = run(
            sk.rejection_sample_flattened,
            rows_p,
            rows_q,
            drafts,
            cu,
            max_spec_len=3,
            generator=gen(17),
            backend=backend,
        )
        assert_follows(out[:, 0], P[0], backend)
        second = out[acc >= 1, 1]
        assert second.numel() > 5000
        assert_follows(second, P[1], backend)
    first_drafts = drafts[(cu - torch.tensor(counts))[torch.tensor(counts) > 0]]
    assert chi_square_pvalue(first_drafts, P[0]) < P_THRESHOLD  # negative control: q is not P


# --------------------------------------------------------------------------- bad input


def _good():
    c = flat_case([2, 0, 3], 9, seed=18)
    return dict(
        target_probs=c["probs"], draft_probs=c["draft"], draft_token_ids=c["drafts"], cu_num_draft_tokens=c["cu"]
    )


BAD = {
    "cu_dtype": (dict(cu_num_draft_tokens=torch.tensor([2.0, 2.0, 5.0])), TypeError, "cu_num_draft_tokens"),
    "cu_rank": (dict(cu_num_draft_tokens=torch.tensor([[2, 2, 5]])), ValueError, "cu_num_draft_tokens"),
    "cu_non_monotone": (
        dict(cu_num_draft_tokens=torch.tensor([3, 2, 5])),
        ValueError,
        "cu_num_draft_tokens must be non-decreasing",
    ),
    "cu_negative": (
        dict(cu_num_draft_tokens=torch.tensor([-1, 2, 5])),
        ValueError,
        "cu_num_draft_tokens must be non-negative",
    ),
    "cu_last_not_T": (dict(cu_num_draft_tokens=torch.tensor([2, 2, 4])), ValueError, "cu_num_draft_tokens[-1]"),
    "cu_empty_with_drafts": (
        dict(cu_num_draft_tokens=torch.zeros(0, dtype=torch.long)),
        ValueError,
        "cu_num_draft_tokens",
    ),
    "target_rows_T_mismatch": (dict(target_probs=torch.rand(7, 9)), ValueError, "target_probs must have T + B"),
    "target_rank": (dict(target_probs=torch.rand(1, 8, 9)), ValueError, "target_probs"),
    "target_dtype": (dict(target_probs=torch.ones(8, 9, dtype=torch.long)), TypeError, "target_probs"),
    "bonus_ids_with_bonus_rows": (
        dict(bonus_token_ids=torch.zeros(3, dtype=torch.long)),
        ValueError,
        "target_probs must have T = 5",
    ),
    "bonus_ids_shape": (
        dict(target_probs=torch.rand(5, 9), bonus_token_ids=torch.zeros(2, dtype=torch.long)),
        ValueError,
        "bonus_token_ids",
    ),
    "bonus_ids_dtype": (
        dict(target_probs=torch.rand(5, 9), bonus_token_ids=torch.zeros(3)),
        TypeError,
        "bonus_token_ids",
    ),
    "draft_ids_rank": (dict(draft_token_ids=torch.zeros(1, 5, dtype=torch.long)), ValueError, "draft_token_ids"),
    "draft_probs_T_mismatch": (dict(draft_probs=torch.rand(6, 9)), ValueError, "draft_probs"),
    "max_spec_len_too_small": (dict(max_spec_len=2), ValueError, "max_spec_len must be at least"),
    "max_spec_len_negative": (dict(max_spec_len=-1), ValueError, "max_spec_len"),
    "max_spec_len_float": (dict(max_spec_len=3.0), TypeError, "max_spec_len"),
    "uniforms_padded_shape": (dict(uniform_samples=torch.rand(3, 3)), ValueError, "uniform_samples"),
    "uniforms_range": (dict(uniform_samples=torch.ones(5)), ValueError, "uniform_samples"),
    "sample_uniforms_shape": (dict(sample_uniforms=torch.rand(5)), ValueError, "sample_uniforms"),
    "seeds_shape": (dict(seeds=torch.arange(5), offsets=torch.arange(5)), ValueError, "seeds"),
    "generator_type": (dict(generator=3), TypeError, "generator"),
}


test_bad_input_rejection = bad_input_test(sk.rejection_sample_flattened, BAD, _good)


GREEDY_BAD = {
    k: v for k, v in BAD.items() if not any(s in k for s in ("draft_probs", "uniforms", "seeds", "generator"))
}


@over_bad_inputs(sk.verify_greedy_flattened, GREEDY_BAD)
def test_bad_input_greedy(fn, case):
    args = _good()
    args["target_logits"] = args.pop("target_probs")
    del args["draft_probs"]
    override, err, message = GREEDY_BAD[case]
    override = {("target_logits" if k == "target_probs" else k): v for k, v in override.items()}
    args.update(override)
    with pytest.raises(err, match=re.escape(message.replace("target_probs", "target_logits"))):
        fn(**args)


def test_value_checks_are_skipped_with_validate_false():
    args = _good()
    args["cu_num_draft_tokens"] = torch.tensor([3, 2, 5])  # decreasing: clamped, not checked
    out, acc = sk.rejection_sample_flattened(**args, generator=gen(0), validate=False)
    assert out.shape == (3, 4)  # max_spec_len from the clamped counts 3, 0, 3


# --------------------------------------------------------------------------- registration


def _op_args():
    c = flat_case([2, 0, 3, 1], 13, seed=19)
    rows = without_bonus_rows(c["probs"], c["counts"])
    bonus = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    greedy = [
        (c["logits"], c["drafts"], c["cu"], None, 3),
        (without_bonus_rows(c["logits"], c["counts"]), c["drafts"].int(), c["cu"].int(), bonus, 5),
    ]
    sample = [
        (c["probs"], c["draft"], c["drafts"], c["cu"], None, c["coins"], c["final"], 3),
        (rows, None, c["drafts"], c["cu"], bonus, c["coins"], c["final"], 4),
    ]
    return greedy, sample


@pytest.mark.parametrize("index", [0, 1])
def test_opcheck(index):
    greedy, sample = _op_args()
    for backend in runnable_backends("verify_greedy_flattened", "cpu"):
        torch.library.opcheck(torch.ops.specdec.verify_greedy_flattened.default, greedy[index], {"backend": backend})
    for backend in runnable_backends("rejection_sample_flattened", "cpu"):
        torch.library.opcheck(torch.ops.specdec.rejection_sample_flattened.default, sample[index], {"backend": backend})
    if "triton" in GREEDY_BACKENDS:
        # on the test device (CUDA, or CPU under the interpreter): the public ops' Triton branch
        triton = {"backend": "triton"}
        torch.library.opcheck(
            torch.ops.specdec.verify_greedy_flattened.default, tuple(dev(a) for a in greedy[index]), triton
        )
        torch.library.opcheck(
            torch.ops.specdec.rejection_sample_flattened.default, tuple(dev(a) for a in sample[index]), triton
        )


def test_fronts_run_on_fake_tensors_with_validate_false():
    """No host read of tensor values with validate=False and max_spec_len given (what
    torch.compile and CUDA-graph capture need), in every random mode that allows it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = flat_case([2, 0, 3], 9, seed=20)
    real = (
        c["probs"],
        c["draft"],
        c["drafts"],
        c["cu"],
        c["logits"],
        torch.arange(3),
        torch.zeros(3, dtype=torch.long),
        c["coins"],
        c["final"],
    )
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        probs, draft, drafts, cu, logits, seeds, offsets, coins, final = (mode.from_tensor(t) for t in real)
        out, acc = sk.verify_greedy_flattened(logits, drafts, cu, max_spec_len=3, validate=False)
        assert out.shape == (3, 4) and acc.shape == (3,)
        d = sk.rejection_sample_flattened(
            probs, draft, drafts, cu, max_spec_len=4, seeds=seeds, offsets=offsets, validate=False, return_details=True
        )
        assert d.output_tokens.shape == (3, 5) and d.valid.dtype == torch.bool
        out, _ = sk.rejection_sample_flattened(
            probs, None, drafts, cu, max_spec_len=3, uniform_samples=coins, sample_uniforms=final, validate=False
        )
        assert out.shape == (3, 4)


def test_compiles_fullgraph_with_max_spec_len_and_validate_false():
    """max_spec_len given and validate=False: no host read, so torch.compile(fullgraph=True)
    traces both fronts (seeds/offsets randomness, details included) without a graph break and
    matches eager."""
    c = flat_case([2, 0, 3, 1], 13, seed=21)
    seeds, offsets = torch.arange(4), torch.zeros(4, dtype=torch.long)

    def step(logits, probs, draft, drafts, cu, seeds, offsets):
        greedy = sk.verify_greedy_flattened(logits, drafts, cu, max_spec_len=3, validate=False)
        details = sk.rejection_sample_flattened(
            probs, draft, drafts, cu, max_spec_len=3, seeds=seeds, offsets=offsets, validate=False, return_details=True
        )
        return tuple(greedy) + tuple(details)

    args = tuple(dev(a) for a in (c["logits"], c["probs"], c["draft"], c["drafts"], c["cu"], seeds, offsets))
    eager = step(*args)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    assert_same(cpu(compiled), cpu(eager))


@pytest.mark.parametrize("op", ["verify_greedy_flattened", "rejection_sample_flattened"])
def test_max_spec_len_none_under_fake_tensors_names_max_spec_len(op):
    """max_spec_len=None needs cu_num_draft_tokens' values: a fake or meta call says so, naming
    the argument, instead of failing inside a host read; with max_spec_len it traces."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for device in ("meta", None):
        ctx = FakeTensorMode() if device is None else torch.device(device)
        with ctx:
            rows = torch.rand(5, 11)
            ids, cu = torch.zeros(3, dtype=torch.int64), torch.tensor([1, 3])
            extra = () if op == "verify_greedy_flattened" else (None,)
            kwargs = (
                {}
                if op == "verify_greedy_flattened"
                else dict(uniform_samples=torch.zeros(3), sample_uniforms=torch.zeros(2))
            )
            with pytest.raises(ValueError, match="max_spec_len"):
                getattr(sk, op)(rows, *extra, ids, cu, validate=False, **kwargs)
            out, acc = getattr(sk, op)(rows, *extra, ids, cu, max_spec_len=2, validate=False, **kwargs)
            assert out.shape == (2, 3) and acc.shape == (2,)
