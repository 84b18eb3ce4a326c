"""Every shipped drafter, its head class and its loader import from ``specdec_kernels.decoding``
(where a user finds ``MedusaDrafter``), not only from the drafter's own module."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import specdec_kernels.decoding as decoding
import specdec_kernels.decoding.drafters as drafters
from specdec_kernels.decoding import SpeculativeDecoder
from specdec_kernels.decoding.draft import Drafter
from specdec_kernels.decoding.drafters.head_file import HeadFile
from tests.engine.tiny import tiny  # noqa: F401 (fixture)


def _shipped():
    """(name, object) of every drafter class, head class and ``load_*`` loader that a module of
    ``decoding.drafters`` (or ``decoding.draft``) defines, found by walking the folder."""
    names = ["specdec_kernels.decoding.draft"] + [
        f"{drafters.__name__}.{m.name}" for m in pkgutil.iter_modules(drafters.__path__)
    ]
    found = {}
    for module_name in names:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if name.startswith("_"):
                continue
            own_class = inspect.isclass(obj) and obj.__module__ == module_name
            if own_class and issubclass(obj, (Drafter, HeadFile)) and obj not in (HeadFile,):
                found[name] = obj
            elif name.startswith("load_") and callable(obj):
                found[name] = obj
    return found


def test_every_shipped_drafter_and_loader_imports_from_decoding():
    shipped = _shipped()
    # the walk finds what the issue named (so the test cannot pass on an empty list)
    expected = {"EagleDrafter", "EagleHead", "load_eagle_head", "LookaheadDrafter", "MedusaDrafter", "MedusaHeads"}
    assert expected | {"load_medusa_heads", "NgramDrafter", "MultiDrafter", "NoDrafter"} <= set(shipped)
    missing = sorted(name for name in shipped if getattr(decoding, name, None) is not shipped[name])
    assert not missing, f"not importable from specdec_kernels.decoding: {missing}"
    assert not sorted(set(shipped) - set(decoding.__all__)), "exported but not listed in __all__"


def test_star_import_gives_the_drafters():
    namespace = {}
    exec("from specdec_kernels.decoding import *", namespace)
    assert {"EagleDrafter", "EagleHead", "load_eagle_head", "LookaheadDrafter"} <= set(namespace)


# --------------------------------------------------------------------------- ENGINE.md's drafters


def engine_md_drafters():
    """The Python block of docs/ENGINE.md's drafter interface section, run: its namespace."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "ENGINE.md").read_text()
    section = text[text.index("## The drafter interface") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")]
    namespace = {}
    exec(compile(code, "docs/ENGINE.md", "exec"), namespace)
    return namespace


def test_engine_md_chain_and_tree_drafters_run_lossless(tiny):  # noqa: F811 (fixture)
    _, model = tiny
    ns = engine_md_drafters()
    prompts = [[12, 99, 8, 12, 99, 8, 12, 99, 101, 4, 12], [5, 17, 5, 17, 5, 17, 33], [64, 3]]
    plain = SpeculativeDecoder(model).generate(prompts, 24).tokens
    shapes = []
    for cls in (ns["RepeatDrafter"], ns["FollowerTree"]):
        drafter = cls()
        propose = drafter.propose

        def recording(request, propose=propose):
            ks = request.num_draft_tokens
            assert isinstance(ks, tuple) and len(ks) == len(request.histories) == len(request.active)
            draft = propose(request)
            shapes.append((type(drafter).__name__, draft.is_chain, draft.parents.tolist(), draft.num_nodes.tolist()))
            return draft

        drafter.propose = recording
        result = SpeculativeDecoder(model, drafter).generate(prompts, 24, num_draft_tokens=3)
        assert result.tokens == plain, cls.__name__  # lossless
        assert result.stats.draft_tokens > 0, cls.__name__  # it drafted
    trees = [s for s in shapes if s[0] == "FollowerTree"]
    assert all(not s[1] for s in trees)
    # some step drafted a real tree: a node whose parent is not the node before it
    assert any(p[i] != i - 1 for _, _, parents, counts in trees for p, n in zip(parents, counts) for i in range(1, n))
    assert all(s[1] for s in shapes if s[0] == "RepeatDrafter")


def test_engine_md_tree_drafter_keeps_and_resets_its_state(tiny):  # noqa: F811 (fixture)
    """FollowerTree learns from ``observe`` (the first accepted draft token of each step) and
    resets at the next run's ``started`` result."""
    _, model = tiny
    drafter = engine_md_drafters()["FollowerTree"]()
    decoder = SpeculativeDecoder(model, drafter)
    prompts = [[12, 99, 8, 12, 99, 8, 12, 99, 101, 4, 12], [5, 17, 5, 17, 5, 17, 33]]
    decoder.generate(prompts, 24, num_draft_tokens=3)
    assert sum(drafter.accepted.values()) > 0
    seen = []
    observe = drafter.observe

    def recording(result, observe=observe):
        before = dict(drafter.accepted)
        observe(result)
        seen.append((result.started, before, dict(drafter.accepted)))

    drafter.observe = recording
    decoder.generate([[64, 3]], 4, num_draft_tokens=3)
    started, before, after = seen[0]
    assert started and sum(before.values()) > 0 and after == {}  # the first run's counts, reset
    assert len(seen) > 1 and not any(s for s, _, _ in seen[1:])  # then one result per step


OLD_HOOKS = (
    "start",
    "observe_hidden",
    "observe_context",
    "observe_target_argmax",
    "set_cache_layout",
    "bind_target_cache",
    "bind_stats",
)


def test_shipped_drafters_implement_the_two_method_contract():
    """Every shipped drafter talks to the engine through ``propose(request)`` and
    ``observe(result)`` only: none keeps a hook of the older contract."""
    found = {n: c for n, c in _shipped().items() if inspect.isclass(c) and issubclass(c, Drafter)}
    assert {"NgramDrafter", "MedusaDrafter", "EagleDrafter", "MergeDrafter", "LookaheadDrafter"} <= set(found)
    for name, cls in found.items():
        old = [h for h in OLD_HOOKS if hasattr(cls, h)]
        assert not old, f"{name} keeps {old}"
        for method in ("propose", "observe"):
            params = list(inspect.signature(getattr(cls, method)).parameters)
            assert params[:1] == ["self"] and len(params) == 2, (name, method, params)


def test_a_drafter_of_the_older_contract_is_refused_by_name(tiny):  # noqa: F811 (fixture)
    import pytest

    _, model = tiny

    class Old(Drafter):
        name = "old-style"

        def propose(self, histories, num_draft_tokens, active):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="old-style.*propose must take one argument"):
        SpeculativeDecoder(model, Old())
