"""The benchmarks' timers (specdec_kernels.bench.common): graph-replay timing on CUDA."""

import pytest
import torch


def test_graph_replay_timing_is_cuda_only():
    from specdec_kernels.bench.common import time_graph_replay

    assert time_graph_replay(lambda: torch.ones(3).add_(1), torch.device("cpu")) is None


@pytest.mark.requires_cuda
def test_graph_replay_times_capturable_calls_and_refuses_host_reads():
    from specdec_kernels.bench.common import time_graph_replay

    x = torch.zeros(1 << 20, device="cuda")
    t = time_graph_replay(lambda: x.add_(1), torch.device("cuda"))
    assert t is not None and 0 < t["p20_us"] <= t["median_us"] <= t["p80_us"]
    assert time_graph_replay(lambda: x.sum().item(), torch.device("cuda")) is None
    x.add_(1)  # the device is still usable after a refused capture
    torch.cuda.synchronize()
