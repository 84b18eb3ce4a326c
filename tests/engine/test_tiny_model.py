"""Decoding engine on a tiny random-weight Llama (vocab 111): forward vs transformers,
greedy equivalence of every drafter, stop tokens, max_new_tokens, ragged batches, changing
K, and the output distribution at temperature > 0 (chi-square)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import rejection_sample, tree_rejection_sample
from specdec_kernels.decoding import (
    Draft,
    Drafter,
    DraftModelDrafter,
    LayerSkipDrafter,
    NgramDrafter,
    SamplingParams,
    SpeculativeDecoder,
    Transformer,
)
from specdec_kernels.decoding.engine import verify as verify_module
from tests.engine.tiny import (  # noqa: F401 (fixture)
    PROMPTS,
    OracleDrafter,
    V,
    exact_marginals,
    ngram_friendly_prompt,
    tiny,
    tree_step_and_paths,
)
from tests.utils import P_THRESHOLD, chi_square_pvalue, one_thread  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")


def hf_greedy(hf, prompt, n):
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


# ---------------------------------------------------------------------------- the forward
@pytest.mark.parametrize("backend", [None, "reference"], ids=["auto", "reference"])
def test_forward_matches_transformers(tiny, backend):
    hf, model = tiny
    model.attention_backend = backend
    try:
        x = torch.tensor([PROMPTS[0] + [1, 2], PROMPTS[2][:9]])
        with torch.inference_mode():
            ref = hf(x).logits
            cache = model.new_kv_cache(2, 16)
            prefill = model(x[:, :5], torch.arange(5).expand(2, 5), cache, torch.zeros(2, dtype=torch.int32))
            rest = model(x[:, 5:], torch.arange(5, 9).expand(2, 4), cache, torch.full((2,), 5, dtype=torch.int32))
        out = torch.cat([prefill, rest], dim=1)
        torch.testing.assert_close(out, ref, atol=1e-4 * ref.abs().max().item(), rtol=0)
    finally:
        model.attention_backend = None


def test_tree_step_matches_transformers_paths(tiny):
    """A tree verify step on ragged cache lengths equals transformers on every root-to-node path."""
    hf, model = tiny
    parents = [-1, 0, 0, 1, 1, 3, 2]
    prompts = [PROMPTS[0], PROMPTS[2]]
    trees = torch.tensor([[7, 3, 50, 3, 60, 61, 9], [11, 4, 5, 6, 7, 8, 9]])
    for ours, ref in tree_step_and_paths(hf, model, prompts, trees, parents):
        torch.testing.assert_close(ours, ref, atol=1e-4 * ref.abs().max().item(), rtol=0)


def test_truncated_model_is_first_layers(tiny):
    hf, model = tiny
    small = model.truncated(1)
    x = torch.tensor([PROMPTS[0]])
    pos = torch.arange(x.shape[1])[None]
    with torch.inference_mode():
        a = small(x, pos, small.new_kv_cache(1, 16), torch.zeros(1, dtype=torch.int32))
        b = model(x, pos, model.new_kv_cache(1, 16), torch.zeros(1, dtype=torch.int32), num_layers=1)
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="num_layers"):
        model.truncated(0)


# ---------------------------------------------------------------------------- greedy equivalence
def drafters(model):
    return {
        "ngram-chain": NgramDrafter(),
        "ngram-tree": NgramDrafter(tree=True),
        "layerskip-chain": LayerSkipDrafter(model, 2),
        "layerskip-tree": LayerSkipDrafter(model, 2, tree_widths=(2, 2)),
        "draftmodel-chain": DraftModelDrafter(model.truncated(1)),
        "draftmodel-tree": DraftModelDrafter(model.truncated(1), tree_widths=(3, 1, 2)),
        # caches of their own instead of the target's (DraftRun.target_kv_cache)
        "layerskip-chain-own": LayerSkipDrafter(model, 2, share_target_cache=False),
        "layerskip-tree-own": LayerSkipDrafter(model, 2, tree_widths=(2, 2), share_target_cache=False),
        "draftmodel-tree-own": DraftModelDrafter(model.truncated(1), tree_widths=(3, 1, 2), share_target_cache=False),
    }


@pytest.fixture(scope="module")
def greedy_outputs(tiny):
    hf, model = tiny
    out = SpeculativeDecoder(model).generate(PROMPTS, 20).tokens
    return out


def test_plain_greedy_matches_transformers(tiny, greedy_outputs):
    hf, model = tiny
    for p, ours in zip(PROMPTS, greedy_outputs):
        assert ours == hf_greedy(hf, p, 20)


DRAFTERS = [
    "ngram-chain",
    "ngram-tree",
    "layerskip-chain",
    "layerskip-tree",
    "draftmodel-chain",
    "draftmodel-tree",
    "layerskip-chain-own",
    "layerskip-tree-own",
    "draftmodel-tree-own",
]


@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("k", [1, 3, 6], ids=lambda k: f"K{k}")
def test_drafters_match_plain_greedy_batched(tiny, greedy_outputs, name, k):
    """A ragged batch through every drafter, chain and tree, returns the plain greedy tokens."""
    _, model = tiny
    result = SpeculativeDecoder(model, drafters(model)[name]).generate(PROMPTS, 20, num_draft_tokens=k)
    assert result.tokens == greedy_outputs
    assert result.stats.tokens == sum(len(t) for t in greedy_outputs)
    assert result.stats.target_passes <= 20


def test_k_changes_between_steps(tiny, greedy_outputs):
    _, model = tiny
    for drafter in (LayerSkipDrafter(model, 2), LayerSkipDrafter(model, 1, tree_widths=(2,)), NgramDrafter(tree=True)):
        decoder = SpeculativeDecoder(model, drafter)
        state = decoder.start(PROMPTS, 20)
        schedule = [0, 5, 1, 3, 7, 2, 0, 4]
        i = 0
        while not state.finished:
            decoder.step(state, schedule[i % len(schedule)])
            i += 1
        assert [state.generated(b) for b in range(len(PROMPTS))] == greedy_outputs
        # a schedule callable, per-sequence K
        result = decoder.generate(PROMPTS, 20, num_draft_tokens=lambda step, st: [step % 4, 1, 5])
        assert result.tokens == greedy_outputs


def test_prefill_in_chunks(tiny, greedy_outputs):
    _, model = tiny
    result = SpeculativeDecoder(model, NgramDrafter(), prefill_chunk=2).generate(PROMPTS, 20)
    assert result.tokens == greedy_outputs
    assert result.stats.prefill_passes == 5  # the longest prompt feeds 10 tokens


# ---------------------------------------------------------------------------- stops and limits
def test_stop_token_inside_accepted_block(tiny, greedy_outputs):
    """The oracle's whole block is accepted; the sequence ends at the stop token within it."""
    _, model = tiny
    future = [g + [1, 2, 3] for g in greedy_outputs]
    stop = greedy_outputs[0][5]
    cut = greedy_outputs[0].index(stop)
    decoder = SpeculativeDecoder(model, OracleDrafter(len(PROMPTS[0]), future[:1], depth=8), stop_token_ids=[stop])
    result = decoder.generate(PROMPTS[:1], 20)
    assert result.tokens[0] == greedy_outputs[0][: cut + 1]
    assert result.stats.target_passes == -(-(cut + 1) // 9)  # 9 tokens per pass (8 drafts + bonus)


def test_max_new_tokens_smaller_than_a_block(tiny, greedy_outputs):
    _, model = tiny
    for n in (1, 3):
        oracle = OracleDrafter(len(PROMPTS[0]), [greedy_outputs[0]], depth=8)  # ignores K
        result = SpeculativeDecoder(model, oracle).generate(PROMPTS[:1], n)
        assert result.tokens[0] == greedy_outputs[0][:n]
        assert result.stats.target_passes == 1
        ngram = SpeculativeDecoder(model, NgramDrafter()).generate(PROMPTS, n, num_draft_tokens=8)
        assert ngram.tokens == [g[:n] for g in greedy_outputs]
    per_seq = SpeculativeDecoder(model, LayerSkipDrafter(model, 2)).generate(PROMPTS, [2, 0, 7], num_draft_tokens=4)
    assert per_seq.tokens == [greedy_outputs[0][:2], [], greedy_outputs[2][:7]]


def test_bad_arguments(tiny):
    _, model = tiny
    decoder = SpeculativeDecoder(model)
    with pytest.raises(ValueError, match="empty"):
        decoder.generate([[1, 2], []], 4)
    with pytest.raises(ValueError, match="outside"):
        decoder.generate([[1, V]], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate([[1, 2]], -1)
    with pytest.raises(ValueError, match="seeds"):
        decoder.generate([[1, 2]], 4, seeds=[1, 2])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)
    other = Transformer.from_hf_model(
        transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=V + 1,
                hidden_size=32,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
            )
        )
    )
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeDecoder(model, DraftModelDrafter(other))


