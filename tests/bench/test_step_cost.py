"""`python -m specdec_kernels.bench.step_cost` runs on a tiny random model and writes its JSON and plot."""

import importlib.util
import json

from specdec_kernels.bench import step_cost


def test_tiny_step_cost(tmp_path):
    rows = step_cost.main(
        [
            "--models",
            "tiny",
            "--prefix",
            "32",
            "--sizes",
            "2,4",
            "--min-time",
            "0.01",
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
        ]
    )
    lines = [json.loads(x) for x in (tmp_path / "step_cost.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["N"]) for r in lines] == [("decode", 1), ("chain", 2), ("tree", 2), ("chain", 4), ("tree", 4)]
    assert lines[0]["ratio_to_decode"] == 1.0 and all(r["median_us"] > 0 for r in lines)
    # the plot exactly when matplotlib is installed (always in CI; the GPU machine may lack it)
    assert (tmp_path / "step_cost.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    assert not (tmp_path / "step_cost.png").exists() or (tmp_path / "step_cost.png").stat().st_size > 0
    assert len(rows) == len(lines)


def test_bushy_tree_is_topological():
    parents = step_cost.bushy_tree(64)
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
