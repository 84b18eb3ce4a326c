"""Random numbers inside the kernels: seeds/offsets and explicit uniforms reach the sampling
kernels as they are, and the kernels compute and clamp the numbers themselves.

- The in-kernel Philox4x32-10 (Triton: ``ops/_triton/_uniforms.py``; C++:
  ``csrc/verify_sample_cpu.cpp``) equals ``specdec_kernels._random.philox_uniforms`` bit for
  bit, read back through each path's debug entry, over batch 1 and uneven batches, widths
  0..17, seeds of all 64 bits, offsets near 2**32, 2**63 and the 2**64 wrap, int32 and int64.
- Every sampling op with seeds/offsets gives, on every backend, the reference's tokens for
  the explicit uniforms ``_random.philox_uniforms`` computes (and other tokens for other
  offsets: the comparison can fail).
- Explicit uniforms of any value (NaN, negative, >= 1, infinite, float64 rounding to 1.0) are
  clamped in the kernels as ``checks.clamp_uniforms`` clamps them, never emitting a token
  without mass; float64 uniforms need no cast.
- No torch op besides the kernels runs per call with explicit uniforms or seeds/offsets, on
  the fronts' eager path and through the registered op (a TorchDispatchMode counting the aten
  ops of the front and of the registered op's body; the C++ kernel op and the Triton launches
  are the kernels); one torch.Generator costs its two draws.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specdec_kernels as sk
from specdec_kernels import _native, _random, reference
from specdec_kernels.bench.host_cost import _NOT_KERNELS
from specdec_kernels.checks import clamp_uniforms
from tests.utils import gen, runnable_backends

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# seeds over all 64 bits (int64 bit patterns) and offsets at the word boundaries
SEEDS = [0, 1, -1, 2**32 - 1, 2**32, 2**63 - 1, -(2**63), 0x0123456789ABCDEF, -0x0123456789ABCDEF, 977]
OFFSETS = [0, 1, 2**32 - 3, 2**32, -3, 2**63 - 2, -(2**63), 2**31 - 1, 12345, 2**32 - 1]


def _keys(batch: int, dtype: torch.dtype, salt: int):
    """``batch`` seeds and offsets of ``dtype``: the edge values above (for int32 the ones that
    fit, negative ones included, which the kernels must sign-extend as ``Tensor.to(torch.int64)``
    does) and random ones over the whole range, shuffled."""
    g = gen(salt)
    info = torch.iinfo(dtype)
    rand = lambda: torch.randint(info.min, info.max, (32,), generator=g, dtype=torch.int64).tolist()  # noqa: E731
    fits = lambda values: [v for v in values if info.min <= v <= info.max]  # noqa: E731
    pool_s, pool_o = torch.tensor(fits(SEEDS) + rand()), torch.tensor(fits(OFFSETS) + rand())
    # shuffled; a batch longer than the pool holds all of it (every edge value) and repeats
    pick_s = torch.randperm(pool_s.numel(), generator=g).repeat(batch // pool_s.numel() + 1)[:batch]
    pick_o = torch.randperm(pool_o.numel(), generator=g).repeat(batch // pool_o.numel() + 1)[:batch]
    return pool_s[pick_s].to(dtype), pool_o[pick_o].to(dtype)


def _native_philox_or_skip():
    if _native.has_kernel("philox_uniforms", "cpu"):
        return torch.ops.specdec_native.philox_uniforms
    if os.environ.get("SPECDEC_REQUIRE_NATIVE") == "1":
        pytest.fail("SPECDEC_REQUIRE_NATIVE=1 but specdec_kernels._C has no specdec_native::philox_uniforms")
    pytest.skip("specdec_kernels._C not built")


def _triton_philox(seeds, offsets, width, stream):
    from specdec_kernels.ops._triton._uniforms import philox_uniforms_triton

    return philox_uniforms_triton(seeds.to(DEVICE), offsets.to(DEVICE), width, stream).cpu()


# --------------------------------------------------------------------------- the numbers


@pytest.mark.parametrize("path", ["triton", "native"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("batch", [1, 3, 18, 64])
@pytest.mark.parametrize("width", [0, 1, 2, 5, 16, 17])
def test_in_kernel_philox_equals_the_reference_bit_for_bit(path, dtype, batch, width):
    if path == "triton" and "triton" not in runnable_backends("rejection_sample"):
        pytest.skip("Triton cannot run here")
    fn = _native_philox_or_skip() if path == "native" else _triton_philox
    seeds, offsets = _keys(batch, dtype, salt=batch * 31 + width)
    for stream in (0, 1):
        got = fn(seeds, offsets, width, stream)
        want = _random.philox_uniforms(seeds, offsets, width, stream)
        assert got.shape == want.shape == (batch, width) and got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (stream, seeds.tolist(), offsets.tolist())


def test_the_reference_philox_wraps_offsets_modulo_2_64():
    """The definition the kernels match: offset 2**64 - 1 (int64 -1) plus one is counter 0."""
    seeds = torch.tensor([123, 123])
    wrapped = _random.philox_uniforms(seeds, torch.tensor([-1, 0]), 2, 0)
    assert torch.equal(wrapped[0, 1], wrapped[1, 0])
    assert not torch.equal(wrapped[0, 0], wrapped[1, 0])


# --------------------------------------------------------------------------- tokens


def _probs(shape, g, zero_every=5):
    """Random rows with zeros (tokens without mass) and a spread that makes coins and the
    sample uniform matter."""
    p = torch.rand(*shape, generator=g) ** 3
    p[..., ::zero_every] = 0.0
    return p / p.sum(-1, keepdim=True)


def _chain_case(counts, K, V, g):
    B = len(counts)
    p = _probs((B, K + 1, V), g)
    q = _probs((B, K, V), g)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K) if K else torch.empty(B, 0).long()
    return p, q, drafts, torch.tensor(counts, dtype=torch.int64)


def _dev(*xs):
    return [x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in xs]


def _cpu(result):
    return [t.cpu() for t in result]


CHAIN_CASES = {
    "B1_K0": ([0], 0),
    "B1_K5": ([5], 5),
    "uneven_K4": ([4, 0, 1, 3, 2, 4, 4], 4),
    "K16": ([16, 7, 0, 16, 1], 16),
}


@pytest.mark.parametrize("backend", runnable_backends("rejection_sample"))
@pytest.mark.parametrize("case", list(CHAIN_CASES))
@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
def test_rejection_sample_with_seeds_gives_the_reference_tokens_for_its_numbers(backend, case, with_q):
    counts, K = CHAIN_CASES[case]
    V = 37  # not a power of two
    g = gen(len(counts) * 100 + K)
    p, q, drafts, n = _chain_case(counts, K, V, g)
    q = q if with_q else None
    seeds, offsets = _keys(len(counts), torch.int64, salt=K)
    coins, final = _random.philox_uniforms(seeds, offsets, K, 0), _random.philox_uniforms(seeds, offsets, 1, 1)[:, 0]
    want = reference.rejection_sample(p, q, drafts, n, uniform_samples=coins, sample_uniforms=final)
    got = _cpu(
        sk.rejection_sample(*_dev(p, q, drafts, n), seeds=seeds.to(DEVICE), offsets=offsets.to(DEVICE), backend=backend)
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the numbers matter: other offsets give other tokens somewhere in the batch
    other = _cpu(
        sk.rejection_sample(
            *_dev(p, q, drafts, n), seeds=seeds.to(DEVICE), offsets=(offsets + 1).to(DEVICE), backend=backend
        )
    )
    if len(counts) > 1:
        assert not torch.equal(other[0], got[0])
    # one of the two given explicitly, the other from Philox
    mixed_coins = torch.rand(len(counts), K, generator=g)
    want_c = reference.rejection_sample(p, q, drafts, n, uniform_samples=mixed_coins, sample_uniforms=final)
    got_c = _cpu(
        sk.rejection_sample(
            *_dev(p, q, drafts, n),
            uniform_samples=mixed_coins.to(DEVICE),
            seeds=seeds.to(DEVICE),
            offsets=offsets.to(DEVICE),
            backend=backend,
        )
    )
    assert torch.equal(got_c[0], want_c[0])
    mixed_final = torch.rand(len(counts), generator=g)
    want_f = reference.rejection_sample(p, q, drafts, n, uniform_samples=coins, sample_uniforms=mixed_final)
    got_f = _cpu(
        sk.rejection_sample(
            *_dev(p, q, drafts, n),
            sample_uniforms=mixed_final.to(DEVICE),
            seeds=seeds.to(DEVICE),
            offsets=offsets.to(DEVICE),
            backend=backend,
        )
    )
    assert torch.equal(got_f[0], want_f[0])


TREE_CASES = {
    "B1_root_only": ([-1], [1]),
    "B1_chain": ([-1, 0, 1, 2], [4]),
    "uneven": ([-1, 0, 0, 1, 1, 2, 4], [7, 1, 4, 0, 6]),
}


@pytest.mark.parametrize("backend", runnable_backends("tree_rejection_sample"))
@pytest.mark.parametrize("case", list(TREE_CASES))
@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "deterministic"])
def test_tree_rejection_sample_with_seeds_gives_the_reference_tokens_for_its_numbers(backend, case, with_q):
    parent_list, counts = TREE_CASES[case]
    B, N, V = len(counts), len(parent_list), 29
    g = gen(B * 10 + N)
    p, q = _probs((B, N, V), g), _probs((B, N, V), g)
    if with_q:  # children drawn from their parent's draft row
        tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, N)
    else:  # distinct deterministic children
        tokens = torch.stack([torch.randperm(V, generator=g)[:N] for _ in range(B)])
    parents, n = torch.tensor(parent_list), torch.tensor(counts)
    seeds, offsets = _keys(B, torch.int64, salt=N)
    coins = _random.philox_uniforms(seeds, offsets, N - 1, 0)
    final = _random.philox_uniforms(seeds, offsets, 1, 1)[:, 0]
    qq = q if with_q else None
    want = reference.tree_rejection_sample(p, tokens, parents, qq, n, uniform_samples=coins, sample_uniforms=final)
    got = _cpu(
        sk.tree_rejection_sample(
            *_dev(p, tokens, parents, qq, n), seeds=seeds.to(DEVICE), offsets=offsets.to(DEVICE), backend=backend
        )
    )
    for w, o in zip(want, got):
        assert torch.equal(o, w)
    other = _cpu(
        sk.tree_rejection_sample(
            *_dev(p, tokens, parents, qq, n), seeds=seeds.to(DEVICE), offsets=(offsets + 1).to(DEVICE), backend=backend
        )
    )
    if B > 1:
        assert not torch.equal(other[0], got[0])


@pytest.mark.parametrize("backend", runnable_backends("rejection_sample_flattened"))
@pytest.mark.parametrize("bonus", [False, True], ids=["bonus_rows", "bonus_ids"])
def test_flattened_with_seeds_gives_the_reference_tokens_for_its_numbers(backend, bonus):
    counts = [3, 0, 5, 1, 0, 2]  # uneven, zero-draft requests
    B, T, K, V = len(counts), sum(counts), 6, 23
    g = gen(5)
    cu = torch.tensor(counts).cumsum(0)
    p = _probs((T if bonus else T + B, V), g)
    q = _probs((T, V), g)
    drafts = torch.multinomial(q, 1, generator=g)[:, 0]
    bonus_ids = torch.randint(0, V, (B,), generator=g) if bonus else None
    seeds, offsets = _keys(B, torch.int64, salt=7)
    # request b's coin j is Philox stream 0 at offsets[b] + j: the padded [B, K] numbers
    padded = _random.philox_uniforms(seeds, offsets, K, 0)
    flat = torch.cat([padded[b, :c] for b, c in enumerate(counts)])
    final = _random.philox_uniforms(seeds, offsets, 1, 1)[:, 0]
    args = (p, q, drafts, cu, bonus_ids)
    want = reference.rejection_sample_flattened(*args, max_spec_len=K, uniform_samples=flat, sample_uniforms=final)
    got = _cpu(
        sk.rejection_sample_flattened(
            *_dev(*args), max_spec_len=K, seeds=seeds.to(DEVICE), offsets=offsets.to(DEVICE), backend=backend
        )
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the registered op's padded [B, max_spec_len] coins (what a generator draws) give the
    # tokens of the flat [T] ones
    padded_explicit = _cpu(
        torch.ops.specdec.rejection_sample_flattened(*_dev(*args), padded.to(DEVICE), final.to(DEVICE), K, backend)
    )
    assert torch.equal(padded_explicit[0], want[0]) and torch.equal(padded_explicit[1], want[1])


# --------------------------------------------------------------------------- hostile uniforms

HOSTILE = [float("nan"), -0.5, -float("inf"), 1.0, 1.5, float("inf"), 0.0, 0.3, 0.999]


@pytest.mark.parametrize("backend", runnable_backends("rejection_sample"))
def test_any_explicit_uniform_is_clamped_in_the_kernel_and_never_emits_a_token_without_mass(backend):
    B, K, V = len(HOSTILE), 3, 13
    g = gen(9)
    p, q, drafts, n = _chain_case([K] * B, K, V, g)
    u = torch.tensor(HOSTILE)
    coins = u[torch.randperm(B * K, generator=g) % B].reshape(B, K)
    for final in (u, u.flip(0)):
        want = reference.rejection_sample(
            p, q, drafts, n, uniform_samples=clamp_uniforms(coins), sample_uniforms=clamp_uniforms(final)
        )
        got = _cpu(
            sk.rejection_sample(
                *_dev(p, q, drafts, n),
                uniform_samples=coins.to(DEVICE),
                sample_uniforms=final.to(DEVICE),
                backend=backend,
                validate=False,
            )
        )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        rows = torch.arange(B)
        sampled = got[0][rows, got[1]]
        row = p[rows, got[1]]
        assert bool((row[rows, sampled] > 0).all())  # the residual's support lies in p's


@pytest.mark.parametrize("backend", runnable_backends("tree_rejection_sample"))
def test_tree_explicit_uniforms_are_clamped_in_the_kernel(backend):
    B, N, V = len(HOSTILE), 4, 11
    g = gen(10)
    p, q = _probs((B, N, V), g), _probs((B, N, V), g)
    tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, N)
    parents = torch.tensor([-1, 0, 0, 1])
    u = torch.tensor(HOSTILE)
    coins = u[torch.randperm(B * (N - 1), generator=g) % B].reshape(B, N - 1)
    want = reference.tree_rejection_sample(
        p, tokens, parents, q, uniform_samples=clamp_uniforms(coins), sample_uniforms=clamp_uniforms(u)
    )
    got = _cpu(
        sk.tree_rejection_sample(
            *_dev(p, tokens, parents, q),
            uniform_samples=coins.to(DEVICE),
            sample_uniforms=u.to(DEVICE),
            backend=backend,
            validate=False,
        )
    )
    for w, o in zip(want, got):
        assert torch.equal(o, w)


@pytest.mark.parametrize("backend", runnable_backends("rejection_sample"))
def test_float64_uniforms_act_as_their_float32_rounding(backend):
    """A float64 uniform just below 1 rounds to 1.0 in float32 and is kept below 1 (the last
    token with mass, never past it); the kernels read float64 without a cast."""
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0]]])
    near_one = torch.tensor([1.0 - 1e-10], dtype=torch.float64)
    assert float(near_one.float()) == 1.0
    out, _ = sk.rejection_sample(
        *_dev(p, None, torch.empty(1, 0, dtype=torch.long)),
        uniform_samples=torch.empty(1, 0, dtype=torch.float64, device=DEVICE),
        sample_uniforms=near_one.to(DEVICE),
        backend=backend,
        validate=False,
    )
    assert int(out[0, 0]) == 2
    g = gen(11)
    p, q, drafts, n = _chain_case([4, 2, 0], 4, 19, g)
    coins, final = torch.rand(3, 4, generator=g, dtype=torch.float64), torch.rand(3, generator=g, dtype=torch.float64)
    want = reference.rejection_sample(p, q, drafts, n, uniform_samples=coins.float(), sample_uniforms=final.float())
    got = _cpu(
        sk.rejection_sample(
            *_dev(
                p,
                q,
                drafts,
                n,
            ),
            uniform_samples=coins.to(DEVICE),
            sample_uniforms=final.to(DEVICE),
            backend=backend,
        )
    )
    assert torch.equal(got[0], want[0])


def test_value_checks_still_refuse_uniforms_outside_the_unit_interval():
    p, q, drafts, n = _chain_case([2], 2, 7, gen(12))
    for bad in (float("nan"), -0.1, 1.0):
        with pytest.raises(ValueError, match="sample_uniforms must lie in"):
            sk.rejection_sample(
                p, q, drafts, n, uniform_samples=torch.zeros(1, 2), sample_uniforms=torch.tensor([bad]), validate=True
            )


# --------------------------------------------------------------------------- torch ops per call


class _CountOps(TorchDispatchMode):
    """Counts the aten ops (views and empty allocations excluded: they launch nothing, as
    ``bench.host_cost`` counts) of a front and of its registered op's body; a ``specdec_native``
    kernel op counts as a kernel call, what runs inside it is not counted (the Triton launchers
    are functions: their launches are counted apart, by ``bench.host_cost.LaunchCounter``).
    ``specdec_observer`` (``_eager.direct_call``): whether the fronts take their eager path
    under this mode (an observer) or go through the registered op."""

    def __init__(self, bodies, observer: bool = False):
        super().__init__()
        self.specdec_observer = observer
        self.bodies = bodies  # public op name -> its registered body (run under this mode)
        self.ops, self.kernels, self.public = [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "specdec_native":
            self.kernels.append(func._schema.name.split("::")[1])
            return func(*args, **kwargs)
        if func.namespace == "specdec":
            name = func._schema.name.split("::")[1]
            assert name in self.bodies, f"specdec::{name} is not a public op"
            self.public.append(name)
            with self:
                return self.bodies[name](*args, **kwargs)
        if not func.is_view and f"{func._opname}.{func._overloadname}" not in _NOT_KERNELS:
            self.ops.append(str(func))
        return func(*args, **kwargs)


def _op_calls():
    """Per op: (call(backend, randomness keywords), coin shape, batch)."""
    g = gen(13)
    B, K, V, N = 3, 4, 64, 6
    p, q, drafts, n = _dev(*_chain_case([4, 1, 0], K, V, g))
    tp, tq = _dev(_probs((B, N, V), g), _probs((B, N, V), g))
    tokens = torch.randint(0, V, (B, N), generator=g).to(DEVICE)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]] * B).to(DEVICE)
    nn = torch.tensor([6, 3, 1]).to(DEVICE)
    counts = [2, 0, 3]
    T = sum(counts)
    cu = torch.tensor(counts).cumsum(0).to(DEVICE)
    fp, fq = _dev(_probs((T + B, V), g), _probs((T, V), g))
    fd = torch.randint(0, V, (T,), generator=g).to(DEVICE)
    return {
        "rejection_sample": (
            lambda backend, **kw: sk.rejection_sample(p, q, drafts, n, backend=backend, validate=False, **kw),
            (B, K),
            B,
        ),
        "tree_rejection_sample": (
            lambda backend, **kw: sk.tree_rejection_sample(
                tp, tokens, parents, tq, nn, backend=backend, validate=False, **kw
            ),
            (B, N - 1),
            B,
        ),
        "rejection_sample_flattened": (
            lambda backend, **kw: sk.rejection_sample_flattened(
                fp, fq, fd, cu, max_spec_len=3, backend=backend, validate=False, **kw
            ),
            (T,),
            B,
        ),
    }


@pytest.mark.parametrize("path", ["eager", "registered_op"])
@pytest.mark.parametrize("op", ["rejection_sample", "tree_rejection_sample", "rejection_sample_flattened"])
@pytest.mark.parametrize("mode", ["seeds", "explicit", "explicit_float64", "generator"])
def test_no_torch_op_besides_the_kernel_with_explicit_uniforms_or_seeds(op, mode, path):
    import importlib

    from specdec_kernels.bench.host_cost import LaunchCounter

    bodies = {name: importlib.import_module(f"specdec_kernels.ops.{name}")._impl for name in _op_calls()}
    call, coin_shape, B = _op_calls()[op]
    backends = [b for b in runnable_backends(op) if b != "reference"]  # the reference is torch ops by design
    assert backends, "no kernel backend runs here"
    for backend in backends:
        if mode == "seeds":
            kw = dict(
                seeds=torch.tensor([1, -2, 2**40]).to(DEVICE), offsets=torch.tensor([0, 2**32 - 1, -1]).to(DEVICE)
            )
        elif mode == "generator":
            kw = dict(generator=gen(14, DEVICE))
        else:
            dtype = torch.float64 if mode == "explicit_float64" else torch.float32
            kw = dict(
                uniform_samples=torch.rand(coin_shape, dtype=dtype).to(DEVICE),
                sample_uniforms=torch.rand(B, dtype=dtype).to(DEVICE),
            )
        counter = _CountOps(bodies, observer=path == "eager")
        # no_grad, not inference_mode: under inference_mode a dtype cast runs below the Python
        # dispatch key (bench.host_cost.counts), where this mode would not see it; the Triton
        # launches counted, not run (the interpreter's own torch ops are not the call's)
        with torch.no_grad(), LaunchCounter(noop=True) as launches, counter:
            call(backend, **kw)
        assert counter.public == ([] if path == "eager" else [op]), counter.public  # one dispatch layer
        if backend == "triton":  # the launcher is a function: its kernels' launches, no op
            assert counter.kernels == [] and sum(launches.launches.values()) == 2, dict(launches.launches)
        else:
            assert counter.kernels == [op] and not launches.launches, (backend, counter.kernels)
        allowed = ["aten.rand.generator"] * 2 if mode == "generator" else []  # the generator's own draws
        assert counter.ops == allowed, (backend, counter.ops)


def test_flattened_seeds_mode_reads_no_tensor_values():
    """validate=False with max_spec_len: the flattened front with seeds/offsets runs on fake
    tensors (no host read), as the padded and tree fronts do."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = gen(15)
    counts, V = [2, 0, 3], 16
    T, B = sum(counts), len(counts)
    real = [_probs((T + B, V), g), _probs((T, V), g), torch.randint(0, V, (T,)), torch.tensor(counts).cumsum(0)]
    keys = [torch.tensor([1, 2, 3]), torch.tensor([0, 5, 9])]
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        p, q, d, cu, seeds, offsets = (mode.from_tensor(t) for t in real + keys)
        out, acc = sk.rejection_sample_flattened(
            p, q, d, cu, max_spec_len=3, seeds=seeds, offsets=offsets, validate=False
        )
        assert out.shape == (B, 4) and acc.shape == (B,)