def test_statistics_are_consistent(tiny, greedy_outputs):
    _, model = tiny
    result = SpeculativeDecoder(model, LayerSkipDrafter(model, 2)).generate(PROMPTS, 20, num_draft_tokens=4)
    s = result.stats
    assert s.tokens == 60 and s.sequence_steps >= s.target_passes
    assert s.mean_accepted_length == pytest.approx(s.tokens / s.sequence_steps)
    assert len(s.acceptance_rates) == 4 and all(0 <= r <= 1 for r in s.acceptance_rates)
    assert s.accepted_draft_tokens <= s.draft_tokens
    assert s.total_time >= s.draft_time + s.verify_time
    plain = SpeculativeDecoder(model).generate(PROMPTS, 20).stats
    assert plain.mean_accepted_length == 1.0 and plain.target_passes == 20 and plain.draft_tokens == 0


# ---------------------------------------------------------------------------- sampling


SAMPLING_CASES = {
    "ngram-chain": lambda m: NgramDrafter(),
    "ngram-tree": lambda m: NgramDrafter(tree=True),
    "layerskip-chain-sampled": lambda m: LayerSkipDrafter(m, 2),
    "layerskip-tree-sampled": lambda m: LayerSkipDrafter(m, 2, tree_widths=(2, 2)),
    "draftmodel-tree-greedy": lambda m: DraftModelDrafter(m.truncated(2), tree_widths=(3, 1, 2), deterministic=True),
}


