"""``Transformer.from_hf`` / ``from_hf_model`` on tiny random models of several transformers
families: Llama (tied head, GQA), Llama with llama3 RoPE scaling, Qwen2 (random q/k/v
biases, untied head) and Mistral (head_dim != hidden / heads, no sliding window).

Our forward equals transformers' (prefill and a ragged tree verify step) within the
tolerance table; greedy decoding with ``SpeculativeDecoder`` (plain, n-gram tree, layer-skip
chain) equals transformers' ``generate(do_sample=False)``; every config or state dict the
engine cannot run exactly raises (ValueError naming the setting, KeyError for a missing
weight), never a silently different model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specdec_kernels.decoding import LayerSkipDrafter, NgramDrafter, SpeculativeDecoder, Transformer
from specdec_kernels.decoding.model import unsupported_hf_config
from tests.engine.families import COMMON, PROMPTS, family_config, logit_scale, tiny_family
from tests.engine.tiny import tree_step_and_paths
from tests.utils import TOLERANCES, assert_close, one_thread  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "llama3-rope", "qwen2", "mistral"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(name, transformers model, our Transformer) sharing the weights."""
    hf = tiny_family(request.param)
    return request.param, hf, Transformer.from_hf_model(hf)


# ---------------------------------------------------------------------------- the forward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_logits_match_transformers(family, dtype):
    name, hf, _ = family
    hf_d = copy.deepcopy(hf).to(dtype)  # (never .to() the shared model: ours holds its tensors)
    model = Transformer.from_hf_model(hf_d, dtype=dtype)
    x = torch.tensor([PROMPTS[0] + [1, 2], PROMPTS[2] + [3]])
    with torch.inference_mode():
        ref = hf_d(x).logits.float()
        cache = model.new_kv_cache(2, 16)
        first = model(x[:, :7], torch.arange(7).expand(2, 7), cache, torch.zeros(2, dtype=torch.int32))
        rest = model(x[:, 7:], torch.arange(7, 12).expand(2, 5), cache, torch.full((2,), 7, dtype=torch.int32))
        ours = torch.cat([first, rest], dim=1)
        if dtype != torch.float32:
            exact = hf(x).logits
    if dtype == torch.float32:
        assert_close(ours, ref, dtype, scale=logit_scale(ref))
    else:
        # In bf16 the two implementations round differently (fused q/k/v, a bias added after
        # the matmul rather than inside it, chunked prefill), and a random 2-layer model
        # amplifies one rounding into more than the table's bf16 bound of a logit.  The
        # contract: ours is as accurate as transformers' own bf16 run, measured against the
        # fp32 model (error at most 2x transformers' plus the table's bf16 tolerance).
        ours_err = (ours - exact).abs().max().item()
        hf_err = (ref - exact).abs().max().item()
        assert ours_err <= 2 * hf_err + TOLERANCES[dtype]["atol"] * logit_scale(exact), (ours_err, hf_err)


def test_tree_step_matches_transformers_paths(family):
    """A tree verify step on ragged cache lengths equals transformers on every root-to-node path."""
    name, hf, model = family
    parents = [-1, 0, 0, 1, 1, 3, 2]
    prompts = [PROMPTS[0], PROMPTS[2]]
    trees = torch.tensor([[0, 3, 50, 3, 60, 61, 9], [0, 4, 5, 6, 7, 8, 9]])
    for ours, ref in tree_step_and_paths(hf, model, prompts, trees, parents):
        assert_close(ours, ref, torch.float32, scale=logit_scale(ref))


def test_qwen2_biases_are_used():
    """The Qwen2 biases change the logits (so the family test above is not vacuous)."""
    hf = tiny_family("qwen2")
    sd = {k: (torch.zeros_like(v) if k.endswith("_proj.bias") else v) for k, v in hf.state_dict().items()}
    with_bias = Transformer.from_hf_model(hf)
    without = Transformer.from_hf(hf.config, sd)
    assert with_bias.layers[0].wqkv.bias is not None and with_bias.layers[0].wqkv.bias.abs().sum() > 0
    x = torch.tensor([PROMPTS[0]])
    pos = torch.arange(x.shape[1])[None]
    a = with_bias(x, pos, with_bias.new_kv_cache(1, 16), torch.zeros(1, dtype=torch.int32))
    b = without(x, pos, without.new_kv_cache(1, 16), torch.zeros(1, dtype=torch.int32))
    assert (a - b).abs().max() > 1e-2


def test_no_bias_models_have_no_bias():
    for name in ("llama", "mistral"):
        model = Transformer.from_hf_model(tiny_family(name))
        assert all(layer.wqkv.bias is None for layer in model.layers)


