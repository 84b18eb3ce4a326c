"""docs/API.md's decode loop over a transformers model, run as written (issue #58): a tiny
random Llama with weights large enough (initializer_range=0.1) that a wrong rotary position
changes the tokens; greedy chains and trees equal transformers' generate, seeded sampling is
reproducible and, at a vanishing temperature, greedy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

API_MD = Path(__file__).resolve().parents[1] / "docs" / "API.md"
PROMPTS = [
    [5, 17, 33, 2, 90, 41, 7, 5, 17, 33, 2, 90],  # repeats: prompt lookup finds drafts
    [12, 99, 8, 12, 99, 8, 12, 99, 101, 4, 12],
    [64, 3],
]
NEW = 24


def loop_namespace():
    """The Python block of docs/API.md's "A decode loop over a transformers model", executed."""
    text = API_MD.read_text()
    section = text[text.index("## A decode loop over a transformers model") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")]
    namespace = {"__name__": "api_md_loop"}
    exec(compile(code, str(API_MD), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=111,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def loop():
    return loop_namespace()


_REFERENCE = {}


def reference(model, prompt):
    """transformers' greedy generate, on its own attention (sdpa); once per prompt."""
    if tuple(prompt) in _REFERENCE:
        return _REFERENCE[tuple(prompt)]
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    _REFERENCE[tuple(prompt)] = out[0, len(prompt) :].tolist()
    return _REFERENCE[tuple(prompt)]


@pytest.mark.parametrize("width", [1, 2, 3], ids=["chain", "tree2", "tree3"])
def test_greedy_loop_equals_generate(model, loop, width):
    for prompt in PROMPTS:
        want = reference(model, prompt)
        assert loop["generate"](model, prompt, NEW, width=width, k=4) == want, prompt


def test_the_loop_drafts_trees_and_gets_drafts_accepted(model, loop, monkeypatch):
    """The loop is exercised: trees with branching are drafted and some drafts accepted (a
    loop that never speculated would pass the test above trivially)."""
    seen = {"branching": 0, "accepted": 0}
    verify = loop["sk"].verify_tree_greedy

    def counting(logits, t, p):
        out, nodes, n = verify(logits, t, p)
        parents = p[0].tolist()
        seen["branching"] += any(parents[i] != i - 1 for i in range(1, len(parents)))
        seen["accepted"] += int(n.sum())
        return out, nodes, n

    monkeypatch.setattr(loop["sk"], "verify_tree_greedy", counting)
    for prompt in PROMPTS:
        loop["generate"](model, prompt, NEW, width=2, k=4)
    assert seen["branching"] > 0 and seen["accepted"] > 0, seen


def test_a_wrong_position_rule_changes_the_tokens(model, loop, monkeypatch):
    """The weights notice a wrong position: cache_seqlens - 1 + depth (the rule tree_depths'
    docstring used to give) in the decode steps leaves generate's tokens.  (The prefill keeps
    its positions: a shift of every position would change nothing, rotary being relative.)"""
    depths, step = loop["tree_depths"], loop["STEP"]
    monkeypatch.setitem(loop, "tree_depths", lambda p: depths(p) - int(int(step["lens"][0]) > 0))
    wrong = [loop["generate"](model, prompt, NEW, width=2, k=4) for prompt in PROMPTS]
    assert any(w != reference(model, prompt) for w, prompt in zip(wrong, PROMPTS))


@pytest.mark.parametrize("width", [1, 2], ids=["chain", "tree"])
def test_seeded_sampling_is_reproducible_and_greedy_at_a_vanishing_temperature(model, loop, width):
    gen = loop["generate"]
    for prompt in PROMPTS[:2]:
        a = gen(model, prompt, NEW, width=width, temperature=1.0, seed=3)
        assert a == gen(model, prompt, NEW, width=width, temperature=1.0, seed=3)  # same seed, same tokens
        assert all(0 <= t < model.config.vocab_size for t in a) and len(a) == NEW
        others = [gen(model, prompt, NEW, width=width, temperature=1.0, seed=s) for s in (4, 5, 6)]
        assert any(o != a for o in others)  # the seed matters
        # at temperature 1e-4 sampling_probs is one-hot at the argmax: the greedy tokens
        assert gen(model, prompt, NEW, width=width, temperature=1e-4, seed=3) == reference(model, prompt)
