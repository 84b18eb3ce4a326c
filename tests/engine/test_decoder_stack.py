"""The layers of a CPU pass in one native call (``specdec_engine::decoder_stack``).

``Transformer.forward`` runs every layer through ``decoder_stack`` (one call per run of layers
between the taps ``hidden_layers`` asks for) where each layer would take the one-call layer
(``specdec_engine::decoder_layer``).  The stack is that layer's function called per layer, so a
pass must give the same bits either way: logits, hidden states and the KV cache it writes, for
chains, trees, ragged batches, layer-skip passes (``num_layers``) and taps.  Its cache of
arguments must follow every change a per-layer call would see (weights replaced or edited in
place, a norm's eps, the numerics), and bad arguments are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import model as model_module
from specdec_kernels.tree import ancestor_mask, tree_depths
from tests.engine.tiny import packed_tiny

pytestmark = pytest.mark.requires_native_op("decoder_layer")  # skipped without the extension, failed in CI

PREFIX = 6


@pytest.fixture(scope="module")
def coded():
    return packed_tiny()


def per_layer(monkeypatch):
    """Make ``forward`` call the layers one by one (``Block.forward``: ``decoder_layer`` each)."""
    monkeypatch.setattr(model_module, "fused_stack_args", lambda *args: None)


def stack_calls(model, fn):
    """(fn's result, the number of decoder_stack and decoder_layer calls it made)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"decoder_stack": 0, "decoder_layer": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "specdec_engine" and func._opname in counts:
                counts[func._opname] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        out = fn()
    return out, counts


def a_pass(model, seqlens, tokens, parents=None, **kwargs):
    """Prefill ragged prefixes (``seqlens`` tokens each), then one pass of ``tokens`` [B, N]
    (a chain, or the tree ``parents``); (the pass's output, the KV cache after it)."""
    B, N = tokens.shape
    g = torch.Generator().manual_seed(11)
    V = model.args.vocab_size
    cache = model.new_kv_cache(B, max(seqlens) + N + 1)
    with torch.inference_mode():
        for b, n in enumerate(seqlens):  # each prefix alone: its own row of the cache
            prompt = torch.randint(0, V, (1, n), generator=g)
            model(prompt, torch.arange(n)[None], cache[:, :, b : b + 1], torch.zeros(1, dtype=torch.int32))
        depths = torch.arange(N) if parents is None else tree_depths(parents)
        lens = torch.tensor(seqlens, dtype=torch.int32)
        mask = None if parents is None else ancestor_mask(parents)
        out = model(tokens, lens[:, None].long() + depths[None], cache, lens, mask, **kwargs)
    return out, cache


CASES = [
    ("one token", [PREFIX], 1, None, {}),
    ("chain of 5, ragged batch", [PREFIX, PREFIX + 3], 5, None, {}),
    ("tree of 7", [PREFIX, PREFIX + 1], 7, [-1, 0, 0, 1, 1, 2, 4], {}),
    ("taps", [PREFIX], 3, None, {"return_hidden": True, "hidden_layers": (1, 0)}),
    ("taps and layer skip", [PREFIX], 2, None, {"return_hidden": True, "hidden_layers": (0,), "num_layers": 1}),
    ("no layers", [PREFIX], 2, None, {"num_layers": 0}),
]


@pytest.mark.parametrize("numerics", ["float32", "int8"])
@pytest.mark.parametrize("name, seqlens, n, parents, kwargs", CASES, ids=[c[0] for c in CASES])
def test_stack_equals_the_layers_one_by_one(coded, numerics, name, seqlens, n, parents, kwargs, monkeypatch):
    coded.numerics = numerics
    try:
        tokens = torch.randint(0, coded.args.vocab_size, (len(seqlens), n), generator=torch.Generator().manual_seed(n))
        (stacked, cache_s), counts = stack_calls(coded, lambda: a_pass(coded, seqlens, tokens, parents, **kwargs))
        layers = kwargs.get("num_layers", len(coded.layers))
        taps = len(set(kwargs.get("hidden_layers", ())) - {layers - 1})
        # one call per run of layers between taps; the prefills (one per sequence) as many again
        assert counts["decoder_layer"] == 0
        assert counts["decoder_stack"] == len(seqlens) + (taps + 1 if layers else 0)
        per_layer(monkeypatch)
        (alone, cache_l), counts = stack_calls(coded, lambda: a_pass(coded, seqlens, tokens, parents, **kwargs))
        assert counts["decoder_stack"] == 0 and counts["decoder_layer"] == len(seqlens) * len(coded.layers) + layers
        pairs = list(zip(stacked, alone)) if isinstance(stacked, tuple) else [(stacked, alone)]
        for s, a in pairs:
            assert torch.equal(s, a)
            assert not torch.equal(s, torch.zeros_like(s))
        assert torch.equal(cache_s, cache_l)
    finally:
        coded.numerics = "float32"


def test_arguments_follow_changes_to_the_layers(coded, monkeypatch):
    """The stack's cached arguments follow what the per-layer calls would read: a weight edited
    in place, a weight replaced, a norm's eps changed, the numerics switched."""
    tokens = torch.tensor([[3, 1, 4]])

    def both():
        with monkeypatch.context() as m:
            s = a_pass(coded, [PREFIX], tokens)[0]
            per_layer(m)
            a = a_pass(coded, [PREFIX], tokens)[0]
        return s, a

    first, _ = both()
    layer = coded.layers[1]
    changes = [
        lambda: layer.ffn_norm.weight.data.mul_(1.5),  # in place: a new version
        lambda: setattr(layer.attention_norm, "weight", torch.nn.Parameter(layer.attention_norm.weight * 0.5)),
        lambda: setattr(layer.ffn_norm, "eps", 1e-2),  # the norms' eps differ: the Python layer
        lambda: setattr(layer.attention_norm, "eps", 1e-2),  # the same again: the stack
        lambda: setattr(coded, "numerics", "int8"),
    ]
    saved = (layer.ffn_norm.weight.detach().clone(), layer.attention_norm.weight, layer.ffn_norm.eps)
    assert layer.attention_norm.eps == layer.ffn_norm.eps
    try:
        previous = first
        for change in changes:
            with torch.no_grad():
                change()
            s, a = both()
            assert torch.equal(s, a)
            assert not torch.equal(s, previous), changes.index(change)  # the change reached the stack
            previous = s
    finally:
        with torch.no_grad():
            layer.ffn_norm.weight.copy_(saved[0])
        layer.attention_norm.weight, layer.ffn_norm.eps, layer.attention_norm.eps = saved[1], saved[2], saved[2]
        coded.numerics = "float32"
    assert torch.equal(a_pass(coded, [PREFIX], tokens)[0], first)


def stack_call(model):
    """``call(**changes)``: ``decoder_stack`` on the arguments of a one-token int8 pass of
    ``model`` (by the op's argument names; a fresh cache unless ``kv_cache`` is given) with
    ``changes`` in place of some; and those arguments."""
    model.numerics = "int8"
    try:
        norms, biases, weights, kinds, outs, eps = model_module.fused_stack_args(model, model.layers, 1)
    finally:
        model.numerics = "float32"
    a = model.args
    cos, sin = model._rotary(torch.tensor([[0]]))
    args = dict(
        x=torch.randn(1, 1, a.hidden_size),
        norms=norms,
        eps=eps,
        cos=cos,
        sin=sin,
        kv_cache=None,
        cache_seqlens=torch.zeros(1, dtype=torch.int32),
        tree_mask=None,
        qkv_biases=biases,
        weights=weights,
        kinds=kinds,
        out_features=outs,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
    )

    def call(**changes):
        given = {**args, **changes}
        if given["kv_cache"] is None:
            given["kv_cache"] = model.new_kv_cache(1, 4)
        return torch.ops.specdec_engine.decoder_stack(**given)

    return call, args


def test_bad_arguments_are_refused_by_name(coded):
    call, args = stack_call(coded)
    with pytest.raises(ValueError, match="2 L norms"):
        call(norms=args["norms"][:-1])
    with pytest.raises(ValueError, match="kv_cache must be"):
        call(kv_cache=coded.new_kv_cache(1, 4)[:1])
    with pytest.raises(ValueError, match="cache_seqlens"):
        call(cache_seqlens=args["cache_seqlens"] + 4)


def test_hooks_and_replaced_forwards_keep_the_layers_one_by_one(coded, monkeypatch):
    """A forward hook on a layer (the training recorders' way to read its outputs), a hook on
    every module, or a replaced ``Block.forward`` sees every layer run: the pass then takes the
    layers one by one, with the same results."""
    from specdec_kernels.decoding.model import Block

    tokens = torch.tensor([[3, 1, 4]])
    want = a_pass(coded, [PREFIX], tokens)[0]
    seen = []
    handle = coded.layers[1].register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        (got, _), counts = stack_calls(coded, lambda: a_pass(coded, [PREFIX], tokens))
    finally:
        handle.remove()
    assert torch.equal(got, want) and counts["decoder_stack"] == 0 and len(seen) == 2  # prefill and pass
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: None)
    try:
        (got, _), counts = stack_calls(coded, lambda: a_pass(coded, [PREFIX], tokens))
    finally:
        handle.remove()
    assert torch.equal(got, want) and counts["decoder_stack"] == 0
    calls = []
    original = Block.forward

    def spy(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Block, "forward", spy)
    assert torch.equal(a_pass(coded, [PREFIX], tokens)[0], want)
    assert len(calls) == 2 * len(coded.layers)
    monkeypatch.undo()
    (got, _), counts = stack_calls(coded, lambda: a_pass(coded, [PREFIX], tokens))
    assert torch.equal(got, want) and counts["decoder_stack"] == 2  # back to the stack


