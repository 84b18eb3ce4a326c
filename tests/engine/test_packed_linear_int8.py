"""The engine's CPU matrix products with 8-bit activations, and the row-independent float32 one.

``packed.packed_linear_int8`` (C++: portable, AVX2 and AVX-512 VNNI paths, each forced where this
CPU runs it) against its float64 reference over odd shapes and row counts 0..64; every path
bit-identical to the portable one; each output row independent of the other rows; the
interleaved layout checked by hand; the distance to the float32 product bounded by the
activation rounding; non-finite inputs; inputs read in place; bad arguments.  And
``packed.rowwise_linear`` (the fixed-order float32 product of a weight with no packed form).
"""

import pytest
import torch

from specdec_kernels.decoding import packed
from tests.engine.test_packed_linear import MAKERS, assert_rejects_bad_x

pytestmark = pytest.mark.requires_native_op("packed_linear_int8")  # skipped without the extension, failed in CI

ISAS = packed.int8_isas()
SHAPES = [(1, 32), (7, 64), (9, 96), (37, 160), (130, 576)]
ROWS = list(range(0, 18)) + [33, 64]
EPS32 = torch.finfo(torch.float32).eps


def summation_bound(x: torch.Tensor, p: packed.PackedWeight) -> torch.Tensor:
    """How far the kernel's float32 result may lie from the exact sum of its terms (the float64
    reference): the terms are A_j = (d_j dx_j) isum_j and B_j = m_j sx_j; the product d_j dx_j
    rounds once (eps/2 of |A_j|), and each of the 2 nb fused multiply-adds and the final add rounds
    once, by at most eps/2 of a partial sum, itself at most M = sum_j |A_j| + |B_j|.  So
    (2 nb + 2) eps/2 M; we allow twice that for the reference's own float64 roundings.  Plus the
    float32 block sums sx of the affine4 minimum term."""
    O, I = p.shape
    nb = I // 32
    q, dx, sx = packed.quantize_activations(x)
    if p.kind == packed.AFFINE4:
        c = p.codes.view(O, nb, 16)
        qw = torch.cat([c & 0x0F, c >> 4], dim=-1).long()
    else:
        qw = p.codes.view(torch.int8).view(O, nb, 32).long()
    isum = torch.einsum("ojk,rjk->roj", qw, q.view(-1, nb, 32).long()).double()
    M = (isum * (p.scales.double()[None] * dx.double()[:, None])).abs().sum(-1)
    sx_err = 0.0
    if p.kind == packed.AFFINE4:
        M = M + (p.mins.double()[None] * sx.double()[:, None]).abs().sum(-1)
        # the kernel sums each block's 32 inputs in float32 (31 roundings, each at most eps/2 of
        # the block's sum of magnitudes); the reference sums them in float64
        absx = x.double().abs().view(-1, nb, 32).sum(-1)
        sx_err = (p.mins.double().abs()[None] * absx[:, None] * 31 * EPS32 / 2).sum(-1)
    return (2 * nb + 2) * EPS32 * M + sx_err + 1e-30


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("form", list(MAKERS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_against_float64_reference_over_row_counts(form, shape, isa):
    w = MAKERS[form][0](*shape, seed=3)
    p = packed.pack_weight(w)
    iw = packed.interleave(p)
    g = torch.Generator().manual_seed(1)
    for R in ROWS:
        x = torch.randn(R, shape[1], generator=g) * torch.rand(R, 1, generator=g) * 4
        y = packed.packed_linear_int8(x, iw, isa=isa)
        assert y.shape == (R, shape[0]) and y.dtype == torch.float32
        ref = packed.packed_linear_int8_reference(x, p)
        assert ((y.double() - ref).abs() <= summation_bound(x, p)).all(), (R, (y.double() - ref).abs().max())


@pytest.mark.parametrize("form", list(MAKERS))
def test_every_isa_path_gives_the_portable_bits(form):
    """The integer block sums are exact on every path and the float32 steps are the same fused
    multiply-adds in the same order: the AVX2, VNNI and AMX paths (where this CPU has them;
    AMX's tiles of 1 to 3 groups and up to 16 rows) equal the portable one bit for bit, at any
    thread count."""
    assert "portable" in ISAS and len(ISAS) >= 1
    w = MAKERS[form][0](61, 320, seed=7)
    iw = packed.interleave(packed.pack_weight(w))
    x = torch.randn(19, 320, generator=torch.Generator().manual_seed(4)) * 3
    want = packed.packed_linear_int8(x, iw, isa="portable")
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):  # the groups split over threads differently (pairs of groups or one)
            torch.set_num_threads(n)
            for isa in ISAS:
                assert torch.equal(packed.packed_linear_int8(x, iw, isa=isa), want), (isa, n)
            assert torch.equal(packed.packed_linear_int8(x, iw), want)  # the automatic choice
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("form", list(MAKERS))
def test_each_row_is_independent_of_the_others(form, isa):
    """A row's output is bit-identical alone and inside passes of 2..64 rows, at any offset: rows
    are taken 8, 4, 2 or 1 at a time, and none of that may show."""
    w = MAKERS[form][0](45, 192, seed=5)
    iw = packed.interleave(packed.pack_weight(w))
    x = torch.randn(64, 192, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([packed.packed_linear_int8(x[r : r + 1], iw, isa=isa) for r in range(64)])
    for R in range(1, 65):
        assert torch.equal(packed.packed_linear_int8(x[:R], iw, isa=isa), alone[:R]), R
    for lo, hi in ((3, 14), (5, 13), (1, 64), (61, 64)):
        assert torch.equal(packed.packed_linear_int8(x[lo:hi], iw, isa=isa), alone[lo:hi])


def test_golden_case_by_hand():
    """One output row, one block: codes 0..15 twice, d = 0.5, m = -1; x = 1 at input 0 and -2 at
    input 17, 0 elsewhere.  dx = 2 / 127, qx(0) = 64 (1 * 63.5 rounds half to even), qx(17) =
    -127, sx = -1.  y = d dx (0 * 64 + 1 * -127) + m sx = 0.5 * (2 / 127) * -127 + 1 = 0.
    And the interleaved layout: byte 4 o + k of chunk c holds inputs 4c + k (low) and 16 + 4c + k
    (high) of output o."""
    codes = torch.cat([torch.arange(16), torch.arange(16)]).float()
    w = (codes * 0.5 - 1.0).view(1, 32)
    p = packed.pack_weight(w)
    assert p.kind == packed.AFFINE4 and p.scales.item() == 0.5 and p.mins.item() == -1.0
    iw = packed.interleave(p)
    assert iw.qw.shape == (1, 1, 128) and iw.dw.shape == (1, 1, 8)
    lanes = iw.qw.view(4, 8, 4)  # chunk, output lane, k
    for c in range(4):
        for k in range(4):
            assert lanes[c, 0, k].item() == (4 * c + k) | ((4 * c + k) << 4)  # inputs i and 16 + i hold code i
    assert (lanes[:, 1:] == 0).all() and (iw.dw[0, 0, 1:] == 0).all()  # padded lanes are zero rows
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 17] = 1.0, -2.0
    q, dx, sx = packed.quantize_activations(x)
    assert q[0, 0] == 64 and q[0, 17] == -127 and dx.item() == pytest.approx(2 / 127) and sx.item() == -1.0
    for isa in ISAS:
        y = packed.packed_linear_int8(x, iw, isa=isa)
        assert abs(y.item()) <= 1e-6, isa
    # scaled8: one row of codes -124, -116, ..., 116, then 127, times d = 0.25, against x = 1
    q8 = torch.arange(-124, 132, 8)
    q8[-1] = 127  # |q| = 127 present: the packer's d = fp16(max|w| / 127) = 0.25
    w8 = (q8.float() * 0.25).view(1, 32)
    p8 = packed.pack_weight(w8)
    assert p8 is not None and p8.kind == packed.SCALED8 and p8.scales.item() == 0.25
    x8 = torch.ones(1, 32)  # dx = 1 / 127, every code 127: y = 0.25 / 127 * 127 * sum(q8)
    want = 0.25 * float(q8.sum())
    for isa in ISAS:
        assert packed.packed_linear_int8(x8, packed.interleave(p8), isa=isa).item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("form", list(MAKERS))
def test_distance_to_the_float32_product_is_the_activation_rounding(form):
    """Each input moves by at most half a step dx / 2 when quantised, so |y_int8 - x W^T| is at
    most sum_j dx_j / 2 * sum_i |w_ij| (plus float32 summation error)."""
    w = MAKERS[form][0](50, 256, seed=11)
    iw = packed.interleave(packed.pack_weight(w))
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(8)) * 2
    x[3, 7] = 40.0  # an outlier widens its block's step only
    y = packed.packed_linear_int8(x, iw).double()
    exact = x.double() @ w.double().T
    _, dx, _ = packed.quantize_activations(x)
    bound = (dx.double()[:, None, :] / 2 * w.double().abs().view(50, 8, 32).sum(-1)[None]).sum(-1)
    assert ((y - exact).abs() <= bound * (1 + 1e-5) + 1e-4).all()
    assert (y - exact).abs().max() > 0  # it is an approximation: this test can fail the other way too


