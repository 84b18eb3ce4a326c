"""tree_attention's launch plans: the eager front keeps the Triton backend's ``LaunchPlan`` per
metadata signature (shapes, strides, dtypes, devices, layouts, scale, split count, backend)
when no value checks run, and a call of a planned signature only allocates and launches.

A planned call must give the same bits as the unplanned one, a signature that differs in any
of those must get its own plan (or its error), and value checks (validate=True, or None on
CPU tensors) must keep running on every call."""

import pytest
import torch

from specdec_kernels import reset_backends
from specdec_kernels.ops import tree_attention as ta
from specdec_kernels.ops.tree_attention import tree_attention
from tests.ops.tree_attention.test_fast_paths import expected, make_inputs, tree_mask_for
from tests.utils import assert_close, runnable_backends

pytestmark = pytest.mark.skipif("triton" not in runnable_backends("tree_attention"), reason="triton not runnable")


@pytest.fixture(autouse=True)
def no_plans():
    ta._PLANS.clear()
    yield
    ta._PLANS.clear()


def paged(k, v, block):
    """The dense [B, Hkv, S, D] cache as a pool of ``block``-slot NHD blocks and its table."""
    B, Hkv, S, D = k.shape
    pool_k = k.permute(0, 2, 1, 3).reshape(B * S // block, block, Hkv, D)
    pool_v = v.permute(0, 2, 1, 3).reshape(B * S // block, block, Hkv, D)
    table = torch.arange(B * S // block, dtype=torch.int32, device=k.device).view(B, S // block)
    return pool_k, pool_v, table


@pytest.mark.parametrize("mask_kind", ["causal", "shared", "per_seq", "packed"])
@pytest.mark.parametrize("layout", ["dense", "paged", "paged_int64_table", "hnd_q"])
@pytest.mark.parametrize("splits", [None, 3])
def test_a_planned_call_gives_the_unplanned_bits(device, mask_kind, layout, splits):
    B, N, H, Hkv, S, D = 2, 5, 4, 2, 64, 16
    q, k, v, lens = make_inputs(B, N, H, Hkv, S, D, [40, 17], torch.float32, device, seed=1)
    mask = tree_mask_for(mask_kind, B, N, seed=1, device=device)
    kw = dict(num_splits=splits, backend="triton", validate=False)
    if layout.startswith("paged"):
        k, v, table = paged(k, v, 16)
        kw["block_table"] = table.long() if layout == "paged_int64_table" else table
    if layout == "hnd_q":
        kw["q_layout"] = "HND"
        q = q.transpose(1, 2).contiguous()
    first = tree_attention(q, k, v, lens, mask, **kw)
    assert len(ta._PLANS) == 1
    second = tree_attention(q, k, v, lens, mask, **kw)  # planned: checks and configuration skipped
    assert len(ta._PLANS) == 1
    assert torch.equal(first, second)
    want = expected(q.transpose(1, 2) if layout == "hnd_q" else q, *_dense_view(k, v, kw), lens, mask)
    got = second.transpose(1, 2) if layout == "hnd_q" else second
    assert_close(got, want, torch.float32)


def _dense_view(k, v, kw):
    """The dense cache behind ``k``/``v`` (unpaged back when a block table is given)."""
    if "block_table" not in kw:
        return k, v
    B = kw["block_table"].shape[0]
    nb, block, Hkv, D = k.shape
    S = nb * block // B
    return (
        k.reshape(B, S, Hkv, D).permute(0, 2, 1, 3),
        v.reshape(B, S, Hkv, D).permute(0, 2, 1, 3),
    )


def test_planned_calls_read_new_values(device):
    """A plan holds no tensors: the next call's q, cache, lengths and mask are the ones read."""
    B, N, H, Hkv, S, D = 1, 4, 2, 1, 32, 16
    q, k, v, lens = make_inputs(B, N, H, Hkv, S, D, [10], torch.float32, device, seed=2)
    mask = tree_mask_for("per_seq", B, N, seed=2, device=device)
    tree_attention(q, k, v, lens, mask, backend="triton", validate=False)
    q2, k2, v2, _ = make_inputs(B, N, H, Hkv, S, D, [10], torch.float32, device, seed=3)
    lens2 = torch.tensor([20], dtype=torch.int32, device=device)
    mask2 = tree_mask_for("per_seq", B, N, seed=4, device=device)
    got = tree_attention(q2, k2, v2, lens2, mask2, backend="triton", validate=False)
    assert len(ta._PLANS) == 1
    assert_close(got, expected(q2, k2, v2, lens2, mask2), torch.float32)


def test_each_signature_gets_its_own_plan_or_error(device):
    B, N, H, Hkv, S, D = 1, 4, 2, 1, 32, 16
    q, k, v, lens = make_inputs(B, N, H, Hkv, S, D, [10], torch.float32, device, seed=5)
    kw = dict(backend="triton", validate=False)
    tree_attention(q, k, v, lens, **kw)
    tree_attention(q, k, v, lens, sm_scale=0.5, **kw)  # another scale
    tree_attention(q[:, :3], k, v, lens, **kw)  # another N (strides of a view)
    tree_attention(q, k, v, lens.long(), **kw)  # another dtype of cache_seqlens
    assert len(ta._PLANS) == 4
    with pytest.raises(ValueError, match="q"):  # a shape the checks refuse: never planned
        tree_attention(q[..., :8], k, v, lens, **kw)
    with pytest.raises(TypeError, match="q"):
        tree_attention(q.to(torch.int32), k, v, lens, **kw)
    assert len(ta._PLANS) == 4


def test_value_checks_run_on_every_call(device):
    """validate=True (and None on CPU tensors) reads values, which no key holds: never planned."""
    B, N, H, Hkv, S, D = 1, 4, 2, 1, 32, 16
    q, k, v, lens = make_inputs(B, N, H, Hkv, S, D, [10], torch.float32, device, seed=6)
    modes = [True] + ([None] if device.type == "cpu" else [])
    for validate in modes:
        tree_attention(q, k, v, lens, backend="triton", validate=validate)
        full = torch.tensor([S], dtype=torch.int32, device=device)  # no room for the N tree tokens
        with pytest.raises(ValueError, match="capacity|cache_seqlens"):
            tree_attention(q, k, v, full, backend="triton", validate=validate)
    assert not ta._PLANS


def test_reset_backends_forgets_the_plans(device):
    q, k, v, lens = make_inputs(1, 4, 2, 1, 32, 16, [10], torch.float32, device, seed=7)
    tree_attention(q, k, v, lens, backend="triton", validate=False)
    assert ta._PLANS
    reset_backends()
    assert not ta._PLANS


def test_a_grad_call_takes_the_registered_op(device):
    """A planned signature whose q requires grad still refuses it (through the registered op)."""
    q, k, v, lens = make_inputs(1, 4, 2, 1, 32, 16, [10], torch.float32, device, seed=8)
    tree_attention(q, k, v, lens, backend="triton", validate=False)
    with pytest.raises((ValueError, RuntimeError)):
        tree_attention(q.clone().requires_grad_(), k, v, lens, backend="triton", validate=False)
