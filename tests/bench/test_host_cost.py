"""`python -m specdec_kernels.bench.host_cost --quick` runs on CPU and its JSON covers every op, both
grad modes and the reference points (counts are asserted against issue #54's table in
tests/ops/test_host_cost.py; no timing is asserted anywhere)."""

import importlib.util
import json

import pytest
import torch

from specdec_kernels.bench import host_cost

# the bench CLI times calls: run apart from the parallel test workers (scripts/run_tests.sh)
pytestmark = pytest.mark.serial


def test_quick_host_cost_writes_json_table_and_plot(tmp_path, capsys):
    threads = torch.get_num_threads()
    host_cost.main(["--quick", "--out", str(tmp_path), "--device", "cpu"])
    assert torch.get_num_threads() == threads  # the benchmark's 1 thread is not left behind
    rows = [json.loads(line) for line in (tmp_path / "host_cost.jsonl").read_text().splitlines()]
    assert (tmp_path / "host_cost.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    cases = [c.name for c in host_cost.make_cases(torch.device("cpu"))]
    ops = {c.op for c in host_cost.make_cases(torch.device("cpu"))}
    # every public op has a case, measured in both grad modes
    assert ops == {
        "verify_greedy",
        "verify_greedy_flattened",
        "verify_tree_greedy",
        "rejection_sample",
        "rejection_sample_flattened",
        "tree_rejection_sample",
        "sampling_probs",
        "tree_attention",
        "compact_kv_cache",
    }
    measured = {(r["case"], r["mode"]) for r in rows if not r["reference_point"]}
    assert measured == {(c, m) for c in cases for m in host_cost.MODES}
    references = {r["case"] for r in rows if r["reference_point"]}
    assert references == {"torch.empty", "empty torch.library op"}
    for r in rows:
        assert 0 < r["p20_us"] <= r["median_us"] <= r["p80_us"]
        assert r["threads"] == 1 and r["validate"] is False and r["fake_sm_count"] == host_cost.FAKE_SM_COUNT
        if not r["reference_point"]:
            assert r["launches"] >= 1 and r["launches"] == sum(r["launch_names"].values())
            assert r["extra_kernels"] == sum(r["kernel_names"].values())
            assert r["host_reads"] == 0  # validate=False: nothing is read on the host
    table = capsys.readouterr().out
    for c in cases:
        assert c in table


def test_counters_see_kernels_launches_and_host_reads():
    """The counting tools count what they claim: torch kernels (not views or empty
    allocations), host reads, and Triton launches replaced by no-ops."""
    x = torch.ones(4)
    with host_cost.KernelCounter() as c:
        y = x.view(2, 2)  # a view: no kernel
        torch.empty(3)  # an allocation: no kernel
        z = x + 1
        torch.zeros(2)
        float(z.sum())
    assert y.shape == (2, 2)
    assert c.kernels == {"aten::add.Tensor": 1, "aten::zeros.default": 1, "aten::sum.default": 1}
    assert c.host_reads == 1

    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def _poison(ptr):
        tl.store(ptr, 1.0)

    out = torch.zeros(1)
    with host_cost.LaunchCounter(noop=True) as launches:
        _poison[(1,)](out)
        _poison[(1,)](out)
    assert dict(launches.launches) == {"_poison": 2}
    assert float(out) == 0.0  # not run
