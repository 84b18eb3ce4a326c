"""The engine is a client of the kernel package's public API (issue #36).

``decoding/``, ``generate.py``, ``integrations/``, ``serving/`` and the vLLM entry point import
from ``specdec_kernels`` only what it makes public: the names in ``specdec_kernels.__all__``,
the public modules (the modules among those names, plus ``checks`` and ``autotune``) and, from
``specdec_kernels.reference``, the names in its ``__all__``.  Nothing with a leading
underscore (``_native``, ``_backend``, ...) and no deep path (``specdec_kernels.ops.x``,
``specdec_kernels.reference.x.y``).  The clients may import each other freely.

Also here: the engine's own attention call (``decoding.model.attend``) gives the public op's
results.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.tree import ancestor_mask
from tests.utils import assert_close

PACKAGE = "specdec_kernels"
PACKAGE_DIR = Path(sk.__file__).parent
REPO = PACKAGE_DIR.parent

# the client side: modules of the package that use the kernels and may import each other
CLIENTS = ("decoding", "generate", "integrations", "serving")
# public helper modules that are not (yet) re-exported in __all__
PUBLIC_HELPER_MODULES = ("autotune", "checks", "cli", "files", "optional")


def client_files() -> List[Path]:
    files = [PACKAGE_DIR / "generate.py", REPO / "specdec_kernels_vllm.py"]
    for sub in ("decoding", "integrations", "serving"):
        files += sorted((PACKAGE_DIR / sub).rglob("*.py"))
    return files


def module_name(path: Path) -> str:
    """Dotted name of a source file (a package's ``__init__.py``: the package)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class PublicApi:
    """What ``specdec_kernels`` makes public, read from the package itself."""

    def __init__(self):
        self.top = set(sk.__all__)
        self.modules = {n for n in sk.__all__ if inspect.ismodule(getattr(sk, n, None))} | set(PUBLIC_HELPER_MODULES)
        self.names = {"reference": set(reference.__all__)}
        for name in self.modules - {"reference"}:
            mod = __import__(f"{PACKAGE}.{name}", fromlist=["_"])
            exported = getattr(mod, "__all__", None)
            if exported is None:  # its own public functions, classes and constants
                exported = [
                    n
                    for n, obj in vars(mod).items()
                    if not n.startswith("_")
                    and not inspect.ismodule(obj)
                    and getattr(obj, "__module__", mod.__name__) == mod.__name__
                ]
            self.names[name] = set(exported)

    def module_ok(self, dotted: str) -> bool:
        """``dotted`` (a module path under the package) may be imported by a client."""
        parts = dotted.split(".")
        if parts[0] != PACKAGE or len(parts) == 1:
            return True
        if parts[1] in CLIENTS:
            return True
        return len(parts) == 2 and parts[1] in self.modules

    def name_ok(self, dotted: str) -> bool:
        """The object at ``dotted`` (package path, then names) is public.  Past the first
        public non-module name the rest are attributes of a public object: allowed."""
        parts = dotted.split(".")
        if parts[0] != PACKAGE or len(parts) == 1:
            return True
        first = parts[1]
        if first in CLIENTS or (_dunder(first) and len(parts) == 2):
            return True
        if first in self.modules:
            return len(parts) == 2 or parts[2] in self.names[first] or _dunder(parts[2])
        return first in self.top


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class _Checker(ast.NodeVisitor):
    def __init__(self, api: PublicApi, module: str, is_package: bool):
        self.api, self.problems = api, []
        self.package = module if is_package else module.rpartition(".")[0]
        self.aliases: Dict[str, str] = {}  # local name -> the package path it is bound to

    def _flag(self, node, what: str) -> None:
        self.problems.append(f"line {node.lineno}: {what}")

    def _absolute(self, module: Optional[str], level: int) -> str:
        if not level:
            return module or ""
        base = self.package.split(".")
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def _import_module(self, node, dotted: str) -> None:
        if dotted.split(".")[0] == PACKAGE and not self.api.module_ok(dotted):
            self._flag(node, f"imports the non-public module {dotted}")

    def visit_Import(self, node):
        for a in node.names:
            self._import_module(node, a.name)
            if a.name.split(".")[0] == PACKAGE:
                if a.asname:
                    self.aliases[a.asname] = a.name
                else:
                    self.aliases[PACKAGE] = PACKAGE

    def visit_ImportFrom(self, node):
        module = self._absolute(node.module, node.level)
        if module.split(".")[0] != PACKAGE:
            return
        self._import_module(node, module)
        for a in node.names:
            full = f"{module}.{a.name}"
            if a.name == "*":  # only from the clients' own modules
                if module.split(".")[1:2] not in [[c] for c in CLIENTS]:
                    self._flag(node, f"imports * from {module}")
                continue
            if not self.api.name_ok(full):
                self._flag(node, f"imports the non-public name {full}")
            self.aliases[a.asname or a.name] = full

    def visit_Attribute(self, node):
        chain, value = [], node
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in self.aliases:
            full = ".".join([self.aliases[value.id]] + chain[::-1])
            if not self.api.name_ok(full):
                self._flag(node, f"uses the non-public {full}")
            return  # the chain is checked whole
        self.generic_visit(node)

    def visit_Call(self, node):
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
        if (
            name in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            self._import_module(node, node.args[0].value)
        self.generic_visit(node)


def private_uses(source: str, module: str, is_package: bool = False, api: Optional[PublicApi] = None) -> List[str]:
    """Where ``source`` (the text of module ``module``) reaches a non-public part of the package."""
    checker = _Checker(api or PublicApi(), module, is_package)
    checker.visit(ast.parse(source))
    return checker.problems


@pytest.fixture(scope="module")
def api():
    return PublicApi()


def test_there_are_client_files():
    names = {module_name(p) for p in client_files()}
    assert {
        "specdec_kernels.decoding.model",
        "specdec_kernels.decoding.engine.loop",
        "specdec_kernels.generate",
        "specdec_kernels.integrations.transformers",
        "specdec_kernels.serving.sglang",
        "specdec_kernels_vllm",
    } <= names


@pytest.mark.parametrize("path", client_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_clients_use_public_names_only(path, api):
    problems = private_uses(path.read_text(), module_name(path), path.name == "__init__.py", api)
    assert not problems, f"{path.relative_to(REPO)}:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "source",
    [
        "from specdec_kernels._native import load",
        "from specdec_kernels import _native",
        "from specdec_kernels import _backend as b",
        "import specdec_kernels._library",
        "import specdec_kernels.ops.tree_attention as t",
        "from specdec_kernels.ops.tree_attention import tree_attention",
        "from specdec_kernels.reference.rejection_sample import sample_from_weights",
        "from specdec_kernels.reference import check_tree_attention_args",
        "from specdec_kernels.checks import _dtype_names",
        "from specdec_kernels.tree import torch",
        "from specdec_kernels import *",
        "from .._native import load",
        "from .. import _random",
        "from ..ops import verify_greedy",
        "from ..reference.tree_attention import SUPPORTED_HEAD_DIMS",
        "import specdec_kernels as sk\nsk._native.load()",
        "import specdec_kernels\nspecdec_kernels.ops.verify_greedy",
        "from specdec_kernels import reference as r\nr.rejection_sample_impl",
        "import importlib\nimportlib.import_module('specdec_kernels._flattened')",
    ],
)
def test_the_checker_flags_private_uses(source, api):
    """Negative controls: each snippet, as code of ``specdec_kernels.decoding.model``, is flagged."""
    assert private_uses(source, "specdec_kernels.decoding.model", api=api), source


def test_the_checker_passes_every_public_name(api):
    """Positive controls, derived from the package: every name of ``__all__``, of
    ``reference.__all__`` and of the public modules, the clients' own modules, attributes of
    public objects, and other packages."""
    lines = [f"from specdec_kernels import {n}" for n in sorted(sk.__all__)]
    lines += [f"from specdec_kernels.reference import {n}" for n in sorted(reference.__all__)]
    for mod in sorted(api.modules):
        lines.append(f"import specdec_kernels.{mod}")
        lines += [f"from specdec_kernels.{mod} import {n}" for n in sorted(api.names[mod])]
    lines += [
        "import specdec_kernels as sk\nsk.tree_attention(1)\nsk.tree.ancestor_mask\nsk.__file__\nsk.reference.__all__",
        "from specdec_kernels.decoding.model import Transformer",
        "from specdec_kernels.decoding import packed",
        "from . import stats\nfrom ..draft import Draft\nfrom .. import model",
        "import torch\nfrom torch.nn import functional\nimport os.path",
    ]
    for source in lines:
        assert not private_uses(source, "specdec_kernels.decoding.engine.loop", api=api), source


# --------------------------------------------------------------------------------------
# The engine's attention call
# --------------------------------------------------------------------------------------


def _mask(kind: str):
    parents = [-1, 0, 0, 1, 2]
    return {
        "chain": None,
        "tree": ancestor_mask(parents),
        "per-sequence": torch.stack(
            [ancestor_mask(parents), ancestor_mask([-1, 0, 1, 2, 3]), ancestor_mask([-1, 0, 0, 0, 0])]
        ),
    }[kind]


@pytest.mark.parametrize("mask_kind", ["chain", "tree", "per-sequence"])
def test_the_engine_attention_matches_the_public_op(mask_kind, monkeypatch):
    """``decoding.model.attend`` (the registered op, no Python front) gives the public op's
    result on each CPU path the automatic choice may take, with a named backend, and with a
    backend preferred through the environment."""
    from specdec_kernels.decoding.model import attend

    g = torch.Generator().manual_seed(4)
    B, N, H, Hkv, D, S = 3, 5, 6, 2, 32, 40
    q = torch.randn(B, N, H, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    lens = torch.tensor([0, 7, 30], dtype=torch.int32)
    mask = _mask(mask_kind)
    want = sk.tree_attention(q, k, v, lens, mask, backend="reference")
    for path in ("native", "torch", "auto"):
        monkeypatch.setenv("SPECDEC_DENSE_ATTENTION", path)
        sk.reset_backends()  # environment variables are read at import and on reset
        for _ in range(7):  # past the measurement of the automatic choice
            assert_close(attend(q, k, v, lens, mask), want, torch.float32)
    assert torch.equal(attend(q, k, v, lens, mask, "reference"), want)
    assert torch.equal(attend(q, k, v, lens, mask, "torch"), sk.tree_attention(q, k, v, lens, mask, backend="torch"))
    monkeypatch.setenv("SPECDEC_BACKEND", "reference")  # a preference, as for the public op
    sk.reset_backends()  # read at import and on reset
    assert torch.equal(attend(q, k, v, lens, mask), want)


@pytest.mark.parametrize("mask_kind", ["chain", "tree"])
def test_the_engine_attention_over_a_paged_pool(mask_kind):
    from specdec_kernels.decoding.model import attend

    g = torch.Generator().manual_seed(5)
    B, N, H, Hkv, D, block, blocks = 2, 5, 4, 2, 16, 4, 12
    q = torch.randn(B, N, H, D, generator=g)
    k, v = torch.randn(blocks, block, Hkv, D, generator=g), torch.randn(blocks, block, Hkv, D, generator=g)
    table = torch.tensor([[3, 1, 7, 0], [2, 5, 9, 11]], dtype=torch.int32)
    lens = torch.tensor([6, 10], dtype=torch.int32)
    mask = _mask(mask_kind)
    want = sk.tree_attention(q, k, v, lens, mask, block_table=table, kv_layout="NHD", backend="reference")
    assert_close(attend(q, k, v, lens, mask, None, table), want, torch.float32)
    assert torch.equal(attend(q, k, v, lens, mask, "reference", table), want)


def test_the_engine_attention_keeps_the_ops_shape_checks():
    from specdec_kernels.decoding.model import attend

    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 3, 8, 16)  # 4 query heads over 3 KV heads
    with pytest.raises((ValueError, RuntimeError)):
        attend(q, k, k, torch.tensor([3], dtype=torch.int32), None)
