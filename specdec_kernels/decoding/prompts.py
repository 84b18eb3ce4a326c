"""Spec-Bench prompts shipped with the package (``specdec_kernels/data/spec_bench``)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Dict, List

SPEC_BENCH = Path(__file__).resolve().parent.parent / "data" / "spec_bench" / "question.jsonl"


@lru_cache(maxsize=1)
def spec_bench_questions() -> List[Dict]:
    """The 480 Spec-Bench questions (dicts with question_id, category, turns), in file order."""
    with open(SPEC_BENCH, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def spec_bench_prompt(question_id: int, turn: int = 0) -> str:
    """The text of one Spec-Bench question's turn (the first by default).

    Raises:
        KeyError: no question with that id (ids run 81..560).
        IndexError: the question has no such turn.
    """
    for q in spec_bench_questions():
        if q["question_id"] == question_id:
            return q["turns"][turn]
    raise KeyError(f"no Spec-Bench question with id {question_id} (ids run 81..560)")
