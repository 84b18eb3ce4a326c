"""On a GPU (``scripts/gpu_check.sh``): the engine's steps with CUDA graphs equal its eager steps.

A random-weight Llama of our own (no transformers, no checkpoint: the GPU machine has neither),
float32 and bfloat16, greedy and seeded sampling, n-gram, EAGLE and Medusa chains and trees:
``SpeculativeDecoder(cuda_graphs=True)`` emits, step by step, what the same decoder emits
eagerly with the same bucketed widths; and the graphs were captured and replayed.  The CPU
runs of the same code path are ``tests/engine/test_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import SamplingParams, SpeculativeDecoder
from specdec_kernels.decoding.drafters.eagle import EagleDrafter, EagleHead
from specdec_kernels.decoding.drafters.medusa import MedusaDrafter, MedusaHeads
from specdec_kernels.decoding.drafters.ngram import NgramDrafter
from specdec_kernels.decoding.model import ModelArgs, Transformer

pytestmark = pytest.mark.requires_cuda

PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 5, 17, 33], [64, 3], [12, 99, 8, 12, 99, 8, 12, 99, 101, 4, 12]]
ARGS = ModelArgs(111, 64, 3, 4, 2, 16, 96)


def _model(dtype) -> Transformer:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Transformer(ARGS)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.3)  # peaked logits: drafts get accepted and rejected
    return model.to(device="cuda", dtype=dtype).eval()


def _drafter(name: str, model: Transformer):
    kind, shape = name.split("-")
    tree = shape == "tree"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        if kind == "eagle":
            head = EagleHead(ARGS.hidden_size, 4, 2, 16, 96, window=16).to(device=model.device, dtype=model.dtype)
            return EagleDrafter(model, head, tree=tree, check_fingerprint=False)
        if kind == "medusa":
            heads = MedusaHeads(ARGS.hidden_size, 3).to(device=model.device, dtype=model.dtype)
            return MedusaDrafter(model, heads, tree=tree, check_fingerprint=False)
    return NgramDrafter(2, tree=tree)


DRAFTERS = ["ngram-chain", "ngram-tree", "eagle-chain", "eagle-tree", "medusa-chain", "medusa-tree"]


SAMPLING = {
    "greedy": (None, "generator"),
    "sampling": (SamplingParams(temperature=0.8), "generator"),
    "philox": (SamplingParams(temperature=0.8, coupling="rejection"), "philox"),
}


@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("mode", list(SAMPLING))
def test_cuda_graph_steps_equal_eager_steps(name, dtype, mode):
    model = _model(dtype)
    sampling, source = SAMPLING[mode]
    runs = []
    for graphs in (False, True):
        dec = SpeculativeDecoder(
            model, _drafter(name, model), cuda_graphs=graphs, node_buckets=True, random_source=source
        )
        state = dec.start(PROMPTS, 24, sampling, seeds=[3, 4, 5])
        steps = []
        for _ in range(8):
            if state.finished:
                break
            dec.step(state, 4)
            steps.append([list(h) for h in state.histories])
        runs.append(steps)
        if graphs:
            assert dec._passes.captures >= 1 and dec._passes.replays >= 1
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", ["ngram-tree", "eagle-tree"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("mode", ["greedy", "philox"])
def test_a_step_synchronises_once(name, graphs, mode):
    """torch's sync debug mode counts the synchronising CUDA calls of each step after the
    first two (Triton's first launches, the captures): one, the copy of the step's results
    (the moves to the device are queued, not synchronised)."""
    import warnings

    model = _model(torch.bfloat16)
    sampling, source = SAMPLING[mode]
    dec = SpeculativeDecoder(model, _drafter(name, model), cuda_graphs=graphs, node_buckets=True, random_source=source)
    state = dec.start([PROMPTS[0] * 3, PROMPTS[2] * 3], 24, sampling, seeds=[3, 4])
    for _ in range(2):
        dec.step(state, 4)
    counts = []
    for _ in range(4):
        if state.finished:
            break
        captures = dec._passes.captures if graphs else 0
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                dec.step(state, 4)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if graphs and dec._passes.captures != captures:
            continue  # a new bucket was captured in this step: capture synchronises
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    assert counts and all(c <= 1 for c in counts), counts
