"""`python -m specdec_kernels.bench.e2e` on the real model (two prompts, few tokens): the JSON lines cover
every requested method, our drafters reproduce our greedy tokens, a method that does not is
flagged and fails the run, and the plot is written.  Prompt selection and method names are
checked without the model."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_kernels.bench import e2e
from tests.bench.e2e_runs import needs_model, read_jsonl, run_e2e
from tests.utils import restore_threads  # noqa: F401 (fixture)

# the bench CLI on the real model, threads of its own: run apart from the parallel test workers (scripts/run_tests.sh)
pytestmark = pytest.mark.serial

QUESTIONS = [
    {
        "question_id": 1,
        "category": "coding",
        "turns": [
            "Rename the function add to plus:\n\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))",
            "second turn unused",
        ],
    },
    {"question_id": 2, "category": "coding", "turns": ["Write a haiku about cats."]},
    {"question_id": 3, "category": "chat", "turns": ["Say hello."]},
    {"question_id": 4, "category": "chat", "turns": ["Say goodbye."]},
]
METHODS = [
    "greedy",
    "ngram-chain",
    "ngram-tree",
    "layerskip-tree",
    "medusa-tree",
    "eagle-tree",
    "lookahead",
    "ensemble",
    "hf-greedy",
]
NEW_TOKENS = 16


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def test_first_n_per_category_in_file_order(prompts_file):
    assert [q["question_id"] for q in e2e.load_questions(prompts_file, 1)] == [1, 3]
    assert [q["question_id"] for q in e2e.load_questions(prompts_file, 2)] == [1, 2, 3, 4]
    assert [q["question_id"] for q in e2e.load_questions(prompts_file, 5, ["chat"])] == [3, 4]
    with pytest.raises(ValueError, match="per_category"):
        e2e.load_questions(prompts_file, 0)


def test_packaged_prompts_13_categories():
    questions = e2e.load_questions(e2e.default_prompts_file(), 2)
    assert len(questions) == 26 and len({q["category"] for q in questions}) == 13


def test_unknown_method_lists_the_valid_names(capsys):
    with pytest.raises(SystemExit) as exc:
        e2e.parse_args(["--methods", "greedy,no-such-method"])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "no-such-method" in err
    for name in e2e.METHODS:
        assert name in err


def test_demo_options_and_overrides():
    args = e2e.parse_args(["--demo"])
    assert args.max_new_tokens == e2e.DEMO["max_new_tokens"] and args.categories == e2e.DEMO["categories"]
    assert args.methods.split(",") == e2e.DEMO["methods"]
    assert args.threads == 1
    assert e2e.parse_args(["--demo", "--max-new-tokens", "8"]).max_new_tokens == 8
    assert e2e.parse_args(["--demo", "--threads", "2"]).threads == 2


@needs_model
def test_two_prompts_all_methods(prompts_file, tmp_path, capsys, restore_threads):
    out = tmp_path / "out"
    rc = run_e2e(prompts_file, out, METHODS, NEW_TOKENS, threads=2)
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "same tokens" in stdout and all(m in stdout for m in METHODS)
    assert (out / "e2e.png").stat().st_size > 0
    lines = read_jsonl(out / "e2e.jsonl")
    assert lines[0]["kind"] == "config" and lines[0]["methods"] == METHODS
    rows = [r for r in lines if r["kind"] == "prompt"]
    summary = [r for r in lines if r["kind"] == "summary"]
    assert {(r["method"], r["question_id"]) for r in rows} == {(m, q) for m in METHODS for q in (1, 3)}
    greedy = {r["question_id"]: r["tokens"] for r in rows if r["method"] == "greedy"}
    for r in rows:
        assert r["torch"] == torch.__version__ and r["commit"]
        assert 0 < r["new_tokens"] == len(r["tokens"]) <= NEW_TOKENS and r["tokens_per_s"] > 0
        if r["family"] == "ours":
            assert r["same_tokens"] and r["tokens"] == greedy[r["question_id"]], r["method"]
        assert r["same_tokens"] == (r["tokens"] == greedy[r["question_id"]])
        assert r["same_as_hf_greedy"] is not None
    for r in rows:
        if r["method"] in ("greedy", "hf-greedy"):  # one token per target pass
            assert r["mean_accepted_length"] == 1.0 and r["target_passes"] == r["new_tokens"]
        else:
            assert r["mean_accepted_length"] >= 1.0
    overall = {s["method"]: s for s in summary if s["scope"] == "overall"}
    assert list(overall) == METHODS
    assert {s["scope"] for s in summary} == {"overall", "coding", "chat"}
    for name, s in overall.items():
        assert s["prompts"] == 2 and s["tokens_per_s"] > 0
        assert s["speedup_vs_greedy"] == pytest.approx(s["tokens_per_s"] / overall["greedy"]["tokens_per_s"])
        assert s["speedup_vs_hf_greedy"] == pytest.approx(s["tokens_per_s"] / overall["hf-greedy"]["tokens_per_s"])
        if s["family"] == "ours":
            assert s["same_tokens"] and s["same_tokens_count"] == "2/2"


@needs_model
def test_a_method_that_changes_tokens_fails_the_run(prompts_file, tmp_path, capsys, monkeypatch, restore_threads):
    def broken(ctx, prompt, max_new_tokens):
        run = e2e.METHODS["greedy"].run(ctx, prompt, max_new_tokens)
        run.tokens[-1] = (run.tokens[-1] + 1) % ctx.model.args.vocab_size
        return run

    monkeypatch.setitem(e2e.METHODS, "broken", e2e.Method("broken", "ours", "flips the last token", broken))
    out = tmp_path / "out"
    rc = run_e2e(prompts_file, out, ["broken"], 4, extra=["--categories", "chat"])
    assert rc == 1
    captured = capsys.readouterr()
    assert "MISMATCH" in captured.out and "broken" in captured.err
    rows = {r["method"]: r for r in read_jsonl(out / "e2e.jsonl") if r["kind"] == "prompt"}
    assert rows["greedy"]["same_tokens"] and not rows["broken"]["same_tokens"]
    assert rows["broken"]["first_mismatch"] == len(rows["greedy"]["tokens"]) - 1


def test_unwritable_out_fails_before_the_model_loads(prompts_file, tmp_path, capsys, monkeypatch):
    import specdec_kernels.decoding.loading as loading

    monkeypatch.setattr(loading, "have_smollm2", lambda: pytest.fail("the work started before --out was checked"))
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    args = e2e.parse_args(["--prompts", str(prompts_file), "--out", str(blocker / "sub"), "--methods", "greedy"])
    assert e2e.run(args) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "not a writable folder" in err


def test_malformed_prompts_file_names_the_line(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question_id": 1, "category": "a", "turns": ["x"]}\n\n{"question_id": 2, "category"\n')
    with pytest.raises(ValueError, match=r"q\.jsonl:3: not a JSON object"):
        e2e.load_questions(bad, 1)
    bad.write_text('{"question_id": 1, "category": "a", "turns": ["x"]}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"q\.jsonl:2:"):
        e2e.load_questions(bad, 1)


def test_shared_prefix_flags_checked_before_loading(prompts_file, capsys, monkeypatch):
    import specdec_kernels.decoding.loading as loading

    with pytest.raises(SystemExit):
        e2e.parse_args(["--scenario", "shared-prefix", "--batch", "1"])
    assert "--batch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.parse_args(["--scenario", "shared-prefix", "--methods", "medusa-tree"])
    assert "shared-prefix" in capsys.readouterr().err
    monkeypatch.setattr(loading, "have_smollm2", lambda: pytest.fail("the model loaded before --batch was checked"))
    args = e2e.parse_args(["--prompts", str(prompts_file), "--scenario", "shared-prefix", "--batch", "5"])
    assert e2e.run(args) == 2  # 4 questions in the file
    assert "--batch 5" in capsys.readouterr().err


@needs_model
def test_shared_prefix_scenario(prompts_file, tmp_path, capsys, restore_threads):
    """Three requests with the packaged system prompt: every batched run reproduces the
    requests decoded alone, sharing computes fewer prefill positions, draft positions and
    cache bytes than the same batch without it."""
    out = tmp_path / "out"
    rc = run_e2e(
        prompts_file,
        out,
        ["greedy", "layerskip-tree"],
        6,
        threads=2,
        per_category=2,
        extra=["--scenario", "shared-prefix", "--batch", "3"],
    )
    assert rc == 0
    assert "same as alone" in capsys.readouterr().out
    assert (out / "shared_prefix.png").stat().st_size > 0
    lines = read_jsonl(out / "shared_prefix.jsonl")
    config = lines[0]
    assert config["kind"] == "config" and config["batch"] == 3 and config["common_prefix_tokens"] > 400
    runs = {(r["method"], r["mode"]): r for r in lines if r["kind"] == "run"}
    assert set(runs) == {(m, mode) for m in ("greedy", "layerskip-tree") for mode in ("alone", "paged", "shared")}
    for r in runs.values():
        assert r["same_as_alone"] and r["same_count"] == "3/3" and r["tokens_per_s"] > 0
    for m in ("greedy", "layerskip-tree"):
        shared, paged = runs[(m, "shared")], runs[(m, "paged")]
        assert shared["shared_prefill_tokens"] >= 2 * (config["common_prefix_tokens"] // 16) * 16
        assert shared["prefill_tokens"] <= paged["prefill_tokens"] - shared["shared_prefill_tokens"] + 3 * 16
        assert shared["kv_cache_bytes"] < paged["kv_cache_bytes"]
    # the layer-skip drafter runs on the target's cache: no prompt of its own to feed (the same
    # positions with or without sharing, none of them a prompt's) and no cache of its own
    for mode in ("paged", "shared"):
        drafted = runs[("layerskip-tree", mode)]
        assert drafted["draft_model_tokens"] == runs[("layerskip-tree", "paged")]["draft_model_tokens"]
        assert drafted["kv_cache_bytes"] == runs[("greedy", mode)]["kv_cache_bytes"]
