"""bench.flashinfer_side (the GPU check's side-by-side with FlashInfer): flags are checked
before any work, and without CUDA it says so and exits 2 (its pairs run on the GPU machine)."""

import pytest
import torch

from specdec_kernels.bench import flashinfer_side


def test_unknown_pair_is_refused():
    with pytest.raises(SystemExit) as e:
        flashinfer_side.main(["--pairs", "sampling,bogus"])
    assert e.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_without_cuda_it_exits_2(tmp_path, capsys):
    assert flashinfer_side.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "flashinfer.jsonl").exists()


def test_rows_carry_eager_and_graph_times(monkeypatch):
    """_row's ratios and format_row's line, with the timers replaced (they need CUDA): a side
    that cannot be captured shows '-' and no graph ratio."""
    from specdec_kernels.bench import common

    eager = iter([30.0, 10.0])
    monkeypatch.setattr(flashinfer_side, "_time_us", lambda fn: next(eager))
    graphs = {"ours": {"median_us": 4.0}, "theirs": {"median_us": 8.0}}
    monkeypatch.setattr(common, "time_graph_replay", lambda fn, device: graphs[fn()])
    r = flashinfer_side._row("op", "B=1", lambda: "ours", lambda: "theirs", "fi.fn", 1000)
    assert r["ratio_ours_over_flashinfer"] == 3.0 and r["graph_ratio_ours_over_flashinfer"] == 0.5
    assert r["ours_gbps"] == 1000 / 30e-6 / 1e9
    line = flashinfer_side.format_row(r)
    assert line.split()[-6:] == ["30.0", "10.0", "3.00", "4.0", "8.0", "0.50"]
    graphs["theirs"] = None
    eager = iter([30.0, 10.0])
    r = flashinfer_side._row("op", "B=1", lambda: "ours", lambda: "theirs", "fi.fn", 1000)
    assert r["graph_flashinfer_us"] is None and r["graph_ratio_ours_over_flashinfer"] is None
    assert flashinfer_side.format_row(r).split()[-3:] == ["4.0", "-", "-"]