# ---------------------------------------------------------------------------- greedy decoding
def hf_generate(hf, prompt, n):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("drafter", ["plain", "ngram-tree", "layerskip"])
def test_greedy_matches_generate(family, drafter):
    name, hf, model = family
    expected = [hf_generate(hf, p, 16) for p in PROMPTS]
    d = {"plain": None, "ngram-tree": NgramDrafter(tree=True), "layerskip": LayerSkipDrafter(model, 1)}[drafter]
    result = SpeculativeDecoder(model, d).generate(PROMPTS, 16, num_draft_tokens=4)
    assert result.tokens == expected


# ---------------------------------------------------------------------------- refusals
UNSUPPORTED = {
    "llama-attention-bias": ("llama", dict(attention_bias=True), "attention_bias"),
    "llama-mlp-bias": ("llama", dict(mlp_bias=True), "mlp_bias"),
    "llama-gelu": ("llama", dict(hidden_act="gelu"), "hidden_act"),
    "llama-dynamic-rope": (
        "llama",
        dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
        "rope_type",
    ),
    "llama-longrope": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64,
            }
        ),
        "rope_type",
    ),
    "llama-head-dim-24": ("llama", dict(head_dim=24), "head_dim"),
    "mistral-sliding-window": ("mistral", dict(sliding_window=16), "sliding_window"),
    "qwen2-sliding-window": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
        "sliding_window",
    ),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_config_raises(case):
    family_name, overrides, word = UNSUPPORTED[case]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(family_config(family_name, **overrides)).eval()
    assert any(word in p for p in unsupported_hf_config(hf.config))
    with pytest.raises(ValueError, match=word):
        Transformer.from_hf_model(hf)


def test_other_model_types_raise():
    for cfg in (transformers.GemmaConfig(**{**COMMON, "head_dim": 16}), transformers.Phi3Config(**COMMON)):
        with pytest.raises(ValueError, match="model_type"):
            Transformer.from_hf(cfg, {})


def test_window_covering_every_position_is_accepted():
    """A Mistral whose sliding window is at least max_position_embeddings never slides: exact."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(family_config("mistral", sliding_window=256)).eval()
    model = Transformer.from_hf_model(hf)
    assert SpeculativeDecoder(model).generate([PROMPTS[0]], 8).tokens[0] == hf_generate(hf, PROMPTS[0], 8)


def test_state_dict_problems_raise():
    llama = tiny_family("llama")
    sd = dict(llama.state_dict())
    # a bias a Llama has no place for
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        Transformer.from_hf(llama.config, {**sd, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    # an o_proj bias on a Qwen2
    qwen = tiny_family("qwen2")
    qsd = dict(qwen.state_dict())
    with pytest.raises(ValueError, match=r"o_proj\.bias"):
        Transformer.from_hf(qwen.config, {**qsd, "model.layers.1.self_attn.o_proj.bias": torch.zeros(64)})
    # a Qwen2 without its biases
    with pytest.raises(KeyError, match=r"q_proj\.bias"):
        Transformer.from_hf(qwen.config, {k: v for k, v in qsd.items() if not k.endswith("q_proj.bias")})
    # more layers than the config
    extra = {k.replace("layers.1.", "layers.2."): v for k, v in sd.items() if "layers.1." in k}
    with pytest.raises(ValueError, match=r"model\.layers\.2\."):
        Transformer.from_hf(llama.config, {**sd, **extra})
    # tied head that differs from the embeddings
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        Transformer.from_hf(llama.config, {**sd, "lm_head.weight": sd["model.embed_tokens.weight"] + 1})
    # an untied model without its head (no silent fallback to the embeddings)
    with pytest.raises(KeyError, match="lm_head"):
        Transformer.from_hf(qwen.config, {k: v for k, v in qsd.items() if k != "lm_head.weight"})
    # a tied model's state dict without lm_head is fine (the head is the embeddings)
    Transformer.from_hf(llama.config, {k: v for k, v in sd.items() if k != "lm_head.weight"})
    # old checkpoints' rotary buffers are not weights
    Transformer.from_hf(llama.config, {**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})


def test_non_causal_lm_heads_raise():
    torch.manual_seed(0)
    clf = transformers.Qwen2ForSequenceClassification(family_config("qwen2", num_labels=3)).eval()
    with pytest.raises((ValueError, KeyError)):
        Transformer.from_hf_model(clf)
    with pytest.raises(TypeError, match="hf_model"):
        Transformer.from_hf_model(object())
