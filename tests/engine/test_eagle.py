"""The EAGLE-style draft head and drafter (``decoding.drafters.eagle``) and its trainer
(``decoding.training.eagle``): the layer by hand, EAGLE-2's dynamic tree against a
node-by-node reference, training and inference computing the same features, greedy
identity (tiny and real model, chain and tree), chi-square at temperature > 0, the training
command end to end."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
import torch.nn.functional as F

from specdec_kernels.decoding import SamplingParams, SpeculativeDecoder
from specdec_kernels.decoding.drafters.eagle import SHIPPED, EagleDrafter, EagleHead, load_eagle_head
from specdec_kernels.decoding.drafters.head_file import model_fingerprint
from specdec_kernels.decoding.training import data as train_data
from specdec_kernels.decoding.training import eagle as train_eagle
from specdec_kernels.decoding.training.softmax import TrainingOptions, label_ranking
from tests.engine import drive
from tests.engine.heads import HIDDEN, PROMPTS, committed, final_hidden, tiny, train_prompts  # noqa: F401 (fixture)
from tests.engine.tiny import V, exact_marginals, real_greedy, real_only, real_stats_equal_to_greedy
from tests.utils import P_THRESHOLD, chi_square_pvalue, one_thread  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")


def random_head(window=16, seed=0, scale=None):
    """A head whose every weight follows from ``seed`` alone: built under a forked global RNG
    seeded with it (the layers' default init draws from the global generator, whose state
    otherwise depends on the tests that ran before in the worker), then the norms (and with
    ``scale`` every weight) drawn again from a generator of its own."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = EagleHead(HIDDEN, 4, 2, 16, 96, window=window)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if scale is not None or "norm" in name:
                p.copy_(
                    1 + 0.1 * torch.randn(p.shape, generator=g)
                    if "norm" in name
                    else torch.randn(p.shape, generator=g) * (scale or 0.2)
                )
    return head


@pytest.fixture(scope="module")
def tiny_rows(tiny):
    with torch.inference_mode():
        data = train_data.generate_data(tiny, train_prompts(), 24, 16, [], "tiny")
    return train_eagle.feature_rows(data, tiny.output.weight)


@pytest.fixture(scope="module")
def trained(tiny, tiny_rows):
    """A head self-distilled on the tiny model's greedy continuations of ``train_prompts()``
    (a random model has nothing to generalise: the tests that need accepted drafts decode
    these same prompts)."""
    head = EagleHead.for_model(tiny, window=16, intermediate_size=96)
    options = TrainingOptions(steps=250, lr=3e-3, seed=0, distill=1.0, negatives=4096)
    losses = train_eagle.train_head(head, tiny, tiny_rows, options, segments=8, segment=16, unroll=3)
    head.set_token_ranking(label_ranking(tiny_rows.labels, V))
    return head, losses


# ---------------------------------------------------------------------------- the layer
def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    hd = x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos * inv
    c, s = torch.cos(ang), torch.sin(ang)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def layer_by_hand(head, f, e, t):
    """g_t of the teacher-forced head over positions 0..t, float64, one query."""
    P = {k: v.double() for k, v in head.state_dict().items()}
    nh, nkv, hd = head.num_heads, head.num_kv_heads, head.head_dim
    u = torch.cat([e, f], -1).double() @ P["fc"].T + P["fc_bias"]  # (T, H)
    x = rms(u, P["attention_norm"], head.eps)
    qkv = x @ P["wqkv"].T
    outs = []
    for h in range(nh):
        kvh = h // (nh // nkv)
        q = rope(qkv[t, h * hd : (h + 1) * hd], t, head.rope_theta)
        ks = [rope(qkv[j, nh * hd + kvh * hd : nh * hd + (kvh + 1) * hd], j, head.rope_theta) for j in range(t + 1)]
        vs = [qkv[j, (nh + nkv) * hd + kvh * hd : (nh + nkv) * hd + (kvh + 1) * hd] for j in range(t + 1)]
        w = torch.softmax(torch.stack([q @ k for k in ks]) / math.sqrt(hd), 0)
        outs.append(sum(wi * v for wi, v in zip(w, vs)))
    a = u[t] + torch.cat(outs) @ P["wo"].T
    gate, up = (rms(a, P["ffn_norm"], head.eps) @ P["w13"].T).chunk(2)
    return a + (F.silu(gate) * up) @ P["w2"].T


def test_head_by_hand():
    head = random_head(scale=0.2)
    g = torch.Generator().manual_seed(1)
    f, e = torch.randn(7, HIDDEN, generator=g), torch.randn(7, HIDDEN, generator=g)
    out = head(f[None], e[None])[0]
    for t in (0, 3, 6):
        torch.testing.assert_close(out[t].double(), layer_by_hand(head, f, e, t), atol=1e-4, rtol=1e-4)


