"""Layer-skip drafting on the target's own KV cache (``DraftRun.target_kv_cache``, taken by
``ModelDrafter`` at the start of a run; ``shares_target_cache``).

A drafter whose layers are the target's first layers reads the keys and values the target
already wrote for every committed token: it feeds no prompt, keeps no cache, and its draft
nodes go to slots the target's verification pass overwrites.  The output never changes:
greedy runs give plain greedy's tokens, seeded sampling runs give the same tokens as the
drafter on a cache of its own (the Gumbel coupling makes every token the target's own
sample), dense and paged, chain and tree.
"""

from __future__ import annotations

import copy

import pytest

from specdec_kernels.decoding import (
    DraftModelDrafter,
    LayerSkipDrafter,
    NgramDrafter,
    SamplingParams,
    SpeculativeDecoder,
)
from specdec_kernels.decoding.drafters.multi import MultiDrafter
from tests.engine.drive import start
from tests.engine.tiny import tiny  # noqa: F401 (fixture)
from tests.utils import one_thread  # noqa: F401 (fixture)

PROMPTS = [[3, 17, 5, 9, 2, 44, 8], [60, 1], [12, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
NEW = 18


def _run(model, drafter, *, block_size=None, sampling=None, seeds=None, k=3):
    decoder = SpeculativeDecoder(model, drafter, block_size=block_size)
    return decoder.generate(PROMPTS, NEW, num_draft_tokens=k, sampling=sampling, seeds=seeds)


@pytest.mark.parametrize("block_size", [None, 5], ids=["dense", "paged5"])
@pytest.mark.parametrize("widths", [None, (2, 2)], ids=["chain", "tree"])
def test_greedy_on_the_target_cache_equals_plain_and_feeds_no_prompt(tiny, one_thread, block_size, widths):  # noqa: F811
    model = tiny[1]
    plain = SpeculativeDecoder(model, block_size=block_size).generate(PROMPTS, NEW)
    shared_drafter = LayerSkipDrafter(model, 2, tree_widths=widths)
    own_drafter = LayerSkipDrafter(model, 2, tree_widths=widths, share_target_cache=False)
    shared, own = _run(model, shared_drafter, block_size=block_size), _run(model, own_drafter, block_size=block_size)
    assert shared.tokens == plain.tokens and own.tokens == plain.tokens
    assert shared_drafter.cache is not None and shared_drafter.kv_cache_bytes == 0
    assert own_drafter.kv_cache_bytes > 0
    # no KV cache beyond the target's
    assert shared.stats.kv_cache_bytes == plain.stats.kv_cache_bytes < own.stats.kv_cache_bytes
    # the drafter on its own cache fed every prompt (all but its root) first; on the target's, none
    prompt_tokens = sum(len(p) - 1 for p in PROMPTS)
    assert shared.stats.draft_model_tokens + prompt_tokens <= own.stats.draft_model_tokens
    # each step feeds the root and the tree's levels below it, nothing more
    nodes = 1 + (3 if widths is None else 2 + 4 + 4)  # a chain of K=3, or (2, 2) then chains
    assert shared.stats.draft_model_tokens <= shared.stats.target_passes * len(PROMPTS) * nodes


@pytest.mark.parametrize("block_size", [None, 7], ids=["dense", "paged7"])
def test_seeded_sampling_on_the_target_cache_is_unchanged(tiny, one_thread, block_size):  # noqa: F811
    model = tiny[1]
    sp = SamplingParams(temperature=0.9, top_k=30)
    seeds = [5, 6, 7]
    plain = SpeculativeDecoder(model, block_size=block_size).generate(PROMPTS, NEW, sampling=sp, seeds=seeds)
    for share in (True, False):
        drafter = LayerSkipDrafter(model, 2, tree_widths=(2,), share_target_cache=share)
        result = _run(model, drafter, block_size=block_size, sampling=sp, seeds=seeds)
        assert result.tokens == plain.tokens, share


def test_a_truncated_draft_model_shares_a_copied_one_does_not(tiny, one_thread):  # noqa: F811
    model = tiny[1]
    plain = SpeculativeDecoder(model).generate(PROMPTS, NEW)
    truncated = DraftModelDrafter(model.truncated(1), tree_widths=(2,))
    copied = DraftModelDrafter(copy.deepcopy(model.truncated(1)), tree_widths=(2,))
    assert _run(model, truncated).tokens == plain.tokens
    assert _run(model, copied).tokens == plain.tokens
    assert truncated.kv_cache_bytes == 0 and copied.kv_cache_bytes > 0


def test_taking_the_target_cache_checks_the_modules(tiny):  # noqa: F811
    model = tiny[1]
    cache = model.new_kv_cache(1, 8)

    def shares(drafter, target, kv_cache) -> bool:
        start(drafter, [[1, 2]], capacity=8, target=target, target_kv_cache=kv_cache)
        return drafter.shares_target_cache

    drafter = LayerSkipDrafter(model, 2)
    assert drafter.shares_target_cache is False  # before any run
    assert shares(drafter, model, cache) is True and drafter.cache is cache
    assert shares(drafter, model, None) is False
    assert shares(drafter, None, cache) is False
    assert shares(drafter, copy.deepcopy(model), cache) is False  # equal weights, other modules
    assert shares(LayerSkipDrafter(model, 2, share_target_cache=False), model, cache) is False


def test_one_sub_drafter_of_a_multi_drafter_shares(tiny, one_thread):  # noqa: F811
    """Two layer-skip sub-drafters would write draft nodes into the same slots: the first
    that can share takes the target's cache, the other keeps its own."""
    model = tiny[1]
    plain = SpeculativeDecoder(model).generate(PROMPTS, NEW)
    first, second = LayerSkipDrafter(model, 1, tree_widths=(2,)), LayerSkipDrafter(model, 2)
    multi = MultiDrafter([NgramDrafter(), first, second])
    assert _run(model, multi).tokens == plain.tokens
    assert first.kv_cache_bytes == 0 and second.kv_cache_bytes > 0
    assert first.shares_target_cache and not second.shares_target_cache and multi.shares_target_cache
    ensemble = MultiDrafter([LayerSkipDrafter(model, 1), LayerSkipDrafter(model, 2)], ensemble=True)
    assert _run(model, ensemble).tokens == plain.tokens


def test_a_drafter_moved_to_another_target_stops_sharing(tiny, one_thread):  # noqa: F811
    model = tiny[1]
    other = copy.deepcopy(model)
    drafter = LayerSkipDrafter(model, 2, tree_widths=(2,))
    assert _run(model, drafter).tokens == SpeculativeDecoder(model).generate(PROMPTS, NEW).tokens
    assert drafter.kv_cache_bytes == 0
    # the same drafter object, now under another target with equal weights: a cache of its own
    assert _run(other, drafter).tokens == SpeculativeDecoder(other).generate(PROMPTS, NEW).tokens
    assert drafter.kv_cache_bytes > 0
