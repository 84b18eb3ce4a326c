"""The packed (exactly block-quantised) weights of the engine's CPU matrix products.

``decoding.packed.pack_weight`` (C++) against ``pack_weight_reference`` (PyTorch); the kernel
``torch.ops.specdec_engine.packed_linear`` (AVX2 and portable paths) against a float64 product
with the decoded weight, over odd shapes; each output row independent of the other rows; inputs
read in place from views inside guard buffers; and the real SmolLM2, whose every weight packs.
"""

import pytest
import torch

from specdec_kernels.decoding import packed

pytestmark = pytest.mark.requires_native_op("packed_linear")  # skipped without the extension, failed in CI

# float32 accumulation over I inputs of products of O(1) values: a few ulps of the row's scale
TOL = {"rtol": 1e-5, "atol": 1e-5}


def q4_1_weight(O: int, I: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight as transformers de-quantises a ggml Q4_1 tensor: per block of 32, codes
    0..15 (0 and 15 present, as the quantiser leaves the block's min and max) times an fp16 scale
    plus an fp16 minimum."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (O, I // 32, 32), generator=g)
    codes[..., 3], codes[..., 17] = 0, 15
    d = (torch.rand(O, I // 32, 1, generator=g) / 7).half().float()
    m = (torch.randn(O, I // 32, 1, generator=g) / 2).half().float()
    return (codes.float() * d + m).reshape(O, I)


def q8_0_weight(O: int, I: int, seed: int = 0) -> torch.Tensor:
    """As a ggml Q8_0 tensor de-quantised: int8 codes (|q| = 127 present) times an fp16 scale."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (O, I // 32, 32), generator=g)
    codes[..., 5] = 127 * (1 - 2 * (torch.rand(O, I // 32, generator=g) < 0.5).long())
    d = (torch.rand(O, I // 32, 1, generator=g) / 100).half().float()
    return (codes.float() * d).reshape(O, I)


MAKERS = {"affine4": (q4_1_weight, packed.AFFINE4), "scaled8": (q8_0_weight, packed.SCALED8)}
SHAPES = [(1, 32), (3, 64), (37, 96), (130, 576), (577, 160)]


@pytest.mark.parametrize("form", list(MAKERS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_packer_matches_the_reference_and_gives_the_weight_back(form, shape):
    make, kind = MAKERS[form]
    w = make(*shape)
    fast, ref = packed.pack_weight(w), packed.pack_weight_reference(w)
    assert fast is not None and ref is not None and fast.kind == ref.kind == kind
    assert torch.equal(fast.codes, ref.codes) and torch.equal(fast.scales, ref.scales)
    assert (fast.mins is None) == (kind == packed.SCALED8)
    if fast.mins is not None:
        assert torch.equal(fast.mins, ref.mins)
    assert torch.equal(fast.dequantize(), w)
    assert fast.nbytes < w.numel() * 4 / 3  # 0.75 or 1.125 bytes per element, not 4


def test_packer_refuses_what_is_not_exact():
    w = q4_1_weight(8, 64)
    # one element one ulp off: neither form gives it back, so nothing is packed
    bad = w.clone()
    bad[5, 40] = torch.nextafter(bad[5, 40], torch.tensor(10.0))
    for fn in (packed.pack_weight, packed.pack_weight_reference):
        assert fn(bad) is None
        assert fn(torch.randn(8, 64)) is None  # a float32 weight in general
        for nonfinite in (float("nan"), float("inf")):
            x = w.clone()
            x[0, 0] = nonfinite
            assert fn(x) is None
        assert fn(w[:, :48].contiguous()) is None  # I not a multiple of 32
        assert fn(w.half()) is None and fn(w.double()) is None and fn(w[0]) is None
        with pytest.raises(TypeError, match="weight"):
            fn([[1.0] * 32])
    # a Q8_0 weight is not affine4 (257 levels), but packs as scaled8
    assert packed.pack_weight(q8_0_weight(4, 64)).kind == packed.SCALED8
    # an all-zero block packs (d = 0)
    z = w.clone()
    z[2, :32] = 0
    assert packed.pack_weight(z) is not None and torch.equal(packed.pack_weight(z).dequantize(), z)


def test_golden_case_by_hand():
    """One Q4_1 block: codes 0..15, 15..0; d = 0.5, m = -1; x = 1 then x = the index."""
    codes = torch.tensor(list(range(16)) + list(range(15, -1, -1)), dtype=torch.float32)
    w = (codes * 0.5 - 1.0).view(1, 32)
    p = packed.pack_weight(w)
    assert p.kind == packed.AFFINE4 and p.scales.item() == 0.5 and p.mins.item() == -1.0
    assert p.codes[0, :4].tolist() == [0 | (15 << 4), 1 | (14 << 4), 2 | (13 << 4), 3 | (12 << 4)]
    # sum(0.5 q - 1) over the block: 0.5 * 240 - 32 = 88
    x = torch.stack([torch.ones(32), torch.arange(32, dtype=torch.float32)])
    # sum(i * (0.5 q_i - 1)): q_i = i for i < 16, 31 - i after
    by_hand = sum(i * (0.5 * (i if i < 16 else 31 - i) - 1) for i in range(32))
    for portable in (False, True):
        y = packed.packed_linear(x, p, portable=portable)
        assert y.tolist() == [[88.0], [float(by_hand)]]


@pytest.mark.parametrize("portable", [False, True], ids=["avx2", "portable"])
@pytest.mark.parametrize("form", list(MAKERS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_against_float64_over_row_counts(form, shape, portable):
    w = MAKERS[form][0](*shape, seed=3)
    p = packed.pack_weight(w)
    g = torch.Generator().manual_seed(1)
    for R in list(range(0, 18)) + [33]:
        x = torch.randn(R, shape[1], generator=g)
        y = packed.packed_linear(x, p, portable=portable)
        assert y.shape == (R, shape[0]) and y.dtype == torch.float32
        torch.testing.assert_close(y, (x.double() @ w.double().T).float(), **TOL)


@pytest.mark.parametrize("portable", [False, True], ids=["avx2", "portable"])
@pytest.mark.parametrize("form", list(MAKERS))
def test_each_row_is_independent_of_the_others(form, portable):
    """A row's output is bit-identical whatever rows come with it: a verification pass over N
    tokens gives each the logits a one-token pass gives it."""
    w = MAKERS[form][0](67, 192, seed=5)
    p = packed.pack_weight(w)
    x = torch.randn(17, 192, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([packed.packed_linear(x[r : r + 1], p, portable=portable) for r in range(17)])
    for R in range(1, 18):
        assert torch.equal(packed.packed_linear(x[:R], p, portable=portable), alone[:R]), R
    assert torch.equal(packed.packed_linear(x[5:13], p, portable=portable), alone[5:13])


@pytest.mark.parametrize("portable", [False, True], ids=["avx2", "portable"])
@pytest.mark.parametrize("form", list(MAKERS) + ["float32"])
def test_rows_of_long_passes_equal_rows_alone(form, portable):
    """Prefill-sized passes (past the kernel's L2 chunk of rows, with output rows not a multiple
    of its tile of 4) give each row the bits it gets alone: every pass size takes the same order,
    so a prefill chunk of 512 tokens and a decode step agree, in any batch."""
    O, I = 67, 192  # a chunk of 128 rows of x at I = 192
    if form == "float32":
        w = torch.randn(O, I, generator=torch.Generator().manual_seed(4))
        run = lambda x: packed.rowwise_linear(x, w, portable=portable)  # noqa: E731
    else:
        p = packed.pack_weight(MAKERS[form][0](O, I, seed=6))
        run = lambda x: packed.packed_linear(x, p, portable=portable)  # noqa: E731
    x = torch.randn(300, I, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([run(x[r : r + 1]) for r in range(300)])
    for R in (3, 129, 300):
        assert torch.equal(run(x[:R]), alone[:R]), R
    assert torch.equal(run(x[150:290]), alone[150:290])
    if not portable:  # the AVX2 path and the portable one compute the same formula
        torch.testing.assert_close(
            alone, (x.double() @ (w if form == "float32" else p.dequantize()).double().T).float(), **TOL
        )


def test_inputs_are_read_in_place_inside_guard_buffers():
    """x, codes, scales and mins as views in the middle of larger buffers full of NaN / garbage:
    the kernel reads only the views (a NaN read from outside would reach the result)."""
    w = q4_1_weight(40, 96, seed=7)
    p = packed.pack_weight(w)
    O, I = p.shape

    def inside(t: torch.Tensor, fill) -> torch.Tensor:
        big = torch.full((t.shape[0] + 6,) + tuple(t.shape[1:]), fill, dtype=t.dtype)
        big[3 : 3 + t.shape[0]] = t
        return big[3 : 3 + t.shape[0]]

    guarded = packed.PackedWeight(
        p.kind, inside(p.codes, 0xFF), inside(p.scales, float("nan")), inside(p.mins, float("nan")), p.shape
    )
    x = torch.randn(5, I)
    xg = inside(x, float("nan"))
    want = packed.packed_linear(x, p)
    for portable in (False, True):
        got = packed.packed_linear(xg, guarded, portable=portable)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **TOL)
    # a strided x (every other row of a buffer) is made contiguous first, same result
    xs = torch.randn(10, I)
    xs[::2] = x
    assert torch.equal(packed.packed_linear(xs[::2], p), want)


def assert_rejects_bad_x(product, weight) -> None:
    """``product(x, weight)``, for a weight of 64 inputs, refuses an x that is not float32, not
    [..., 64] or not a tensor, naming x."""
    with pytest.raises(ValueError, match="x must be float32"):
        product(torch.randn(2, 64).double(), weight)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        product(torch.randn(2, 32), weight)
    with pytest.raises(TypeError, match="x must be a tensor"):
        product([1.0], weight)


def test_bad_arguments_raise_naming_them():
    p = packed.pack_weight(q4_1_weight(4, 64))
    assert_rejects_bad_x(packed.packed_linear, p)
    op = torch.ops.specdec_engine.packed_linear
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="kind"):
        op(x, p.codes, p.scales, p.mins, 3, False)
    with pytest.raises(ValueError, match="codes"):
        op(x, p.codes[:, :16].contiguous(), p.scales, p.mins, 0, False)
    with pytest.raises(ValueError, match="scales"):
        op(x, p.codes, p.scales[:, :1].contiguous(), p.mins, 0, False)
    with pytest.raises(ValueError, match="mins"):
        op(x, p.codes, p.scales, None, 0, False)
    with pytest.raises(ValueError, match="multiple of 32"):
        op(torch.randn(2, 48), p.codes, p.scales, p.mins, 0, False)


def test_registration_follows_the_weight():
    """A packed form belongs to one weight object, and is dropped once that weight changes."""
    w = q4_1_weight(6, 64)
    p = packed.pack_weight(w)
    packed.register(w, p)
    assert packed.packed_form(w) is p
    assert packed.packed_form(w.clone()) is None  # another tensor, equal values: not registered
    w.mul_(2)  # written in place: the codes are stale
    assert packed.packed_form(w) is None
    with pytest.raises(ValueError, match="does not fit"):
        packed.register(w[:3], p)
    with pytest.raises(ValueError, match="does not fit"):
        packed.register(w.double(), p)


def test_a_converted_or_repacked_module_drops_its_packed_form():
    """``module.bfloat16()`` keeps the Parameter object and its version but changes its dtype and
    storage: the packed form is dropped and ``linear`` computes in bf16 with F.linear (it used
    to try the packed path on the bf16 weight and raise).  ``pack_weights`` re-registers."""
    from specdec_kernels.decoding import model as m

    lin = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_(q4_1_weight(8, 64))
    packed.register(lin.weight, packed.pack_weight(lin.weight))
    assert packed.packed_form(lin.weight) is not None
    lin.bfloat16()
    assert packed.packed_form(lin.weight) is None
    x = torch.randn(3, 64).bfloat16()
    for _ in range(12):  # through the measurement and after it
        torch.testing.assert_close(m.linear(x, lin.weight), torch.nn.functional.linear(x, lin.weight))
    lin.float()
    with torch.no_grad():
        lin.weight.copy_(q4_1_weight(8, 64))  # bf16 rounded the codes' values away
    packed.register(lin.weight, packed.pack_weight(lin.weight))
    assert packed.packed_form(lin.weight) is not None
    packed.unregister(lin.weight)
    assert packed.packed_form(lin.weight) is None


def test_tiny_models_from_random_weights_pack_nothing():
    """A model whose weights are not exactly block-quantised keeps F.linear: nothing registered."""
    from specdec_kernels.decoding import Transformer
    from tests.engine.tiny import tiny_llama

    model = Transformer.from_hf_model(tiny_llama())
    kinds = model.pack_weights()
    assert kinds and set(kinds.values()) == {"none"}
    assert all(packed.packed_form(p) is None for p in model.parameters())