def test_step_one_of_the_unroll_is_teacher_forcing_and_step_two_feeds_back():
    """unrolled's step 1 equals forward; step 2 at chain t equals the layer fed (g1_t,
    x_{t+2}) at position t + 1 attending to the real positions <= t and to itself."""
    head = random_head(scale=0.2)
    g = torch.Generator().manual_seed(2)
    E = torch.randn(V, HIDDEN, generator=g)
    L, U = 6, 2
    f = torch.randn(1, L + U, HIDDEN, generator=g)
    nxt = torch.randint(0, V, (1, L + U), generator=g)
    valid = torch.ones(1, L + U, dtype=torch.bool)
    with torch.no_grad():
        g1, g2 = train_eagle.unrolled(head, E, f, nxt, valid, U)
        torch.testing.assert_close(g1, head(f[:, :L], E[nxt[:, :L]]))
        t = 3
        u_real = head.inputs(f[:, : t + 1], E[nxt[:, : t + 1]])
        _, k_r, v_r = head.project(u_real, torch.arange(t + 1)[None])
        u2 = head.inputs(g1[:, t : t + 1], E[nxt[:, t + 1 : t + 2]])
        q2, k2, v2 = head.project(u2, torch.tensor([[t + 1]]))
        mask = torch.ones(1, 1, t + 2, dtype=torch.bool)
        want = head.finish(u2, head.attend(q2, torch.cat([k_r, k2], 1), torch.cat([v_r, v2], 1), mask))
        torch.testing.assert_close(g2[:, t : t + 1], want)


def test_save_load_round_trip(tmp_path):
    head = random_head(scale=0.2)
    head.config = {"base_model": "x"}
    head.save(tmp_path / "h.pt")
    back = EagleHead.load(tmp_path / "h.pt")
    assert back.window == head.window and back.config["base_model"] == "x"
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(b, a.half().float(), msg=n)


@pytest.mark.parametrize("quantize_head", [None, True, False], ids=["default", "quantized", "float32"])
@pytest.mark.parametrize("weight,bad", [("fc", float("nan")), ("attention_norm", float("inf")), ("w2", -float("inf"))])
def test_non_finite_head_weights_are_named_with_the_fix(tmp_path, tiny, quantize_head, weight, bad):
    """A NaN or infinite weight in a head: EagleDrafter refuses it, whatever quantize_head
    (quantised it failed inside quantize_scaled8 naming neither the head nor the fix; unquantised
    it drafted NaN-scored tokens the target never accepted), with a ValueError naming the head,
    the file it came from, the weight and the fix; so does ``quantized()`` itself."""
    head = random_head(scale=0.2)
    head.save(tmp_path / "h.pt")
    for source in (None, str(tmp_path / "h.pt")):
        poisoned = random_head(scale=0.2) if source is None else EagleHead.load(source)
        with torch.no_grad():
            dict(poisoned.named_parameters())[weight].view(-1)[3] = bad
        with pytest.raises(ValueError) as e:
            EagleDrafter(tiny, poisoned, quantize_head=quantize_head)
        message = str(e.value)
        assert "quantize_scaled8" not in message, message
        assert "non-finite weights in the EAGLE head" in message and f"'{weight}': 1 of " in message, message
        assert "with quantize_head=True or False" in message and "use a head with finite weights" in message
        assert (source is None) or f"({source})" in message, message
        with pytest.raises(ValueError, match=f"non-finite weights in the EAGLE head.*'{weight}'"):
            poisoned.quantized()
    EagleDrafter(tiny, head, quantize_head=quantize_head)  # the finite head is taken


