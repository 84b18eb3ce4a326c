"""llama.cpp as an anchor of the benchmarks (bench/llamacpp.py): ``bench.e2e``'s llamacpp-*
methods and ``bench.step_cost --real``'s llama.cpp curve.

Where the llama.cpp environment exists (``bash scripts/setup_llamacpp_env.sh``) they run for
real on a short case; without it (always forced here by pointing the environment elsewhere)
they are reported as skipped with a reason naming the setup script, and the run still succeeds.
"""

from __future__ import annotations

import json
import sys

import pytest

from specdec_kernels.bench import e2e, llamacpp, step_cost
from tests.bench.e2e_runs import needs_model, read_jsonl, run_e2e
from tests.utils import restore_threads  # noqa: F401 (fixture)

# the bench CLIs start processes (the llama.cpp driver) and threads of their own
pytestmark = pytest.mark.serial
needs_llamacpp = pytest.mark.skipif(llamacpp.unavailable() is not None, reason=f"llama.cpp: {llamacpp.unavailable()}")

LLAMACPP_METHODS = ["llamacpp-greedy", "llamacpp-prompt-lookup", "llamacpp-prompt-lookup-2"]
NEW_TOKENS = 8
QUESTION = {
    "question_id": 1,
    "category": "coding",
    "turns": ["Rename the function add to plus:\n\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))"],
}


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps(QUESTION) + "\n")
    return path


@pytest.fixture
def no_llamacpp(monkeypatch, tmp_path):
    """The llama.cpp environment made missing: a folder without it, checks not cached."""
    monkeypatch.setenv("SPECDEC_LLAMACPP_VENV", str(tmp_path / "no-llamacpp-venv"))
    monkeypatch.delenv("SPECDEC_LLAMACPP_PYTHON", raising=False)
    monkeypatch.setattr(llamacpp, "_checked", {})


def test_registered_as_llamacpp_family():
    for name in LLAMACPP_METHODS:
        m = e2e.METHODS[name]
        assert m.family == "llama.cpp" and m.default and m.unavailable is not None
    assert e2e.METHODS["llamacpp-prompt-lookup"].params["num_pred_tokens"] == 10
    assert e2e.METHODS["llamacpp-prompt-lookup-2"].params["num_pred_tokens"] == 2
    assert {"llamacpp-greedy", "llamacpp-prompt-lookup"} <= set(e2e.DEMO["methods"])


def test_missing_environment_names_the_setup_script(no_llamacpp):
    reason = llamacpp.unavailable()
    assert reason and "scripts/setup_llamacpp_env.sh" in reason and "no-llamacpp-venv" in reason
    assert "\n" not in reason
    for name in LLAMACPP_METHODS:
        assert e2e.METHODS[name].unavailable() == reason
    with pytest.raises(FileNotFoundError, match="setup_llamacpp_env.sh"):
        llamacpp.Driver()


@needs_model
def test_e2e_skips_llamacpp_without_its_environment(no_llamacpp, prompts_file, tmp_path, capsys, restore_threads):
    """Selected explicitly, the llama.cpp methods are reported as skipped with the reason; the
    rest of the run goes on and succeeds."""
    out = tmp_path / "out"
    assert run_e2e(prompts_file, out, ["greedy"] + LLAMACPP_METHODS, NEW_TOKENS) == 0
    captured = capsys.readouterr()
    for name in LLAMACPP_METHODS:
        assert f"# skipped {name}: no llama.cpp environment" in captured.out
        assert f"# skipped {name}:" in captured.err
    assert "setup_llamacpp_env.sh" in captured.out
    lines = read_jsonl(out / "e2e.jsonl")
    config = lines[0]
    assert config["methods"] == ["greedy"] and set(config["skipped"]) == set(LLAMACPP_METHODS)
    skipped = [r for r in lines if r["kind"] == "skipped"]
    assert [r["method"] for r in skipped] == LLAMACPP_METHODS
    assert all("setup_llamacpp_env.sh" in r["reason"] for r in skipped)
    assert {r["method"] for r in lines if r["kind"] in ("prompt", "summary")} == {"greedy"}
    # our own figures are still all there
    (row,) = [r for r in lines if r["kind"] == "prompt"]
    assert row["ttft_s"] > 0 and row["cpu_seconds"] > 0 and row["tokens_per_cpu_s"] > 0
    assert row["same_as_llamacpp_greedy"] is None


