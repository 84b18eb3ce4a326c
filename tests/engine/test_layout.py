"""The decoding package's layout: the engine depends on no drafter, every drafter lives in
``decoding.drafters`` under its name."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import specdec_kernels.decoding as decoding

ROOT = Path(decoding.__file__).parent


def imported_modules(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "engine").glob("*.py")) + [ROOT / "draft.py", ROOT / "model.py", ROOT / "paged.py"],
    ids=lambda p: p.name,
)
def test_the_engine_imports_no_drafter_and_no_trainer(path):
    bad = [
        m
        for m in imported_modules(path)
        if m.startswith(("specdec_kernels.decoding.drafters", "specdec_kernels.decoding.training"))
    ]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize(
    "module,names",
    [
        ("ngram", ["NgramDrafter"]),
        ("model_drafter", ["ModelDrafter", "DraftModelDrafter", "LayerSkipDrafter"]),
        ("medusa", ["MedusaDrafter", "MedusaHeads"]),
        ("eagle", ["EagleDrafter", "EagleHead"]),
        ("eagle_head", ["EagleHead"]),
        ("eagle_format", ["EagleHeadFile"]),
        ("eagle_quant", ["QuantizableHead"]),
        ("lookahead", ["LookaheadDrafter"]),
        ("multi", ["MultiDrafter"]),
        ("composite", ["CompositeDrafter"]),
        ("merge", ["MergeDrafter"]),
        ("fallback", ["FallbackDrafter"]),
        ("ensemble", ["EnsembleDrafter"]),
    ],
)
def test_each_drafter_lives_under_its_name(module, names):
    mod = importlib.import_module(f"specdec_kernels.decoding.drafters.{module}")
    for name in names:
        assert isinstance(getattr(mod, name), type)
        assert f"``{module}``" in importlib.import_module("specdec_kernels.decoding.drafters").__doc__
