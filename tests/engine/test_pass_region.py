"""The int8 layers of a pass in one parallel region (``decoder_stack`` where every product is
on the int8 path; csrc/decoder_layer_cpu.cpp, ``decoder_stack_region``).

The region runs a whole pass with one team of threads, a barrier between its steps, instead of
a fork and join of the thread pool per product (issue #56).  It must give the bits of the
layers called one by one (``decoder_layer``, one parallel loop per product) at every thread
count: outputs and cache writes, for one token, chains, trees, ragged batches, Qwen2's q/k/v
biases and a layer whose intermediate size differs.  Every layer's arguments are checked
before the region starts: a bad weight in the last layer fails before the first layer writes
its cache.
"""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import model as model_module
from specdec_kernels.decoding import packed
from specdec_kernels.tree import ancestor_mask, tree_depths
from tests.engine.tiny import packed_tiny

pytestmark = pytest.mark.requires_native_op("decoder_stack")  # skipped without the extension, failed in CI


@pytest.fixture(scope="module")
def coded():
    return packed_tiny()


@pytest.fixture
def restore_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def int8_args(model, rows):
    """``fused_stack_args`` of an int8 pass of ``rows`` tokens (every kind 4 or 5)."""
    model.numerics = "int8"
    try:
        args = model_module.fused_stack_args(model, model.layers, rows)
    finally:
        model.numerics = "float32"
    norms, biases, weights, kinds, outs, eps = args
    assert set(kinds) <= {4, 5}, kinds
    return list(norms), list(biases), list(weights), list(kinds), list(outs), eps


def one_by_one(x, norms, eps, cos, sin, cache, lens, mask, biases, weights, kinds, outs, H, Hkv, isa=0):
    """The layers by ``decoder_layer``, one call each (the per-product parallel loops)."""
    for layer in range(len(biases)):
        x = torch.ops.specdec_engine.decoder_layer(
            x,
            norms[2 * layer],
            norms[2 * layer + 1],
            eps,
            cos,
            sin,
            cache[layer, 0],
            cache[layer, 1],
            lens,
            mask,
            biases[layer],
            weights[12 * layer : 12 * layer + 12],
            kinds[4 * layer : 4 * layer + 4],
            outs[4 * layer : 4 * layer + 4],
            H,
            Hkv,
            isa,
        )
    return x


def stacked(x, norms, eps, cos, sin, cache, lens, mask, biases, weights, kinds, outs, H, Hkv, isa=0):
    return torch.ops.specdec_engine.decoder_stack(
        x, norms, eps, cos, sin, cache, lens, mask, biases, weights, kinds, outs, H, Hkv, isa
    )


CASES = [  # (name, cache_seqlens, N, tree parents or None)
    ("one token", [9], 1, None),  # fewer rows than threads: some idle in the row steps
    ("one token, batch of 2", [9, 30], 1, None),
    ("two tokens", [0], 2, None),
    ("one token, batch of 3", [9, 0, 30], 1, None),
    ("chain of 5, ragged", [4, 17], 5, None),
    ("tree of 7", [12, 3], 7, [-1, 0, 0, 1, 1, 2, 4]),
    ("chain of 16", [40], 16, None),
    ("one token, long cache", [150], 1, None),  # attention over three 64-key splits
    ("tree of 7 across a split", [60, 130], 7, [-1, 0, 0, 1, 1, 2, 4]),  # the tree slots cross key 64
]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "qkv bias"])
@pytest.mark.parametrize("name, seqlens, n, parents", CASES, ids=[c[0] for c in CASES])
def test_region_gives_the_bits_of_the_layers_one_by_one(
    coded, threads, bias, name, seqlens, n, parents, restore_threads
):
    torch.set_num_threads(threads)
    a = coded.args
    g = torch.Generator().manual_seed(n * 7 + len(seqlens))
    B = len(seqlens)
    norms, biases, weights, kinds, outs, eps = int8_args(coded, B * n)
    if bias:  # Qwen2's q/k/v biases, one per layer (the tiny Llama has none)
        biases = [torch.randn(outs[4 * i], generator=g) for i in range(len(biases))]
    x = torch.randn(B, n, a.hidden_size, generator=g) * 3
    lens = torch.tensor(seqlens, dtype=torch.int32)
    depths = torch.arange(n) if parents is None else tree_depths(parents)
    cos, sin = coded._rotary(lens[:, None].long() + depths[None])
    mask = None if parents is None else ancestor_mask(parents)
    cache = torch.randn(len(coded.layers), 2, B, a.num_kv_heads, max(seqlens) + n + 3, a.head_dim, generator=g)
    cache_region, cache_layers = cache.clone(), cache.clone()
    common = (norms, eps, cos, sin)
    tail = (biases, weights, kinds, outs, a.num_heads, a.num_kv_heads)
    got = stacked(x, *common, cache_region, lens, mask, *tail)
    want = one_by_one(x, *common, cache_layers, lens, mask, *tail)
    assert torch.equal(got, want)
    assert torch.equal(cache_region, cache_layers)
    assert not torch.equal(cache_region, cache)  # the pass wrote its keys and values
    assert torch.isfinite(got).all() and not torch.equal(got, x)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("isa", list(packed.int8_isas()))