@needs_model
@needs_llamacpp
def test_e2e_llamacpp_methods_short_case(prompts_file, tmp_path, capsys, restore_threads):
    """One prompt, 8 tokens: llama.cpp's greedy and prompt lookup run on the same prompt ids and
    report the same figures as our methods, and their token identity (against llama.cpp's own
    greedy and against ours) is in the JSON, reported, never failed."""
    out = tmp_path / "out"
    assert run_e2e(prompts_file, out, ["greedy"] + LLAMACPP_METHODS, NEW_TOKENS) == 0
    stdout = capsys.readouterr().out
    assert "x llama.cpp" in stdout and "same as llama.cpp" in stdout and "skipped" not in stdout
    lines = read_jsonl(out / "e2e.jsonl")
    assert lines[0]["methods"] == ["greedy"] + LLAMACPP_METHODS and lines[0]["skipped"] == {}
    rows = {r["method"]: r for r in lines if r["kind"] == "prompt"}
    vocab = 49152
    for name in LLAMACPP_METHODS:
        r = rows[name]
        assert r["family"] == "llama.cpp"
        assert 0 < r["new_tokens"] == len(r["tokens"]) <= NEW_TOKENS
        assert all(isinstance(t, int) and 0 <= t < vocab for t in r["tokens"])
        assert r["seconds"] > 0 and r["tokens_per_s"] > 0 and r["ttft_s"] > 0 and r["cpu_seconds"] > 0
        assert r["tokens_per_cpu_s"] > 0 and r["ttft_s"] < r["seconds"]
        if r["new_tokens"] > 1:
            assert r["decode_tokens_per_s"] > 0 and r["decode_tokens_per_cpu_s"] > 0
        assert r["target_passes"] >= 1 and r["mean_accepted_length"] == pytest.approx(
            r["new_tokens"] / r["target_passes"]
        )
        assert r["llama_cpp_python"] and r["use_extra_bufts"] in (False, True, None)
        # the weight buffers as chosen (probe or $SPECDEC_LLAMACPP_EXTRA_BUFTS), and why
        assert r["extra_bufts"].split(":")[0] in ("on", "off", "default")
        assert r["use_extra_bufts"] is None or r["use_extra_bufts"] == r["extra_bufts"].startswith("on")
        # identity against llama.cpp's own greedy and against ours: recorded, both ways
        assert r["same_as_llamacpp_greedy"] == (r["tokens"] == rows["llamacpp-greedy"]["tokens"])
        assert r["first_mismatch_vs_llamacpp_greedy"] == e2e.first_mismatch(
            r["tokens"], rows["llamacpp-greedy"]["tokens"]
        )
        assert r["same_tokens"] == (r["tokens"] == rows["greedy"]["tokens"])
        assert r["first_mismatch"] == e2e.first_mismatch(r["tokens"], rows["greedy"]["tokens"])
    greedy = rows["llamacpp-greedy"]
    assert greedy["mean_accepted_length"] == 1.0 and greedy["target_passes"] == greedy["new_tokens"]
    assert greedy["same_as_llamacpp_greedy"] and greedy["draft_tokens"] is None
    for name in LLAMACPP_METHODS[1:]:
        r = rows[name]
        assert r["mean_accepted_length"] >= 1.0 and r["draft_tokens"] >= r["accepted_draft_tokens"] >= 0
        assert r["accepted_draft_tokens"] == r["new_tokens"] - r["target_passes"]
    overall = {s["method"]: s for s in lines if s["kind"] == "summary" and s["scope"] == "overall"}
    assert overall["llamacpp-greedy"]["speedup_vs_llamacpp_greedy"] == pytest.approx(1.0)
    # decode (after the first token) and end to end, each as a ratio to llama.cpp greedy
    assert overall["llamacpp-greedy"]["decode_speedup_vs_llamacpp_greedy"] == pytest.approx(1.0)
    assert overall["greedy"]["decode_speedup_vs_llamacpp_greedy"] == pytest.approx(
        overall["greedy"]["decode_tokens_per_s"] / overall["llamacpp-greedy"]["decode_tokens_per_s"]
    )
    assert "decode x llama.cpp" in stdout and "# llama.cpp weight buffers: " in stdout
    assert overall["greedy"]["speedup_vs_llamacpp_greedy"] > 0
    assert overall["llamacpp-greedy"]["same_as_llamacpp_greedy_count"] == "1/1"


@needs_model
def test_step_cost_real_skips_llamacpp_without_its_environment(no_llamacpp, tmp_path, capsys, restore_threads):
    rows = step_cost.main(
        ["--real", "--threads", "1", "--sizes", "2", "--min-time", "0.01", "--out", str(tmp_path), "--device", "cpu"]
    )
    want = [("prefill", 300), ("decode", 1), ("chain", 2), ("tree", 2)]
    assert [(r["engine"], r["numerics"], r["kind"], r["N"]) for r in rows] == [
        ("ours", nx, kind, n) for nx in ("float32", "int8") for kind, n in want
    ]
    assert all(r["model"] == step_cost.REAL and r["threads"] == 1 for r in rows)
    assert all(r["prefix"] == (0 if r["kind"] == "prefill" else 300) for r in rows)
    assert all(r["streamed_bytes"] > 0 and r["median_us"] > 0 for r in rows)
    decode = [r for r in rows if r["kind"] == "decode"]
    assert all(r["decode_over_stream"] > 0 and r["copy_gbps"] > 0 for r in decode)
    assert "# skipped llama.cpp: no llama.cpp environment" in capsys.readouterr().out
    lines = read_jsonl(tmp_path / "step_cost.jsonl")
    assert lines[-1]["kind"] == "skipped" and "setup_llamacpp_env.sh" in lines[-1]["reason"]


