"""Every row of a target pass is independent of the others, bit for bit, on every CPU path.

A verification pass feeds the root and the draft nodes together; speculative output equals
greedy output only if each node's logits are exactly those a one-token decode step gives it
after its ancestors.  For each numerics ("float32": the packed codes or the fixed-order float32
kernel; "int8": 8-bit activations), with the one-call layer (specdec_engine::decoder_layer) and with the
Python layer, chains and trees of 1..128 nodes (past the one-call layer's 64), batch 1 and 2: the
logits of node i equal those of decoding the path to i one token at a time.  Also: the one-call
layer equals the Python layer bit for bit (both run the same RMSNorm loop, specdec_engine::rms_norm, and
the same kernels), and the 8-bit model stays close to the float32 one.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec_kernels.decoding import Transformer, packed
from specdec_kernels.decoding.model import FUSED_ENV
from specdec_kernels.tree import ancestor_mask, path_to, tree_depths
from tests.engine.tiny import snap_to_gguf_codes, tiny_llama

pytestmark = pytest.mark.requires_native_op("decoder_layer")  # skipped without the extension, failed in CI

SIZES = [1, 2, 3, 5, 8, 16, 17, 33, 64, 65, 128]
PREFIX = 9


@pytest.fixture(scope="module")
def models():
    plain = Transformer.from_hf_model(tiny_llama())
    hf = tiny_llama()
    snap_to_gguf_codes(hf)
    coded = Transformer.from_hf_model(hf)
    kinds = coded.pack_weights()
    assert set(kinds.values()) == {"affine4", "scaled8"}, kinds  # every weight packed
    assert set(plain.pack_weights().values()) == {"none"}
    return {"plain": plain, "coded": coded}


def random_tree(n: int, seed: int) -> list:
    rng = random.Random(seed)
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def run_pass(model, prefixes, tokens, parents):
    """Prefill each prefix (one row of the batch each), then one pass of the node tokens
    [B, N] with the tree ``parents`` (None: a chain); returns the pass's logits [B, N, V]."""
    B, N = tokens.shape
    cache = model.new_kv_cache(B, PREFIX + N + 1)
    with torch.inference_mode():
        model(prefixes, torch.arange(PREFIX).expand(B, -1), cache, torch.zeros(B, dtype=torch.int32))
        depths = torch.arange(N) if parents is None else tree_depths(parents)
        seqlens = torch.full((B,), PREFIX, dtype=torch.int32)
        mask = None if parents is None else ancestor_mask(parents)
        return model(tokens, PREFIX + depths[None].expand(B, -1), cache, seqlens, mask)


def decode_path(model, prefix, path_tokens):
    """Prefill the prefix, then decode the path one token per pass; the logits of each step."""
    cache = model.new_kv_cache(1, PREFIX + len(path_tokens) + 1)
    out = []
    with torch.inference_mode():
        model(prefix[None], torch.arange(PREFIX)[None], cache, torch.zeros(1, dtype=torch.int32))
        for d, t in enumerate(path_tokens):
            pos = torch.tensor([[PREFIX + d]])
            out.append(model(torch.tensor([[t]]), pos, cache, torch.tensor([PREFIX + d], dtype=torch.int32))[0, 0])
    return out