def test_public_philox_uniforms_is_the_ops_definition_and_checks_its_arguments():
    """``specdec_kernels.philox_uniforms`` gives the numbers the ops use with seeds/offsets
    (column 0 of stream 1 is what ``rejection_sample`` samples its token with: a target
    distribution with its mass split evenly between two tokens shows it), and names bad args."""
    seeds, offsets = torch.tensor([5, -7, 9, 10]), torch.tensor([0, 2**40, 3, 4])
    got = sk.philox_uniforms(seeds, offsets, 3, 0)
    assert torch.equal(got, _random.philox_uniforms(seeds, offsets, 3, 0))
    assert got.dtype == torch.float32 and got.shape == (4, 3)
    assert torch.equal(sk.philox_uniforms(seeds.int(), offsets, 3), got)  # int32 seeds sign-extended
    # no drafts: the op only samples, token 1 exactly when the sample uniform is >= 0.5
    p = torch.tensor([[[0.5, 0.5, 0.0]]]).expand(4, 1, 3).contiguous()
    out, _ = sk.rejection_sample(p, None, torch.zeros(4, 0, dtype=torch.int64), seeds=seeds, offsets=offsets)
    want = [int(u >= 0.5) for u in sk.philox_uniforms(seeds, offsets, 1, 1)[:, 0].tolist()]
    assert out[:, 0].tolist() == want and set(want) == {0, 1}  # both tokens among these seeds
    assert sk.philox_uniforms(seeds, offsets, 0).shape == (4, 0)
    with pytest.raises(TypeError, match="seeds"):
        sk.philox_uniforms(seeds.float(), offsets, 1)
    with pytest.raises(ValueError, match="offsets"):
        sk.philox_uniforms(seeds, offsets[:1], 1)
    with pytest.raises(ValueError, match="width"):
        sk.philox_uniforms(seeds, offsets, -1)
    with pytest.raises(ValueError, match="stream"):
        sk.philox_uniforms(seeds, offsets, 1, 2**32)
    with pytest.raises(TypeError, match="width"):
        sk.philox_uniforms(seeds, offsets, 1.5)