@pytest.mark.parametrize(
    "name, random_source",
    [(name, "generator") for name in SAMPLING_CASES]
    + [("ngram-chain", "philox"), ("layerskip-tree-sampled", "philox")],
)
def test_sampling_keeps_the_target_distribution(tiny, name, random_source):
    """Over many seeds, each of the first 3 emitted tokens follows the target's marginal
    (temperature, top-k and top-p applied to both sides), with the sampling ops' numbers from
    per-sequence generators or computed on the device from seeds and offsets (Philox)."""
    _, model = tiny
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    prompt = ngram_friendly_prompt(model, sp)
    B = 4000
    decoder = SpeculativeDecoder(model, SAMPLING_CASES[name](model), random_source=random_source)
    result = decoder.generate([prompt] * B, 3, num_draft_tokens=3, sampling=sp, seeds=list(range(B)))
    out = torch.tensor(result.tokens)
    assert out.shape == (B, 3)
    s = result.stats
    assert s.accepted_draft_tokens > 0.1 * s.sequence_steps  # drafts do get accepted
    for j, marginal in enumerate(exact_marginals(model, prompt, sp, 3)):
        assert chi_square_pvalue(out[:, j], marginal) > P_THRESHOLD, f"token {j}"


@pytest.mark.parametrize("random_source", ["generator", "philox"])
def test_sampling_depends_only_on_each_sequence_seed(tiny, random_source):
    _, model = tiny
    sp = SamplingParams(temperature=1.0)
    decoder = SpeculativeDecoder(model, LayerSkipDrafter(model, 2, tree_widths=(2,)), random_source=random_source)
    batch = decoder.generate(PROMPTS, 12, num_draft_tokens=3, sampling=sp, seeds=[7, 8, 9]).tokens
    alone = [
        decoder.generate([p], 12, num_draft_tokens=3, sampling=sp, seeds=[s]).tokens[0]
        for p, s in zip(PROMPTS, [7, 8, 9])
    ]
    assert batch == alone
    again = decoder.generate(PROMPTS, 12, num_draft_tokens=3, sampling=sp, seeds=[7, 8, 9]).tokens
    assert again == batch
    other = decoder.generate(PROMPTS, 12, num_draft_tokens=3, sampling=sp, seeds=[1, 2, 3]).tokens
    assert other != batch


