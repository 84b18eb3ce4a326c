"""Benchmarks, installed with the package: ``python -m specdec_kernels.bench.kernels`` (per op
and backend; console script ``specdec-bench-kernels``) and ``python -m specdec_kernels.bench.e2e``
(end to end on SmolLM2; ``specdec-bench-e2e``), with the others in this folder.  In a source
checkout ``python -m bench.<name>`` forwards here."""

from pathlib import Path


def checkout_root() -> Path:
    """The source checkout the package runs from (where ``scripts/`` makes the ``.venv-*``
    environments of the llama.cpp and vLLM comparisons), else the current directory (an
    installed package)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "scripts").is_dir() else Path.cwd()