def test_bad_arguments(tmp_path, tiny, capsys):
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        EagleHead(HIDDEN, 3, 2, 16, 96)
    with pytest.raises(ValueError, match="head_dim must be even"):
        EagleHead(HIDDEN, 4, 2, 15, 96)
    with pytest.raises(ValueError, match="window"):
        EagleHead(HIDDEN, 4, 2, 16, 96, window=0)
    with pytest.raises(ValueError, match="hidden size"):
        EagleDrafter(tiny, EagleHead(32, 4, 2, 8, 64))
    for kw in ({"top_k": 0}, {"max_nodes": 0}, {"max_depth": 0}, {"top_k": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            EagleDrafter(tiny, random_head(), **kw)
    (tmp_path / "bad.pt").write_bytes(b"")
    torch.save({"nothing": 1}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not an EAGLE head file"):
        EagleHead.load(tmp_path / "bad.pt")
    torch.save({"config": {"format": 99}, "state_dict": {}}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="format"):
        EagleHead.load(tmp_path / "bad.pt")
    for bad in (["--steps", "0"], ["--unroll", "0"], ["--distill", "2"], ["--reg", "-1"], ["--threads", "0"]):
        with pytest.raises(SystemExit):
            train_eagle.parse_args(bad)
    for bad, flag in (
        (["--lr", "0"], "--lr must be a finite number > 0"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--negatives", "-1"], "--negatives must be a finite number >= 0"),
        (["--reg", "nan"], "--reg must be a finite number >= 0"),
        (["--hass-top-k", "-1"], "--hass-top-k must be a finite number >= 0"),
        (["--hass-weight", "nan"], "--hass-weight must be a finite number >= 0"),
        (["--hass-weight", "inf"], "--hass-weight must be a finite number >= 0"),
    ):
        with pytest.raises(SystemExit):
            train_eagle.parse_args(bad)
        assert flag in capsys.readouterr().err
    with pytest.raises(ValueError, match="unroll"):
        train_eagle.train_head(
            random_head(), tiny, None, TrainingOptions(steps=1, lr=1e-3, seed=0), segments=1, segment=4, unroll=0
        )


# ---------------------------------------------------------------------------- the dynamic tree
def reference_tree(head, model, feats, history, top_k, max_nodes, depth, vocab=None):
    """EAGLE-2's dynamic tree node by node: (tokens, parents, log path probabilities) of the
    kept nodes, root first, in topological order (by depth, then path probability).
    ``vocab`` (ids): the head's softmax over those tokens only (a draft vocabulary)."""
    E, W = model.tok_embeddings.weight, model.output.weight
    ids = torch.arange(W.shape[0]) if vocab is None else torch.as_tensor(vocab)
    W = W[ids]
    p = len(history) - 1  # the root's position; features of positions < p are known
    lo = max(0, p - head.window)
    u_ctx = head.inputs(feats[lo:p][None], E[torch.tensor(history[lo + 1 : p + 1])][None])
    q_ctx, k_ctx, v_ctx = head.project(u_ctx, torch.arange(lo, p)[None])

    def run(u, q, anc_keys):
        ks = torch.cat([k_ctx] + [k for k, _ in anc_keys], 1)
        vs = torch.cat([v_ctx] + [v for _, v in anc_keys], 1)
        g = head.finish(u, head.attend(q, ks, vs, torch.ones(1, 1, ks.shape[1], dtype=torch.bool)))
        return torch.log_softmax(g[0, 0] @ W.T, -1), g

    nodes = [{"tok": history[-1], "par": -1, "score": 0.0, "dep": 0}]
    logp, g_root = run(u_ctx[:, -1:], q_ctx[:, -1:], [])
    top = logp.topk(top_k)
    frontier = []
    for s, t in zip(top.values.tolist(), ids[top.indices].tolist()):
        nodes.append({"tok": t, "par": 0, "score": s, "dep": 1, "g_par": g_root, "anc": []})
        frontier.append(len(nodes) - 1)
    for d in range(1, depth):
        cands = []
        for n in frontier:
            node = nodes[n]
            u = head.inputs(node["g_par"], E[torch.tensor([[node["tok"]]])])
            q, k, v = head.project(u, torch.tensor([[p - 1 + d]]))
            anc = node["anc"] + [(k, v)]
            logp, g = run(u, q, anc)
            top = logp.topk(top_k)
            for s, t in zip(top.values.tolist(), ids[top.indices].tolist()):
                nodes.append({"tok": t, "par": n, "score": node["score"] + s, "dep": d + 1, "g_par": g, "anc": anc})
                cands.append(len(nodes) - 1)
        frontier = sorted(cands, key=lambda i: -nodes[i]["score"])[:top_k]
    ids = sorted(range(1, len(nodes)), key=lambda i: (-nodes[i]["score"], nodes[i]["dep"], i))[: max_nodes - 1]
    ids = sorted(ids, key=lambda i: (nodes[i]["dep"], -nodes[i]["score"], i))
    where = {0: 0}
    tokens, parents, scores = [history[-1]], [-1], [0.0]
    for i in ids:
        where[i] = len(tokens)
        tokens.append(nodes[i]["tok"])
        parents.append(where[nodes[i]["par"]])
        scores.append(nodes[i]["score"])
    return tokens, parents, scores


def propose_after(drafter, model, history, k):
    """Propose for one sequence whose committed features come from teacher forcing."""
    (feats,) = committed(drafter, model, [history])
    return drafter.propose(drive.request([history], [k], drafter.run, [True])), feats


@pytest.mark.parametrize("quantize_head", [False, None], ids=["float32-head", "default-head"])
@pytest.mark.parametrize("top_k,max_nodes,depth", [(1, 8, 5), (2, 6, 3), (3, 20, 4), (4, 64, 6)])
@pytest.mark.parametrize("length", [2, 9, 30])
def test_dynamic_tree_matches_the_node_by_node_reference(tiny, top_k, max_nodes, depth, length, quantize_head):
    """Length 30 exceeds the window (16): the sliding window is exercised too.  The
    attention weights are scaled up so that which tree ancestors a node attends to moves
    its scores far beyond float32 rounding (random logits are peaked: log path
    probabilities reach -1000, so the tolerance is relative).  The reference runs the head
    that drafts: the one passed in, or the drafter's Q8_0 copy (the default on CPU with the
    extension)."""
    head = random_head(window=16, scale=0.25, seed=length)
    with torch.no_grad():
        head.wo.mul_(4)
        head.wqkv.mul_(3)
    g = torch.Generator().manual_seed(length)
    history = torch.randint(0, V, (length,), generator=g).tolist()
    drafter = EagleDrafter(
        tiny, head, tree=top_k > 1, top_k=top_k, max_nodes=max_nodes, max_depth=8, quantize_head=quantize_head
    )
    assert (drafter.head is head) == (not drafter.head_quantized)
    with torch.inference_mode():
        draft, feats = propose_after(drafter, tiny, history, depth)
        want_t, want_p, want_s = reference_tree(drafter.head, tiny, feats, history, top_k, max_nodes, depth)
    n = int(draft.num_nodes[0])
    assert draft.tokens[0, :n].tolist() == want_t
    assert draft.parents[0, :n].tolist() == want_p
    torch.testing.assert_close(torch.tensor(drafter.path_logprobs[0]), torch.tensor(want_s), atol=1e-2, rtol=1e-3)
    assert n <= max_nodes and int(draft.depths()[0, :n].max()) <= depth
    assert draft.probs is None
    if top_k == 1:
        assert draft.is_chain and n == min(depth, max_nodes - 1) + 1


@pytest.mark.parametrize("top_k,max_nodes,depth", [(1, 8, 5), (3, 20, 4)])
@pytest.mark.parametrize("size", [3, 17, 110])
def test_draft_vocab_tree_matches_the_node_by_node_reference(tiny, top_k, max_nodes, depth, size):
    """A draft vocabulary of ``size`` tokens in a scrambled order (3: top_k's own size; 110:
    all but one token): the tree is the reference's with the head's softmax over those
    tokens, and every drafted token lies inside it."""
    head = random_head(window=16, scale=0.25, seed=size)
    g = torch.Generator().manual_seed(size)
    head.set_token_ranking(torch.randperm(V, generator=g))
    history = torch.randint(0, V, (12,), generator=g).tolist()
    drafter = EagleDrafter(tiny, head, tree=top_k > 1, top_k=top_k, max_nodes=max_nodes, max_depth=8, draft_vocab=size)
    vocab = head.token_ranking[:size]
    assert drafter.draft_vocab.tolist() == sorted(vocab.tolist())
    with torch.inference_mode():
        draft, feats = propose_after(drafter, tiny, history, depth)
        want_t, want_p, want_s = reference_tree(drafter.head, tiny, feats, history, top_k, max_nodes, depth, vocab)
    n = int(draft.num_nodes[0])
    assert draft.tokens[0, :n].tolist() == want_t
    assert draft.parents[0, :n].tolist() == want_p
    torch.testing.assert_close(torch.tensor(drafter.path_logprobs[0]), torch.tensor(want_s), atol=1e-2, rtol=1e-3)
    assert set(draft.tokens[0, 1:n].tolist()) <= set(vocab.tolist())


def test_draft_vocab_arguments(tmp_path, tiny):
    """ "auto" follows the head's stored recommendation; an int takes the head of the ranking;
    ids are taken as given (ascending); the whole vocabulary is None; bad values name the
    argument."""
    head = random_head()
    assert EagleDrafter(tiny, head).draft_vocab is None  # no ranking: the whole vocabulary
    with pytest.raises(ValueError, match="token ranking"):
        EagleDrafter(tiny, head, draft_vocab=10)
    ranking = torch.randperm(V, generator=torch.Generator().manual_seed(1))
    head.set_token_ranking(ranking)
    assert EagleDrafter(tiny, head).draft_vocab is None  # a ranking but no recommended size
    head.config["draft_vocab_size"] = 20
    assert EagleDrafter(tiny, head).draft_vocab.tolist() == sorted(ranking[:20].tolist())
    assert EagleDrafter(tiny, head, draft_vocab=None).draft_vocab is None
    assert EagleDrafter(tiny, head, draft_vocab=V).draft_vocab is None
    assert EagleDrafter(tiny, head, top_k=3, draft_vocab=torch.tensor(7)).draft_vocab.tolist() == sorted(
        ranking[:7].tolist()
    )
    assert EagleDrafter(tiny, head, draft_vocab=[40, 3, 99, 12, 0, 5, 6, 7, 8, 9, 10]).draft_vocab.tolist() == [
        0,
        3,
        5,
        6,
        7,
        8,
        9,
        10,
        12,
        40,
        99,
    ]
    for bad, match in (
        ("all", "draft_vocab"),
        (True, "draft_vocab"),
        (0, "draft_vocab"),
        (-3, "draft_vocab"),
        ([1, 2, V] + list(range(3, 13)), "outside the vocabulary"),
        ([-1] + list(range(12)), "negative"),
        ([4, 4] + list(range(5, 15)), "repeats"),
        ([0.5, 1.0], "integer"),
        ([], "non-empty"),
        (torch.zeros(2, 6, dtype=torch.int64), "1-D"),
    ):
        with pytest.raises(ValueError, match=match):
            EagleDrafter(tiny, head, draft_vocab=bad)
    with pytest.raises(ValueError, match="top_k"):
        EagleDrafter(tiny, head, top_k=10, draft_vocab=[1, 2, 3])
    with pytest.raises(ValueError, match="ranking"):
        head.set_token_ranking([3, 3])
    head.set_token_ranking(torch.arange(V + 5))  # a ranking from a larger vocabulary
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        EagleDrafter(tiny, head, draft_vocab=10)
    # stored with the weights; a head file without one reads as before
    head.set_token_ranking(ranking)
    head.save(tmp_path / "h.pt")
    back = EagleHead.load(tmp_path / "h.pt")
    assert torch.equal(back.token_ranking, ranking) and back.config["draft_vocab_size"] == 20
    head.set_token_ranking(None)
    head.save(tmp_path / "h.pt")
    assert EagleHead.load(tmp_path / "h.pt").token_ranking is None


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)], ids=["greedy", "sampled"]
)
def test_draft_vocab_chain_distribution_is_the_heads_over_it(tiny, sampling):
    """chain_begin / chain_extend with a draft vocabulary: 0 outside it, and inside it the
    head's distribution (temperature, top-k, top-p) over those tokens only: what a chain
    drawn from it samples (the q that rejection sampling is handed)."""
    from specdec_kernels.decoding.draft import draft_distribution

    head = random_head(window=16, scale=0.25, seed=3)
    vocab = torch.tensor([0, 2, 5, 9, 17, 33, 41, 64, 90, 99, 101, 110])
    full, restricted = EagleDrafter(tiny, head, tree=False), EagleDrafter(tiny, head, tree=False, draft_vocab=vocab)
    hist = [PROMPTS[0] + [5, 17], PROMPTS[2]]
    outside = torch.ones(V, dtype=torch.bool)
    outside[vocab] = False
    with torch.inference_mode():
        for d in (full, restricted):
            feats = [final_hidden(tiny, h) for h in hist]
            context = [f[: len(h) - 1] for f, h in zip(feats, hist)]
            last = torch.zeros(len(hist), HIDDEN)  # the drafter reads the context alone
            drive.start(d, hist, sampling, features=drive.features(last, [True, True], context, [0, 0]))
        p_full, _ = full.chain_begin(drive.request(hist, [2, 2], full.run, [True, True]), V)
        p_res, has = restricted.chain_begin(drive.request(hist, [2, 2], restricted.run, [True, True]), V)
        for depth in range(2):
            assert bool(has.all())
            assert float(p_res[:, outside].abs().max()) == 0.0
            # the same head output g as the unrestricted drafter's (fed the same tokens),
            # through the output head's rows of the draft vocabulary
            g = restricted._chain["g"][:, 0]
            torch.testing.assert_close(g, full._chain["g"][:, 0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(
                p_full, draft_distribution(g @ tiny.output.weight.T, sampling), atol=1e-5, rtol=1e-4
            )
            torch.testing.assert_close(
                p_res[:, vocab], draft_distribution(g @ tiny.output.weight[vocab].T, sampling), atol=1e-5, rtol=1e-4
            )
            tok = p_res.argmax(-1)
            p_full, _ = full.chain_extend(tok)
            p_res, has = restricted.chain_extend(tok)


def test_batched_drafts_equal_one_sequence_at_a_time(tiny):
    """Ragged histories, different K per sequence (0 included), one inactive: each row is
    what that sequence gets alone."""
    head = random_head(window=16, scale=0.25)
    g = torch.Generator().manual_seed(7)
    hist = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 23, 2, 11)]
    ks, active = [3, 5, 0, 2], [True, True, True, False]
    drafter = EagleDrafter(tiny, head, top_k=3, max_nodes=12)
    with torch.inference_mode():
        feats = [final_hidden(tiny, h) for h in hist]
        firsts = [max(0, len(h) - 1 - 16) for h in hist]
        context = [f[a : len(h) - 1] for f, a, h in zip(feats, firsts, hist)]
        last = torch.zeros(len(hist), HIDDEN)  # the drafter reads the context alone
        run = drive.start(drafter, hist, features=drive.features(last, [True] * 4, context, firsts))
        draft = drafter.propose(drive.request(hist, ks, run, active))
        for b, h in enumerate(hist):
            n = int(draft.num_nodes[b])
            if not active[b] or ks[b] == 0:
                assert n == 1 and draft.tokens[b, 0] == h[-1]
                continue
            one, _ = propose_after(EagleDrafter(tiny, head, top_k=3, max_nodes=12), tiny, h, ks[b])
            m = int(one.num_nodes[0])
            assert draft.tokens[b, :n].tolist() == one.tokens[0, :m].tolist()
            assert draft.parents[b, :n].tolist() == one.parents[0, :m].tolist()
            scores = drafter.path_logprobs[b]
            assert len(scores) == n and all(s <= 0 for s in scores)


def test_chain_features_follow_the_training_unroll(tiny):
    """The drafter's depth-s draft is the argmax of the training unroll's step s at the
    root's predecessor, fed the drafted tokens: training and inference compute the same
    features."""
    head = random_head(window=16, scale=0.25, seed=5)
    g = torch.Generator().manual_seed(5)
    history = torch.randint(0, V, (10,), generator=g).tolist()
    drafter = EagleDrafter(tiny, head, tree=False, max_depth=4)
    with torch.inference_mode():
        draft, feats = propose_after(drafter, tiny, history, 4)
        drafts = draft.tokens[0, 1:].tolist()
        assert len(drafts) == 4
        # rows: positions 0..p-1 with the real features, then the drafted continuation
        p = len(history) - 1
        f = torch.cat([feats[:p], torch.zeros(4, HIDDEN)])[None]
        nxt = torch.tensor([history[1:] + drafts])[:, : p + 4]
        valid = torch.ones(1, p + 4, dtype=torch.bool)
        outs = train_eagle.unrolled(head, tiny.tok_embeddings.weight, f, nxt, valid, 4)
        for s, out in enumerate(outs, start=1):
            assert int((out[0, p - 1] @ tiny.output.weight.T).argmax()) == drafts[s - 1], s


def test_hass_top_k_term_by_hand():
    """HASS's top-K distillation term, worked by hand: the teacher's logits are its states
    (W_c the identity), p = softmax(2, 1, 0, -1); the term is -sum over p's K most likely
    candidates of p(x) log q(x); K >= C gives the whole soft cross-entropy, K = 0 none."""
    from specdec_kernels.decoding.training.softmax import hard_and_soft_losses

    teacher = torch.tensor([[[1.0, 2.0, -1.0, 0.0]]])  # candidates 1, 0, 3, 2 by probability
    W_c = torch.eye(4, dtype=torch.bfloat16)
    bias = torch.zeros(4)
    logits = torch.tensor([[[0.5, -0.25, 1.0, 0.0]]])
    target = torch.tensor([[1]])
    z = sum(math.exp(x) for x in (1.0, 2.0, -1.0, 0.0))
    p = [math.exp(x) / z for x in (1.0, 2.0, -1.0, 0.0)]
    zq = sum(math.exp(x) for x in (0.5, -0.25, 1.0, 0.0))
    logq = [x - math.log(zq) for x in (0.5, -0.25, 1.0, 0.0)]
    hard, soft, top = hard_and_soft_losses(logits, target, teacher, W_c, bias, top_k=2)
    assert float(hard) == pytest.approx(-logq[1], rel=1e-6)
    assert float(soft) == pytest.approx(-sum(a * b for a, b in zip(p, logq)), rel=1e-6)
    assert float(top) == pytest.approx(-(p[1] * logq[1] + p[0] * logq[0]), rel=1e-6)
    assert float(hard_and_soft_losses(logits, target, teacher, W_c, bias, top_k=9).top) == pytest.approx(float(soft))
    assert hard_and_soft_losses(logits, target, teacher, W_c, bias).top is None
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="top_k"):
            hard_and_soft_losses(logits, target, teacher, W_c, bias, top_k=bad)


