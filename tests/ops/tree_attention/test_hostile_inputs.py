"""tree_attention: hostile inputs with value checks off (validate=False, the CUDA default); the
guard buffers and the rule they check are described in tests/ops/hostile.py."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.ops.hostile import in_guard
from tests.utils import gen, runnable_backends


@pytest.mark.parametrize("backend", runnable_backends("tree_attention", "cpu"))
def test_tree_attention_invisible_slots_never_reach_the_output(backend):
    """Slots past a sequence (NaN, as torch.empty may leave them) and other sequences' slots
    never change the output, on every backend, for ragged batches."""
    B, N, H, Hkv, S, D = 3, 4, 4, 2, 32, 16
    g = gen(6)
    q = torch.randn(B, N, H, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    lens = torch.tensor([3, 17, 0], dtype=torch.int32)
    mask = sk.tree.ancestor_mask([-1, 0, 0, 1])
    want = reference.tree_attention(q, k, v, lens, mask)
    k_nan, v_nan = k.clone(), v.clone()
    for b in range(B):
        end = int(lens[b]) + N
        k_nan[b, :, end:] = float("nan")
        v_nan[b, :, end:] = float("nan")
    got = sk.tree_attention(q, k_nan, v_nan, lens, mask, backend=backend, validate=False)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", runnable_backends("tree_attention", "cpu"))
def test_tree_attention_out_of_range_lengths_are_clamped(backend):
    """cache_seqlens past S - N (2**30 once killed the process for memory) or negative act
    as the nearest valid length; nothing outside the caches is read."""
    B, N, H, Hkv, S, D = 2, 2, 2, 1, 16, 16
    g = gen(7)
    q = torch.randn(B, N, H, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    for bad, clamped in ((2**30, S - N), (S, S - N), (-4, 0)):
        lens = torch.tensor([5, bad], dtype=torch.int32)
        want = reference.tree_attention(q, k, v, torch.tensor([5, clamped], dtype=torch.int32))
        got = sk.tree_attention(
            q, in_guard(k, float("nan")), in_guard(v, float("nan")), lens, backend=backend, validate=False
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", runnable_backends("tree_attention", "cpu"))
@pytest.mark.parametrize("where", ["v", "k", "both"])
def test_tree_attention_masked_tree_slot_with_nan_reaches_only_its_viewers(backend, where):
    """A padding node of a tree (mask column empty for the real queries) whose K/V slot holds
    NaN or inf: the real queries' outputs are the reference's on clean data; a query that does
    see a NaN slot gets NaN (once every backend leaked NaN into all queries through 0 * NaN,
    and the torch path through an additive -inf mask plus inf)."""
    B, N, H, Hkv, S, D = 2, 5, 4, 2, 24, 16
    g = gen(11)
    q = torch.randn(B, N, H, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    lens = torch.tensor([4, 9], dtype=torch.int32)
    mask = sk.tree.ancestor_mask([-1, 0, 0, 1, 2])
    mask[:4, 4] = False  # node 4 (a padding node): no other query sees it
    want = reference.tree_attention(q, k, v, lens, mask)
    kb, vb = k.clone(), v.clone()
    for b in range(B):
        slot = int(lens[b]) + 4
        if where in ("v", "both"):
            vb[b, :, slot, 3] = float("nan")
        if where in ("k", "both"):
            kb[b, :, slot, 0] = float("inf")
    got = sk.tree_attention(q, kb, vb, lens, mask, backend=backend, validate=False)
    torch.testing.assert_close(got[:, :4], want[:, :4], atol=1e-5, rtol=1e-5)  # queries 0..3 do not see it
    assert got[:, 4].isnan().all()  # query 4 sees its own garbage slot


def test_direct_op_num_splits_out_of_range_is_a_value_error():
    q = torch.randn(1, 1, 2, 16)
    k = torch.randn(1, 1, 4, 16)
    for bad in (-1, 1000):
        with pytest.raises(ValueError, match="num_splits"):
            torch.ops.specdec.tree_attention(q, k, k, torch.tensor([1], dtype=torch.int32), None, 0.25, bad)
