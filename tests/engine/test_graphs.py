"""Captured verification passes (``engine.graphs``, ``SpeculativeDecoder(cuda_graphs=True)``).

On CPU the capture mechanism is ``EagerGraph`` (the pass re-run into the captured outputs), so
that everything around it runs here as on a GPU: the shape classes, the static input buffers,
the first pass eager then captured, the replays reading the state's KV cache and
``cache_seqlens`` in place.  Every drafter, greedy and sampling: the tokens of each step equal
the eager steps', and each step still reads the device once.  The CUDA graphs themselves run
in ``scripts/gpu_check.sh`` (``tests/engine/test_graphs_cuda.py``).
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import SpeculativeDecoder
from specdec_kernels.decoding.engine.graphs import CapturedPasses, EagerGraph
from tests.engine.test_host_reads import DRAFTERS, PROMPTS, SAMPLING, STEPS, K, _run
from tests.engine.tiny import tiny, tiny_llama  # noqa: F401 (fixture)


def _graph_run(model, make, sampling, **options):
    """_run with the passes captured (EagerGraph): (reads per step, emitted per step, passes)."""
    passes = CapturedPasses(model, EagerGraph)
    reads, emitted = _run(model, make(model), sampling, True, passes, node_buckets=True, max_draft_nodes=16, **options)
    return reads, emitted, passes


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("mode", ["greedy", "gumbel", "rejection", "philox"])
def test_captured_passes_give_the_eager_steps_tokens(tiny, name, mode):
    model, (sampling, options) = tiny[1], SAMPLING[mode]
    reads, emitted, passes = _graph_run(model, DRAFTERS[name], sampling, **options)
    _, eager = _run(model, DRAFTERS[name](model), sampling, False, max_draft_nodes=16, **options)
    assert emitted == eager
    assert all(len(r) <= 1 for r in reads), reads
    assert passes.captures >= 1 and passes.captures + passes.replays == len(emitted)


def test_a_new_state_drops_the_old_states_graphs(tiny):
    """Graphs read the KV cache they were captured with: another state's first pass (a new
    cache) forgets them instead of replaying them over freed memory."""
    model = tiny[1]
    passes = CapturedPasses(model, EagerGraph)
    dec = SpeculativeDecoder(model, DRAFTERS["ngram-chain"](model), node_buckets=True)
    dec._passes = passes
    for _ in range(2):
        state = dec.start(PROMPTS, 12, seeds=[1, 2, 3])
        for _ in range(STEPS):
            dec.step(state, K)
        assert all(key[4] == state.kv_cache.data_ptr() for key in passes._entries)


def test_cuda_graphs_option_is_checked():
    model = tiny_llama()
    from specdec_kernels.decoding.model import Transformer

    ours = Transformer.from_hf_model(model)
    with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
        SpeculativeDecoder(ours, cuda_graphs=1)
    with pytest.raises(TypeError, match="node_buckets must be a bool"):
        SpeculativeDecoder(ours, node_buckets="yes")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            SpeculativeDecoder(ours, cuda_graphs=True)


@pytest.mark.parametrize("max_draft_nodes", [1, 3, 5])
def test_buckets_capped_by_an_odd_max_draft_nodes(tiny, max_draft_nodes):
    """max_draft_nodes 1, 3, 5 (no power of two above 1): the widest bucket is max_draft_nodes
    itself, and the tokens are the unpadded steps'."""
    model = tiny[1]
    make = DRAFTERS["ngram-tree"]
    _, padded = _run(model, make(model), None, False, node_buckets=True, max_draft_nodes=max_draft_nodes)
    _, plain = _run(model, make(model), None, False, max_draft_nodes=max_draft_nodes)
    assert padded == plain


def test_graphs_beyond_max_graphs_are_dropped_and_recaptured(tiny):
    """max_graphs=1 with steps of changing widths: each new class drops the old graph and is
    captured anew; the tokens are still the eager steps'."""
    model = tiny[1]
    passes = CapturedPasses(model, EagerGraph, max_graphs=1)
    dec = SpeculativeDecoder(model, DRAFTERS["ngram-chain"](model), node_buckets=True)
    dec._passes = passes
    state = dec.start(PROMPTS, 24, seeds=[3, 4, 5])
    steps = []
    for k in (1, 4, 2, 4, 1, 3):
        dec.step(state, k)
        steps.append([list(h) for h in state.histories])
        assert len(passes._entries) <= 1
    eager = SpeculativeDecoder(model, DRAFTERS["ngram-chain"](model))
    state = eager.start(PROMPTS, 24, seeds=[3, 4, 5])
    want = []
    for k in (1, 4, 2, 4, 1, 3):
        eager.step(state, k)
        want.append([list(h) for h in state.histories])
    assert steps == want and passes.captures >= 2
