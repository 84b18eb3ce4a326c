"""compact_kv_cache: gather from a snapshot copy, overlap hazards, layouts, bad input."""

import re

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.utils import over_bad_inputs, runnable_backends

BACKENDS = runnable_backends("compact_kv_cache")


def snapshot_oracle(cache, seqlens, indices, counts):
    """Gather every source row from an untouched copy, then write: overlap cannot matter."""
    snap = cache.clone()
    want = cache.clone()
    for b in range(cache.shape[2]):
        for i in range(int(counts[b])):
            want[:, :, b, :, int(seqlens[b]) + i] = snap[:, :, b, :, int(seqlens[b]) + int(indices[b, i])]
    return want


@pytest.fixture(params=BACKENDS)
def compact(request, device):
    def run(cache, *args, **kw):
        moved = cache.to(device, copy=True)
        sk.compact_kv_cache(moved, *(a.to(device) for a in args), backend=request.param, **kw)
        return moved.cpu()

    return run


def test_overlapping_sources_and_destinations(compact):
    # seq 0: slots 2, 3 move to 1, 2 (slot 2 is both a source and a destination);
    # seq 1: [1, 2, 3, 5] moves 1->0, 2->1, 3->2, 5->3.
    L, B, Hkv, S, D = 2, 2, 3, 10, 5
    cache = torch.arange(L * 2 * B * Hkv * S * D, dtype=torch.float32).reshape(L, 2, B, Hkv, S, D)
    seqlens = torch.tensor([1, 2])
    indices = torch.tensor([[0, 2, 3, -1], [1, 2, 3, 5]])
    counts = torch.tensor([3, 4])
    out = compact(cache, seqlens, indices, counts)
    assert torch.equal(out, snapshot_oracle(cache, seqlens, indices, counts))
    # by hand, one row: seq 1 slot 2 (first destination) now holds slot 3's values
    assert torch.equal(out[0, 0, 1, 0, 2], cache[0, 0, 1, 0, 3])
    # nothing past the accepted block changed
    assert torch.equal(out[:, :, 1, :, 6:], cache[:, :, 1, :, 6:])


def test_zero_and_identity_moves_change_nothing(compact):
    cache = torch.randn(1, 2, 2, 1, 8, 4)
    out = compact(cache, torch.tensor([2, 3]), torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.tensor([3, 0]))
    assert torch.equal(out, cache)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.float64],
    ids=["fp32", "fp16", "bf16", "u8", "fp64"],
)
def test_random_trees_ragged_batch(compact, dtype):
    g = torch.Generator().manual_seed(0)
    L, B, Hkv, S, D, M = 3, 4, 2, 32, 67, 6
    cache = (torch.rand(L, 2, B, Hkv, S, D, generator=g) * 100).to(dtype)
    seqlens = torch.tensor([0, 5, 13, 20])
    counts = torch.tensor([0, 6, 3, 2])
    indices = torch.full((B, M), -1)
    for b in range(B):  # a random accepted path: strictly increasing, index >= position
        n = int(counts[b])
        offsets = torch.randint(0, 3, (n,), generator=g).cumsum(0)
        indices[b, :n] = torch.arange(n) + offsets
    out = compact(cache, seqlens, indices, counts)
    assert torch.equal(out, snapshot_oracle(cache, seqlens, indices, counts))


