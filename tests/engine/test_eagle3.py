"""EAGLE-3's multi-layer features: the target's layer outputs (``Transformer.forward``'s
``hidden_layers``) against transformers' own hidden states, the head's fusion by hand, a
widened head drafting exactly as the head it came from, EAGLE-2's tree with a fused head
against the node-by-node reference, the engine handing each drafter its own columns (alone
and in a ``MultiDrafter``), greedy identity, the head file's format 2, the trainer's layer
outputs (batched as one sequence at a time, cached) and its command end to end."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import MultiDrafter, SpeculativeDecoder
from specdec_kernels.decoding.draft import Draft, Drafter, DraftRequest
from specdec_kernels.decoding.drafters.eagle import EagleDrafter, EagleHead
from specdec_kernels.decoding.training import data as train_data
from specdec_kernels.decoding.training import eagle as train_eagle
from specdec_kernels.files import BadFileError
from tests.engine.heads import HIDDEN, PROMPTS, committed, tiny  # noqa: F401 (fixture)
from tests.engine.heads import final_hidden as wide_hidden
from tests.engine.test_eagle import random_head, reference_tree, rms
from tests.engine.tiny import V, tiny_llama

transformers = pytest.importorskip("transformers")

LAYERS = 3  # tiny_llama()'s


def fused_head(layers, seed=0, scale=0.25):
    """A random head of ``layers`` whose fusion is far from the identity."""
    head = random_head(window=16, scale=scale, seed=seed).with_feature_layers(layers)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        head.fuse.copy_(torch.randn(head.fuse.shape, generator=g) * 0.2)
        head.feature_norms.copy_(1 + 0.3 * torch.randn(head.feature_norms.shape, generator=g))
        head.wo.mul_(4)
        head.wqkv.mul_(3)
    return head


# ---------------------------------------------------------------------------- the target's layers
def test_layer_outputs_are_transformers_hidden_states(tiny):
    """transformers' hidden_states[i + 1] is layer i's output (the last one after the final
    norm): ours appended after the final hidden state, which is unchanged bit for bit."""
    hf = tiny_llama()
    ids = [5, 17, 33, 2, 90, 41, 7, 64, 12]
    with torch.no_grad():
        want = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    H = HIDDEN
    plain = wide_hidden(tiny, ids, ())
    wide = wide_hidden(tiny, ids, (1, 0, 2))
    assert wide.shape == (len(ids), 4 * H)
    assert torch.equal(wide[:, :H], plain)
    torch.testing.assert_close(wide[:, :H], want[LAYERS][0], atol=1e-5, rtol=1e-5)
    # the residual streams are unnormalised (values up to ~10 here): float32 rounding relative
    # to their largest entry
    for cols, layer in ((slice(H, 2 * H), 1), (slice(2 * H, 3 * H), 0)):
        ref = want[layer + 1][0]
        torch.testing.assert_close(wide[:, cols], ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-4)
    # the last layer's output, normed, is the final hidden state
    torch.testing.assert_close(tiny.norm(wide[:, 3 * H :]), plain, atol=1e-6, rtol=1e-6)


def test_layer_outputs_with_logit_rows_paged_and_layer_skip(tiny):
    """The wanted rows only, the same through a paged cache, and among the layers run."""
    from specdec_kernels.decoding.paged import CacheLayout, PagedKVCache

    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7]])
    T = ids.shape[1]
    pos = torch.arange(T)[None]
    zero = torch.zeros(1, dtype=torch.int32)
    rows = torch.tensor([[6, 2, 3]])
    with torch.inference_mode():
        _, full = tiny(ids, pos, tiny.new_kv_cache(1, T), zero, return_hidden=True, hidden_layers=[2, 0])
        _, some = tiny(
            ids, pos, tiny.new_kv_cache(1, T), zero, return_hidden=True, hidden_layers=[2, 0], logit_rows=rows
        )
        assert torch.equal(some[0], full[0, rows[0]])
        cache = PagedKVCache.allocate(tiny, ids.tolist(), T, CacheLayout(paged=True, block_size=4))
        _, paged = tiny(ids, pos, cache, zero, return_hidden=True, hidden_layers=[2, 0])
        # another attention path: float32 rounding relative to the largest residual entry
        torch.testing.assert_close(paged, full, atol=1e-5 * float(full.abs().max()), rtol=1e-4)
        _, skip = tiny(ids, pos, tiny.new_kv_cache(1, T), zero, return_hidden=True, hidden_layers=[1], num_layers=2)
        torch.testing.assert_close(tiny.norm(skip[..., HIDDEN:]), skip[..., :HIDDEN], atol=1e-6, rtol=1e-6)
        for bad, err in (
            ([3], ValueError),
            ([0, 0], ValueError),
            ([-1], ValueError),
            ("01", TypeError),
            ([0.5], TypeError),
        ):
            with pytest.raises(err, match="hidden_layers"):
                tiny(ids, pos, tiny.new_kv_cache(1, T), zero, return_hidden=True, hidden_layers=bad)
        with pytest.raises(ValueError, match="hidden_layers"):
            tiny(ids, pos, tiny.new_kv_cache(1, T), zero, return_hidden=True, hidden_layers=[2], num_layers=2)


# ---------------------------------------------------------------------------- the head
def test_fusion_by_hand():
    head = fused_head((2, 0))
    g = torch.Generator().manual_seed(5)
    f = torch.randn(3, 3 * HIDDEN, generator=g) * torch.tensor([1.0] * HIDDEN + [7.0] * HIDDEN + [0.1] * HIDDEN)
    P = {k: v.double() for k, v in head.state_dict().items()}
    parts = [f[:, :HIDDEN].double()] + [
        rms(f[:, (1 + i) * HIDDEN : (2 + i) * HIDDEN].double(), P["feature_norms"][i], head.eps) for i in range(2)
    ]
    want = torch.cat(parts, -1) @ P["fuse"].T
    torch.testing.assert_close(head.fuse_features(f).double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=f"\\(..., {3 * HIDDEN}\\)"):
        head.fuse_features(f[:, :HIDDEN])
    plain = random_head()
    assert plain.fuse_features(f[:, :HIDDEN]) is f[:, :HIDDEN] or torch.equal(
        plain.fuse_features(f[:, :HIDDEN]), f[:, :HIDDEN]
    )
    assert plain.feature_layers == ()
    with pytest.raises(ValueError, match=f"\\(..., {HIDDEN}\\)"):
        plain.fuse_features(f)


def test_bad_feature_layers(tiny):
    for bad, err in (
        ([-1], ValueError),
        ([1, 1], ValueError),
        ("2", TypeError),
        ([1.5], TypeError),
        ([True], TypeError),
    ):
        with pytest.raises(err, match="feature_layers"):
            EagleHead(HIDDEN, 4, 2, 16, 96, feature_layers=bad)
    with pytest.raises(ValueError, match="layer 3 is not an index >= 0 and below the 3 layers"):
        EagleHead.for_model(tiny, feature_layers=[3])
    with pytest.raises(ValueError, match="already reads"):
        fused_head((0,)).with_feature_layers((1,))
    head = EagleHead(HIDDEN, 4, 2, 16, 96, window=16, feature_layers=[7])
    with pytest.raises(ValueError, match="reads layer 7's output, the model has 3 layers"):
        EagleDrafter(tiny, head, check_fingerprint=False)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_widened_head_drafts_exactly_as_the_head(tiny, tree):
    """fuse = [I 0 ...] reads the final hidden state alone: the same drafts, bit for bit, so
    the same outputs and target passes (fine-tuning starts where the EAGLE head is)."""
    head = random_head(window=16, scale=0.25, seed=3)
    wide = head.with_feature_layers([2, 0])
    assert wide.feature_layers == (2, 0) and head.feature_layers == ()
    for name, p in head.state_dict().items():
        assert torch.equal(wide.state_dict()[name], p)
    runs = []
    for h in (head, wide):
        d = EagleDrafter(tiny, h, tree=tree, top_k=3, max_nodes=12, size_by_cost=False)
        r = SpeculativeDecoder(tiny, d, stop_token_ids=[3]).generate(PROMPTS, 16, num_draft_tokens=4)
        runs.append((r.tokens, r.stats.target_passes, r.stats.accepted_draft_tokens))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("top_k,max_nodes,depth", [(1, 8, 5), (3, 20, 4)])
@pytest.mark.parametrize("length", [2, 9, 30])
def test_fused_dynamic_tree_matches_the_node_by_node_reference(tiny, top_k, max_nodes, depth, length):
    """The committed positions read fused features (the reference fuses them itself), deeper
    nodes the head's own g."""
    layers = (2, 0)
    head = fused_head(layers, seed=length)
    history = torch.randint(0, V, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    drafter = EagleDrafter(tiny, head, tree=top_k > 1, top_k=top_k, max_nodes=max_nodes, max_depth=8)
    assert drafter.feature_layers == layers
    with torch.inference_mode():
        (feats,) = committed(drafter, tiny, [history], layers)
        draft = drafter.propose(DraftRequest([history], [depth], [True], drafter.run))
        h = drafter.head  # the head that drafts (the drafter's Q8_0 copy by default)
        want_t, want_p, want_s = reference_tree(h, tiny, h.fuse_features(feats), history, top_k, max_nodes, depth)
    n = int(draft.num_nodes[0])
    assert draft.tokens[0, :n].tolist() == want_t and draft.parents[0, :n].tolist() == want_p
    torch.testing.assert_close(torch.tensor(drafter.path_logprobs[0]), torch.tensor(want_s), atol=1e-2, rtol=1e-3)


# ---------------------------------------------------------------------------- the engine
class Recorder(Drafter):
    """Drafts nothing; keeps every hidden state the engine hands it."""

    wants_hidden = True
    context_window = 4

    def __init__(self, layers):
        self.feature_layers = tuple(layers)
        self.context, self.last = [], []

    def propose(self, request):
        return Draft.from_lists([([h[-1]], [-1]) for h in request.histories])

    def observe(self, result):
        super().observe(result)
        f = result.features
        if f is None:
            return
        if f.context is not None:
            self.context.append([None if h is None else h.clone() for h in f.context])
        self.last.append(f.last.clone())


def test_each_drafter_gets_the_columns_of_its_own_layers(tiny):
    """Alone, a drafter gets the final hidden state and its layers' outputs (checked against
    a teacher-forced pass); in a MultiDrafter with others, exactly what it got alone."""
    prompts = [[5, 17, 33, 2, 90, 41, 7], [12, 99, 8, 12, 99]]
    alone = {}
    for layers in ((2, 0), (1,), ()):
        rec = Recorder(layers)
        SpeculativeDecoder(tiny, rec).generate(prompts, 3, num_draft_tokens=2)
        alone[layers] = rec
    rec = alone[(2, 0)]
    assert rec.last[0].shape == (2, 3 * HIDDEN) and alone[()].last[0].shape == (2, HIDDEN)
    want = wide_hidden(tiny, prompts[0], (2, 0))
    torch.testing.assert_close(rec.context[0][0], want[2:6], atol=1e-5, rtol=1e-5)  # the last 4 fed positions
    recs = [Recorder((2, 0)), Recorder((1,)), Recorder(())]
    multi = MultiDrafter(recs)
    assert multi.feature_layers == (0, 1, 2)
    SpeculativeDecoder(tiny, multi).generate(prompts, 3, num_draft_tokens=2)
    for r in recs:
        a = alone[r.feature_layers]
        assert len(r.last) == len(a.last) and len(r.context) == len(a.context)
        for x, y in zip(r.last, a.last):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
        for xs, ys in zip(r.context, a.context):
            for x, y in zip(xs, ys):
                assert (x is None) == (y is None)
                if x is not None:
                    torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def test_the_engine_checks_a_drafters_feature_layers(tiny):
    for bad, err in (((3,), ValueError), ((0, 0), ValueError), ((-1,), ValueError), (2, TypeError), ("0", TypeError)):
        with pytest.raises(err, match="drafter.feature_layers"):
            SpeculativeDecoder(tiny, _with_layers(bad))
    with pytest.raises(TypeError, match=r"drafter.feature_layers\[0\] must be an int"):
        SpeculativeDecoder(tiny, _with_layers((1.0,)))
    # a drafter that wants no hidden states asks for no layers, whatever it says
    quiet = _with_layers((7,))
    quiet.wants_hidden = False
    SpeculativeDecoder(tiny, quiet)


def _with_layers(layers):
    r = Recorder(())
    r.feature_layers = layers
    return r


def test_a_transformers_target_refuses_hidden_states_with_one_message():
    """``HFCausalLM`` has no hidden states: a drafter that wants them, with layers or not,
    gets the same ValueError (not a TypeError about an unknown keyword)."""
    from specdec_kernels.integrations.transformers import HFCausalLM

    with HFCausalLM(tiny_llama()) as target:
        for layers in ((), (1,)):
            with pytest.raises(ValueError, match="return_hidden is not available for transformers models"):
                SpeculativeDecoder(target, Recorder(layers)).generate([[5, 17, 33]], 3, num_draft_tokens=2)


@pytest.mark.parametrize("block_size", [None, 4], ids=["dense", "paged"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("k", [0, 1, 3, 7], ids=lambda k: f"K{k}")
def test_greedy_equals_plain_greedy(tiny, tree, k, block_size):
    plain = SpeculativeDecoder(tiny, stop_token_ids=[3]).generate(PROMPTS, 20)
    d = EagleDrafter(tiny, fused_head((2, 0), seed=k), tree=tree, top_k=3, max_nodes=12)
    r = SpeculativeDecoder(tiny, d, stop_token_ids=[3], block_size=block_size).generate(PROMPTS, 20, num_draft_tokens=k)
    assert r.tokens == plain.tokens


def test_greedy_in_a_multi_drafter_with_an_eagle_head(tiny):
    plain = SpeculativeDecoder(tiny, stop_token_ids=[3]).generate(PROMPTS, 20)
    drafters = [EagleDrafter(tiny, fused_head((1,), seed=1), top_k=2, max_nodes=8), EagleDrafter(tiny, random_head())]
    multi = MultiDrafter(drafters, names=["eagle3", "eagle"], max_nodes=16)
    r = SpeculativeDecoder(tiny, multi, stop_token_ids=[3]).generate(PROMPTS, 20, num_draft_tokens=4)
    assert r.tokens == plain.tokens


# ---------------------------------------------------------------------------- the file
def test_file_format_2_round_trip(tmp_path, tiny):
    head = fused_head((2, 0))
    path = tmp_path / "e3.pt"
    head.save(path)
    assert EagleHead.file_config(path)["format"] == 2 and EagleHead.file_config(path)["feature_layers"] == [2, 0]
    back = EagleHead.load(path)
    assert back.feature_layers == (2, 0)
    for name, p in head.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], p.half().float())
    plain = tmp_path / "e.pt"
    random_head().save(plain)
    assert EagleHead.file_config(plain)["format"] == 1 and "feature_layers" not in EagleHead.file_config(plain)
    payload = torch.load(path, weights_only=False)
    del payload["config"]["feature_layers"]
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(BadFileError, match="feature_layers"):
        EagleHead.load(tmp_path / "bad.pt")


# ---------------------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def tiny_data(tiny):
    prompts = [[5, 17, 33, 2, 90, 41, 7], [64, 3], [12, 99, 8, 12, 99, 8, 12, 99, 101, 4, 12], [3, 1, 4]]
    with torch.inference_mode():
        return train_data.generate_data(tiny, prompts, 9, 4, [], "tiny")


def test_trainer_layer_outputs_are_each_sequences_own(tiny, tiny_data, tmp_path, monkeypatch):
    """Batched and right-padded as computed one sequence at a time; the rows line up with
    ``feature_rows``' (the final hidden state first); a second call reads the cache."""
    layers = (2, 0)
    out = train_eagle.layer_outputs(tiny, tiny_data, layers, tmp_path)
    one = train_eagle.layer_outputs(tiny, tiny_data, layers, None, max_batch=1)
    for s, (a, b) in enumerate(zip(out, one)):
        n = train_eagle.recorded_rows(tiny_data, s)
        assert a.shape == (n, 2 * HIDDEN) and a.dtype == torch.float16
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
        toks, first = tiny_data.tokens[s], tiny_data.first[s]
        want = wide_hidden(tiny, toks[: first + n], layers)[first:, HIDDEN:]
        torch.testing.assert_close(a.float(), want, atol=2e-3, rtol=2e-3)
    rows = train_eagle.feature_rows(tiny_data, tiny.output.weight, layer_outputs=out)
    plain = train_eagle.feature_rows(tiny_data, tiny.output.weight)
    assert rows.states.shape == (plain.states.shape[0], 3 * HIDDEN)
    assert torch.equal(rows.states[:, :HIDDEN], plain.states) and torch.equal(rows.labels, plain.labels)

    # a cache file that cannot be read is reported, named, and recomputed
    (cached,) = list(tmp_path.glob("layers-*.pt"))
    good = cached.read_bytes()
    cached.write_bytes(good[: len(good) // 2])
    with pytest.warns(RuntimeWarning, match=f"{cached.name}.*recomputing"):
        redone = train_eagle.layer_outputs(tiny, tiny_data, layers, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(redone, out))
    assert all(torch.equal(a, b) for a, b in zip(torch.load(cached, weights_only=True), out))  # rewritten whole

    tiny.numerics = "int8"  # a pass in other numerics is cached under another name
    try:
        train_eagle.layer_outputs(tiny, tiny_data, layers, tmp_path / "int8")
    finally:
        tiny.numerics = "float32"
    assert len(list((tmp_path / "int8").glob("layers-*.pt"))) == 1
    assert {p.name for p in (tmp_path / "int8").glob("layers-*.pt")}.isdisjoint(p.name for p in tmp_path.glob("*.pt"))

    def no_pass(*a, **k):
        raise AssertionError("the cached layer outputs were recomputed")

    monkeypatch.setattr(type(tiny), "forward", no_pass)
    again = train_eagle.layer_outputs(tiny, tiny_data, layers, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(again, out))
    with pytest.raises(ValueError, match="at least one layer"):
        train_eagle.layer_outputs(tiny, tiny_data, (), None)


def test_layers_recorded_with_the_data_are_the_teacher_forced_ones(tiny, tiny_data):
    """``generate_data(feature_layers=...)``: the same text and final hidden states (bits) as
    without, each row followed by the layers' outputs of the teacher-forced pass
    (``layer_outputs``); ``feature_rows`` of it equals the rows with those outputs appended."""
    layers = (2, 0)
    prompts = [t[:n] for t, n in zip(tiny_data.tokens, tiny_data.prompt_lengths)]
    with torch.inference_mode():
        wide = train_data.generate_data(tiny, prompts, 9, 4, [], "tiny", feature_layers=layers)
    assert wide.tokens == tiny_data.tokens and wide.first == tiny_data.first
    forced = train_eagle.layer_outputs(tiny, tiny_data, layers)
    for s, (h, plain, f) in enumerate(zip(wide.hidden, tiny_data.hidden, forced)):
        assert h.shape == (plain.shape[0], 3 * HIDDEN) and h.dtype == torch.float16
        assert torch.equal(h[:, :HIDDEN], plain)
        torch.testing.assert_close(h[: f.shape[0], HIDDEN:], f, atol=2e-3, rtol=2e-3)
    rows = train_eagle.feature_rows(wide, tiny.output.weight)
    ref = train_eagle.feature_rows(tiny_data, tiny.output.weight, layer_outputs=forced)
    assert rows.states.shape == ref.states.shape and torch.equal(rows.labels, ref.labels)
    torch.testing.assert_close(rows.states, ref.states, atol=2e-3, rtol=2e-3)


def test_generation_numerics_and_layers_are_checked_and_restored(tiny):
    """The model's own numerics come back after an int8 generation; an unknown numerics or a
    layer outside the model is refused before any decoding."""
    prompts = [[5, 17, 33], [64, 3]]
    with torch.inference_mode():
        data = train_data.generate_data(tiny, prompts, 4, 2, [], "int8", numerics="int8")
    assert tiny.numerics == "float32" and len(data.tokens) == 2
    with pytest.raises(RuntimeError, match="inside"), tiny.numerics_as("int8"):
        assert tiny.numerics == "int8" and all(layer.numerics == "int8" for layer in tiny.layers)
        raise RuntimeError("inside")
    assert tiny.numerics == "float32" and all(layer.numerics == "float32" for layer in tiny.layers)
    with pytest.raises(ValueError, match="numerics"):
        train_data.generate_data(tiny, prompts, 4, 2, [], numerics="int4")
    with pytest.raises(ValueError, match="feature_layers"):
        train_data.generate_data(tiny, prompts, 4, 2, [], feature_layers=(LAYERS,))
    assert tiny.numerics == "float32"


def test_the_recorder_leaves_no_hook_and_refuses_what_float16_cannot_hold(tiny):
    """A generation that fails (an empty prompt, refused by the engine) leaves no hook on the
    model; a layer output beyond float16's range is an error naming the layers, not inf."""
    hooked = lambda: sum(len(layer._forward_hooks) for layer in tiny.layers)  # noqa: E731
    before = hooked()
    with torch.inference_mode(), pytest.raises(ValueError):
        train_data.generate_data(tiny, [[5, 17, 33], []], 4, 2, [], feature_layers=(0, 2))
    assert hooked() == before
    with torch.inference_mode():
        plain = train_data.generate_data(tiny, [[5, 17, 33]], 4, 2, [])
    big = tiny.layers[0].register_forward_hook(lambda m, a, out: out * 1e6)
    try:
        with torch.inference_mode(), pytest.raises(ValueError, match=r"layers \[0\].*float16"):
            train_data.generate_data(tiny, [[5, 17, 33]], 4, 2, [], feature_layers=(0,))
        with pytest.raises(ValueError, match=r"layers \[0\].*float16"):  # the teacher-forced pass too
            train_eagle.layer_outputs(tiny, plain, (0,))
    finally:
        big.remove()
    assert hooked() == before


def test_data_cache_names(tmp_path):
    """A default run keeps the cache name it always had (the hash of the fingerprint, the
    settings and the prompts); int8 numerics and recorded layers each name another file."""
    import hashlib
    import json

    prompts = [[1, 2, 3], [4, 5]]
    old = hashlib.sha256(json.dumps(["fp", 64, 24, 4096, prompts]).encode()).hexdigest()[:16]
    name = lambda **k: train_data.cache_path(tmp_path, "train", "fp", 64, 24, 4096, prompts, **k).name  # noqa: E731
    assert name() == f"train-{old}.pt" == name(numerics="float32", feature_layers=())
    names = {name(), name(numerics="int8"), name(feature_layers=(2, 15)), name(numerics="int8", feature_layers=(2,))}
    assert len(names) == 4
    # a cache whose hidden states have another width (other layers) is reported and remade
    path = tmp_path / "train-x.pt"
    train_data.cached_data(path, lambda part: _data(4), expected=2)
    with pytest.warns(RuntimeWarning, match="another width"):
        got = train_data.cached_data(path, lambda part: _data(8), expected=2, width=8)
    assert got.hidden[0].shape[1] == 8


def _data(width):
    return train_data.SelfDistilled(
        tokens=[[1, 2, 3], [4, 5]],
        prompt_lengths=[1, 1],
        first=[0, 0],
        hidden=[torch.zeros(2, width, dtype=torch.float16), torch.zeros(1, width, dtype=torch.float16)],
    )


def test_training_command_records_the_layers_with_the_data(tmp_path, capsys, monkeypatch):
    """--record-layers: the layers come with the generated data (int8 generation here), no
    teacher-forced pass runs, and the head reads them; without --feature-layers it is refused."""

    def no_pass(*a, **k):
        raise AssertionError("a second pass over the data ran")

    monkeypatch.setattr(train_eagle, "layer_outputs", no_pass)
    out = tmp_path / "recorded.pt"
    flags = ["--random-model", "--steps", "2", "--segments", "2", "--segment", "8", "--new-tokens", "5"]
    flags += ["--feature-layers", "1,0", "--record-layers", "--gen-numerics", "int8", "--out", str(out)]
    assert train_eagle.main(flags) == 0
    head = EagleHead.load(out)
    assert head.feature_layers == (1, 0) and head.config["training"]["record_layers"] is True
    assert head.config["training"]["gen_numerics"] == "int8"
    plain = tmp_path / "plain.pt"
    assert train_eagle.main(flags[:9] + ["--out", str(plain)]) == 0
    assert train_eagle.main(flags[:9] + ["--record-layers", "--init", str(plain), "--out", str(out)]) == 2
    assert "--record-layers: the head of --init" in capsys.readouterr().err
    for bad, message in (
        (["--record-layers"], "--record-layers records the --feature-layers"),
        (["--gen-numerics", "int4"], "--gen-numerics"),
    ):
        with pytest.raises(SystemExit) as e:
            train_eagle.parse_args(["--random-model", "--segment", "8", "--out", str(out)] + bad)
        assert e.value.code == 2 and message in capsys.readouterr().err, bad


def test_training_command_with_feature_layers(tmp_path, capsys):
    """A fresh EAGLE-3 head, then one widened from an EAGLE head by --init: it records its
    layers, drafts through the engine, and its greedy output is the target's.  Bad layers
    stop the command before any data is generated."""
    base = ["--random-model", "--steps", "2", "--segments", "2", "--segment", "8", "--new-tokens", "5"]
    fresh, plain, widened = tmp_path / "fresh.pt", tmp_path / "plain.pt", tmp_path / "widened.pt"
    assert (
        train_eagle.main(base + ["--feature-layers", "1,0", "--out", str(fresh), "--evaluate", "--eval-tokens", "5"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("equals plain greedy: True") == 2
    head = EagleHead.load(fresh)
    assert head.feature_layers == (1, 0) and head.config["training"]["feature_layers"] == [1, 0]
    assert train_eagle.main(base + ["--out", str(plain)]) == 0
    assert train_eagle.main(base + ["--init", str(plain), "--feature-layers", "1", "--out", str(widened)]) == 0
    wide = EagleHead.load(widened)
    assert wide.feature_layers == (1,) and wide.config["training"]["init"]["file"] == str(plain)
    # --init of an EAGLE-3 head keeps its layers, and the file records them
    assert train_eagle.main(base + ["--init", str(widened), "--out", str(tmp_path / "again.pt")]) == 0
    again = EagleHead.load(tmp_path / "again.pt")
    assert again.feature_layers == (1,) and again.config["training"]["feature_layers"] == [1]
    # --draft-vocab-only reads the layers of the head at --out, whatever --init says (the
    # command is the training's own flags plus these)
    weights = {k: v.clone() for k, v in again.state_dict().items()}
    vocab_only = [
        "--draft-vocab-only",
        "--draft-vocab",
        "20",
        "--init",
        str(plain),
        "--out",
        str(tmp_path / "again.pt"),
    ]
    assert train_eagle.main(base + vocab_only) == 0
    ranked = EagleHead.load(tmp_path / "again.pt")
    assert ranked.config["draft_vocab_size"] == 20 and ranked.feature_layers == (1,)
    assert all(torch.equal(v, weights[k]) for k, v in ranked.state_dict().items())
    model = train_data.tiny_random_model(0)
    r = SpeculativeDecoder(model, EagleDrafter(model, wide)).generate([[1, 2, 3]], 6, num_draft_tokens=3)
    assert r.tokens == SpeculativeDecoder(model).generate([[1, 2, 3]], 6).tokens
    for flags, message in (
        (["--feature-layers", "a,1"], "comma-separated layer indices"),
        (["--feature-layers", "1,1"], "--feature-layers repeats a layer"),
        (["--feature-layers", "-1"], "--feature-layers: layer -1 is not an index >= 0"),
        (["--init", str(widened), "--feature-layers", "0"], "reads layers [1]"),
        (["--draft-vocab-only", "--feature-layers", "0"], "--draft-vocab-only"),
    ):
        with pytest.raises(SystemExit) as e:
            train_eagle.parse_args(["--random-model", "--segment", "8", "--out", str(fresh)] + flags)
        assert e.value.code == 2 and message in capsys.readouterr().err, flags
    with pytest.raises(SystemExit) as e:
        train_eagle.main(base + ["--feature-layers", "5", "--out", str(tmp_path / "x.pt")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "the target has 2 layers, no layer 5" in err and "generate" not in err


def test_heldout_agreement_reads_the_heads_layers(tiny, tiny_data):
    """``training.agreement`` scores an EAGLE-3 head on its fused features: the same figures
    as the trainer's ``agreement`` over rows with the layer outputs appended."""
    from specdec_kernels.decoding.training import agreement

    head = fused_head((2, 0), seed=4)
    got = agreement.eagle_agreement(tiny, head, tiny_data, 2)
    rows = train_eagle.feature_rows(
        tiny_data, tiny.output.weight, layer_outputs=train_eagle.layer_outputs(tiny, tiny_data, (2, 0))
    )
    assert got == train_eagle.agreement(head, tiny, rows, 2, agreement.SEGMENT)
    assert got["positions"][0] > 0


def test_heldout_measure_computes_the_layer_outputs_once(tiny, monkeypatch):
    """``training.agreement.measure`` runs the teacher-forced pass once for every group, and
    each group's figures are those of its own sequences."""
    from specdec_kernels.decoding.training import agreement

    head = fused_head((1,), seed=6)
    prompts = [[5, 17, 33, 2], [12, 99, 8], [64, 3, 7, 7, 1], [4, 4]]
    categories = ["a", "b", "a", "b"]
    real, calls = train_eagle.layer_outputs, []
    monkeypatch.setattr(train_eagle, "layer_outputs", lambda *a, **k: calls.append(1) or real(*a, **k))
    res = agreement.measure(tiny, prompts, categories, head, None, 6, 2, [])
    assert len(calls) == 1 and set(res) == {"overall", "a", "b"}
    with torch.inference_mode():
        data = train_data.generate_data(tiny, prompts, 6, 8, [], "again")
    part = agreement.subset(data, [1, 3])
    assert res["b"]["eagle"] == agreement.eagle_agreement(tiny, head, part, 2, real(tiny, part, (1,)))
