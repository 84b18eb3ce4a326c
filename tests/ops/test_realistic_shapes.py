"""Every fast path against the reference at real model shapes.

With SPECDEC_TEST_LARGE=1 (set by scripts/gpu_check.sh on a GPU machine) the shapes are the
real ones (Llama-3-8B / Qwen2.5-7B vocabularies, batch 64, 64-node trees, prefix 4096, 32
layers); otherwise scaled-down versions of the same cases run here, in the Triton interpreter.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from specdec_kernels.tree import ancestor_mask
from tests.conftest import LARGE
from tests.ops.sampling import random_uniforms
from tests.utils import assert_close, runnable_backends, to_device

FAST = lambda op: [b for b in runnable_backends(op) if b != "reference"]  # noqa: E731

VERIFY = (
    [dict(B=64, K=8, V=128256), dict(B=1, K=8, V=49152), dict(B=8, K=5, V=152064)]
    if LARGE
    else [dict(B=3, K=5, V=1000), dict(B=1, K=8, V=4099)]
)
TREES = [dict(B=64, N=64, V=128256), dict(B=1, N=16, V=49152)] if LARGE else [dict(B=2, N=9, V=777)]
ATTN = (
    [dict(B=8, H=32, Hkv=8, D=128, P=4096, N=64), dict(B=1, H=9, Hkv=3, D=64, P=16384, N=16)]
    if LARGE
    else [dict(B=2, H=9, Hkv=3, D=64, P=100, N=7)]
)
COMPACT = [dict(L=32, B=8, Hkv=8, S=4096, D=128, M=8)] if LARGE else [dict(L=4, B=3, Hkv=3, S=64, D=64, M=8)]


def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tree_parents(n, g):
    return torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])


def parents_argmax(rows, parents):
    """Tree tokens [B, N]: each node's token is the argmax of its parent's row (the root's own)."""
    return rows.argmax(-1).gather(1, parents.clamp(min=0)[None].expand(rows.shape[0], -1)).contiguous()


def assert_equals_reference(op, backend, *args, **kwargs):
    """``op`` on ``backend`` gives the reference's integer outputs exactly."""
    got = getattr(sk, op)(*args, backend=backend, **kwargs)
    want = getattr(reference, op)(*args, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("backend", FAST("verify_greedy"))
@pytest.mark.parametrize("s", VERIFY, ids=str)
def test_verify_greedy(s, backend):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(s["B"], s["K"] + 1, s["V"], generator=g, dtype=torch.float32).to(device(), torch.bfloat16)
    drafts = logits[:, :-1].float().argmax(-1)
    drafts[:, s["K"] // 2] += 1
    assert_equals_reference("verify_greedy", backend, logits, drafts)


@pytest.mark.parametrize("backend", FAST("rejection_sample"))
@pytest.mark.parametrize("s", VERIFY, ids=str)
def test_rejection_sample(s, backend):
    g = torch.Generator().manual_seed(1)
    B, K, V = s["B"], s["K"], s["V"]
    logits = torch.randn(B, K + 1, V, generator=g)
    p = torch.softmax(logits, -1).to(device())
    q = torch.softmax(logits[:, :K] + torch.randn(B, K, V, generator=g), -1).to(device())
    tokens = q.argmax(-1)
    assert_equals_reference("rejection_sample", backend, p, q, tokens, **to_device(random_uniforms(B, K, g), device()))


@pytest.mark.parametrize("backend", FAST("verify_tree_greedy"))
@pytest.mark.parametrize("s", TREES, ids=str)
def test_verify_tree_greedy(s, backend):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(s["B"], s["N"], s["V"], generator=g).to(device())
    parents = tree_parents(s["N"], g).to(device())
    assert_equals_reference("verify_tree_greedy", backend, logits, parents_argmax(logits, parents), parents)


@pytest.mark.parametrize("backend", FAST("tree_rejection_sample"))
@pytest.mark.parametrize("s", TREES, ids=str)
def test_tree_rejection_sample(s, backend):
    g = torch.Generator().manual_seed(3)
    B, N, V = s["B"], s["N"], s["V"]
    p = torch.softmax(torch.randn(B, N, V, generator=g), -1).to(device())
    parents = tree_parents(N, g).to(device())
    randoms = to_device(random_uniforms(B, N - 1, g), device())
    assert_equals_reference("tree_rejection_sample", backend, p, parents_argmax(p, parents), parents, **randoms)


@pytest.mark.parametrize("backend", FAST("tree_attention"))
@pytest.mark.parametrize("s", ATTN, ids=str)
def test_tree_attention(s, backend):
    g = torch.Generator().manual_seed(4)
    B, H, Hkv, D, P, N = (s[k] for k in ("B", "H", "Hkv", "D", "P", "N"))
    dt = torch.bfloat16
    q = torch.randn(B, N, H, D, generator=g).to(device(), dt)
    k = torch.randn(B, Hkv, P + N, D, generator=g).to(device(), dt)
    v = torch.randn(B, Hkv, P + N, D, generator=g).to(device(), dt)
    seqlens = torch.full((B,), P, dtype=torch.int32, device=device())
    mask = ancestor_mask(tree_parents(N, g)).to(device())
    got = sk.tree_attention(q, k, v, seqlens, mask, backend=backend)
    want = reference.tree_attention(q.float(), k.float(), v.float(), seqlens, mask)
    assert_close(got, want, dt)


@pytest.mark.parametrize("backend", FAST("compact_kv_cache"))
@pytest.mark.parametrize("s", COMPACT, ids=str)
def test_compact_kv_cache(s, backend):
    g = torch.Generator().manual_seed(5)
    L, B, Hkv, S, D, M = (s[k] for k in ("L", "B", "Hkv", "S", "D", "M"))
    cache = torch.randn(L, 2, B, Hkv, S, D, generator=g).to(device(), torch.bfloat16)
    seqlens = torch.randint(0, S // 2, (B,), generator=g).to(device())
    idx = (torch.arange(M) + torch.randint(0, 3, (B, M), generator=g).cumsum(1)).to(device())
    counts = torch.randint(0, M + 1, (B,), generator=g).to(device())
    want = cache.clone()
    reference.compact_kv_cache(want, seqlens, idx, counts)
    sk.compact_kv_cache(cache, seqlens, idx, counts, backend=backend)
    assert torch.equal(cache, want)