@pytest.mark.parametrize("chain", [True, False], ids=["chain", "tree"])
def test_philox_source_moves_each_offset_past_its_own_numbers(tiny, chain):
    """random_source="philox": the ops get the sequences' seeds and offsets, each offset then
    moves past the max(C_b, 1) numbers its sequence used (C_b its drafts), and the tokens are
    not the generator source's (the numbers really come from elsewhere)."""
    _, model = tiny
    sp = SamplingParams(temperature=1.0, coupling="rejection")
    drafter = (lambda: NgramDrafter(2)) if chain else (lambda: LayerSkipDrafter(model, 2, tree_widths=(2, 2)))
    dec = SpeculativeDecoder(model, drafter(), random_source="philox")
    state = dec.start(PROMPTS, 16, sp, seeds=[11, 12, -13])
    # the keys are the sequences' generator seeds (seeds modulo 2**63)
    assert state.philox_seeds.tolist() == [11, 12, 2**63 - 13] and state.philox_offsets == [0, 0, 0]
    used = [0, 0, 0]
    for _ in range(4):
        before = [len(h) for h in state.histories]
        seen = {}
        real = rejection_sample if chain else tree_rejection_sample

        def spy(*args, **kwargs):
            seen.update(kwargs, drafts=args[3] if chain else args[4] - 1)  # C_b per sequence
            return real(*args, **kwargs)

        name = "rejection_sample" if chain else "tree_rejection_sample"
        with mock.patch.object(verify_module, name, spy):
            dec.step(state, 3)
        assert set(seen) >= {"seeds", "offsets"} and "uniform_samples" not in seen
        assert seen["offsets"].tolist() == used
        used = [u + max(c, 1) for u, c in zip(used, seen["drafts"].tolist())]
        assert state.philox_offsets == used
        assert all(len(h) > n for h, n in zip(state.histories, before))
    philox = SpeculativeDecoder(model, drafter(), random_source="philox").generate(
        PROMPTS, 16, 3, sp, seeds=[11, 12, 13]
    )
    generator = SpeculativeDecoder(model, drafter()).generate(PROMPTS, 16, 3, sp, seeds=[11, 12, 13])
    assert philox.tokens != generator.tokens


def test_random_source_is_checked(tiny):
    import numpy as np

    for bad in ("cuda", np.array(["philox"]), None):
        with pytest.raises(ValueError, match="random_source"):
            SpeculativeDecoder(tiny[1], random_source=bad)
    # a numpy integer is a seed like an int
    dec = SpeculativeDecoder(tiny[1])
    assert dec.generate(PROMPTS, 3, seeds=np.int64(5)).tokens == dec.generate(PROMPTS, 3, seeds=5).tokens


def test_one_token_prompt(tiny):
    """A prompt of one token has nothing to prefill: its first step feeds it as the root."""
    hf, model = tiny
    result = SpeculativeDecoder(model, LayerSkipDrafter(model, 2, tree_widths=(2,))).generate(
        [[64], PROMPTS[0]], 6, num_draft_tokens=3
    )
    assert result.tokens[0] == hf_greedy(hf, [64], 6)
    assert result.stats.prefill_passes == 1  # the longer prompt still prefills
    alone = SpeculativeDecoder(model, NgramDrafter()).generate([[64]], 6)
    assert alone.tokens[0] == result.tokens[0] and alone.stats.prefill_passes == 0


# ---------------------------------------------------------------------------- hostile input
class ScriptedDrafter(Drafter):
    """Returns whatever ``make(histories)`` builds: to test the engine's checks of a drafter's output."""

    name = "scripted"

    def __init__(self, make):
        self.make = make

    def propose(self, request):
        return self.make(request.histories)