@pytest.mark.parametrize("name, seqlens, n, parents", [CASES[1], CASES[3], CASES[4]], ids=["batch 3", "tree", "chain"])
def test_every_int8_path_this_cpu_runs(coded, isa, threads, name, seqlens, n, parents, restore_threads):
    """Each instruction set of the int8 products (``packed.int8_isas()``: the portable loop,
    AVX2, AVX-512 VNNI, AMX where the CPU runs them) in the region against the same one in the
    layers one by one, and against the portable loop: every path gives the same bits."""
    torch.set_num_threads(threads)
    a = coded.args
    g = torch.Generator().manual_seed(n)
    B = len(seqlens)
    norms, biases, weights, kinds, outs, eps = int8_args(coded, B * n)
    x = torch.randn(B, n, a.hidden_size, generator=g)
    lens = torch.tensor(seqlens, dtype=torch.int32)
    depths = torch.arange(n) if parents is None else tree_depths(parents)
    cos, sin = coded._rotary(lens[:, None].long() + depths[None])
    mask = None if parents is None else ancestor_mask(parents)
    cache = torch.randn(len(coded.layers), 2, B, a.num_kv_heads, max(seqlens) + n, a.head_dim, generator=g)
    caches = [cache.clone() for _ in range(3)]
    common = (norms, eps, cos, sin)
    tail = (biases, weights, kinds, outs, a.num_heads, a.num_kv_heads)
    code = packed.isa_code(isa)
    got = stacked(x, *common, caches[0], lens, mask, *tail, code)
    assert torch.equal(got, one_by_one(x, *common, caches[1], lens, mask, *tail, code))
    assert torch.equal(got, stacked(x, *common, caches[2], lens, mask, *tail, packed.isa_code("portable")))
    assert torch.equal(caches[0], caches[1]) and torch.equal(caches[0], caches[2])


@pytest.mark.parametrize("seqlens", [[5, 21], [61, 150]], ids=["short", "over key splits"])
@pytest.mark.parametrize("B, n", [(1, 1), (2, 1), (2, 6)])
def test_region_bits_do_not_depend_on_the_thread_count(coded, B, n, seqlens, restore_threads):
    """The region alone at 1 to 7 threads: one result (more threads than the 2 cores included),
    for passes of fewer rows than threads and of more, and caches of one or several 64-key
    attention splits (the threads share a sequence's splits)."""
    a = coded.args
    g = torch.Generator().manual_seed(3)
    norms, biases, weights, kinds, outs, eps = int8_args(coded, B * n)
    x = torch.randn(B, n, a.hidden_size, generator=g)
    lens = torch.tensor(seqlens[:B], dtype=torch.int32)
    cos, sin = coded._rotary(lens[:, None].long() + torch.arange(n)[None])
    cache0 = torch.randn(len(coded.layers), 2, B, a.num_kv_heads, max(seqlens) + n, a.head_dim, generator=g)
    results = []
    for t in (1, 2, 3, 4, 7):
        torch.set_num_threads(t)
        cache = cache0.clone()
        out = stacked(
            x, norms, eps, cos, sin, cache, lens, None, biases, weights, kinds, outs, a.num_heads, a.num_kv_heads
        )
        results.append((out, cache))
    for out, cache in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(cache, results[0][1])