def test_hass_top_k_term_in_a_sampled_softmax_by_hand():
    """A drawn negative (candidate 2, bias log 22: it stands for 22 tokens) ranks first by
    the corrected distribution but third by its own logit: the top-2 term takes candidates 0
    and 1, with each token's own probability and log q (the bias taken off)."""
    from specdec_kernels.decoding.training.softmax import hard_and_soft_losses

    raw = [2.0, 0.5, 0.25, -3.0]
    b = [0.0, 0.0, math.log(22.0), 0.0]
    head = [0.5, 1.0, -0.5, 0.0]
    teacher = torch.tensor([[raw]])
    bias = torch.tensor(b)
    logits = torch.tensor([[[h + x for h, x in zip(head, b)]]])  # candidate_logits add the bias
    z = sum(math.exp(r + x) for r, x in zip(raw, b))
    zq = sum(math.exp(h + x) for h, x in zip(head, b))
    p_own = [math.exp(r) / z for r in raw]  # p(x) of the token itself
    logq_own = [h - math.log(zq) for h in head]
    _, _, top = hard_and_soft_losses(logits, torch.tensor([[0]]), teacher, torch.eye(4, dtype=torch.bfloat16), bias, 2)
    assert float(top) == pytest.approx(-(p_own[0] * logq_own[0] + p_own[1] * logq_own[1]), rel=1e-5)