def test_non_finite_inputs_reach_only_their_own_row():
    w = MAKERS["affine4"][0](20, 64, seed=1)
    iw = packed.interleave(packed.pack_weight(w))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    clean = packed.packed_linear_int8(x, iw)
    for bad in (float("nan"), float("inf"), -float("inf")):
        xb = x.clone()
        xb[2, 40] = bad
        for isa in ISAS:
            y = packed.packed_linear_int8(xb, iw, isa=isa)
            assert y[2].isnan().all(), (bad, isa)
            assert torch.equal(y[[0, 1, 3]], clean[[0, 1, 3]])


def test_inputs_are_read_in_place_inside_guard_buffers():
    """x as a strided view inside a buffer full of NaN: only the view is read."""
    w = MAKERS["scaled8"][0](33, 96, seed=2)
    iw = packed.interleave(packed.pack_weight(w))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    want = packed.packed_linear_int8(x, iw)
    buf = torch.full((11, 100), float("nan"))
    buf[1::2, 2:98] = x
    view = buf[1::2, 2:98]
    assert not view.is_contiguous()
    assert torch.equal(packed.packed_linear_int8(view, iw), want)
    assert torch.equal(packed.packed_linear_int8(x.view(5, 1, 96), iw).view(5, 33), want)  # leading dims kept