def test_per_layer_list_layout_matches_the_single_buffer():
    g = torch.Generator().manual_seed(1)
    L, B, Hkv, S, D = 2, 2, 3, 12, 8
    cache = torch.randn(L, 2, B, Hkv, S, D, generator=g)
    args = (torch.tensor([1, 4]), torch.tensor([[1, 3], [0, 2]]), torch.tensor([2, 1]))
    as_list = [cache[l, kv].clone() for l in range(L) for kv in range(2)]
    as_pairs = [(cache[l, 0].clone(), cache[l, 1].clone()) for l in range(L)]
    sk.compact_kv_cache(cache, *args)
    sk.compact_kv_cache(as_list, *args)
    sk.compact_kv_cache(as_pairs, *args)
    assert torch.equal(torch.stack(as_list).reshape(cache.shape), cache)
    assert torch.equal(torch.stack([torch.stack(p) for p in as_pairs]), cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_layer_keys_and_values_tensors_match_the_single_buffer(backend, device):
    """One layer's keys and values as one [2, B, Hkv, S, D] tensor (vLLM's per-layer form),
    alone or a list of them, give the [L, 2, B, Hkv, S, D] buffer's result."""
    g = torch.Generator().manual_seed(2)
    L, B, Hkv, S, D = 3, 2, 2, 10, 4
    cache = torch.randn(L, 2, B, Hkv, S, D, generator=g).to(device)
    args = [t.to(device) for t in (torch.tensor([2, 0]), torch.tensor([[0, 2, 5], [1, 3, 4]]), torch.tensor([3, 2]))]
    layers = [cache[l].clone() for l in range(L)]
    one = cache[1].clone()
    sk.compact_kv_cache(cache, *args, backend="reference")
    sk.compact_kv_cache(layers, *args, backend=backend)
    sk.compact_kv_cache(one, *args, backend=backend)
    assert torch.equal(torch.stack(layers), cache)
    assert torch.equal(one, cache[1])


_SHARED = torch.zeros(1, 1, 8, 4)
BAD = {
    "not_increasing": (dict(accepted_indices=torch.tensor([[2, 2]])), ValueError, "increasing"),
    "index_below_position": (
        dict(accepted_indices=torch.tensor([[0, 0]]), num_slots=torch.tensor([2])),
        ValueError,
        ">= i",
    ),
    "index_beyond_capacity": (dict(accepted_indices=torch.tensor([[0, 9]])), ValueError, "capacity"),
    "count_range": (dict(num_slots=torch.tensor([3])), ValueError, "num_slots must lie in 0..2"),
    "seqlens_shape": (dict(cache_seqlens=torch.tensor([1, 2])), ValueError, "cache_seqlens"),
    "indices_dtype": (dict(accepted_indices=torch.tensor([[0.0, 1.0]])), TypeError, "accepted_indices"),
    "layer_shapes": (dict(kv_cache=[torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 9, 4)]), ValueError, "kv_cache[1]"),
    "layer_dtypes": (
        dict(kv_cache=[torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 8, 4, dtype=torch.float16)]),
        TypeError,
        "kv_cache[1]",
    ),
    "cache_rank": (dict(kv_cache=torch.zeros(1, 1, 8, 4)), ValueError, "kv_cache"),
    "cache_type": (dict(kv_cache="cache"), TypeError, "kv_cache"),
    # in-place compaction must write every element once: no self-overlap, no aliasing
    "expanded_heads": (
        dict(kv_cache=torch.zeros(1, 2, 1, 1, 8, 4).expand(1, 2, 1, 3, 8, 4)),
        ValueError,
        "overlaps itself",
    ),
    "same_tensor_twice": (dict(kv_cache=[_SHARED, _SHARED]), ValueError, "alias"),
    "six_dims_not_kv": (dict(kv_cache=torch.zeros(1, 3, 1, 1, 8, 4)), ValueError, "[L, 2"),
}


@over_bad_inputs(sk.compact_kv_cache, BAD)
def test_bad_input(fn, case):
    args = dict(
        kv_cache=torch.zeros(1, 2, 1, 1, 8, 4),
        cache_seqlens=torch.tensor([3]),
        accepted_indices=torch.tensor([[0, 2]]),
        num_slots=torch.tensor([2]),
    )
    override, err, name = BAD[case]
    args.update(override)
    snapshot = args["kv_cache"].clone() if isinstance(args["kv_cache"], torch.Tensor) else None
    with pytest.raises(err, match=re.escape(name)):
        fn(**args)
    if snapshot is not None:  # a rejected call changes nothing
        assert torch.equal(args["kv_cache"], snapshot)


@pytest.mark.parametrize("backend", BACKENDS)
def test_permuted_buffer_is_written_in_place(backend):
    """A [2, L, ...] allocation seen as [L, 2, ...] cannot be flattened without a copy."""
    storage = torch.arange(2 * 3 * 1 * 1 * 6 * 2, dtype=torch.float32).reshape(2, 3, 1, 1, 6, 2)
    cache = storage.transpose(0, 1)  # [L=3, 2, B=1, Hkv=1, S=6, D=2], a view
    args = (torch.tensor([1]), torch.tensor([[2]]), torch.tensor([1]))
    want = snapshot_oracle(cache.contiguous(), *args)
    sk.compact_kv_cache(cache, *args, backend=backend)
    assert torch.equal(cache, want) and torch.equal(storage.transpose(0, 1), want)


def test_meta_cache_is_a_shape_only_no_op():
    """On the meta device (shapes without data) the reference backend checks the arguments and
    moves nothing."""
    m = "meta"
    out = sk.compact_kv_cache(
        torch.zeros(1, 2, 1, 1, 8, 4, device=m),
        torch.tensor([3], device=m),
        torch.tensor([[0, 2]], device=m),
        torch.tensor([2], device=m),
        backend="reference",
    )
    assert out is None
    assert (
        reference.compact_kv_cache(
            torch.zeros(1, 2, 1, 1, 8, 4, device=m),
            torch.tensor([3], device=m),
            torch.tensor([[0, 2]], device=m),
            torch.tensor([2], device=m),
        )
        is None
    )
    with pytest.raises(ValueError, match="accepted_indices"):
        sk.compact_kv_cache(
            torch.zeros(1, 2, 1, 1, 8, 4, device=m),
            torch.tensor([3], device=m),
            torch.tensor([[0, 2]], device=m)[0],
            torch.tensor([2], device=m),
            backend="reference",
        )
