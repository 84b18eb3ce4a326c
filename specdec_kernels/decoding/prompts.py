"""Spec-Bench prompts shipped with the package (``specdec_kernels/data/spec_bench``)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Union

from specdec_kernels import files as _files
from specdec_kernels.files import BadFileError

SPEC_BENCH = Path(__file__).resolve().parent.parent / "data" / "spec_bench" / "question.jsonl"


def read_questions(path: Union[str, Path]) -> List[Dict]:
    """Spec-Bench questions from a JSON-lines file, in file order: one object per line with
    ``question_id`` (int), ``category`` (str) and ``turns`` (a non-empty list of strings).
    The shipped file is first checked against the package's SHA-256 manifest.

    Raises:
        FileNotFoundError: no such file.
        ValueError (``BadFileError``, the message starting with the path): empty, truncated
            (an incomplete last line), not UTF-8 JSON lines, a record that is not a question
            (the line named), or a shipped file not matching the manifest.
    """
    questions = _files.read_jsonl(path, "Spec-Bench question", {"question_id": int, "category": str, "turns": list})
    for n, q in enumerate(questions, 1):
        if not q["turns"] or not all(isinstance(t, str) for t in q["turns"]):
            raise BadFileError(path, f"question {n} (id {q['question_id']}): turns must be a non-empty list of strings")
    return questions


@lru_cache(maxsize=1)
def spec_bench_questions() -> List[Dict]:
    """The 480 Spec-Bench questions (dicts with question_id, category, turns), in file order.

    Raises:
        ValueError: the shipped file is damaged (``read_questions``).
    """
    return read_questions(SPEC_BENCH)


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