def test_bad_arguments_raise_naming_them():
    p = packed.pack_weight(MAKERS["affine4"][0](4, 64))
    iw = packed.interleave(p)
    assert_rejects_bad_x(packed.packed_linear_int8, iw)
    with pytest.raises(ValueError, match="isa"):
        packed.packed_linear_int8(torch.randn(2, 64), iw, isa="avx1024")
    with pytest.raises(TypeError, match="PackedWeight"):
        packed.interleave(iw)
    op = torch.ops.specdec_engine.packed_linear_int8
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="kind"):
        op(x, iw.qw, iw.dw, iw.mw, 2, 4, 0)
    with pytest.raises(ValueError, match="out_features"):
        op(x, iw.qw, iw.dw, iw.mw, 0, 9, 0)
    with pytest.raises(ValueError, match="out_features"):
        op(x, iw.qw, iw.dw, iw.mw, 0, -1, 0)
    with pytest.raises(ValueError, match="qw"):
        op(x, iw.qw[..., :64].contiguous(), iw.dw, iw.mw, 0, 4, 0)
    with pytest.raises(ValueError, match="mw"):
        op(x, iw.qw, iw.dw, None, 0, 4, 0)
    with pytest.raises(ValueError, match="isa"):
        op(x, iw.qw, iw.dw, iw.mw, 0, 4, 7)
    with pytest.raises(ValueError, match="dw must be float16"):
        op(x, iw.qw, iw.dw.float(), iw.mw, 0, 4, 0)
    with pytest.raises(ValueError, match="mw, float16"):
        op(x, iw.qw, iw.dw, iw.mw.float(), 0, 4, 0)


def test_scales_and_mins_are_the_packed_forms_fp16_values():
    """The interleaved layout keeps ggml's fp16 scales and mins as float16 (the bytes a product
    streams), exactly the packed form's values, and refuses a form whose scales are not fp16."""
    for form in ("affine4", "scaled8"):
        p = packed.pack_weight(MAKERS[form][0](20, 96))
        iw = packed.interleave(p)
        assert iw.dw.dtype == torch.float16 and (iw.mw is None or iw.mw.dtype == torch.float16)
        G, nb = iw.dw.shape[:2]
        back = iw.dw.float().permute(0, 2, 1).reshape(G * 8, nb)[:20]
        assert torch.equal(back, p.scales.view(20, nb).float())
        assert iw.nbytes == iw.qw.numel() + 2 * iw.dw.numel() * (2 if iw.mw is not None else 1)
    bad = packed.pack_weight(MAKERS["scaled8"][0](8, 32))
    bad.scales.view(-1)[0] += 2.0**-20  # no longer an fp16 value
    with pytest.raises(ValueError, match="not fp16 values"):
        packed.interleave(bad)


