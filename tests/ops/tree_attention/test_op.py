"""tree_attention: hand-worked cases, an independent per-query oracle, and bad input."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.tree import ancestor_mask, path_to
from tests.utils import assert_close, bad_input_test, each_dtype, on_each_backend, runnable_backends

BACKENDS = runnable_backends("tree_attention")


attend = on_each_backend(sk.tree_attention, BACKENDS)


def test_zero_queries_average_their_visible_values(attend):
    # prefix of 1 key; two sibling tree nodes (each sees the prefix and itself)
    D = 16
    v = torch.zeros(1, 1, 4, D)
    v[0, 0, 0], v[0, 0, 1], v[0, 0, 2], v[0, 0, 3] = 1.0, 3.0, 5.0, 100.0  # slot 3 is beyond the block
    out = attend(
        torch.zeros(1, 2, 1, D),
        torch.randn(1, 1, 4, D),
        v,
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([[True, False], [False, True]]),
    )
    assert torch.allclose(out[0, :, 0], torch.tensor([[2.0] * D, [3.0] * D]))


def test_chain_mask_none_is_causal(attend):
    D = 16
    v = torch.arange(4, dtype=torch.float32).repeat_interleave(D).reshape(1, 1, 4, D)
    out = attend(torch.zeros(1, 3, 1, D), torch.zeros(1, 1, 4, D), v, torch.tensor([0], dtype=torch.int32))
    # query i sees slots 0..i: means 0, 0.5, 1
    assert torch.allclose(out[0, :, 0, 0], torch.tensor([0.0, 0.5, 1.0]))


def test_peaked_query_picks_its_key(attend):
    D = 16
    k = torch.zeros(1, 1, 3, D)
    k[0, 0, 1, 0] = 1.0
    v = torch.eye(3).repeat(1, D // 3 + 1)[:, :D].reshape(1, 1, 3, D)
    q = torch.zeros(1, 1, 1, D)
    q[0, 0, 0, 0] = 200.0
    out = attend(q, k, v, torch.tensor([2], dtype=torch.int32), sm_scale=1.0)
    assert torch.allclose(out[0, 0, 0], v[0, 0, 1], atol=1e-6)


def oracle(q, k_cache, v_cache, cache_seqlens, mask, scale):
    """Per query and head: softmax over the explicitly listed visible slots, in float64."""
    B, N, H, D = q.shape
    group = H // k_cache.shape[1]
    out = torch.zeros(B, N, H, D, dtype=torch.float64)
    for b in range(B):
        L = int(cache_seqlens[b])
        for i in range(N):
            m = mask if mask.dim() == 2 else mask[b]
            slots = list(range(L)) + [L + j for j in range(N) if m[i, j]]
            for h in range(H):
                keys = k_cache[b, h // group, slots].double()
                w = torch.softmax(keys @ q[b, i, h].double() * scale, 0)
                out[b, i, h] = w @ v_cache[b, h // group, slots].double()
    return out


@each_dtype
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 4, 16), (8, 2, 32)], ids=["gqa9-3_d64", "mha4_d16", "gqa8-2_d32"])
def test_against_the_oracle(attend, dtype, H, Hkv, D):
    g = torch.Generator().manual_seed(0)
    B, N, S = 3, 6, 24
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 0, 0]])
    mask = ancestor_mask(parents)
    seqlens = torch.tensor([0, 7, 18], dtype=torch.int32)
    q = torch.randn(B, N, H, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    out = attend(q, k, v, seqlens, mask)
    assert out.dtype == dtype and out.shape == (B, N, H, D)
    assert_close(out, oracle(q, k, v, seqlens, mask, D**-0.5), dtype)


def test_each_node_equals_causal_attention_over_its_path(attend):
    g = torch.Generator().manual_seed(1)
    parents = [-1, 0, 0, 1, 1, 2, 4]
    N, H, Hkv, D, L, S = len(parents), 6, 2, 32, 5, 20
    q = torch.randn(1, N, H, D, generator=g)
    k = torch.randn(1, Hkv, S, D, generator=g)
    v = torch.randn(1, Hkv, S, D, generator=g)
    seqlens = torch.tensor([L], dtype=torch.int32)
    out = attend(q, k, v, seqlens, ancestor_mask(parents))
    for node in range(N):
        path = path_to(parents, node)
        slots = list(range(L)) + [L + j for j in path]
        kc, vc = torch.zeros_like(k), torch.zeros_like(v)
        kc[:, :, : len(slots)], vc[:, :, : len(slots)] = k[:, :, slots], v[:, :, slots]
        chain = reference.tree_attention(q[:, path], kc, vc, seqlens)  # mask None: causal chain
        torch.testing.assert_close(out[0, node], chain[0, -1], atol=1e-5, rtol=1e-5)


BAD = {
    "mask_size": (dict(tree_mask=torch.ones(3, 3, dtype=torch.bool)), ValueError, "tree_mask"),
    "mask_dtype": (dict(tree_mask=torch.ones(2, 2)), TypeError, "tree_mask"),
    "beyond_capacity": (dict(cache_seqlens=torch.tensor([7], dtype=torch.int32)), ValueError, "cache_seqlens"),
    "head_dim": (
        dict(q=torch.zeros(1, 2, 4, 20), k_cache=torch.zeros(1, 2, 8, 20), v_cache=torch.zeros(1, 2, 8, 20)),
        ValueError,
        "head dim",
    ),
    "heads_not_multiple": (dict(q=torch.zeros(1, 2, 3, 16)), ValueError, "multiple"),
    "kv_dtype": (dict(k_cache=torch.zeros(1, 2, 8, 16, dtype=torch.float16)), TypeError, "k_cache"),
    "kv_shape": (dict(v_cache=torch.zeros(1, 2, 9, 16)), ValueError, "v_cache"),
    "seqlens_dtype": (dict(cache_seqlens=torch.tensor([1.0])), TypeError, "cache_seqlens"),
}


test_bad_input = bad_input_test(
    sk.tree_attention,
    BAD,
    lambda: dict(
        q=torch.zeros(1, 2, 4, 16),
        k_cache=torch.zeros(1, 2, 8, 16),
        v_cache=torch.zeros(1, 2, 8, 16),
        cache_seqlens=torch.tensor([3], dtype=torch.int32),
        tree_mask=torch.ones(2, 2, dtype=torch.bool),
    ),
)
