"""`python -m specdec_kernels.bench.kernels --quick` runs, checks results, and its JSON covers every op and backend."""

import importlib
import importlib.util
import json

import pytest
import torch

from specdec_kernels import _backend
from specdec_kernels.bench import kernels

# the bench CLI, timing with all threads: run apart from the parallel test workers (scripts/run_tests.sh)
pytestmark = pytest.mark.serial


def test_quick_benchmark_writes_json_and_plot(tmp_path):
    kernels.main(["--quick", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "kernels.jsonl").read_text().splitlines()]
    # the plot exactly when matplotlib is installed (always in CI; the GPU machine may lack it)
    assert (tmp_path / "kernels.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    assert not (tmp_path / "kernels.png").exists() or (tmp_path / "kernels.png").stat().st_size > 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for entry in kernels.ENTRIES:
        mine = [r for r in rows if r["op"] == entry.op]
        assert mine, f"no rows for {entry.op}"
        want = set(kernels.backends_here(entry.op, device)) | set(entry.baselines)
        assert {r["backend"] for r in mine} == want
        implemented = importlib.import_module(f"specdec_kernels.ops.{entry.op}").IMPLEMENTED
        for b in implemented:  # every backend that can run here, except the interpreter, is timed
            runs = _backend._can_run(b, entry.op, device) is None and not (b == "triton" and device.type != "cuda")
            assert runs == (b in want)
    for r in rows:
        assert r["median_us"] > 0 and r["p20_us"] <= r["median_us"] <= r["p80_us"]
        assert r["bytes"] > 0 and r["commit"] and r["torch"] == torch.__version__


def test_plot_draws_only_ops_with_data_and_names_the_rest(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    seen = {}
    real_suptitle = plt.Figure.suptitle

    def spy(self, text, **kw):
        seen["title"] = text
        seen["axes"] = len(self.axes)
        return real_suptitle(self, text, **kw)

    monkeypatch.setattr(plt.Figure, "suptitle", spy)
    row = dict(shape_str="B=1", speedup_vs_reference=2.0)
    rows = [
        dict(op="a", backend="reference", **row),
        dict(op="a", backend="torch", **row),
        dict(op="b", backend="reference", **row),
    ]
    kernels.plot(rows, tmp_path / "p.png", {"device": "cpu", "commit": "abc"})
    assert seen["axes"] == 1  # only op a has a fast path
    assert "reference only): b" in seen["title"]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_decode_shape_set_covers_the_gpu_checks_shapes():
    """``--decode`` (scripts/gpu_check.sh): every verify / sampling op at B 1 / 8 / 64 and
    V 49152 / 128256 with K 4 (trees N 16); attention at both models' dimensions."""
    for fn, key in ((kernels._verify_shapes, "K"), (kernels._tree_shapes, "N")):
        got = {(s["B"], s["V"], s[key]) for s in fn("decode")}
        assert got == {(b, v, 4 if key == "K" else 16) for b in (1, 8, 64) for v in (49152, 128256)}
    attention = kernels._attention_shapes("decode")
    assert {(s["model"], s["B"]) for s in attention} == {(m, b) for m in kernels.DECODE_MODELS for b in (1, 8, 64)}
    assert (
        len(kernels._verify_shapes("quick"))
        < len(kernels._verify_shapes("decode"))
        < len(kernels._verify_shapes("full"))
    )


def test_quick_and_decode_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        kernels.main(["--quick", "--decode"])
    assert "--quick and --decode" in capsys.readouterr().err
