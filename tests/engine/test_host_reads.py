"""A decode step reads the device once (issue #55): counted on CPU by ``tests/engine/host_reads``.

Every drafter, chain and tree, greedy and sampling (the Gumbel coupling, rejection sampling,
Medusa's typical acceptance), dense and paged caches: each ``SpeculativeDecoder.step`` makes at
most one host read of a device tensor outside its drafter's calls (the one device-to-host copy
of the step's results), and the counted run gives the tokens of an uncounted one.  The counter
itself is tested on a handful of reads it must see and moves it must not count.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import SamplingParams, SpeculativeDecoder
from specdec_kernels.decoding.drafters.eagle import EagleDrafter
from specdec_kernels.decoding.drafters.lookahead import LookaheadDrafter
from specdec_kernels.decoding.drafters.medusa import MedusaDrafter
from specdec_kernels.decoding.drafters.model_drafter import DraftModelDrafter, LayerSkipDrafter
from specdec_kernels.decoding.drafters.multi import MultiDrafter
from specdec_kernels.decoding.drafters.ngram import NgramDrafter
from specdec_kernels.decoding.engine.loop import node_bucket
from tests.engine.host_reads import count_step_reads, device_reads
from tests.engine.test_eagle import random_head
from tests.engine.test_medusa import random_heads
from tests.engine.tiny import PROMPTS, tiny, tiny_llama  # noqa: F401 (fixture)

STEPS, K = 5, 4

DRAFTERS = {
    "ngram-chain": lambda m: NgramDrafter(2),
    "ngram-tree": lambda m: NgramDrafter(2, tree=True),
    "layerskip-chain": lambda m: LayerSkipDrafter(m, 2),
    "layerskip-tree": lambda m: LayerSkipDrafter(m, 2, tree_widths=(2, 2)),
    "draftmodel-chain": lambda m: DraftModelDrafter(m.truncated(2)),
    "eagle-chain": lambda m: EagleDrafter(m, random_head(), check_fingerprint=False),
    "eagle-tree": lambda m: EagleDrafter(m, random_head(), tree=True, check_fingerprint=False),
    "medusa-chain": lambda m: MedusaDrafter(m, random_heads(3), check_fingerprint=False),
    "medusa-tree": lambda m: MedusaDrafter(m, random_heads(3), tree=True, check_fingerprint=False),
    "lookahead": lambda m: LookaheadDrafter(),
    "fallback": lambda m: MultiDrafter([NgramDrafter(2), LayerSkipDrafter(m, 2)], fallback=True),
    "merge": lambda m: MultiDrafter([NgramDrafter(2), LayerSkipDrafter(m, 2)]),
}

SAMPLING = {
    "greedy": (None, {}),
    "gumbel": (SamplingParams(temperature=0.8), {}),
    "rejection": (SamplingParams(temperature=0.8, coupling="rejection"), {}),
    # the sampling ops' numbers computed on the device from seeds and offsets
    "philox": (SamplingParams(temperature=0.8, coupling="rejection"), {"random_source": "philox"}),
}


def _run(model, drafter, sampling, counted: bool, passes=None, **options):
    """STEPS steps of K drafts on PROMPTS: (per-step read lists, emitted tokens); ``passes``: a
    ``CapturedPasses`` the decoder runs its target passes through (tests/engine/test_graphs.py)."""
    dec = SpeculativeDecoder(model, drafter, **options)
    if passes is not None:
        dec._passes = passes
    state = dec.start(PROMPTS, 24, sampling, seeds=[3, 4, 5])  # lookahead draws its guesses from them
    reads, emitted = [], []
    for _ in range(STEPS):
        if state.finished:
            break
        if counted:
            reads.append(count_step_reads(dec, state, K))
        else:
            dec.step(state, K)
        emitted.append([list(h) for h in state.histories])
    return reads, emitted


def _check(model, make, sampling, **options):
    """The counted run reads the device at most once a step and emits, step by step, what an
    uncounted run emits."""
    reads, emitted = _run(model, make(model), sampling, True, **options)
    _, plain = _run(model, make(model), sampling, False, **options)
    assert emitted == plain  # counting changes nothing
    assert reads and all(len(r) <= 1 for r in reads), reads
    assert any(len(r) == 1 for r in reads)  # the one copy is seen (the counter counts)


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("mode", list(SAMPLING))
def test_a_step_reads_the_device_once(tiny, name, mode):
    sampling, options = SAMPLING[mode]
    _check(tiny[1], DRAFTERS[name], sampling, **options)


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("mode", ["greedy", "gumbel"])
def test_bucketed_steps_read_once_and_give_the_unpadded_tokens(tiny, name, mode):
    """``node_buckets=True``: every target pass of a step is one of the bucket widths, the
    step still reads the device once, and every step emits what the unpadded step emits."""
    model, make, sampling = tiny[1], DRAFTERS[name], SAMPLING[mode][0]
    widths = []
    real = model.forward

    def forward(tokens, *args, **kwargs):
        if kwargs.get("host_seqlens") is not None:  # a step's pass (the prefill passes none)
            widths.append(tokens.shape[1])
        return real(tokens, *args, **kwargs)

    model.forward = forward
    try:
        reads, emitted = _run(model, make(model), sampling, True, node_buckets=True, max_draft_nodes=24)
    finally:
        del model.forward
    _, plain = _run(model, make(model), sampling, False, max_draft_nodes=24)
    assert emitted == plain
    assert all(len(r) <= 1 for r in reads) and any(reads), reads
    assert widths and set(widths) <= {1, 2, 4, 8, 16, 24}, sorted(set(widths))


@pytest.mark.parametrize("n, max_nodes, want", [(1, 128, 1), (3, 128, 4), (5, 8, 8), (9, 12, 12), (12, 12, 12)])
def test_node_bucket(n, max_nodes, want):
    assert node_bucket(n, max_nodes) == want


@pytest.mark.parametrize("name", ["ngram-tree", "eagle-tree"])
def test_a_step_on_a_paged_cache_reads_the_device_once(tiny, name):
    _check(tiny[1], DRAFTERS[name], None, block_size=16)


@pytest.mark.parametrize("name", ["ngram-chain", "ngram-tree", "lookahead"])
@pytest.mark.parametrize("mode", ["greedy", "gumbel"])
def test_a_step_through_the_transformers_integration_reads_the_device_once(name, mode):
    """The target as transformers runs it (``HFCausalLM``: our attention inside transformers'
    forward), the loop handing it the cache lengths it keeps on the host."""
    from specdec_kernels.integrations.transformers import HFCausalLM

    with HFCausalLM(tiny_llama()) as target:
        _check(target, DRAFTERS[name], SAMPLING[mode][0])


@pytest.mark.parametrize("random_source", ["generator", "philox"])
def test_typical_acceptance_reads_the_device_once(tiny, random_source):
    _check(tiny[1], DRAFTERS["medusa-tree"], SamplingParams(temperature=0.8), typical=0.09, random_source=random_source)


def test_the_counter_sees_reads_and_not_moves():
    """Reads of marked tensors and of what is computed from them are counted, each kind once;
    host tensors, moves to the device and reads with counting off are not."""
    dev, host = torch.arange(6), torch.arange(6)
    with device_reads(dev) as mode:
        mode.counting = True
        derived = dev * 2 + host
        derived.tolist()
        int(derived[0])
        bool(derived.sum() > 0)
        derived.nonzero()
        derived[derived > 3]
        copy = derived.cpu()
        copy.tolist()  # a host copy: free
        host.tolist()
        float(host[0])
        moved = host.to(torch.device("cpu"))  # not moved by the target's side (this file): stays host
        moved.tolist()
        mode.counting = False
        derived.tolist()
    kinds = [r.split(" at ")[0] for r in mode.reads]
    assert kinds == [
        "Tensor.tolist",
        "aten::_local_scalar_dense",
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "boolean indexing",
        "Tensor.cpu",
    ], kinds


def test_host_seqlens_none_is_read_once_from_the_device(tiny):
    """A caller that drops ``host_seqlens`` (having changed cache_seqlens itself) costs one more
    read on the next step, and the steps go on as before."""
    model = tiny[1]
    dec = SpeculativeDecoder(model, NgramDrafter(2))
    state = dec.start(PROMPTS, 12, seeds=[3, 4, 5])
    dec.step(state, K)
    kept = list(state.host_seqlens)
    state.host_seqlens = None
    reads = count_step_reads(dec, state, K)
    assert len(reads) == 2 and "tolist" in reads[0], reads
    assert state.host_seqlens == state.cache_seqlens.tolist() and state.host_seqlens != kept