def test_sequence_uniforms_are_the_ops_per_sequence_draws_and_check_their_arguments():
    """``specdec_kernels.sequence_uniforms`` draws what ``rejection_sample`` draws from a list
    of per-sequence generators (its tokens with those numbers given explicitly are the same),
    a None generator draws nothing, and bad arguments are named."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(3, 4, 9, generator=g)
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(3, 3, 9, generator=g)
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.randint(0, 9, (3, 3), generator=g)
    counts = torch.tensor([3, 1, 0])
    gens = lambda: [torch.Generator().manual_seed(s) for s in (5, 6, 7)]  # noqa: E731
    want = sk.rejection_sample(p, q, drafts, counts, generator=gens())
    coins, finals = sk.sequence_uniforms(gens(), counts.tolist(), 3)
    got = sk.rejection_sample(p, q, drafts, counts, uniform_samples=coins, sample_uniforms=finals)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert (coins[1, 1:] == 0).all() and (coins[2] == 0).all() and (finals > 0).all()
    c2, f2 = sk.sequence_uniforms([gens()[0], None, gens()[2]], [3, 1, 0], 3)
    assert torch.equal(c2[[0, 2]], coins[[0, 2]]) and (c2[1] == 0).all() and f2[1] == 0
    with pytest.raises(ValueError, match="coin_counts"):
        sk.sequence_uniforms(gens(), [4, 0, 0], 3)
    with pytest.raises(ValueError, match="coin_counts"):
        sk.sequence_uniforms(gens(), [1, 0], 3)
    with pytest.raises(TypeError, match=r"generators\[1\]"):
        sk.sequence_uniforms([gens()[0], 3, None], [0, 0, 0], 3)
    with pytest.raises(ValueError, match="num_coins"):
        sk.sequence_uniforms([], [], -1)