@needs_model
@needs_llamacpp
def test_step_cost_real_beside_llamacpp(tmp_path, capsys, restore_threads):
    rows = step_cost.main(
        ["--real", "--threads", "1", "--sizes", "2,4", "--min-time", "0.01", "--out", str(tmp_path), "--device", "cpu"]
    )
    theirs = [r for r in rows if r["engine"] == "llama.cpp"]
    assert [(r["kind"], r["N"]) for r in theirs] == [("prefill", 300), ("decode", 1), ("chain", 2), ("chain", 4)]
    assert all(r["median_us"] > 0 and r["threads"] == 1 for r in theirs)
    assert all(r["p20_us"] <= r["p80_us"] for r in theirs[1:])
    assert theirs[1]["ratio_to_decode"] == 1.0
    both = step_cost.side_by_side(rows)
    assert [b["N"] for b in both] == [1, 2, 4, "prefill"]
    assert all(b[f"{nx}_over_llamacpp"] > 0 for b in both for nx in ("float32", "int8"))
    assert "beside llama.cpp" in capsys.readouterr().out


# ---------------------------------------------------------------------- llama.cpp's weight buffers
@pytest.mark.parametrize("value", ["on", "off", "ON "])
def test_extra_bufts_forced_by_the_environment(monkeypatch, value):
    """A forced choice is taken as given, with no probe and no llama.cpp."""
    monkeypatch.setenv(llamacpp.EXTRA_BUFTS_ENV, value)
    monkeypatch.setattr(llamacpp, "probe_extra_bufts", lambda *a, **k: pytest.fail("probed although forced"))
    on, why = llamacpp.extra_bufts_choice(model="unused.gguf")
    assert on == (value.strip().lower() == "on")
    assert why.startswith(value.strip().lower() + ": set by $SPECDEC_LLAMACPP_EXTRA_BUFTS")


def test_extra_bufts_setting_checked(monkeypatch):
    monkeypatch.setenv(llamacpp.EXTRA_BUFTS_ENV, "maybe")
    with pytest.raises(ValueError, match="SPECDEC_LLAMACPP_EXTRA_BUFTS must be auto, on or off"):
        llamacpp.extra_bufts_choice(model="unused.gguf")


def test_extra_bufts_probe_runs_once_per_python_and_model(monkeypatch):
    monkeypatch.delenv(llamacpp.EXTRA_BUFTS_ENV, raising=False)
    monkeypatch.setattr(llamacpp, "_bufts", {})
    calls = []
    monkeypatch.setattr(llamacpp, "probe_extra_bufts", lambda python, model: calls.append(model) or (False, "off: x"))
    for _ in range(3):
        assert llamacpp.extra_bufts_choice("/py", "a.gguf") == (False, "off: x")
    assert llamacpp.extra_bufts_choice("/py", "b.gguf") == (False, "off: x")
    assert calls == ["a.gguf", "b.gguf"]


def test_extra_bufts_probe_reports_a_crash(tmp_path, monkeypatch):
    """A llama.cpp Python that dies of a signal, one that answers errors, and one that hangs:
    each is a failed probe (buffers off) whose reason says what happened."""
    cases = {
        "signal": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n",
        "error": 'import sys\nfor line in sys.stdin:\n    print(\'{"ok": false, "error": "boom"}\', flush=True)\n',
        "hang": "import time\ntime.sleep(60)\n",
    }
    monkeypatch.setattr(llamacpp, "PROBE_TIMEOUT_S", 3)
    for name, body in cases.items():
        script = tmp_path / f"fake_llamacpp_{name}.py"
        script.write_text(body)
        exe = tmp_path / f"python-{name}"
        exe.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
        exe.chmod(0o755)
        on, why = llamacpp.probe_extra_bufts(str(exe), "unused.gguf")
        assert on is False and why.startswith("off: "), (name, why)
        want = {"signal": "killed by signal 11", "error": "boom", "hang": "no answer in 3 s"}[name]
        assert want in why, (name, why)


@needs_model
@needs_llamacpp
def test_extra_bufts_probe_agrees_with_forced_runs(tmp_path):
    """llama.cpp with its default buffers forced on and forced off: off always generates; on
    generates exactly when the probe says so (on this machine's CPU), and the choice is
    reported in the driver's info."""
    on, why = llamacpp.probe_extra_bufts()
    prompt = list(range(200, 230))
    results = {}
    for forced in (False, True):
        driver = llamacpp.Driver(extra_bufts=forced, timeout=120)
        try:
            assert driver.info["extra_bufts"].startswith("on" if forced else "off")
            assert driver.info["use_extra_bufts"] in (forced, None)
            r = driver.request(
                "generate", model=llamacpp.gguf_path(), prompt=prompt, max_new_tokens=6, eos=-1, threads=2
            )
            results[forced] = r["tokens"]
        except RuntimeError as e:  # the driver died: only acceptable with buffers on and a failed probe
            assert forced and not on, f"{why}; forced {forced}: {e}"
            results[forced] = None
        finally:
            driver.close()
    assert len(results[False]) == 6
    assert (results[True] is not None) == on, why
