"""Lossless in every numerics, batch, layout and tree size: a property test of whole generations.

A sequence's tokens must not depend on how its passes were shaped: the batch it runs in (prompts
of mixed lengths are padded to the longest in the prefill), the KV-cache layout (dense, or paged
with any block size), the prefill chunk, or the size of the token trees verified (up to the
decoder's ``max_draft_nodes``, past the one-call layer's 64 rows).  Here, for random draws of
(numerics, batch, layout, block size, prefill chunk, tree size, drafter), every sequence's greedy
tokens equal its own plain greedy decoding alone, on a dense cache, prefilled in one chunk; and a
seeded sampling run (the Gumbel coupling) equals plain sampling alone with the same seed.

The tiny model's weights are rounded to GGUF codes, so every CPU path of the real model applies:
the packed float32 kernel, the int8 products, the one-call layer and the Python layer.  The same
property on SmolLM2 (int8, batch 4 of mixed lengths, paged and dense, a 96-node EAGLE tree) runs
where the model package is installed.
"""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

import pytest
import torch

from specdec_kernels.decoding import Draft, Drafter, NgramDrafter, SamplingParams, SpeculativeDecoder, Transformer
from specdec_kernels.decoding.drafters.eagle import EagleDrafter, EagleHead
from specdec_kernels.decoding.drafters.model_drafter import LayerSkipDrafter
from tests.engine.tiny import real_only, snap_to_gguf_codes, tiny_llama

pytestmark = pytest.mark.requires_native_op("decoder_layer")  # the paths under test need the extension

NEW_TOKENS = 12
SAMPLING = SamplingParams(temperature=0.9, top_k=20)


def mixed_prompts(vocab: int) -> List[List[int]]:
    """Prompts of 2 to 100 tokens (one past the one-call layer's 64 rows), some repetitive (so
    that prompt lookup drafts), seeded."""
    g = torch.Generator().manual_seed(11)
    rand = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (2, 9, 100, 23, 70)]
    return rand + [[12, 99, 8, 12, 99, 8, 12, 99, 101, 4, 12], [5, 6, 7, 5, 6, 7, 5, 6]]


class TreeOracleDrafter(Drafter):
    """Random token trees of up to ``max_size`` nodes that contain the known continuation of each
    sequence as one branch, at a random depth: long accepted paths inside wide trees, the
    largest verification passes a drafter can cause.  Deterministic drafts (no ``probs``)."""

    name = "tree-oracle"

    def __init__(self, prompts: List[List[int]], futures: List[List[int]], max_size: int, seed: int):
        self.prompts, self.futures, self.max_size = prompts, futures, max_size
        self.rng = random.Random(seed)
        self.vocab = max(max(p) for p in prompts) + 1

    def propose(self, request):
        trees = []
        for b, h in enumerate(request.histories):
            done = len(h) - len(self.prompts[b])
            true = self.futures[b][done : done + self.rng.randint(0, 10)]
            tokens, parents = [h[-1]] + true, [-1] + list(range(len(true)))
            size = self.rng.randint(len(tokens), max(len(tokens), self.max_size))
            while len(tokens) < size:
                parents.append(self.rng.randrange(len(tokens)))
                tokens.append(self.rng.randrange(self.vocab))
            trees.append((tokens, parents))
        return Draft.from_lists(trees, is_chain=False)


@pytest.fixture(scope="module")
def coded():
    """The tiny Llama (3 layers, vocab 111) with GGUF-coded weights: every product packed."""
    hf = tiny_llama()
    snap_to_gguf_codes(hf)
    model = Transformer.from_hf_model(hf)
    assert set(model.pack_weights().values()) == {"affine4", "scaled8"}
    return model


def alone(model, prompt, numerics, sampling=None, seed=None) -> List[int]:
    """The reference: the prompt alone, dense cache, one prefill chunk, no drafts."""
    model.numerics = numerics
    dec = SpeculativeDecoder(model, None, prefill_chunk=4096)
    return dec.generate([prompt], NEW_TOKENS, 0, sampling=sampling, seeds=None if seed is None else [seed]).tokens[0]


DRAFTERS = ("tree-oracle", "ngram-tree", "eagle-tree-96", "layerskip-tree")


def make_drafter(name: str, model, prompts, futures, max_nodes: int, seed: int) -> Drafter:
    if name == "tree-oracle":
        return TreeOracleDrafter(prompts, futures, max_nodes, seed)
    if name == "ngram-tree":
        return NgramDrafter(tree=True)
    if name == "eagle-tree-96":
        head = EagleHead(model.args.hidden_size, 4, 2, 16, 96, window=16)
        return EagleDrafter(model, head, tree=True, top_k=8, max_nodes=96, size_by_cost=False)
    return LayerSkipDrafter(model, 2, tree_widths=(4, 3, 2), deterministic=True)


