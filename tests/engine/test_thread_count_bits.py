"""The thread count never changes a bit: SmolLM2's passes and whole generations at 1, 2 and 3
intra-op threads, float32 and int8 numerics.

Every product and layer path splits its work by output rows with a fixed reduction order, so
a row never depends on how many threads computed it (issue #56).  Checked here on the real
model: the logits of a chunked prefill, a one-token pass, a chain and a tree pass over a
dense and a paged KV cache; and whole generations with every drafter, whose drafts (and so
their accepted counts, not only the tokens, which speculation keeps equal anyway) must not
move with the thread count either.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import SpeculativeDecoder
from specdec_kernels.decoding.paged import CacheLayout, PagedKVCache
from specdec_kernels.tree import ancestor_mask
from tests.engine.test_real_model import DRAFTERS, HEAD_DRAFTERS, PROMPTS, chat, real  # noqa: F401 (fixture)
from tests.engine.tiny import real_only

pytestmark = real_only

THREADS = (1, 2, 3)
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3]


@pytest.fixture()
def restore_torch_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def _passes(model, prompt, paged: bool):
    """Logits of: the prompt's prefill in chunks of 16 (every row), then a one-token pass, a
    chain of 4 and a 7-node tree after it, each from the same cache length."""
    n = len(prompt)
    capacity = n + 16
    if paged:
        cache = PagedKVCache.allocate(model, [[]], capacity, CacheLayout(paged=True, block_size=16))
    else:
        cache = model.new_kv_cache(1, capacity)
    out = []
    for c in range(0, n, 16):
        block = torch.tensor([prompt[c : c + 16]])
        pos = torch.arange(c, c + block.shape[1])[None]
        out.append(model(block, pos, cache, torch.tensor([c], dtype=torch.int32)))
    base = torch.tensor([n], dtype=torch.int32)
    follow = [prompt[i % n] for i in range(7)]
    out.append(model(torch.tensor([follow[:1]]), torch.tensor([[n]]), cache, base))
    out.append(model(torch.tensor([follow[:4]]), torch.arange(n, n + 4)[None], cache, base))
    depths = [0, 1, 1, 2, 2, 2, 3]
    mask = ancestor_mask(TREE_PARENTS)
    out.append(model(torch.tensor([follow]), (n + torch.tensor(depths))[None], cache, base, mask))
    return out


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("numerics", ["float32", "int8"])
def test_pass_logits_identical_at_1_2_3_threads(real, numerics, paged, restore_torch_threads):  # noqa: F811
    model, _, tok = real
    prompt = chat(tok, PROMPTS["code-edit"])
    saved = model.numerics
    model.numerics = numerics
    try:
        runs = {}
        for t in THREADS:
            torch.set_num_threads(t)
            runs[t] = _passes(model, prompt, paged)
    finally:
        model.numerics = saved
    assert len(runs[1]) >= 4
    for t in THREADS[1:]:
        for i, (a, b) in enumerate(zip(runs[1], runs[t])):
            assert torch.equal(a, b), f"{numerics}, pass {i}: 1 thread against {t}"


# every drafter in int8 (the numerics whose products have the most paths), two also in
# float32 (the pass tests above cover float32's paths)
GENERATIONS = [(name, "int8") for name in list(DRAFTERS) + list(HEAD_DRAFTERS)] + [
    (name, "float32") for name in ("layerskip-tree", "lookahead")
]


@pytest.mark.parametrize("name,numerics", GENERATIONS)
def test_generations_identical_at_1_2_3_threads(real, numerics, name, restore_torch_threads):  # noqa: F811
    model, _, tok = real
    prompt = chat(tok, PROMPTS["code-edit"])
    make = {**DRAFTERS, **HEAD_DRAFTERS}[name]
    saved = model.numerics
    model.numerics = numerics
    try:
        torch.set_num_threads(max(THREADS))
        runs = {}
        for t in THREADS:
            decoder = SpeculativeDecoder(model, make(model), stop_token_ids=[tok.eos_token_id], threads=t)
            # seeded: lookahead's fresh guesses are drawn from the request's generator
            r = decoder.generate([prompt], 20, num_draft_tokens=3, seeds=[1234])
            assert r.stats.threads == {"all": t}, r.stats.threads
            runs[t] = (r.tokens, r.stats.draft_tokens, r.stats.accepted_draft_tokens, r.stats.target_passes)
    finally:
        model.numerics = saved
    assert runs[1][1] > 0  # it drafted
    for t in THREADS[1:]:
        assert runs[t] == runs[1], f"{name}, {numerics}: 1 thread against {t}"
