"""Optional dependencies: import one, or fail with a message that names what is missing.

The package itself needs torch and numpy only.  The engine, the integrations and the
benchmarks import their other libraries where they use them, through ``require``, so that a
missing (or too old) library is reported by its name, the ``pip install`` that brings it and
the extra of ``pyproject.toml`` that lists it, rather than as a bare ``No module named ...``
or a confusing ``cannot import name ...`` from deep inside another package.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

# The oldest transformers each part works with (pyproject.toml's extras say the same; a test
# checks that they agree).  The integration: 4.54 (``PreTrainedModel.set_attn_implementation``,
# transformers.masking_utils; tested on 4.54 .. 4.57 and 5.x).  The engine on SmolLM2: 5.18
# (older versions convert the GGUF's tokenizer with <|im_start|> as its end-of-sequence token,
# so generation would not stop at <|im_end|>).
TRANSFORMERS_INTEGRATION_MIN = "4.54"
TRANSFORMERS_ENGINE_MIN = "5.18"


def _version_tuple(version: str) -> tuple:
    """ "5.18.0" / "5.18.0.dev0" / "2.4.1+cpu" -> (5, 18, 0): the leading numeric parts."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def install_hint(package: str, extra: Optional[str], min_version: Optional[str] = None) -> str:
    """The install command for ``package`` (and the extra that lists it)."""
    spec = f"{package}>={min_version}" if min_version else package
    hint = f"pip install '{spec}'"
    if extra:
        hint += f" (or the package's extra: pip install 'specdec-kernels[{extra}]')"
    return hint


def require(
    module: str,
    *,
    purpose: str,
    package: Optional[str] = None,
    extra: Optional[str] = None,
    min_version: Optional[str] = None,
    why: str = "",
    install: Optional[str] = None,
) -> ModuleType:
    """``importlib.import_module(module)``, checked.

    Args:
        module: the module to import, e.g. "transformers".
        purpose: what needs it, for the message ("the transformers integration").
        package: its name on PyPI (default: ``module``).
        extra: the extra of this package that installs it, or None.
        min_version: the oldest ``package.__version__`` that works, or None.
        why: why older versions do not (appended to the message).
        install: how to install it, said instead of the default ``pip install`` hint
            (``install_hint``), e.g. where the usual build is not the one to take first.

    Returns:
        The module.

    Raises:
        ModuleNotFoundError: the module is not installed (the message names the package, the
            install command and the extra).
        ImportError: it is older than ``min_version`` (the message names both versions).
    """
    package = package or module
    hint = install or install_hint(package, extra, min_version)
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.split(".")[0] != module.split(".")[0]:
            raise  # the module is there, one of its own dependencies is not: its message says which
        raise ModuleNotFoundError(
            f"{purpose} needs {package}, which is not installed: {hint}",
            name=module,
        ) from None
    if min_version is not None:
        found = getattr(mod, "__version__", "0")
        if _version_tuple(found) < _version_tuple(min_version):
            raise ImportError(
                f"{purpose} needs {package} >= {min_version}, found {found}"
                + (f" ({why})" if why else "")
                + f": {hint}",
                name=module,
            )
    return mod