BAD_DRAFTS = {
    "wrong_root": (lambda hs: Draft.from_lists([([h[-1] + 1, 3], [-1, 0]) for h in hs]), ValueError, "root"),
    "token_outside_vocab": (
        lambda hs: Draft.from_lists([([h[-1], V + 7], [-1, 0]) for h in hs]),
        ValueError,
        "vocabulary",
    ),
    "negative_token": (lambda hs: Draft.from_lists([([h[-1], -2], [-1, 0]) for h in hs]), ValueError, "vocabulary"),
    "no_root": (
        lambda hs: Draft(
            torch.zeros(len(hs), 1, dtype=torch.long),
            torch.full((len(hs), 1), -1),
            torch.zeros(len(hs), dtype=torch.long),
        ),
        ValueError,
        "num_nodes",
    ),
    "wrong_batch": (lambda hs: Draft.from_lists([([hs[0][-1]], [-1])]), ValueError, "B="),
    "not_a_draft": (lambda hs: None, TypeError, "Draft"),
    "parent_out_of_range": (
        lambda hs: Draft.from_lists([([h[-1], 3, 4], [-1, 0, 5]) for h in hs]),
        ValueError,
        "parents",
    ),
    "parent_after_child": (
        lambda hs: Draft.from_lists([([h[-1], 3, 4], [-1, 2, 0]) for h in hs]),
        ValueError,
        "parents",
    ),
    "root_with_parent": (
        lambda hs: Draft(
            torch.tensor([[h[-1], 3] for h in hs]), torch.tensor([[0, 0]] * len(hs)), torch.full((len(hs),), 2)
        ),
        ValueError,
        "parents",
    ),
    "float_tokens": (
        lambda hs: Draft(
            torch.tensor([[float(h[-1]), 3.0] for h in hs]),
            torch.tensor([[-1, 0]] * len(hs)),
            torch.full((len(hs),), 2),
        ),
        TypeError,
        "integers",
    ),
    # the embedding takes int64 / int32 ids only: other integer dtypes are named where drafts
    # enter the loop, not left to fail inside the embedding with an unnamed RuntimeError
    **{
        f"{dtype}_tokens".replace("torch.", ""): (
            lambda hs, dtype=dtype: Draft(
                torch.tensor([[h[-1], 3] for h in hs], dtype=dtype),
                torch.tensor([[-1, 0]] * len(hs)),
                torch.full((len(hs),), 2),
            ),
            TypeError,
            rf"Draft\.tokens must be int64 or int32 .*got {dtype}",
        )
        for dtype in (torch.uint8, torch.int8, torch.int16)
    },
    "int8_parents": (
        lambda hs: Draft(
            torch.tensor([[h[-1], 3] for h in hs]),
            torch.tensor([[-1, 0]] * len(hs), dtype=torch.int8),
            torch.full((len(hs),), 2),
        ),
        TypeError,
        r"Draft\.parents must be int64 or int32 .*got torch\.int8",
    ),
    "one_d_parents": (
        lambda hs: Draft(torch.tensor([[h[-1], 3] for h in hs]), torch.tensor([-1, 0]), torch.full((len(hs),), 2)),
        ValueError,
        "parents must have shape",
    ),
    "chain_flag_on_a_tree": (
        lambda hs: Draft(
            torch.tensor([[h[-1], 3, 4] for h in hs]),
            torch.tensor([[-1, 0, 0]] * len(hs)),
            torch.full((len(hs),), 3),
            None,
            True,
        ),
        ValueError,
        "is_chain",
    ),
    "probs_of_the_wrong_shape": (
        lambda hs: Draft(
            torch.tensor([[h[-1], 3] for h in hs]),
            torch.tensor([[-1, 0]] * len(hs)),
            torch.full((len(hs),), 2),
            torch.ones(len(hs), 2, 5),
        ),
        ValueError,
        "probs",
    ),
}