def test_hass_top_k_joins_the_training_loss(tiny, tiny_rows):
    """One step from the same head and seed: the loss with the top-K term is the loss
    without it plus hass_weight times a positive term; a weight of 0 changes nothing."""

    def first_loss(**kw):
        head = random_head(window=16, scale=0.2, seed=4)
        options = TrainingOptions(steps=1, lr=1e-3, seed=0, distill=1.0)
        return train_eagle.train_head(head, tiny, tiny_rows, options, segments=2, segment=16, unroll=2, **kw)[0]

    plain = first_loss()
    assert first_loss(hass_top_k=5, hass_weight=0.0) == pytest.approx(plain, rel=1e-6)
    half, one = first_loss(hass_top_k=5, hass_weight=0.5), first_loss(hass_top_k=5, hass_weight=1.0)
    assert one > half > plain
    assert one - plain == pytest.approx(2 * (half - plain), rel=1e-4)
    for bad in (dict(hass_top_k=-1), dict(hass_top_k=2.5), dict(hass_weight=float("nan"))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            first_loss(**bad)


def test_agreement_scores_every_position_of_every_sequence(tiny, tiny_rows):
    """Segments shorter and longer than the sequences: each depth d scores every row t of
    every sequence whose row t + d exists, whatever the segment length."""
    ends = torch.unique_consecutive(tiny_rows.seq_end).tolist()
    lengths = [e - s for s, e in zip([0] + ends[:-1], ends)]
    for segment in (4, 16, 64):
        report = train_eagle.agreement(random_head(), tiny, tiny_rows, 3, segment)
        assert report["positions"] == [sum(max(0, n - d) for n in lengths) for d in (1, 2, 3)]
        assert all(0 <= a <= 1 for a in report["top1"])


# ---------------------------------------------------------------------------- decoding
def test_training_fits_the_target(tiny, trained):
    """The loss falls, and on the text it was trained on the trained head's drafts are
    accepted far more often than a random head's."""
    head, losses = trained
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20
    mal = {}
    for name, h in (("random", random_head(window=16, scale=0.2, seed=9)), ("trained", head)):
        r = SpeculativeDecoder(tiny, EagleDrafter(tiny, h, tree=False)).generate(
            train_prompts(), 24, num_draft_tokens=4
        )
        mal[name] = r.stats.mean_accepted_length
    assert mal["trained"] > mal["random"] + 1.0, mal


@pytest.mark.parametrize("vocab", [None, 40], ids=["full", "vocab40"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("k", [0, 1, 3, 7], ids=lambda k: f"K{k}")
def test_greedy_equals_plain_greedy(tiny, trained, tree, k, vocab):
    """Ragged batch with a one-token prompt; K beyond max_depth is cut to it; the whole
    vocabulary and the 40 most frequent training labels as the draft vocabulary."""
    head, _ = trained
    plain = SpeculativeDecoder(tiny, stop_token_ids=[3]).generate(PROMPTS, 20)
    drafter = EagleDrafter(tiny, head, tree=tree, top_k=3, max_nodes=16, max_depth=5, draft_vocab=vocab)
    result = SpeculativeDecoder(tiny, drafter, stop_token_ids=[3]).generate(PROMPTS, 20, num_draft_tokens=k)
    assert result.tokens == plain.tokens
    s = result.stats
    if k:
        assert s.accepted_draft_tokens > 0
        assert len(s.proposed_at) <= min(k, 5)
    else:
        assert s.draft_tokens == 0


@pytest.mark.parametrize("block_size", [None, 4], ids=["dense", "paged"])
def test_greedy_with_paged_cache_and_multi_drafter(tiny, trained, block_size):
    from specdec_kernels.decoding import MultiDrafter, NgramDrafter

    head, _ = trained
    plain = SpeculativeDecoder(tiny, stop_token_ids=[3]).generate(PROMPTS, 20)
    drafter = MultiDrafter([NgramDrafter(), EagleDrafter(tiny, head, top_k=2, max_nodes=8)], max_nodes=16)
    result = SpeculativeDecoder(tiny, drafter, stop_token_ids=[3], block_size=block_size).generate(
        PROMPTS, 20, num_draft_tokens=4
    )
    assert result.tokens == plain.tokens
    assert result.stats.drafters["eagle-tree"]["accepted"] > 0


@pytest.mark.parametrize("tree,vocab", [(False, None), (True, None), (True, 40)], ids=["chain", "tree", "tree-vocab40"])
def test_sampling_keeps_the_target_distribution(tiny, trained, tree, vocab):
    """Deterministic top-k drafts with q = None: each of the first 3 emitted tokens follows
    the target's marginal over 3000 seeds.  P_THRESHOLD 1e-3 per test: a correct sampler
    fails one of these 9 checks (3 tokens, 3 cases) with probability under 0.9 %; a sampler that ignores the
    residual distribution shifts the marginals by far more than the chi-square resolves at
    3000 samples."""
    head, _ = trained
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    # a prompt that ends inside the greedy text the head was fitted on (a random target's
    # prompts are unpredictable, its greedy continuations repetitive), so drafts get accepted
    prompt = train_prompts()[0]
    prompt = prompt + SpeculativeDecoder(tiny).generate([prompt], 5).tokens[0]
    B = 3000
    drafter = EagleDrafter(tiny, head, tree=tree, top_k=3, max_nodes=10, max_depth=3, draft_vocab=vocab)
    result = SpeculativeDecoder(tiny, drafter).generate(
        [prompt] * B, 3, num_draft_tokens=3, sampling=sp, seeds=list(range(B))
    )
    out = torch.tensor(result.tokens)
    assert out.shape == (B, 3)
    assert result.stats.accepted_draft_tokens > 0.3 * result.stats.sequence_steps
    for j, marginal in enumerate(exact_marginals(tiny, prompt, sp, 3)):
        assert chi_square_pvalue(out[:, j], marginal) > P_THRESHOLD, f"token {j}"


@pytest.mark.parametrize("extra", [[], ["--hass-top-k", "3", "--hass-weight", "0.5"]], ids=["plain", "hass"])
def test_training_command_end_to_end(tmp_path, extra):
    out = tmp_path / "eagle.pt"
    assert (
        train_eagle.main(
            extra
            + [
                "--random-model",
                "--steps",
                "3",
                "--segments",
                "2",
                "--segment",
                "8",
                "--new-tokens",
                "6",
                "--out",
                str(out),
                "--evaluate",
                "--eval-tokens",
                "6",
            ]
        )
        == 0
    )
    head = EagleHead.load(out)
    assert head.window == 8
    assert len(head.config["training"]["tune_positions"]) == 3 and head.config["training"]["tune_positions"][0] > 0
    assert head.config["training"]["command"].startswith(
        "python -m specdec_kernels.decoding.training.eagle " + " ".join(extra + ["--random-model"])
    )
    assert head.config["training"]["hass_top_k"] == (3 if extra else 0)
    assert head.config["base_model"] == "tiny-random-llama"
    model = train_data.tiny_random_model(0)
    assert head.config["base_fingerprint"] == model_fingerprint(model)
    r = SpeculativeDecoder(model, EagleDrafter(model, head)).generate([[1, 2, 3]], 8, num_draft_tokens=3)
    assert len(r.tokens[0]) == 8
    # the ranking of the training labels and the recommended draft vocabulary (the default
    # 4096 exceeds the random model's 111 tokens: the whole vocabulary)
    assert head.token_ranking is not None and head.config["draft_vocab_size"] is None
    assert head.config["draft_vocab"]["size"] == 111 and head.config["draft_vocab"]["tune_coverage"] == 1.0
    # --draft-vocab-only: the same head, a recommended size stored, the weights untouched
    before = {k: v.clone() for k, v in head.state_dict().items()}
    assert (
        train_eagle.main(
            [
                "--random-model",
                "--new-tokens",
                "6",
                "--segment",
                "8",
                "--out",
                str(out),
                "--draft-vocab-only",
                "--draft-vocab",
                "30",
            ]
        )
        == 0
    )
    again = EagleHead.load(out)
    assert again.config["draft_vocab_size"] == 30 and again.config["draft_vocab"]["size"] == 30
    assert 0 < again.config["draft_vocab"]["tune_coverage"] <= 1
    assert again.config["draft_vocab"]["command"].endswith("--draft-vocab-only --draft-vocab 30")
    assert again.config["training"] == head.config["training"]
    assert torch.equal(again.token_ranking, head.token_ranking)
    for k, v in again.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert EagleDrafter(model, again).draft_vocab.numel() == 30
    with pytest.raises(SystemExit):
        train_eagle.parse_args(["--draft-vocab-only", "--out", str(tmp_path / "none.pt")])
    with pytest.raises(SystemExit):
        train_eagle.parse_args(["--draft-vocab", "-1"])


# ---------------------------------------------------------------------------- the shipped head
@pytest.fixture(scope="module")
def real():
    return real_greedy(["Give three tips for staying healthy.", "Write a haiku about the sea."])


@real_only
def test_shipped_head_loads(real):
    model = real[0]
    assert SHIPPED.exists() and SHIPPED.stat().st_size < 16 * 2**20
    head = load_eagle_head()
    assert head.hidden_size == model.args.hidden_size
    assert head.config["base_fingerprint"] == model_fingerprint(model)
    assert head.config["training"]["command"].startswith("python -m specdec_kernels.decoding.training.eagle")
    # the recorded top-1 agreement with the target on the held-out tuning prompts (0.42 at
    # depth 1 over 11k positions; an untrained head agrees almost never), after 435k training
    # positions generated in int8 (with 960 written requests) fine-tuning the head of commit
    # 99e345c (its SHA-256 recorded), which read EAGLE-3's low-, mid- and high-level features
    # of the 30-layer target
    training = head.config["training"]
    assert training["tune_top1"][0] > 0.3 and training["train_positions"] > 400_000
    assert training["gen_numerics"] == "int8" and training["record_layers"]
    assert training["init"]["sha256"] == "191840d3a7ff45b9cdbbdba9c7ab0d42bfee80ab7815be8e0bdd1ef3e2a57f3b"
    assert training["init"]["training"]["init"]["sha256"] == (
        "8ef8719e28a89e46927f47fd911d8aac993002f10c00cfe27f768fa633b5190a"
    )
    assert head.feature_layers == (2, 15, 27) and training["feature_layers"] == [2, 15, 27]
    assert EagleHead.file_config(SHIPPED)["format"] == 2
    # the draft vocabulary: the training labels' ranking, the recommended size, the share of
    # the tuning labels it holds and the head's agreement drafting over it (recorded by the
    # training run)
    vocab = head.config["draft_vocab"]
    assert head.token_ranking is not None and head.config["draft_vocab_size"] == vocab["size"] < model.args.vocab_size
    assert vocab["tune_coverage"] > 0.8 and vocab["tune_top1"][0] > 0.3
    drafter = EagleDrafter(model)
    assert drafter.draft_vocab.numel() == vocab["size"]


@real_only
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_real_greedy_equals_plain_greedy(real, tree):
    model = real[0]
    s = real_stats_equal_to_greedy(real, EagleDrafter(model, tree=tree), 6)
    # an untrained head is accepted almost never (1.0); bench.e2e measured 1.56 (chain) and 2.26
    # (64-node tree) on 13 prompts, and these two prompts' 32 tokens give about 1.3 and 1.8
    assert s.accepted_draft_tokens > 0 and s.mean_accepted_length > (1.4 if tree else 1.15), s.mean_accepted_length


def test_training_command_fine_tunes_from_init(tmp_path, capsys):
    """--init starts from a head file's weights and records where they came from; a head of
    another window, or no file, stops the command before any data is generated."""
    first, second = tmp_path / "first.pt", tmp_path / "second.pt"
    base = ["--random-model", "--steps", "1", "--segments", "1", "--segment", "8", "--new-tokens", "4"]
    assert train_eagle.main(base + ["--out", str(first)]) == 0
    assert train_eagle.main(base + ["--out", str(second), "--init", str(first)]) == 0
    a, b = EagleHead.load(first), EagleHead.load(second)
    init = b.config["training"]["init"]
    assert init["file"] == str(first) and init["training"]["command"] == a.config["training"]["command"]
    assert init["sha256"] == hashlib.sha256(first.read_bytes()).hexdigest()
    assert any(not torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    for extra, message in (
        (["--segment", "16", "--init", str(first)], "window is 8"),
        (["--init", str(tmp_path / "none.pt")], "--init"),
        (["--init", str(first), "--segment", "8", "--intermediate-size", "32"], "--intermediate-size"),
    ):
        with pytest.raises(SystemExit) as e:
            train_eagle.main(["--random-model", "--out", str(second)] + extra)
        assert e.value.code == 2 and message in capsys.readouterr().err
