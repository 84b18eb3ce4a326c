"""``python -m specdec_kernels.bench.step_graphs`` on CPU (the tiny shape, ``EagerGraph``
standing in for the CUDA graph): it checks both modes' tokens equal, then writes its table
and JSON lines; bad flags stop it before any model is built."""

import json

import pytest

from specdec_kernels.bench import step_graphs


def test_quick_run_writes_rows(tmp_path, capsys):
    rc = step_graphs.main(["--prefix", "8", "--steps", "2", "--batch", "1,2", "--nodes", "4", "--out", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "step_graphs.jsonl").read_text().splitlines()]
    assert [(r["batch"], r["kind"]) for r in rows] == [(1, "tree"), (1, "chain"), (2, "tree"), (2, "chain")]
    for r in rows:
        assert r["graph_mechanism"] == "eager stand-in (CPU)" and r["captures"] >= 1
        assert r["eager_us"] > 0 and r["graph_us"] > 0 and r["commit"]
    assert "eager/graph" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [(["--nodes", "1"], "--nodes"), (["--steps", "0"], "--steps"), (["--batch", "x"], "--batch")],
)
def test_bad_flags_stop_before_the_model(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        step_graphs.main(argv + ["--out", str(tmp_path)])
    assert e.value.code == 2 and message in capsys.readouterr().err