@pytest.mark.parametrize("case", list(BAD_DRAFTS), ids=list(BAD_DRAFTS))
def test_a_broken_drafter_is_named_not_obeyed(tiny, case):
    """A custom drafter's bad output raises an error naming the drafter instead of an embedding
    index error or, worse, a silently different output (a draft whose root is not the last
    committed token)."""
    _, model = tiny
    make, err, match = BAD_DRAFTS[case]
    decoder = SpeculativeDecoder(model, ScriptedDrafter(make))
    with pytest.raises(err, match=match) as info:
        decoder.generate(PROMPTS[:2], 4, num_draft_tokens=1)
    assert "scripted" in str(info.value)


def test_int32_drafts_are_taken_like_int64(tiny):
    """int32 tokens and parents (the other dtype the embedding takes) give the output of the
    same drafts in int64."""
    _, model = tiny

    def make(dtype):
        return lambda hs: Draft(
            torch.tensor([[h[-1], 3, 4] for h in hs], dtype=dtype),
            torch.tensor([[-1, 0, 0]] * len(hs), dtype=dtype),
            torch.full((len(hs),), 3, dtype=dtype),
            None,
            False,
        )

    out = {
        dtype: SpeculativeDecoder(model, ScriptedDrafter(make(dtype)))
        .generate(PROMPTS[:2], 4, num_draft_tokens=2)
        .tokens
        for dtype in (torch.int32, torch.int64)
    }
    assert out[torch.int32] == out[torch.int64]
    assert out[torch.int64] == SpeculativeDecoder(model, None).generate(PROMPTS[:2], 4).tokens


BAD_ARGUMENTS = {
    "float_k": (lambda d: d.generate(PROMPTS, 4, num_draft_tokens=2.5), TypeError, "num_draft_tokens"),
    "none_in_k_list": (lambda d: d.generate(PROMPTS, 4, num_draft_tokens=[1, None, 1]), TypeError, "num_draft_tokens"),
    "float_max_new": (lambda d: d.generate(PROMPTS, 2.5), TypeError, "max_new_tokens"),
    "float_prompt_token": (lambda d: d.generate([[1.5, 2]], 4), TypeError, "prompts"),
    "sampling_dict": (lambda d: d.generate(PROMPTS, 4, sampling={"temperature": 1.0}), TypeError, "sampling"),
    "string_seeds": (lambda d: d.generate(PROMPTS, 4, seeds="abc"), TypeError, "seeds"),
    "float_seed": (lambda d: d.generate(PROMPTS, 4, seeds=[1.7, 2, 3]), TypeError, "seeds"),
    "bool_seed": (lambda d: d.generate(PROMPTS, 4, seeds=[True, 2, 3]), TypeError, "seeds"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS), ids=list(BAD_ARGUMENTS))
def test_bad_generate_arguments_are_named(tiny, case):
    _, model = tiny
    call, err, match = BAD_ARGUMENTS[case]
    with pytest.raises(err, match=match):
        call(SpeculativeDecoder(model, NgramDrafter()))


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(drafter="ngram"), TypeError, "drafter"),
        (dict(stop_token_ids="12"), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=5), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=[3, V]), ValueError, "stop_token_ids"),
        (dict(stop_token_ids=[-5]), ValueError, "stop_token_ids"),
    ],
    ids=["drafter_string", "stop_string", "stop_int", "stop_past_vocab", "stop_negative"],
)
def test_bad_constructor_arguments_are_named(tiny, kwargs, err, match):
    _, model = tiny
    with pytest.raises(err, match=match):
        SpeculativeDecoder(model, **kwargs)


def test_numpy_and_tensor_integers_are_accepted(tiny):
    np = pytest.importorskip("numpy")
    _, model = tiny
    decoder = SpeculativeDecoder(model, NgramDrafter(), stop_token_ids=np.array([3]))
    want = decoder.generate(PROMPTS, 6, num_draft_tokens=2).tokens
    assert decoder.generate(PROMPTS, np.int64(6), num_draft_tokens=np.int64(2)).tokens == want
    assert decoder.generate(PROMPTS, torch.tensor([6, 6, 6]), num_draft_tokens=torch.tensor(2)).tokens == want