# ---------------------------------------------------------------- rowwise_linear
@pytest.mark.parametrize("portable", [False, True], ids=["avx2", "portable"])
@pytest.mark.parametrize("shape", [(1, 32), (9, 96), (130, 576)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_rowwise_linear_against_float64_and_row_independent(shape, portable):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(6))
    x = torch.randn(64, shape[1], generator=torch.Generator().manual_seed(7))
    alone = torch.cat([packed.rowwise_linear(x[r : r + 1], w, portable=portable) for r in range(64)])
    torch.testing.assert_close(alone, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)
    for R in (0, 1, 2, 3, 8, 17, 64):
        assert torch.equal(packed.rowwise_linear(x[:R], w, portable=portable), alone[:R]), R
    buf = torch.full((shape[0] + 2, shape[1] + 8), float("nan"))
    buf[1:-1, 4:-4] = w
    assert torch.equal(packed.rowwise_linear(x, buf[1:-1, 4:-4], portable=portable), alone)  # a strided weight view


def test_rowwise_linear_bad_arguments():
    w = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight must be float32"):
        packed.rowwise_linear(torch.randn(2, 64), w.double())
    with pytest.raises(ValueError, match="weight must be float32"):
        packed.rowwise_linear(torch.randn(2, 48), torch.randn(4, 48))
    with pytest.raises(ValueError, match="x must be float32"):
        packed.rowwise_linear(torch.randn(2, 32), w)
    with pytest.raises(TypeError, match="weight must be a tensor"):
        packed.rowwise_linear(torch.randn(2, 64), [[1.0]])


def _adversarial_activations(rows: int, I: int) -> torch.Tensor:
    """Rows of blocks that test the 8-bit activations' rounding: amax 127 (d = 1) with every
    half-integer tie in -126.5..126.5, -0.0 and subnormals; a block near float32's largest value;
    an all-zero block (d = 0); a block of one repeated negative value (its codes clamp at -127);
    and random blocks."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(rows, I, generator=g) * 5
    ties = torch.arange(-126.5, 127.0, 1.0)  # 254 ties, rounded half to even
    specials = torch.tensor([127.0, -0.0, 1e-40, -1e-40, 0.5, -0.5, 1.5, -2.5])
    pool = torch.cat([ties, specials])
    for r in range(rows):
        blocks = x[r].view(-1, 32)
        kind = r % 5
        if kind == 0:
            blocks[0] = pool[torch.randint(0, len(pool), (32,), generator=g)]
            blocks[0, 0] = 127.0
        elif kind == 1:
            blocks[-1] = torch.rand(32, generator=g) * 3.0e38 * torch.sign(torch.randn(32, generator=g))
        elif kind == 2:
            blocks[0] = 0.0
        elif kind == 3:
            blocks[-1] = -5.0
    return x


@pytest.mark.parametrize("form", list(MAKERS))
def test_activation_rounding_is_the_same_on_every_path_and_thread_count(form):
    """The portable quantisation and the vector one (every other path) give the same codes,
    scales and block sums: ties round half to even, -0.0, subnormals, huge values, zero blocks
    and clamped codes included, and the blocks split over 1, 2 or 3 threads (400 blocks: past
    the split's grain).  Seen through the outputs, bit for bit, and against the reference."""
    w = MAKERS[form][0](24, 320, seed=9)
    p = packed.pack_weight(w)
    iw = packed.interleave(p)
    x = _adversarial_activations(40, 320)
    want = packed.packed_linear_int8(x, iw, isa="portable")
    # the reference bound holds where float32 does not overflow (not the rows near 3e38)
    held = [r for r in range(40) if r % 5 != 1]
    ref = packed.packed_linear_int8_reference(x[held], p)
    assert ((want[held].double() - ref).abs() <= summation_bound(x[held], p)).all()
    assert not want[1::5].isfinite().all()  # the huge rows do reach float32's limits
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for isa in ISAS:
                got = packed.packed_linear_int8(x, iw, isa=isa)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (isa, n)
    finally:
        torch.set_num_threads(threads)
    # every tie reached the kernel as a tie: the reference rounds them half to even
    q, d, _ = packed.quantize_activations(x[:1])
    assert d[0, 0] == 1.0 and (q[0, :32].float() == torch.round(x[0, :32])).all()
