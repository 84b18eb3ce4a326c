"""tree_attention's flash-decoding splits follow the sequences' lengths: the split count is
bounded by the cache's capacity on the host, and the kernels use only the splits that a
sequence's prefix fills (``split_layout``, from cache_seqlens on the device). A split without
keys writes no partials (its guard values stay), the combine reads only the splits that hold
keys, and the partials' traffic stays a fraction of the KV bytes read."""

from functools import partial

import pytest
import torch

from specdec_kernels import _device
from specdec_kernels.ops._tree_attention_launch import MIN_SPLIT_KEYS, active_splits, launch_config, split_layout
from specdec_kernels.ops.tree_attention import tree_attention
from tests.ops.tree_attention.test_fast_paths import expected, make_inputs, tree_mask_for
from tests.utils import assert_close, runnable_backends

GUARD = 12345.0  # what the partial buffers hold before the launch


@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_every_key_lies_in_an_active_split(block_n):
    """The active splits hold every key of the prefix, each holds at least one, and a prefix
    of at least num_splits * MIN_SPLIT_KEYS keys is cut as by num_splits alone."""
    for seqlen in list(range(0, 700, 13)) + [8191, 8192, 8193, 32768]:
        for num_splits in (1, 2, 3, 7, 32):
            for min_keys in (1, MIN_SPLIT_KEYS):
                chunk, active = split_layout(seqlen, num_splits, block_n, min_keys)
                assert 1 <= active <= num_splits and chunk % block_n == 0
                assert active * chunk >= seqlen  # no key left out
                assert (active - 1) * chunk < max(seqlen, 1)  # the last active split holds a key
                if seqlen >= num_splits * min_keys:
                    by_count = -(-(-(-seqlen // num_splits)) // block_n) * block_n
                    assert chunk == by_count
                else:
                    assert active <= max(seqlen // min_keys, 1)


def test_partial_traffic_follows_the_length():
    """B=1, H=32, Hkv=8, D=128, N=16 (bf16) in an 8192-slot cache at length 1000 on a 132-SM
    GPU: the capacity allows 32 splits, the length fills 3 of them; the partials written and
    read back, the KV read and q / out stay within 1.5x of the KV bytes."""
    B, H, Hkv, D, N, capacity, length, elt = 1, 32, 8, 128, 16, 8192, 1000, 2
    cfg = launch_config(B, Hkv, N, H // Hkv, D, 132, capacity=capacity)
    M = (H // Hkv) * N
    kv = (length + N) * B * Hkv * D * elt * 2  # keys and values, prefix and tree
    qo = 2 * B * N * H * D * elt

    def partials(splits):  # written by the forward kernel, read by the combine: o and lse
        return 2 * splits * B * Hkv * M * (D + 1) * 4

    active = active_splits(length, cfg.num_splits, cfg.block_n, cfg.min_split_keys)
    assert cfg.num_splits > 8 and active < cfg.num_splits
    assert kv + partials(active) + qo <= 1.5 * kv
    assert kv + partials(cfg.num_splits) + qo > 1.5 * kv  # every split of the capacity would not be


@pytest.mark.parametrize("min_keys", [None, 1], ids=["default", "one_key_tile"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_a_split_without_keys_writes_nothing(device, monkeypatch, min_keys, paged):
    if "triton" not in runnable_backends("tree_attention"):
        pytest.skip("triton is not runnable here")
    from specdec_kernels.ops._triton import tree_attention as kernels

    buffers = []

    def guarded(rows, M, num_splits, head_dim, device):
        opart = torch.full((rows, M, num_splits, head_dim), GUARD, device=device)
        lse = torch.full((rows, M, num_splits), GUARD, device=device)
        buffers.append((opart, lse))
        return opart, lse

    monkeypatch.setattr(kernels, "split_workspace", guarded)
    if min_keys is not None:
        monkeypatch.setattr(kernels, "launch_config", partial(kernels.launch_config, min_split_keys=min_keys))
    B, N, H, Hkv, S, D, splits = 3, 4, 4, 2, 600, 16, 7
    lens = [520, 0, 150]
    q, k, v, seqlens = make_inputs(B, N, H, Hkv, S, D, lens, torch.float32, device, seed=3)
    mask = tree_mask_for("per_seq", B, N, seed=3, device=device)
    if paged:  # the same cache as one block per slot range: sequence b owns blocks b * 6..
        block = 100
        pool_k = k.permute(0, 2, 1, 3).reshape(B * S // block, block, Hkv, D)
        pool_v = v.permute(0, 2, 1, 3).reshape(B * S // block, block, Hkv, D)
        table = torch.arange(B * S // block, dtype=torch.int32, device=device).view(B, S // block)
        out = tree_attention(q, pool_k, pool_v, seqlens, mask, block_table=table, num_splits=splits, backend="triton")
    else:
        out = tree_attention(q, k, v, seqlens, mask, num_splits=splits, backend="triton")
    assert_close(out, expected(q, k, v, seqlens, mask), torch.float32)

    ((opart, lse),) = buffers
    cfg = kernels.launch_config(B, Hkv, N, H // Hkv, D, _device.sm_count(q.device), num_splits=splits)
    actives = [active_splits(n, splits, cfg.block_n, cfg.min_split_keys) for n in lens]
    assert max(actives) < splits and (min_keys is None or max(actives) > 1)
    for b, active in enumerate(actives):
        rows = slice(b * Hkv, (b + 1) * Hkv)
        assert (lse[rows, :, active:] == GUARD).all() and (opart[rows, :, active:] == GUARD).all()
        assert (lse[rows, :, :active] != GUARD).all()  # the active splits did write
