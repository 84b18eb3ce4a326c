"""rejection_sample: hand-worked cases, distribution tests, invariants and bad input."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.utils import (
    DRAWS,
    P_THRESHOLD,
    assert_follows,
    bad_input_test,
    chi_square_pvalue,
    gen,
    on_each_backend,
    runnable_backends,
)

BACKENDS = runnable_backends("rejection_sample")


P0 = [0.1, 0.6, 0.2, 0.1]
P1 = [0.25, 0.25, 0.25, 0.25]
P2 = [0.0, 0.0, 1.0, 0.0]


sample = on_each_backend(sk.rejection_sample, BACKENDS)


def probs(*rows):
    return torch.tensor([rows])


GOLDEN = {
    # name: (target rows, draft rows or None, drafts, coins, sample uniform, output, accepted)
    # accept x0=1 (0.5*1 < 0.6), reject x1=3 (0.3 >= 0.25); residual p1 - onehot(3) = [.25,.25,.25,0],
    # threshold 0.5 * 0.75 = 0.375 -> cdf [.25, .5, ...] -> token 1
    "one_hot_reject_second": (probs(P0, P1, P2), None, [[1, 3]], [[0.5, 0.3]], [0.5], [[1, 1, -1]], [1]),
    # both accepted, the bonus comes from row 2 (all mass on token 2)
    "one_hot_all_accepted": (probs(P0, P1, P2), None, [[1, 3]], [[0.1, 0.1]], [0.99], [[1, 3, 2]], [2]),
    # q0(1) = 0.9: 0.7 * 0.9 = 0.63 >= 0.6 rejects; residual max(0, p0 - q0) = [0, 0, .2, .1],
    # threshold 0.7 * 0.3 = 0.21 -> token 3
    "sampled_first_rejected": (
        probs(P0, P1, P2),
        probs([0.1, 0.9, 0.0, 0.0], P1),
        [[1, 0]],
        [[0.7, 0.0]],
        [0.7],
        [[3, -1, -1]],
        [0],
    ),
    # p0 == q0 with the draft outside both supports: p(2) = 0 is never accepted; the residual
    # has no mass, so the token comes from p0 itself (all mass on 1)
    "residual_without_mass": (probs([0, 1.0, 0, 0], P1), probs([0, 1.0, 0, 0]), [[2]], [[0.0]], [0.3], [[1, -1]], [0]),
    # K = 0: the bonus token only
    "zero_drafts": (probs(P2), None, [[]], [[]], [0.5], [[2]], [0]),
}


@pytest.mark.parametrize("case", list(GOLDEN), ids=list(GOLDEN))
def test_golden(sample, case):
    target, draft, drafts, coins, final, want_out, want_acc = GOLDEN[case]
    out, acc = sample(
        target,
        draft,
        torch.tensor(drafts, dtype=torch.long).reshape(1, -1),
        uniform_samples=torch.tensor(coins).reshape(1, -1),
        sample_uniforms=torch.tensor(final),
    )
    assert out.tolist() == want_out and acc.tolist() == want_acc


def test_ragged_counts_take_the_bonus_from_the_row_after_the_last_draft(sample):
    target = torch.tensor([[P1, P1, P2, [1.0, 0, 0, 0]]] * 2)
    drafts = torch.tensor([[0, 1, 2], [0, 1, 2]])
    out, acc = sample(
        target,
        None,
        drafts,
        torch.tensor([2, 0]),
        uniform_samples=torch.zeros(2, 3),
        sample_uniforms=torch.tensor([0.5, 0.1]),
    )
    # seq 0 accepts its 2 counted drafts, bonus from row 2 -> token 2; seq 1 has no drafts:
    # bonus from row 0 (uniform) with u = 0.1 -> token 0
    assert out.tolist() == [[0, 1, 2, -1], [0, -1, -1, -1]] and acc.tolist() == [2, 0]


def test_ids_out_of_range_are_rejected(sample):
    target = torch.tensor([[P1, P1], [P1, P1]])
    out, acc = sample(
        target,
        None,
        torch.tensor([[-1], [4]]),
        uniform_samples=torch.zeros(2, 1),
        sample_uniforms=torch.tensor([0.0, 0.99]),
    )
    assert acc.tolist() == [0, 0] and out.tolist() == [[0, -1], [3, -1]]


def make_case(temperature, top_k, top_p, V=12, K=3, seed=0):
    g = gen(seed)
    logits = torch.randn(1, K + 1, V, generator=g) * 2
    target = sk.sampling_probs(logits, temperature, top_k, top_p)
    # a draft model that roughly agrees with the target, as a real one does
    draft = sk.sampling_probs(logits[:, :K] + torch.randn(1, K, V, generator=g), temperature)
    return target, draft


TARGETS = {
    "t1.0": (1.0, None, None),
    "t0.6": (0.6, None, None),
    "t1.0_topk5": (1.0, 5, None),
    "t0.6_topp0.8": (0.6, None, 0.8),
}


def draw_chain(sampler, target, draft, sampled_drafts, seed):
    """DRAWS sequences sharing one target/draft; returns (output_tokens, num_accepted)."""
    B, K = DRAWS, draft.shape[1]
    g = gen(seed)
    if sampled_drafts:
        tokens = torch.multinomial(draft[0], B, replacement=True, generator=g).T  # [B, K]
        q = draft.expand(B, -1, -1)
    else:  # deterministic drafts (a greedy drafter that agrees with the target's mode), q one-hot
        tokens = target[0, :K].argmax(-1).expand(B, K)
        q = None
    return sampler(target.expand(B, -1, -1), q, tokens, generator=g)


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_drafts", "one_hot_drafts"])
@pytest.mark.parametrize("target_case", list(TARGETS), ids=list(TARGETS))
def test_distribution_matches_target(sampled, target_case):
    target, draft = make_case(*TARGETS[target_case])
    out, acc = draw_chain(reference.rejection_sample, target, draft, sampled, seed=11)
    assert_follows(out[:, 0], target[0, 0])
    # Given the first draft was accepted, the next emitted token follows row 1.
    second = out[acc >= 1, 1]
    assert second.numel() > 1000
    assert_follows(second, target[0, 1])
    assert (target[0, 0][out[:, 0]] > 0).all()  # a zero-probability token is never emitted


def test_negative_control_detects_a_lossy_sampler():
    """Accepting every draft (ignoring p) must fail the same test: the test has power."""
    target, draft = make_case(1.0, None, None)
    tokens = torch.multinomial(draft[0], DRAWS, replacement=True, generator=gen(5)).T
    assert chi_square_pvalue(tokens[:, 0], target[0, 0]) < P_THRESHOLD


def test_invariants_and_batch_independence(sample):
    g = gen(2)
    B, K, V = 7, 5, 23
    target = sk.sampling_probs(torch.randn(B, K + 1, V, generator=g), 0.8, 10)
    draft = sk.sampling_probs(torch.randn(B, K, V, generator=g), 0.8)
    tokens = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(B, K)
    counts = torch.tensor([5, 0, 3, 1, 5, 2, 4])
    coins, final = torch.rand(B, K, generator=g), torch.rand(B, generator=g)
    out, acc = sample(target, draft, tokens, counts, uniform_samples=coins, sample_uniforms=final)
    assert torch.equal((out >= 0).sum(1), acc + 1)
    assert (out[:, -1][acc < K] == -1).all()
    emitted = out.gather(1, acc[:, None]).squeeze(1)
    assert (target.gather(1, acc[:, None, None].expand(B, 1, V)).squeeze(1).gather(1, emitted[:, None]) > 0).all()
    again = sample(target, draft, tokens, counts, uniform_samples=coins, sample_uniforms=final)
    assert torch.equal(again[0], out)
    for b in (0, 3, 6):
        one = sample(
            target[b : b + 1],
            draft[b : b + 1],
            tokens[b : b + 1],
            counts[b : b + 1],
            uniform_samples=coins[b : b + 1],
            sample_uniforms=final[b : b + 1],
        )
        assert torch.equal(one[0][0], out[b])


def test_per_sequence_generators_make_results_independent_of_the_batch():
    target, draft = make_case(1.0, None, None, K=4)
    tokens = draft[0].argmax(-1)[None]
    alone = reference.rejection_sample(target, None, tokens, generator=[gen(7)])
    batch = reference.rejection_sample(
        target.expand(3, -1, -1), None, tokens.expand(3, -1), generator=[gen(1), gen(7), gen(9)]
    )
    assert torch.equal(batch[0][1], alone[0][0])


BAD = {
    "target_rank": (dict(target_probs=torch.zeros(3, 5)), ValueError, "target_probs"),
    "target_dtype": (dict(target_probs=torch.zeros(1, 3, 5, dtype=torch.int64)), TypeError, "target_probs"),
    "missing_bonus_row": (dict(target_probs=torch.zeros(1, 2, 5)), ValueError, "draft_tokens"),
    "draft_probs_shape": (dict(draft_probs=torch.zeros(1, 3, 5)), ValueError, "draft_probs"),
    "batch_mismatch": (dict(draft_tokens=torch.zeros(2, 2, dtype=torch.long)), ValueError, "draft_tokens"),
    "uniforms_shape": (dict(uniform_samples=torch.zeros(1, 3)), ValueError, "uniform_samples"),
    "uniforms_range": (dict(uniform_samples=torch.ones(1, 2)), ValueError, "uniform_samples"),
    "sample_uniforms_shape": (dict(sample_uniforms=torch.zeros(2)), ValueError, "sample_uniforms"),
    "generator_list_length": (dict(generator=[gen(0), gen(1)]), ValueError, "generator"),
    "generator_type": (dict(generator=3), TypeError, "generator"),
    "counts_range": (dict(num_draft_tokens=torch.tensor([3])), ValueError, "num_draft_tokens"),
}


test_bad_input = bad_input_test(
    sk.rejection_sample,
    BAD,
    lambda: dict(
        target_probs=torch.full((1, 3, 5), 0.2),
        draft_probs=torch.full((1, 2, 5), 0.2),
        draft_tokens=torch.zeros(1, 2, dtype=torch.long),
    ),
)
