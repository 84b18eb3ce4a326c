"""The engine's C++ kernels (``torch.ops.specdec_engine``): their schemas and fakes against the
real kernels, on the calls a real pass makes.

A tiny model's passes (its weights snapped to GGUF codes and packed; float32 and int8
numerics; the one-call layer and the Python layer) are run under a dispatch mode that keeps the
first call of each engine kernel; ``torch.library.opcheck`` then checks each recorded call's
schema (mutations declared, aliasing) and its fake (shapes, dtypes, strides against the real
output).  What each kernel computes is tested against the Python it replaces elsewhere:
``test_row_independence.py`` (the one-call layer and ``rms_norm`` against the Python layer, bit
for bit), ``test_packed_linear.py`` and ``test_packed_linear_int8.py`` (the products against a
float64 product and ggml's arithmetic).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specdec_kernels.decoding.model import swiglu
from tests.engine.tiny import packed_tiny

pytestmark = pytest.mark.requires_native_op("decoder_layer")

ENGINE_KERNELS = ("decoder_stack", "decoder_layer", "rms_norm", "silu_mul", "packed_linear", "packed_linear_int8")


class _FirstCalls(TorchDispatchMode):
    """Keeps the arguments of the first call of each ``specdec_engine`` kernel."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "specdec_engine" and func._opname not in self.calls:
            clone = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            self.calls[func._opname] = (
                func,
                tuple([clone(x) for x in a] if isinstance(a, list) else clone(a) for a in args),
                kwargs,
            )
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def recorded():
    model = packed_tiny()
    mode = _FirstCalls()
    tokens = torch.tensor([[5, 17, 33, 2, 90, 41, 7]])
    with torch.inference_mode(), mode:
        for numerics in ("float32", "int8"):
            model.numerics = numerics
            cache = model.new_kv_cache(1, 16)
            model(tokens, torch.arange(7)[None], cache, torch.zeros(1, dtype=torch.int32))
            # a second pass after the first (the head and final norm run in Python: rms_norm, products)
            model(torch.arange(9)[None] + 3, torch.arange(7, 16)[None], cache, torch.tensor([7], dtype=torch.int32))
            # one layer alone (Block.forward: the call an EAGLE head's layer makes; a pass runs decoder_stack)
            x = torch.randn(1, 2, model.args.hidden_size)
            cos, sin = model._rotary(torch.arange(16, 18)[None])
            layer_cache = model.new_kv_cache(1, 20)[0]
            model.layers[0](x, cos, sin, layer_cache, None, torch.tensor([16], dtype=torch.int32), None, None)
            swiglu(torch.randn(2, 3, 2 * model.args.intermediate_size))  # the Python layer's SwiGLU
    model.numerics = "float32"
    return mode.calls


def test_a_pass_calls_every_engine_kernel(recorded):
    assert set(ENGINE_KERNELS) <= set(recorded), sorted(recorded)


@pytest.mark.parametrize("name", ENGINE_KERNELS)
def test_schema_and_fake_match_the_kernel(recorded, name):
    func, args, kwargs = recorded[name]
    torch.library.opcheck(func, args, kwargs, test_utils=("test_schema", "test_faketensor"))


def test_fakes_give_the_kernels_shapes_under_fake_tensors(recorded):
    """Under ``FakeTensorMode`` each recorded call gives an output of the real one's shape and
    dtype (what torch.compile's tracing of the engine's model sees)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name in ENGINE_KERNELS:
        func, args, kwargs = recorded[name]
        real = func(*args, **kwargs)
        with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
            fake_args = [
                [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in a]
                if isinstance(a, list)
                else (fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a)
                for a in args
            ]
            fake = func(*fake_args, **kwargs)
        assert fake.shape == real.shape and fake.dtype == real.dtype, name
