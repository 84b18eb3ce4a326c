"""Row independence of tree_attention's CPU paths, and determinism of its automatic CPU backend.

(a) A query row's output is bit-identical whether the row is computed alone or inside a pass
of 2 to 64 rows, chain or tree, whatever the other sequences of the batch hold.  The row alone:
node i of a pass attends to the cache prefix and to its ancestors and itself among the N new
keys; alone, q is that row (N = 1), the cache holds the prefix, the ancestors in order, then
the node's own key, cache_seqlens = prefix + ancestors and tree_mask None: what plain decoding
computes for the token once its ancestors are accepted.  Checked for the C++ kernel ("native",
the automatic CPU backend) and the float64 reference, dense and paged (the row alone in the
other layout and another block size), float32 and bfloat16, and against B = 1 calls and
batches whose other sequences hold other data.

The SDPA path ("torch") is not row-independent and is not tested for it: torch's CPU SDPA
rounds a row differently with the number of query rows (its GEMMs), with the number of key
slots (masked slots at the end change its vectorised sums), and in a tree pass the masked
slots between a node's ancestors move them to other lanes.  The automatic backend takes it
only where SPECDEC_DENSE_ATTENTION / SPECDEC_PAGED_ATTENTION force it (or without the C++
kernel).

(b) Identical calls of the automatic backend give identical bits from the first call on (it
used to time its C++ and SDPA paths on the first calls, alternating them), so
torch.library.opcheck's eager-vs-AOTDispatcher comparison holds in bf16.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _native
from specdec_kernels.ops import tree_attention as ta
from specdec_kernels.tree import ancestor_mask
from tests.ops.tree_attention.test_paged import paged_case, to_pool
from tests.utils import NAN, gen

H, HKV, D = 9, 3, 64  # SmolLM2-135M's attention heads
NS = (2, 3, 8, 17, 64)
LENS = [32, 77, 0]  # prefixes: one whole 32-slot chunk, two and a part, none
BLOCK = 16  # block size of the passes (NHD); the rows alone use ALONE_BLOCK (HND)
ALONE_BLOCK = 5

PATHS = [
    pytest.param("native", marks=pytest.mark.requires_native_op("paged_tree_attention")),
    "reference",
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _masks(tree, B, N, g):
    """None (the chain) or one random ancestor mask per sequence, bool [B, N, N]."""
    if not tree:
        return None
    parents = [[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)] for _ in range(B)]
    return ancestor_mask(torch.tensor(parents))


def _attend(path, paged, q, k, v, lens, mask, table=None, pk=None, pv=None, layout="NHD"):
    if not paged:
        return sk.tree_attention(q, k, v, lens, mask, backend=path)
    return sk.tree_attention(q, pk, pv, lens, mask, block_table=table, kv_layout=layout, backend=path)


def _alone(path, paged, q_row, keys, values):
    """Attention of one query row [1, 1, H, D] to the keys [Hkv, T, D] it sees (its own last),
    as a decode step: N = 1, cache_seqlens T - 1, the slots past T NaN."""
    T = keys.shape[1]
    lens = torch.tensor([T - 1])
    if not paged:
        pad = torch.full((HKV, 3, D), NAN, dtype=keys.dtype)
        return _attend(
            path, False, q_row, torch.cat([keys, pad], 1)[None], torch.cat([values, pad], 1)[None], lens, None
        )
    M = -(-T // ALONE_BLOCK) + 1
    table = torch.randperm(M + 2, generator=gen(T))[:M].to(torch.int32)[None]  # shuffled, spare blocks NaN

    def pool(x):
        dense = torch.full((1, HKV, M * ALONE_BLOCK, D), NAN, dtype=x.dtype)
        dense[0, :, :T] = x
        return to_pool(dense, table, M + 2, "HND")

    return _attend(path, True, q_row, None, None, lens, None, table, pool(keys), pool(values), "HND")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("path", PATHS)
def test_a_row_alone_equals_the_row_inside_a_pass(path, paged, tree, dtype):
    for N in NS:
        B = len(LENS)
        q, k, v, lens, table, pk, pv = paged_case(B, N, H, HKV, D, LENS, BLOCK, "NHD", dtype=dtype, seed=N)
        mask = _masks(tree, B, N, gen(100 + N))
        out = _attend(path, paged, q, k, v, lens, mask, table, pk, pv)
        assert not out.isnan().any()
        for b, L in enumerate(LENS):
            for i in range(N):
                seen = [j for j in range(i) if (mask[b, i, j] if tree else True)] + [i]
                slots = list(range(L)) + [L + j for j in seen]
                one = _alone(path, paged, q[b : b + 1, i : i + 1], k[b][:, slots], v[b][:, slots])
                assert torch.equal(one[0, 0], out[b, i]), f"N={N}, sequence {b}, node {i} (ancestors {seen[:-1]})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("path", PATHS)
def test_a_sequence_alone_equals_the_sequence_inside_a_batch(path, paged, tree, dtype):
    """B = 1 vs B = 3, and a batch whose other sequences hold other queries, keys, values,
    lengths and masks (the pool's other blocks rewritten)."""
    for N in (1,) + NS:
        B = len(LENS)
        q, k, v, lens, table, pk, pv = paged_case(B, N, H, HKV, D, LENS, BLOCK, "NHD", dtype=dtype, seed=50 + N)
        mask = _masks(tree, B, N, gen(200 + N))
        out = _attend(path, paged, q, k, v, lens, mask, table, pk, pv)
        for b in range(B):
            sel = slice(b, b + 1)
            alone = _attend(
                path, paged, q[sel], k[sel], v[sel], lens[sel], None if mask is None else mask[sel], table[sel], pk, pv
            )
            assert torch.equal(alone, out[sel]), f"N={N}, sequence {b}"
        g = gen(300 + N)
        q2, k2, v2, lens2 = q.clone(), k.clone(), v.clone(), lens.clone()
        q2[1:] = torch.randn(q2[1:].shape, generator=g).to(dtype)
        k2[1:, :, : LENS[1] + N] = torch.randn(k2[1:, :, : LENS[1] + N].shape, generator=g).to(dtype)
        v2[1:, :, : LENS[1] + N] = torch.randn(v2[1:, :, : LENS[1] + N].shape, generator=g).to(dtype)
        lens2[1] = LENS[1] // 2
        mask2 = None if mask is None else torch.cat([mask[:1], _masks(True, B - 1, N, g)])
        pk2, pv2 = to_pool(k2, table, pk.shape[0], "NHD"), to_pool(v2, table, pv.shape[0], "NHD")
        out2 = _attend(path, paged, q2, k2, v2, lens2, mask2, table, pk2, pv2)
        assert torch.equal(out2[0], out[0]), f"N={N}: sequence 0 changed with the others"
        assert not torch.equal(out2[1], out[1])  # the others did change


def _expected_automatic_path(paged: bool) -> str:
    op = "paged_tree_attention" if paged else "tree_attention"
    return ta.automatic_cpu_path(paged) if _native.has_kernel(op, "cpu") else "torch"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_identical_automatic_calls_give_identical_bits(paged, dtype, monkeypatch):
    """Ten identical calls from a fresh state (backends and CPU choices reset), chain and a
    tree mask for the batch, N = 8 and 64: every call equals the first, and the path the
    automatic backend documents."""
    monkeypatch.delenv("SPECDEC_BACKEND", raising=False)
    monkeypatch.delenv("SPECDEC_DENSE_ATTENTION", raising=False)
    monkeypatch.delenv("SPECDEC_PAGED_ATTENTION", raising=False)
    for N in (8, 64):
        q, k, v, lens, table, pk, pv = paged_case(3, N, H, HKV, D, [300, 450, 600], BLOCK, "NHD", dtype=dtype, seed=N)
        for mask in (None, _masks(True, 1, N, gen(N))[0]):
            sk.reset_backends()
            ta.DENSE_CPU_CHOICE.reset()
            ta.PAGED_CPU_CHOICE.reset()
            calls = [_attend(None, paged, q, k, v, lens, mask, table, pk, pv) for _ in range(10)]
            for n, out in enumerate(calls[1:], 2):
                assert torch.equal(out, calls[0]), f"N={N}: call {n} differs from the first"
            path = _attend(_expected_automatic_path(paged), paged, q, k, v, lens, mask, table, pk, pv)
            assert torch.equal(calls[0], path)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_opcheck_of_the_automatic_backend_in_bf16(paged):
    """opcheck compares eager calls with AOTDispatcher's: it fails if two calls differ."""
    sk.reset_backends()
    ta.DENSE_CPU_CHOICE.reset()
    ta.PAGED_CPU_CHOICE.reset()
    N = 8
    q, k, v, lens, table, pk, pv = paged_case(2, N, H, HKV, D, [40, 70], BLOCK, "NHD", dtype=torch.bfloat16, seed=7)
    mask = _masks(True, 2, N, gen(7))
    if paged:
        args = (q, pk, pv, lens, mask, table, "NHD", D**-0.5)
        torch.library.opcheck(torch.ops.specdec.paged_tree_attention.default, args)
    else:
        args = (q, k, v, lens, mask, D**-0.5)
        torch.library.opcheck(torch.ops.specdec.tree_attention.default, args)
