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
