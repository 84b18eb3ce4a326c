"""SwiGLU's ``silu(gate) * up`` on the CPU (``specdec_engine::silu_mul``, the loop the one-call
layer runs): against float64 arithmetic and torch's float32 ops over odd sizes and special
values, row by row independent, identical calls identical, and refusals by name.

Tolerance: the loop's exp has a relative error of about 2e-7 and each of its four roundings
(1 + e, the quotient, the two products) half an ulp (6e-8), so the result is within 1e-6
relative of the float64 value; below about 1e-30 in magnitude (a gate under -65, whose silu
is below 1e-26 times up) an absolute 1e-30.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specdec_kernels.decoding.model import swiglu

pytestmark = pytest.mark.requires_native_op("silu_mul")


def op(gate_up: torch.Tensor) -> torch.Tensor:
    return torch.ops.specdec_engine.silu_mul(gate_up)


def exact(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.double().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


@pytest.mark.parametrize("I", [1, 7, 8, 9, 31, 1536])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5), (0,)])
def test_against_float64_and_torch(I, lead):
    gen = torch.Generator().manual_seed(I)
    gu = torch.randn(*lead, 2 * I, generator=gen) * 6
    out = op(gu)
    assert out.shape == (*lead, I) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact(gu), rtol=1e-6, atol=1e-30)
    g, u = gu.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(g) * u, rtol=2e-6, atol=1e-30)
    assert torch.equal(swiglu(gu), out)  # the Python layer's SwiGLU is this loop


def test_special_values_by_hand():
    g = torch.tensor([0.0, -0.0, 1.0, -1.0, 100.0, -100.0, -87.0, -88.0, math.inf, -math.inf, math.nan, 1e-40])
    u = torch.tensor([2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    out = op(torch.cat([g, u]))
    # silu(1) = 1 / (1 + e^-1) = 0.7310585786..., silu(-1) = -0.2689414213...
    assert out[0] == 0 and out[1] == 0
    assert out[2].item() == pytest.approx(0.7310585786300049, rel=1e-6)
    assert out[3].item() == pytest.approx(-0.2689414213699951, rel=1e-6)
    assert out[4] == 100.0 and out[5] == pytest.approx(-100.0 * math.exp(-100.0), abs=1e-30)
    assert out[6].item() == pytest.approx(-87.0 * math.exp(-87.0), rel=1e-5)
    assert abs(out[7].item()) < 1e-30  # exp underflows below -87: a silu of -0 (the true one is -5e-37)
    assert out[8] == math.inf  # as torch: inf * 1
    assert math.isnan(out[9]) and math.isnan(out[10])  # -inf * 0 and nan, as torch
    assert out[11].item() == pytest.approx(0.5e-40, rel=1e-3)  # a subnormal gate: silu(g) = g / 2


def test_rows_alone_views_and_repeats():
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 40, generator=gen)
    gu = wide[:, 3:33]  # a strided view inside a larger tensor (I = 15)
    before = wide.clone()
    out = op(gu)
    assert torch.equal(wide, before)  # the input is only read
    assert torch.equal(out, op(gu.contiguous()))
    for r in range(5):  # a row's output does not depend on the other rows
        assert torch.equal(out[r], op(gu[r : r + 1].contiguous())[0])
    assert torch.equal(op(gu), out)  # identical calls, identical bits


@pytest.mark.parametrize(
    "bad, error",
    [
        (torch.randn(2, 8, dtype=torch.float64), ValueError),
        (torch.randn(2, 7), ValueError),  # an odd last dimension: no gate/up halves
        (torch.tensor(1.0), ValueError),
    ],
)
def test_refusals_name_the_argument(bad, error):
    with pytest.raises(error, match="gate_up"):
        op(bad)
