"""tree_attention's q_layout (issue #58): "HND" takes q as transformers hands it, (batch, heads,
N, head_dim), and returns the output in that layout; it equals "NHD" on the transposed q on
every backend, dense and paged, and says what the shapes cannot when N equals heads."""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels.tree import ancestor_mask
from tests.utils import runnable_backends

BACKENDS = runnable_backends("tree_attention")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(B, N, H, Hkv, D, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, H, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3][:N])
    mask = ancestor_mask(parents)
    lens = torch.tensor([3, 9][:B], dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k, v, lens, mask)]


def paged(k, v, block_size=4):
    """The dense caches as shuffled NHD pools and their block table."""
    B, Hkv, S, D = k.shape
    per_seq = S // block_size
    order = torch.randperm(B * per_seq, generator=torch.Generator().manual_seed(1)).to(k.device)
    table = order.view(B, per_seq).to(torch.int32)

    def pool(c):
        out = torch.empty(B * per_seq, block_size, Hkv, D, device=c.device)
        out[table.long().view(-1)] = (
            c.view(B, Hkv, per_seq, block_size, D).permute(0, 2, 3, 1, 4).reshape(-1, block_size, Hkv, D)
        )
        return out

    return pool(k), pool(v), table


@pytest.mark.parametrize("cache", ["dense", "paged"])
@pytest.mark.parametrize("mask_kind", ["tree", "chain"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_hnd_equals_nhd_on_the_transposed_q(backend, mask_kind, cache):
    q, k, v, lens, mask = inputs(B=2, N=6, H=4, Hkv=2, D=16, S=24)
    mask = mask if mask_kind == "tree" else None
    kw = dict(backend=backend)
    if cache == "paged":
        k, v, kw["block_table"] = paged(k, v)
    nhd = sk.tree_attention(q, k, v, lens, mask, **kw)
    q_hnd = q.transpose(1, 2).contiguous()  # (B, H, N, D), as transformers hands it
    hnd = sk.tree_attention(q_hnd, k, v, lens, mask, q_layout="HND", **kw)
    assert hnd.shape == (2, 4, 6, 16) and hnd.dtype == q.dtype
    assert torch.equal(hnd.transpose(1, 2), nhd)
    assert hnd.transpose(1, 2).is_contiguous()  # back to (B, N, H, D) for free
    # a transposed view of an NHD buffer (transformers' q before .contiguous()) works alike
    assert torch.equal(sk.tree_attention(q.transpose(1, 2), k, v, lens, mask, q_layout="HND", **kw), hnd)


@pytest.mark.parametrize("backend", BACKENDS)
def test_n_equal_to_heads_needs_the_layout_said(backend):
    """N == H: a (B, H, N, D) q passes NHD's shape checks and gives wrong rows silently; said
    as "HND" it gives the attention of the transposed q."""
    q, k, v, lens, mask = inputs(B=2, N=4, H=4, Hkv=2, D=16, S=16, seed=3)
    q_hf = q.transpose(1, 2).contiguous()
    want = sk.tree_attention(q, k, v, lens, mask, backend=backend)  # (B, N, H, D)
    got = sk.tree_attention(q_hf, k, v, lens, mask, q_layout="HND", backend=backend)
    assert torch.equal(got.transpose(1, 2), want)
    guessed = sk.tree_attention(q_hf, k, v, lens, mask, backend=backend)  # the layout left to the default
    assert guessed.shape == want.shape and not torch.allclose(guessed, want, atol=1e-3)


def test_the_kernels_get_a_view_of_q_not_a_copy(monkeypatch):
    """An HND q reaches the backend as a transposed view, on the eager path (the front calls the
    backend itself) and through the registered op (here under a dispatch mode, as when traced)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from specdec_kernels.ops import tree_attention as module

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q, k, v, lens, mask = inputs(B=2, N=6, H=4, Hkv=2, D=16, S=24)
    q_hnd = q.transpose(1, 2).contiguous()
    seen = []
    real = module._dense

    def spy(name, backend, q_arg, *args):
        seen.append(q_arg)
        return real(name, backend, q_arg, *args)

    monkeypatch.setattr(module, "_dense", spy)
    eager = sk.tree_attention(q_hnd, k, v, lens, mask, q_layout="HND")
    with PassThrough():
        registered = sk.tree_attention(q_hnd, k, v, lens, mask, q_layout="HND")
    assert len(seen) == 2 and torch.equal(eager, registered)
    for q_arg in seen:
        assert q_arg.shape == (2, 6, 4, 16) and q_arg.data_ptr() == q_hnd.data_ptr()


def test_layout_errors_name_the_argument_and_the_layout():
    q, k, v, lens, mask = inputs(B=2, N=6, H=4, Hkv=2, D=16, S=24)
    with pytest.raises(ValueError, match="q_layout must be 'NHD' .* or 'HND'"):
        sk.tree_attention(q, k, v, lens, mask, q_layout="BHSD")
    with pytest.raises(TypeError, match="q_layout must be a str"):
        sk.tree_attention(q, k, v, lens, mask, q_layout=None)
    # an HND q whose heads do not divide by kv_heads: the message says how q was read
    bad = torch.randn(2, 3, 6, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"multiple of k_cache's heads .*q_layout='HND': q is \(batch, heads, N"):
        sk.tree_attention(bad, k, v, lens, mask, q_layout="HND")
    # an NHD mistake keeps its message as it was
    with pytest.raises(ValueError, match=r"multiple of k_cache's heads \(2\) \(GQA\)$"):
        sk.tree_attention(bad.transpose(1, 2), k, v, lens, mask)
