"""`python -m bench.kernels --quick` runs, checks results, and its JSON covers every op and backend."""
import importlib
import json

import torch

from bench import kernels
from specdec_kernels import _backend


def test_quick_benchmark_writes_json_and_plot(tmp_path):
    kernels.main(["--quick", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "kernels.jsonl").read_text().splitlines()]
    assert (tmp_path / "kernels.png").stat().st_size > 0
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