def test_ragged_limits_need_only_each_sequence_to_fit(tiny):
    """The position limit is per sequence (prompt + its max_new_tokens), not the longest prompt
    plus the largest limit of another sequence."""
    _, model = tiny
    positions = model.args.max_position
    long_prompt, short_prompt = [7] * (positions - 100), [1, 2]
    decoder = SpeculativeDecoder(model, NgramDrafter())
    result = decoder.generate([long_prompt, short_prompt], [1, positions - 100], num_draft_tokens=3)
    alone = decoder.generate([short_prompt], positions - 100, num_draft_tokens=3).tokens[0]
    assert len(result.tokens[0]) == 1 and result.tokens[1] == alone
    with pytest.raises(ValueError, match="positions"):
        decoder.generate([long_prompt], 101)


def test_forward_outside_inference_mode_works_and_matches(tiny, monkeypatch):
    """Transformer.forward called without torch.inference_mode (once: 'a leaf Variable that
    requires grad is being used in an in-place operation') gives the inference-mode logits."""
    _, model = tiny
    # the same paths for both calls (while a shape class is being measured, calls alternate)
    monkeypatch.setenv("SPECDEC_DENSE_ATTENTION", "native")
    sk.reset_backends()  # environment variables are read at import and on reset
    monkeypatch.setenv("SPECDEC_LINEAR", "f_linear")
    tok, pos = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
    lens = torch.tensor([0], dtype=torch.int32)
    plain = model(tok, pos, model.new_kv_cache(1, 16), lens)
    with torch.inference_mode():
        inside = model(tok, pos, model.new_kv_cache(1, 16), lens)
    assert not plain.requires_grad
    torch.testing.assert_close(plain, inside, rtol=0, atol=0)


def test_step_threads_are_measured_pinned_or_left_alone(tiny, monkeypatch):
    """threads="auto" times the candidate thread counts on the first steps of each shape class
    and reports the choice; an int pins the count; None leaves torch's; torch's setting comes
    back after the call either way; the tokens never depend on it."""
    from specdec_kernels.decoding.engine import loop as engine

    hf, model = tiny
    prompt = [5, 17, 33, 2, 9]
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = SpeculativeDecoder(model, None, threads=None).generate([prompt], 12, num_draft_tokens=0)
        assert want.stats.threads == {}
        auto = SpeculativeDecoder(model, None).generate([prompt], 12, num_draft_tokens=0)
        assert auto.tokens == want.tokens and torch.get_num_threads() == 2
        assert set(auto.stats.threads) == {"tokens<=1"} and auto.stats.threads["tokens<=1"] in (1, 2)
        pinned = SpeculativeDecoder(model, NgramDrafter(), threads=1).generate([prompt], 12, num_draft_tokens=3)
        assert pinned.tokens == want.tokens and pinned.stats.threads == {"all": 1} and torch.get_num_threads() == 2
        monkeypatch.setenv(engine.THREADS_ENV, "1")
        forced = SpeculativeDecoder(model, None).generate([prompt], 4, num_draft_tokens=0)
        assert forced.stats.threads == {"all": 1}
        monkeypatch.setenv(engine.THREADS_ENV, "many")
        with pytest.raises(ValueError, match="SPECDEC_ENGINE_THREADS"):
            SpeculativeDecoder(model, None).generate([prompt], 4, num_draft_tokens=0)
        monkeypatch.delenv(engine.THREADS_ENV)
        torch.set_num_threads(1)  # one thread: nothing to choose, nothing changed
        assert SpeculativeDecoder(model, None).generate([prompt], 4, num_draft_tokens=0).stats.threads == {}
    finally:
        torch.set_num_threads(saved)
    for bad in (0, -1, 2.0, True, "fast", 5000):
        with pytest.raises(ValueError, match="threads"):
            SpeculativeDecoder(model, None, threads=bad)
    # a step that raises still gives torch its thread count back
    try:
        torch.set_num_threads(2)
        decoder = SpeculativeDecoder(model, None, threads=1)

        def broken(state, k):
            assert torch.get_num_threads() == 1
            raise RuntimeError("a broken step")

        monkeypatch.setattr(decoder, "step", broken)
        with pytest.raises(RuntimeError, match="broken step"):
            decoder.generate([prompt], 4, num_draft_tokens=0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)
