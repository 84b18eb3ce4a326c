"""Entry points in serving engines' own layouts, running this package's ops.

``specdec_kernels.serving.sglang``: SGLang's tree form (first-child / next-sibling lists,
flat ``predicts`` and ``accept_index`` outputs) for greedy tree verification and tree
rejection sampling, and the conversion of its trees from and to parent lists.  Nothing is imported until a name is used.
"""

from __future__ import annotations

import importlib

__all__ = [
    "sglang",
    "verify_tree_greedy_sglang",
    "tree_rejection_sample_sglang",
    "from_sglang_tree",
    "to_sglang_tree",
    "SGLangTree",
]

_NAMES = {
    "sglang": None,
    "verify_tree_greedy_sglang": "sglang",
    "tree_rejection_sample_sglang": "sglang",
    "from_sglang_tree": "sglang",
    "to_sglang_tree": "sglang",
    "SGLangTree": "sglang",
}


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_NAMES[name] or name}")
    return module if _NAMES[name] is None else getattr(module, name)
