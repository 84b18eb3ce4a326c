"""Tiny random-weight models of several transformers families (Llama, Llama with llama3 RoPE
scaling, Qwen2 with random q/k/v biases, Mistral), for the engine's ``from_hf`` tests and the
transformers integration's."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding.training.data import TINY_MODEL_SIZES

transformers = pytest.importorskip("transformers")

COMMON = {
    **TINY_MODEL_SIZES,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}
PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 5, 17, 33], [64, 3], [12, 99, 8, 12, 99, 8, 12, 99, 101, 4, 12]]


def family_config(name: str, **overrides):
    """The transformers config of a tiny model of family ``name`` ("llama", "llama3-rope", "qwen2"
    or "mistral")."""
    kw = {**COMMON, **overrides}
    if name == "llama":
        return transformers.LlamaConfig(**{"tie_word_embeddings": True, **kw})
    if name == "llama3-rope":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        return transformers.LlamaConfig(**{"rope_parameters": rope, **kw})
    if name == "qwen2":
        return transformers.Qwen2Config(**{"tie_word_embeddings": False, **kw})
    if name == "mistral":
        return transformers.MistralConfig(
            **{"head_dim": 32, "sliding_window": None, "tie_word_embeddings": False, **kw}
        )
    raise ValueError(name)


def tiny_family(name: str, seed: int = 0):
    """A random-weight transformers causal LM of family ``name`` (eval mode); a Qwen2's q/k/v
    biases are drawn at random too (transformers initialises biases to zero)."""
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(family_config(name)).eval()
    if name == "qwen2":
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    return hf


def logit_scale(ref: torch.Tensor) -> float:
    """Logits are sums over the hidden size of products of O(1) values: rounding errors grow with
    their magnitude, so the table's tolerances are applied relative to max |logit| (>= 1)."""
    return max(1.0, ref.abs().max().item())