def test_an_empty_pass_leaves_no_arguments_behind(coded, monkeypatch):
    """A pass of no tokens takes other products (``linear_path``'s rule for rows == 0); the
    cached arguments of the stack and of each layer must not carry them into the next pass."""
    tokens = torch.tensor([[5, 2]])
    coded.numerics = "int8"
    try:
        a_pass(coded, [PREFIX], torch.zeros(1, 0, dtype=torch.long))
        after_empty = a_pass(coded, [PREFIX], tokens)[0]
        monkeypatch.setenv("SPECDEC_FUSED_LAYER", "0")  # the Python layer: no cached arguments
        want = a_pass(coded, [PREFIX], tokens)[0]
    finally:
        coded.numerics = "float32"
    assert torch.equal(after_empty, want)


def test_hostile_arguments_fail_before_any_write(coded):
    """Weights that disagree with out_features, tensors off the CPU and a bias of the wrong
    shape are refused by name (the loops after each product would otherwise read and write
    outside its output)."""
    call, args = stack_call(coded)
    a, outs = coded.args, args["out_features"]
    inputs = (a.hidden_size, a.num_heads * a.head_dim, a.hidden_size, outs[2] // 2)  # wqkv, wo, w13, w2
    for i, rows in ((1, 8), (3, 1), (0, 2), (2, 4)):  # each linear of layer 0 with too few outputs
        w, k = list(args["weights"]), list(args["kinds"])
        w[3 * i : 3 * i + 3] = [torch.randn(rows, inputs[i]), None, None]  # a plain float32 weight (kind 3)
        k[i] = 3
        with pytest.raises(ValueError, match=f"linear {i}"):
            call(weights=w, kinds=k)
    with pytest.raises(ValueError, match="CPU tensors"):
        call(kv_cache=coded.new_kv_cache(1, 4).to("meta"))
    with pytest.raises(ValueError, match="qkv_bias"):
        call(qkv_biases=[torch.zeros(6, 1)] + list(args["qkv_biases"][1:]))


def test_a_norm_of_another_kind_keeps_its_own_arithmetic(coded, monkeypatch):
    """A layer whose norm is not the engine's RMSNorm (a LayerNorm put in its place) runs its
    Python ops: the same results as with every layer in Python."""
    layer = coded.layers[0]
    saved = layer.attention_norm
    layer.attention_norm = torch.nn.LayerNorm(coded.args.hidden_size, eps=saved.eps)
    try:
        tokens = torch.tensor([[3, 1, 4]])
        got = a_pass(coded, [PREFIX], tokens)[0]
        monkeypatch.setenv("SPECDEC_FUSED_LAYER", "0")
        want = a_pass(coded, [PREFIX], tokens)[0]
    finally:
        layer.attention_norm = saved
    assert torch.equal(got, want)


def count_stack_args(monkeypatch):
    """Count the calls of ``fused_stack_args`` (the per-pass check of every layer)."""
    calls = []
    original = model_module.fused_stack_args

    def spy(*args):
        calls.append(args[2])
        return original(*args)

    monkeypatch.setattr(model_module, "fused_stack_args", spy)
    return calls


def test_weights_fixed_gathers_the_arguments_once_per_pass_class(coded, monkeypatch):
    """Inside ``weights_fixed`` the stack's arguments are gathered once per pass class and
    numerics (the same bits as outside); a change made inside is seen after the block, whose
    end (also by an exception) brings the per-pass check back; nested blocks share."""
    tokens = torch.tensor([[3, 1, 4]])
    want = a_pass(coded, [PREFIX], tokens)[0]
    calls = count_stack_args(monkeypatch)
    with coded.weights_fixed():
        first = a_pass(coded, [PREFIX], tokens)[0]
        again = a_pass(coded, [PREFIX], tokens)[0]
        assert len(calls) == 1  # the prefill (6 tokens) and the pass (3): one class, gathered once
        with coded.weights_fixed():  # nested: the outer arguments
            a_pass(coded, [PREFIX], tokens)
        assert len(calls) == 1
        layer = coded.layers[0]
        saved = layer.ffn_norm.weight.detach().clone()
        with torch.no_grad():
            layer.ffn_norm.weight.mul_(2.0)  # not re-checked inside: the same argument tensors
        a_pass(coded, [PREFIX], tokens)
        assert len(calls) == 1
        coded.numerics = "int8"  # another numerics: gathered for it
        try:
            a_pass(coded, [PREFIX], tokens)
        finally:
            coded.numerics = "float32"
        assert len(calls) == 2
    with torch.no_grad():
        layer.ffn_norm.weight.copy_(saved)
    assert torch.equal(first, want) and torch.equal(again, want)
    n = len(calls)
    assert torch.equal(a_pass(coded, [PREFIX], tokens)[0], want)
    assert len(calls) == n + 2  # checked every pass again
    with pytest.raises(RuntimeError, match="inside"):
        with coded.weights_fixed():
            raise RuntimeError("inside")
    assert coded.__dict__.get("_fixed_stack") is None


def test_a_generation_checks_the_layers_once_per_pass_class(coded, monkeypatch):
    """``SpeculativeDecoder.generate`` decodes in ``weights_fixed``: the layers' arguments are
    gathered per pass class, not per step, and the tokens are those of steps run one by one
    outside it (``start`` and ``step``, each pass checked)."""
    from specdec_kernels.decoding import SpeculativeDecoder

    coded.numerics = "int8"
    try:
        calls = count_stack_args(monkeypatch)
        decoder = SpeculativeDecoder(coded, threads=1)
        got = decoder.generate([[5, 17, 33, 2]], 12, num_draft_tokens=0).tokens[0]
        assert len(calls) == 1, calls  # the prefill and the one-token steps: one class
        state = decoder.start([[5, 17, 33, 2]], 12)
        want = []
        while not state.finished:
            want += decoder.step(state, 0)[0]
        assert len(calls) > 12  # outside: one check per pass
        assert got == want and len(got) == 12
    finally:
        coded.numerics = "float32"