@pytest.mark.parametrize("fused", [True, False], ids=["one-call-layer", "python-layer"])
@pytest.mark.parametrize(
    "which, numerics", [("plain", "float32"), ("coded", "float32"), ("coded", "int8")], ids=lambda v: str(v)
)
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_each_node_gets_the_logits_of_decoding_its_path(models, which, numerics, fused, shape, monkeypatch):
    monkeypatch.setenv(FUSED_ENV, "1" if fused else "0")
    model = models[which]
    model.numerics = numerics
    try:
        g = torch.Generator().manual_seed(3)
        V = model.args.vocab_size
        prefixes = torch.randint(0, V, (2, PREFIX), generator=g)
        for n in SIZES:
            parents = None if shape == "chain" else random_tree(n, seed=n)
            tokens = torch.randint(0, V, (2, n), generator=g)
            both = run_pass(model, prefixes, tokens, parents)
            alone = run_pass(model, prefixes[1:], tokens[1:], parents)  # the other sequence gone
            assert torch.equal(both[1], alone[0]), n
            nodes = range(n) if shape == "chain" else sorted({n - 1, n // 2, 0})
            if shape == "chain":  # one decode of the whole chain checks every node
                steps = decode_path(model, prefixes[0], tokens[0].tolist())
                for i in nodes:
                    assert torch.equal(both[0, i], steps[i]), (n, i)
            else:
                for i in nodes:
                    path = path_to(parents, i)
                    steps = decode_path(model, prefixes[0], [int(tokens[0, j]) for j in path])
                    assert torch.equal(both[0, i], steps[-1]), (n, i)
    finally:
        model.numerics = "float32"


@pytest.mark.parametrize("which, numerics", [("plain", "float32"), ("coded", "float32"), ("coded", "int8")])
def test_one_call_layer_equals_the_python_layer(models, which, numerics, monkeypatch):
    """The same ops in one native call give the same bits as the Python layer (dense and paged
    caches, chains and trees, a pass of a few nodes and one of 65, past the one-call layer's
    limit): the two share the RMSNorm loop and every kernel, so the path a pass takes (chosen by
    its size and the cache layout) never changes a token, in float32 or int8."""
    from specdec_kernels.decoding.paged import CacheLayout, PagedKVCache

    model = models[which]
    model.numerics = numerics
    try:
        g = torch.Generator().manual_seed(5)
        prefixes = torch.randint(0, model.args.vocab_size, (2, PREFIX), generator=g)
        tokens = torch.randint(0, model.args.vocab_size, (2, 7), generator=g)
        out = {}
        for fused in ("1", "0"):
            monkeypatch.setenv(FUSED_ENV, fused)
            out[fused] = run_pass(model, prefixes, tokens, random_tree(7, seed=1))
        assert not torch.equal(out["1"], torch.zeros_like(out["1"]))
        assert torch.equal(out["1"], out["0"])
        # the paged cache (always the Python layer) against the dense one-call layer
        monkeypatch.setenv(FUSED_ENV, "1")
        for n, parents in ((7, random_tree(7, seed=1)), (65, None)):
            toks = torch.randint(0, model.args.vocab_size, (2, n), generator=g)
            dense = run_pass(model, prefixes, toks, parents)
            layout = CacheLayout(paged=True, block_size=4, share_prefix=False)
            cache = PagedKVCache.allocate(model, prefixes.tolist(), PREFIX + n + 1, layout)
            with torch.inference_mode():
                model(prefixes, torch.arange(PREFIX).expand(2, -1), cache, torch.zeros(2, dtype=torch.int32))
                depths = torch.arange(n) if parents is None else tree_depths(parents)
                mask = None if parents is None else ancestor_mask(parents)
                seqlens = torch.full((2,), PREFIX, dtype=torch.int32)
                paged = model(toks, PREFIX + depths[None].expand(2, -1), cache, seqlens, mask)
            assert torch.equal(dense, paged), n
    finally:
        model.numerics = "float32"


def test_int8_numerics_stay_close_to_float32(models):
    """8-bit activations approximate the float32 products: on the tiny model (peaked logits) the
    logits move by well under their spread, and the next-token argmax agrees almost everywhere."""
    model = models["coded"]
    g = torch.Generator().manual_seed(9)
    prefixes = torch.randint(0, model.args.vocab_size, (2, PREFIX), generator=g)
    tokens = torch.randint(0, model.args.vocab_size, (2, 16), generator=g)
    out = {}
    try:
        for numerics in ("float32", "int8"):
            model.numerics = numerics
            out[numerics] = run_pass(model, prefixes, tokens, None)
    finally:
        model.numerics = "float32"
    diff = (out["int8"] - out["float32"]).abs().max()
    spread = out["float32"].std()
    assert 0 < diff < 0.2 * spread, (diff, spread)
    agree = (out["int8"].argmax(-1) == out["float32"].argmax(-1)).float().mean()
    assert agree >= 0.9, agree


def test_numerics_setting(models):
    model = models["coded"]
    with pytest.raises(ValueError, match="numerics"):
        model.numerics = "int4"
    small = model.truncated(2)
    model.numerics = "int8"
    try:
        assert all(layer.numerics == "int8" for layer in model.layers)
        assert model.truncated(1).numerics == "int8"
        assert small.layers[0].numerics == "int8"  # shared layers follow
    finally:
        model.numerics = "float32"
    assert packed.int8_form(model.layers[0].wqkv.weight) is not None


def test_int8_instruction_set_is_measured_and_changes_no_bit(models, monkeypatch):
    """The int8 products' instruction set is chosen by timing whole passes (it changes speed
    only: every path gives the same bits), and $SPECDEC_INT8_ISA forces one."""
    from specdec_kernels.decoding import model as m

    choice = m._int8_isa_choice()
    isas = [i for i in packed.int8_isas() if i != "portable"]
    if len(isas) < 2:
        pytest.skip(f"this CPU runs one vector path of the int8 product ({isas}): nothing to choose")
    assert choice is not None and set(choice.candidates) == set(isas)
    model = models["coded"]
    model.numerics = "int8"
    g = torch.Generator().manual_seed(2)
    prefixes = torch.randint(0, model.args.vocab_size, (1, PREFIX), generator=g)
    tokens = torch.randint(0, model.args.vocab_size, (1, 3), generator=g)
    try:
        choice.reset()
        outs = [run_pass(model, prefixes, tokens, None) for _ in range(len(isas) * choice.trials + 1)]
        assert all(torch.equal(o, outs[0]) for o in outs)  # trials of every path: the same bits
        assert any(c["choice"] in isas for c in choice.choices())  # decided for the 3-token passes
        for isa in packed.int8_isas():  # every path, the untimed portable one included
            monkeypatch.setenv(m.INT8_ISA_ENV, isa)
            choice.read_environment()
            assert torch.equal(run_pass(model, prefixes, tokens, None), outs[0]), isa
        monkeypatch.setenv(m.INT8_ISA_ENV, "avx1024")
        choice.read_environment()
        with pytest.raises(ValueError, match=m.INT8_ISA_ENV):
            run_pass(model, prefixes, tokens, None)
        with pytest.raises(ValueError, match="isa"):
            model.set_int8_isa("avx1024")
    finally:
        monkeypatch.delenv(m.INT8_ISA_ENV, raising=False)
        choice.read_environment()
        model.numerics = "float32"