def draws(count: int, seed: int) -> List[Dict]:
    """``count`` random configurations of everything that shapes a pass."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        block = rng.choice([None, 1, 3, 4, 16])
        out.append(
            {
                "numerics": ("float32", "int8")[i % 2],
                "batch": rng.sample(range(7), rng.randint(2, 4)),
                "block_size": block,
                "share_prefix": block is not None and rng.random() < 0.3,
                "prefill_chunk": rng.choice([5, 32, 64, 4096]),
                "max_draft_nodes": rng.choice([8, 65, 128]),
                "drafter": DRAFTERS[i % len(DRAFTERS)],
                "k": rng.randint(1, 8),
                "seed": rng.randrange(1 << 16),
            }
        )
    return out


def run_config(model, prompts, futures, cfg, sampling=None, seeds=None) -> Tuple[List[List[int]], object]:
    model.numerics = cfg["numerics"]
    batch = [prompts[i] for i in cfg["batch"]]
    drafter = make_drafter(
        cfg["drafter"], model, batch, [futures[i] for i in cfg["batch"]], cfg["max_draft_nodes"], cfg["seed"]
    )
    dec = SpeculativeDecoder(
        model,
        drafter,
        prefill_chunk=cfg["prefill_chunk"],
        max_draft_nodes=cfg["max_draft_nodes"],
        block_size=cfg["block_size"],
        share_prefix=cfg["share_prefix"],
    )
    result = dec.generate(batch, NEW_TOKENS, cfg["k"], sampling=sampling, seeds=seeds)
    return result.tokens, result.stats


CONFIGS = draws(16, seed=2026)


def _ids(cfg):
    layout = (
        "dense" if cfg["block_size"] is None else f"paged{cfg['block_size']}" + ("s" if cfg["share_prefix"] else "")
    )
    return f"{cfg['numerics']}-{cfg['drafter']}-B{len(cfg['batch'])}-{layout}-chunk{cfg['prefill_chunk']}-max{cfg['max_draft_nodes']}"


@pytest.fixture(scope="module")
def references(coded):
    """Each prompt's greedy and seeded-sampling tokens alone, per numerics."""
    prompts = mixed_prompts(coded.args.vocab_size)
    ref = {}
    try:
        for numerics in ("float32", "int8"):
            ref[numerics, "greedy"] = [alone(coded, p, numerics) for p in prompts]
            ref[numerics, "sampled"] = [alone(coded, p, numerics, SAMPLING, 300 + i) for i, p in enumerate(prompts)]
    finally:
        coded.numerics = "float32"
    return prompts, ref


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_greedy_tokens_do_not_depend_on_batch_layout_chunks_or_tree_size(coded, references, cfg):
    prompts, ref = references
    greedy = ref[cfg["numerics"], "greedy"]
    try:
        tokens, stats = run_config(coded, prompts, greedy, cfg)
    finally:
        coded.numerics = "float32"
    assert tokens == [greedy[i] for i in cfg["batch"]]
    assert stats.draft_tokens > 0  # drafts were verified, not only plain steps
    if cfg["drafter"] == "tree-oracle":
        assert stats.accepted_draft_tokens > 0  # and long accepted paths were taken


@pytest.mark.parametrize("cfg", CONFIGS[::3], ids=_ids)
def test_seeded_sampling_does_not_depend_on_batch_layout_chunks_or_tree_size(coded, references, cfg):
    prompts, ref = references
    sampled = ref[cfg["numerics"], "sampled"]
    seeds = [300 + i for i in cfg["batch"]]
    try:
        tokens, stats = run_config(coded, prompts, sampled, cfg, SAMPLING, seeds)
    finally:
        coded.numerics = "float32"
    assert tokens == [sampled[i] for i in cfg["batch"]]
    assert stats.draft_tokens > 0


def test_the_draws_cover_every_dimension():
    """The configurations above reach every value of every dimension they vary (so that a
    change of ``draws`` cannot quietly drop one)."""
    seen = {key: {str(c[key]) for c in CONFIGS} for key in ("numerics", "block_size", "prefill_chunk", "drafter")}
    assert seen["numerics"] == {"float32", "int8"}
    assert seen["block_size"] >= {"None", "1", "4", "16"}
    assert seen["prefill_chunk"] >= {"5", "32", "4096"}
    assert seen["drafter"] == set(DRAFTERS)
    assert {c["max_draft_nodes"] for c in CONFIGS} >= {65, 128}
    assert any(2 in c["batch"] for c in CONFIGS)  # the 100-token prompt batched


# ---------------------------------------------------------------------------- the real model
@pytest.mark.slow
@real_only
def test_real_model_int8_batch_paged_and_96_node_eagle_tree_equal_greedy_alone():
    """SmolLM2 in int8: a batch of 4 prompts of mixed lengths, dense and paged (block size 16),
    verified with the shipped EAGLE head's 96-node trees, gives each prompt's own greedy tokens."""
    from specdec_kernels.decoding import load_smollm2
    from specdec_kernels.decoding.prompts import spec_bench_prompt
    from specdec_kernels.decoding.training.data import chat_ids

    model, tok = load_smollm2()
    model.numerics = "int8"
    try:
        texts = [spec_bench_prompt(q) for q in (81, 121, 141, 161)]
        prompts = [chat_ids(tok, t) for t in texts]
        prompts[0] = prompts[0][:20]  # mixed lengths: one short prompt beside long ones
        greedy = [SpeculativeDecoder(model, None).generate([p], 24, 0).tokens[0] for p in prompts]
        for block in (None, 16):
            drafter = EagleDrafter(model, None, tree=True, max_nodes=96, size_by_cost=False)
            dec = SpeculativeDecoder(model, drafter, block_size=block, max_draft_nodes=128)
            result = dec.generate(prompts, 24, 8)
            assert result.tokens == greedy, block
            assert result.stats.accepted_draft_tokens > 0
    finally:
        model.numerics = "float32"