def test_layers_of_different_intermediate_sizes(coded, restore_threads):
    """A stack whose last layer has a smaller MLP (w13 and w2 of another layer's shape cut
    down): the region's buffers hold the largest, each layer uses its own."""
    torch.set_num_threads(2)
    a = coded.args
    norms, biases, weights, kinds, outs, eps = int8_args(coded, 3)
    last = len(biases) - 1
    inter = outs[4 * last + 2] // 2
    half = inter // 2
    assert half % 32 == 0 and half % 8 == 0
    w13 = weights[12 * last + 6 : 12 * last + 9]  # qw [G, nb, B], dw, mw [G, nb, 8]
    # gate rows 0 .. half - 1 and up rows inter .. inter + half - 1: groups of 8 rows
    keep = torch.cat([torch.arange(half // 8), inter // 8 + torch.arange(half // 8)])
    weights[12 * last + 6 : 12 * last + 9] = [t[keep].contiguous() if t is not None else None for t in w13]
    w2 = weights[12 * last + 9 : 12 * last + 12]  # its input blocks: the first half // 32
    weights[12 * last + 9 : 12 * last + 12] = [t[:, : half // 32].contiguous() if t is not None else None for t in w2]
    outs[4 * last + 2] = 2 * half
    x = torch.randn(1, 3, a.hidden_size, generator=torch.Generator().manual_seed(5))
    lens = torch.tensor([7], dtype=torch.int32)
    cos, sin = coded._rotary(lens[:, None].long() + torch.arange(3)[None])
    cache = torch.zeros(len(coded.layers), 2, 1, a.num_kv_heads, 12, a.head_dim)
    c1, c2 = cache.clone(), cache.clone()
    tail = (biases, weights, kinds, outs, a.num_heads, a.num_kv_heads)
    got = stacked(x, norms, eps, cos, sin, c1, lens, None, *tail)
    assert torch.equal(got, one_by_one(x, norms, eps, cos, sin, c2, lens, None, *tail))
    assert torch.equal(c1, c2)


def test_a_bad_last_layer_fails_before_the_first_writes(coded):
    """Every layer is checked before the region starts: a last layer whose int8 weight does not
    fit its out_features, or lacks its mins, is refused by name, and no cache slot is written."""
    a = coded.args
    norms, biases, weights, kinds, outs, eps = int8_args(coded, 1)
    last = len(biases) - 1
    x = torch.randn(1, 1, a.hidden_size)
    lens = torch.tensor([2], dtype=torch.int32)
    cos, sin = coded._rotary(lens[:, None].long())
    cache = torch.zeros(len(coded.layers), 2, 1, a.num_kv_heads, 4, a.head_dim)
    tail = (a.num_heads, a.num_kv_heads)

    def call(w, o=outs):
        return stacked(x, norms, eps, cos, sin, cache, lens, None, biases, w, kinds, o, *tail)

    bad = list(weights)
    bad[12 * last + 3] = weights[12 * last + 3][:-1]  # wo with a group of 8 outputs too few
    with pytest.raises(ValueError, match="out_features must lie in"):
        call(bad)
    bad = list(weights)
    bad[12 * last + 11] = None  # w2 (affine4) without its mins
    with pytest.raises(ValueError, match="linear 3 needs its weight tensor"):
        call(bad)
    bad = list(weights)
    bad[12 * last + 1] = weights[12 * last + 1].float()  # scales not float16
    with pytest.raises(ValueError, match="dw must be float16"):
        call(bad)
    with pytest.raises(ValueError, match="cache_seqlens"):
        stacked(x, norms, eps, cos, sin, cache, lens + 3, None, biases, weights, kinds, outs, *tail)
    assert not cache.any()  # nothing written by any layer
    call(weights)
    assert cache.any()


def test_a_strided_cache_view_keeps_its_guards(coded, restore_threads):
    """The cache as a view into a larger buffer (more slots, more sequences around it): the
    region writes exactly the new slots of its own sequences, with the bits of a contiguous
    cache, and every guard value around the view stays as it was."""
    torch.set_num_threads(2)
    a = coded.args
    g = torch.Generator().manual_seed(9)
    norms, biases, weights, kinds, outs, eps = int8_args(coded, 2 * 3)
    L, Hkv, D = len(coded.layers), a.num_kv_heads, a.head_dim
    buffer = torch.full((L, 2, 4, Hkv, 20, D), 7.25)
    view = buffer[:, :, 1:3, :, 2:14]  # sequences 1 and 2 of 4, slots 2 .. 13 of 20
    view.copy_(torch.randn(view.shape, generator=g))
    dense = view.clone()
    x = torch.randn(2, 3, a.hidden_size, generator=g)
    lens = torch.tensor([4, 9], dtype=torch.int32)  # 9 + 3 = 12 <= 12 slots
    cos, sin = coded._rotary(lens[:, None].long() + torch.arange(3)[None])
    tail = (biases, weights, kinds, outs, a.num_heads, a.num_kv_heads)
    got = stacked(x, norms, eps, cos, sin, view, lens, None, *tail)
    want = stacked(x, norms, eps, cos, sin, dense, lens, None, *tail)
    assert torch.equal(got, want) and torch.equal(view, dense)
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[:, :, 1:3, :, 2:14] = False
    assert (buffer[outside] == 7.25).all()


@pytest.mark.parametrize("how", ["batch expanded", "keys are values", "slots closer than a row"])
def test_a_cache_whose_entries_share_memory_is_refused(coded, how):
    """A cache where two (sequence, head, slot) entries share memory would have two writes land
    in one place, in an order that depends on the threads: both paths refuse it by name."""
    a = coded.args
    norms, biases, weights, kinds, outs, eps = int8_args(coded, 2)
    L, Hkv, D = len(coded.layers), a.num_kv_heads, a.head_dim
    if how == "batch expanded":  # one prefix cache shared by a batch of 2 (stride 0)
        cache = torch.zeros(L, 2, 1, Hkv, 7, D).expand(-1, -1, 2, -1, -1, -1)
    elif how == "keys are values":
        cache = torch.zeros(L, 1, 2, Hkv, 7, D).expand(-1, 2, -1, -1, -1, -1)
    else:  # slot stride D / 2: slot s + 1 starts in the middle of slot s
        base = torch.zeros(L * 2 * 2 * Hkv * 8 * D)
        cache = base.as_strided(
            (L, 2, 2, Hkv, 7, D), (2 * 2 * Hkv * 8 * D, 2 * Hkv * 8 * D, Hkv * 8 * D, 8 * D, D // 2, 1)
        )
    x = torch.randn(2, 1, a.hidden_size)
    lens = torch.tensor([3, 3], dtype=torch.int32)
    cos, sin = coded._rotary(lens[:, None].long())
    tail = (biases, weights, kinds, outs, a.num_heads, a.num_kv_heads)
    with pytest.raises(ValueError, match="memory of its own"):
        stacked(x, norms, eps, cos, sin, cache, lens, None, *tail)
    with pytest.raises(ValueError, match="memory of its own"):
        one_by_one(x, norms, eps, cos, sin, cache, lens, None, *tail)


@pytest.mark.parametrize("int8_stack", [True, False], ids=["int8 layers", "a float32 layer"])
def test_a_bad_kind_or_weight_in_the_last_layer_fails_before_any_write(coded, int8_stack):
    """The stack checks every layer (kinds, weights against out_features, norms, caches) before
    the first one runs, whichever path it then takes: a bad last layer writes no cache slot."""
    a = coded.args
    norms, biases, weights, kinds, outs, eps = int8_args(coded, 1)
    last = len(biases) - 1
    if not int8_stack:  # layer 0's wo as a plain float32 product: the stack runs layer by layer
        weights[3:6] = [torch.randn(a.hidden_size, a.num_heads * a.head_dim), None, None]
        kinds[1] = 3
    x = torch.randn(1, 1, a.hidden_size)
    lens = torch.tensor([2], dtype=torch.int32)
    cos, sin = coded._rotary(lens[:, None].long())
    cache = torch.zeros(len(coded.layers), 2, 1, a.num_kv_heads, 4, a.head_dim)
    tail = (a.num_heads, a.num_kv_heads)
    bad_kind = list(kinds)
    bad_kind[4 * last] = 6
    with pytest.raises(ValueError, match=r"kinds\[0\] must lie in 0..5"):
        stacked(x, norms, eps, cos, sin, cache, lens, None, biases, weights, bad_kind, outs, *tail)
    plain = list(weights), list(kinds)  # the last layer's w2 as float32 of the wrong shape
    plain[0][12 * last + 9 : 12 * last + 12] = [torch.randn(a.hidden_size, 32), None, None]
    plain[1][4 * last + 3] = 3
    with pytest.raises(ValueError, match="linear 3's weight must be float32"):
        stacked(x, norms, eps, cos, sin, cache, lens, None, biases, plain[0], plain[1], outs, *tail)
    assert not cache.any()
    stacked(x, norms, eps, cos, sin, cache, lens, None, biases, weights, kinds, outs, *tail)
    assert cache.any()


@pytest.fixture(scope="module")
def whole_block_heads():
    """Tiny Llamas whose head dims (32, 64) are whole blocks of 32: the region's step 5 then
    combines and quantises the attention output by heads (the tiny Llama's D = 16 takes its
    per-row branch)."""
    transformers = pytest.importorskip("transformers")
    from specdec_kernels.decoding import Transformer
    from specdec_kernels.decoding.training.data import tiny_llama_config
    from tests.engine.tiny import snap_to_gguf_codes

    models = {}
    for name, sizes in (
        ("D32", dict(hidden_size=128)),
        ("D64", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)),
    ):
        torch.manual_seed(0)
        cfg = tiny_llama_config(num_hidden_layers=2, rope_theta=10000.0, max_position_embeddings=256, **sizes)
        hf = transformers.LlamaForCausalLM(cfg).eval()
        snap_to_gguf_codes(hf)
        model = Transformer.from_hf_model(hf)
        model.pack_weights()
        models[name] = model
    return models


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("head_dim", ["D32", "D64"])
def test_heads_of_whole_blocks_give_the_bits_of_the_layers(whole_block_heads, head_dim, threads, restore_threads):
    model = whole_block_heads[head_dim]
    a = model.args
    assert a.head_dim == int(head_dim[1:])
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(threads)
    seqlens, n, parents = [70, 3], 5, [-1, 0, 0, 1, 2]  # a tree, one cache over two 64-key splits
    B = len(seqlens)
    norms, biases, weights, kinds, outs, eps = int8_args(model, B * n)
    x = torch.randn(B, n, a.hidden_size, generator=g) * 3
    lens = torch.tensor(seqlens, dtype=torch.int32)
    cos, sin = model._rotary(lens[:, None].long() + tree_depths(parents)[None])
    mask = ancestor_mask(parents)
    cache = torch.randn(len(model.layers), 2, B, a.num_kv_heads, max(seqlens) + n, a.head_dim, generator=g)
    cache_region, cache_layers = cache.clone(), cache.clone()
    common = (norms, eps, cos, sin)
    tail = (biases, weights, kinds, outs, a.num_heads, a.num_kv_heads)
    got = stacked(x, *common, cache_region, lens, mask, *tail)
    want = one_by_one(x, *common, cache_layers, lens, mask, *tail)
    assert torch.equal(got, want) and torch.equal(cache_region, cache_layers)
    assert torch.isfinite(got).all() and not torch.equal(cache_region, cache)
