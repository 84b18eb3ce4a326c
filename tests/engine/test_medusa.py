"""Medusa heads (Cai et al. 2024): the residual blocks by hand, zero-initialised heads equal
the base head, save/load, the tree built from choice paths, the hidden state the engine hands
over (prefill and the last accepted node of chains and trees), greedy equivalence and the
output distribution when sampling on a tiny random Llama, the training command end to end
on a tiny model, the tree tuning, the held-out split; on SmolLM2-135M-Instruct the shipped
heads: they load, draft, and chain / tree decoding equals plain greedy decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec_kernels.decoding import Draft, Drafter, SamplingParams, SpeculativeDecoder
from specdec_kernels.decoding.drafters.head_file import model_fingerprint
from specdec_kernels.decoding.drafters.medusa import (
    SHIPPED,
    MedusaDrafter,
    MedusaHeads,
    load_medusa_heads,
)
from specdec_kernels.decoding.training import medusa as train_medusa
from specdec_kernels.decoding.training.softmax import TrainingOptions
from specdec_kernels.tree import medusa_choices_to_tree
from tests.engine import drive
from tests.engine.heads import HIDDEN, PROMPTS, final_hidden, tiny, train_prompts  # noqa: F401 (fixture)
from tests.engine.tiny import V, exact_marginals, real_greedy, real_only, real_stats_equal_to_greedy
from tests.utils import P_THRESHOLD, chi_square_pvalue, one_thread  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")


def random_heads(k=3, seed=0, scale=0.3, conditioned=False, context=0):
    heads = MedusaHeads(HIDDEN, k, token_conditioned=conditioned, context_window=context)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return heads


def path_embeddings(model, ids, k):
    """(T, k, hidden): for every position t of ids, the input embeddings of ids[t + 1 ..
    t + k] (the root and the path below it; the last token repeated past the end)."""
    T = len(ids)
    idx = (torch.arange(T)[:, None] + 1 + torch.arange(k)).clamp(max=T - 1)
    return model.tok_embeddings.weight.detach()[torch.tensor(ids)[idx]]


@pytest.fixture(scope="module")
def tiny_data(tiny):
    with torch.inference_mode():
        data = train_medusa.generate_data(tiny, train_prompts(), 24, 16, [], "tiny")
    return train_medusa.examples(data, 3, output_weight=tiny.output.weight)


def train_on_tiny_data(heads, tiny, ex, *, steps, distill, **options):
    """``train_heads`` on ``tiny_data`` with its path tokens and the target's soft labels
    (batch 128, lr 1e-2, seed 0)."""
    return train_medusa.train_heads(
        heads,
        tiny.output.weight,
        ex.hidden,
        ex.labels,
        TrainingOptions(steps=steps, lr=1e-2, seed=0, distill=distill),
        batch=128,
        tokens=ex.path,
        embedding=tiny.tok_embeddings.weight,
        teacher=ex.teacher,
        teacher_states=ex.states,
        **options,
    )


@pytest.fixture(scope="module", params=["medusa", "conditioned", "context"])
def trained_heads(tiny, tiny_data, request):
    """Heads (plain Medusa, token-conditioned, or token-conditioned with a context layer of
    window 6) self-distilled on the tiny model's greedy continuations of ``train_prompts()``
    (a random-weight model has nothing to generalise: the tests that need accepted drafts
    decode these same prompts)."""
    ex = tiny_data
    heads = MedusaHeads(
        HIDDEN, 3, token_conditioned=request.param != "medusa", context_window=6 if request.param == "context" else 0
    )
    train_on_tiny_data(
        heads, tiny, ex, steps=300, distill=0.0, context=ex if request.param == "context" else None, segment=8
    )
    return heads


def test_distillation_fits_the_target_distribution(tiny, tiny_data):
    """Soft labels (distill=1) bring the heads' distributions closer to the target's own
    (KL on the training positions) than its argmax alone (distill=0), with the same steps."""
    ex = tiny_data
    W_out = tiny.output.weight.detach()
    kl = {}
    for distill in (0.0, 1.0):
        heads = MedusaHeads(HIDDEN, 3, token_conditioned=True)
        train_on_tiny_data(heads, tiny, ex, steps=200, distill=distill)
        with torch.no_grad():
            logp = heads.logits(ex.hidden.float(), W_out, embeddings=tiny.tok_embeddings.weight[ex.path]).log_softmax(
                -1
            )
            has = ex.teacher >= 0
            target = (ex.states[ex.teacher.clamp(min=0)].float() @ W_out.T).log_softmax(-1)
            kl[distill] = ((target.exp() * (target - logp)).sum(-1) * has).sum().item() / has.sum().item()
    assert kl[1.0] < 0.8 * kl[0.0], kl


# ---------------------------------------------------------------------------- the heads
@pytest.mark.parametrize("k", [1, 3, 5], ids=lambda k: f"k{k}")
def test_heads_by_hand(k):
    heads = random_heads(k, seed=k)
    h = torch.randn(2, 7, HIDDEN)
    out = heads(h)
    assert out.shape == (2, 7, k, HIDDEN)
    for i in range(k):
        torch.testing.assert_close(out[:, :, i], h + F.silu(h @ heads.weight[i].T))
    W_out = torch.randn(V, HIDDEN)
    torch.testing.assert_close(
        heads.logits(h, W_out, num_heads=min(k, 2)), out[:, :, : min(k, 2)] @ W_out.T, rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("k", [1, 3, 5], ids=lambda k: f"k{k}")
def test_conditioned_heads_by_hand(k):
    """s_{i+1} = s_i + SiLU(W_i s_i + U_i e_i + b_i) from s_0 = h; ``forward`` chains the
    steps over the given path embeddings, ``logits`` reads every state out."""
    heads = random_heads(k, seed=k, conditioned=True)
    h, emb = torch.randn(2, 7, HIDDEN), torch.randn(2, 7, k, HIDDEN)
    out = heads(h, embeddings=emb)
    assert out.shape == (2, 7, k, HIDDEN)
    s = h
    for i in range(k):
        s = s + F.silu(s @ heads.weight[i].T + emb[:, :, i] @ heads.token_weight[i].T + heads.bias[i])
        torch.testing.assert_close(out[:, :, i], s, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(heads.step(i, out[:, :, i - 1] if i else h, emb[:, :, i]), s, rtol=1e-4, atol=1e-4)
    W_out = torch.randn(V, HIDDEN)
    m = min(k, 2)
    torch.testing.assert_close(
        heads.logits(h, W_out, num_heads=m, embeddings=emb), out[:, :, :m] @ W_out.T, rtol=1e-5, atol=1e-4
    )
    # a head only sees the path up to its own token: later embeddings do not change it
    emb2 = emb.clone()
    emb2[:, :, k - 1] += 1.0
    torch.testing.assert_close(heads(h, embeddings=emb2)[:, :, : k - 1], out[:, :, : k - 1])


@pytest.mark.parametrize("conditioned", [False, True], ids=["medusa", "conditioned"])
def test_zero_heads_equal_the_base_head(tiny, conditioned):
    """A fresh head is the base head: on the hidden state of position t its argmax is the
    target's own next token (t + 1), i.e. the token head i should predict i + 1 positions
    later: untrained heads lag by i + 1."""
    heads = MedusaHeads(HIDDEN, 4, token_conditioned=conditioned)
    assert all(torch.count_nonzero(p) == 0 for p in heads.parameters())
    ids = [5, 17, 33, 2, 90, 41, 7, 8]
    h = final_hidden(tiny, ids)
    emb = path_embeddings(tiny, ids, 4) if conditioned else None
    with torch.inference_mode():
        base = tiny(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            tiny.new_kv_cache(1, len(ids)),
            torch.zeros(1, dtype=torch.int32),
        )[0]
        logits = heads.logits(h, tiny.output.weight, embeddings=emb)  # (T, 4, V)
    for i in range(4):
        torch.testing.assert_close(logits[:, i], base, rtol=1e-5, atol=1e-4)
        assert torch.equal(logits[:, i].argmax(-1), base.argmax(-1))


def test_save_load_round_trip(tmp_path, tiny):
    heads = random_heads(3)
    heads.config = {
        "base_model": "tiny",
        "base_fingerprint": model_fingerprint(tiny),
        "tree_choices": [[0], [1], [0, 0]],
    }
    path = tmp_path / "h.pt"
    heads.save(path)
    back = MedusaHeads.load(path)
    assert back.num_heads == 3 and back.hidden_size == HIDDEN
    assert back.config["base_fingerprint"] == model_fingerprint(tiny)
    assert back.tree_choices == [(0,), (1,), (0, 0)]
    torch.testing.assert_close(back.weight, heads.weight.detach().half().float())
    assert not back.token_conditioned
    assert path.stat().st_size < 2 * 3 * HIDDEN * HIDDEN + 4096  # fp16


def test_conditioned_save_load_round_trip(tmp_path):
    heads = random_heads(2, seed=4, conditioned=True)
    heads.save(tmp_path / "c.pt")
    back = MedusaHeads.load(tmp_path / "c.pt")
    assert back.token_conditioned and back.num_heads == 2
    for name, p in heads.named_parameters():
        torch.testing.assert_close(getattr(back, name), p.detach().half().float())
    h, emb = torch.randn(3, HIDDEN), torch.randn(3, 2, HIDDEN)
    torch.testing.assert_close(back(h, embeddings=emb), heads(h, embeddings=emb), rtol=1e-2, atol=1e-2)


def test_format_1_files_still_load(tmp_path):
    """Files written before token-conditioned heads (format 1: one 'weight' tensor)."""
    w = torch.randn(2, HIDDEN, HIDDEN).half()
    torch.save(
        {
            "config": {"format": 1, "hidden_size": HIDDEN, "num_heads": 2, "tree_choices": [[0]]},
            "state_dict": {"weight": w},
        },
        tmp_path / "old.pt",
    )
    back = MedusaHeads.load(tmp_path / "old.pt")
    assert not back.token_conditioned and back.tree_choices == [(0,)]
    torch.testing.assert_close(back.weight, w.float())
    torch.save(
        {"config": {"format": 99, "hidden_size": HIDDEN, "num_heads": 2}, "state_dict": {"weight": w}},
        tmp_path / "new.pt",
    )
    with pytest.raises(ValueError, match="format 99"):
        MedusaHeads.load(tmp_path / "new.pt")


def test_bad_arguments(tmp_path, tiny):
    with pytest.raises(ValueError, match="num_heads"):
        MedusaHeads(HIDDEN, 0)
    with pytest.raises(ValueError, match="hidden"):
        MedusaHeads(HIDDEN, 2)(torch.zeros(3, HIDDEN + 1))
    with pytest.raises(ValueError, match="num_heads"):
        MedusaHeads(HIDDEN, 2)(torch.zeros(3, HIDDEN), num_heads=3)
    conditioned = MedusaHeads(HIDDEN, 2, token_conditioned=True)
    with pytest.raises(ValueError, match="need embeddings"):
        conditioned(torch.zeros(3, HIDDEN))
    with pytest.raises(ValueError, match="embeddings must have shape"):
        conditioned(torch.zeros(3, HIDDEN), embeddings=torch.zeros(3, 1, HIDDEN))
    with pytest.raises(ValueError, match="embeddings must have shape"):
        conditioned(torch.zeros(3, HIDDEN), embeddings=torch.zeros(4, 2, HIDDEN))
    with pytest.raises(ValueError, match="only for token-conditioned"):
        MedusaHeads(HIDDEN, 2)(torch.zeros(3, HIDDEN), embeddings=torch.zeros(3, 2, HIDDEN))
    with pytest.raises(ValueError, match="token-conditioned"):
        MedusaHeads(HIDDEN, 2).step(0, torch.zeros(HIDDEN), torch.zeros(HIDDEN))
    with pytest.raises(ValueError, match="i must lie"):
        conditioned.step(2, torch.zeros(HIDDEN), torch.zeros(HIDDEN))
    with pytest.raises(ValueError, match="last dimension"):
        conditioned.step(0, torch.zeros(HIDDEN), torch.zeros(HIDDEN + 1))
    X, Y = torch.zeros(4, HIDDEN), torch.zeros(4, 2, dtype=torch.int64)
    one, soft = TrainingOptions(steps=1, lr=1e-3, seed=0), TrainingOptions(steps=1, lr=1e-3, seed=0, distill=1.0)
    with pytest.raises(ValueError, match="Y"):
        train_medusa.train_heads(MedusaHeads(HIDDEN, 3), tiny.output.weight, X, Y, one, batch=2)
    with pytest.raises(ValueError, match="tokens must have"):
        train_medusa.train_heads(
            conditioned, tiny.output.weight, X, Y, one, batch=2, tokens=Y[:, :1], embedding=tiny.tok_embeddings.weight
        )
    with pytest.raises(ValueError, match="teacher must have"):
        train_medusa.train_heads(
            MedusaHeads(HIDDEN, 2), tiny.output.weight, X, Y, soft, batch=2, teacher=Y[:3], teacher_states=X
        )
    with pytest.raises(ValueError, match="teacher rows"):
        train_medusa.train_heads(
            MedusaHeads(HIDDEN, 2), tiny.output.weight, X, Y, soft, batch=2, teacher=Y + 4, teacher_states=X
        )
    torch.save(
        {
            "config": {"format": 2, "hidden_size": HIDDEN, "num_heads": 2, "token_conditioned": True},
            "state_dict": {"weight": torch.zeros(2, HIDDEN, HIDDEN)},
        },
        tmp_path / "half.pt",
    )
    with pytest.raises(ValueError, match="do not fit"):
        MedusaHeads.load(tmp_path / "half.pt")
    for heads, options, match in (
        (MedusaHeads(HIDDEN, 2), dict(distill=0.5), "distill"),
        (conditioned, {}, "tokens"),
    ):
        with pytest.raises(ValueError, match=match):
            train_medusa.train_heads(
                heads, tiny.output.weight, X, Y, TrainingOptions(steps=1, lr=1e-3, seed=0, **options), batch=2
            )
    for field, value, match in (
        ("distill", 1.5, "distill must lie"),
        ("steps", 0, "steps must be"),
        ("lr", 0.0, "lr must be"),
        ("weight_decay", -1.0, "weight_decay must be"),
        ("frequent", -1, "frequent must be"),
        ("negatives", -1, "negatives must be"),
    ):
        with pytest.raises(ValueError, match=match):
            TrainingOptions(**{"steps": 1, "lr": 1e-3, "seed": 0, field: value})
    with pytest.raises(ValueError, match="hidden size"):
        MedusaDrafter(tiny, MedusaHeads(HIDDEN * 2, 2))
    with pytest.raises(ValueError, match="choices"):
        MedusaDrafter(tiny, MedusaHeads(HIDDEN, 2), tree=True, choices=[[0, 0, 0]])
    with pytest.raises(ValueError, match="max_nodes"):
        MedusaDrafter(tiny, MedusaHeads(HIDDEN, 2), max_nodes=0)
    torch.save({"weight": torch.zeros(2)}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="not a Medusa heads file"):
        MedusaHeads.load(tmp_path / "x.pt")
    heads = MedusaHeads(HIDDEN, 2, config={"base_model": "other", "base_fingerprint": "0" * 16})
    with pytest.warns(UserWarning, match="different model"):
        MedusaDrafter(tiny, heads)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_heads_are_named_with_the_fix(tmp_path, tiny, bad):
    """Medusa heads with a NaN or infinite weight are refused like an EAGLE head's: a
    ValueError naming the heads, their file, the weight and the fix (the drafter used to take
    them and draft tokens from NaN scores)."""
    random_heads().save(tmp_path / "h.pt")
    for source in (None, str(tmp_path / "h.pt")):
        heads = random_heads() if source is None else MedusaHeads.load(source)
        with torch.no_grad():
            heads.weight.view(-1)[7] = bad
        with pytest.raises(ValueError) as e:
            MedusaDrafter(tiny, heads)
        message = str(e.value)
        assert "non-finite weights in the Medusa heads" in message and "'weight': 1 of " in message, message
        assert "use a head with finite weights" in message and "quantize_head" not in message, message
        assert (source is None) or f"({source})" in message, message
    MedusaDrafter(tiny, random_heads())  # finite heads are taken


# ---------------------------------------------------------------------------- drafting
class StepDrafter(MedusaDrafter):
    """Records, for each propose, the hidden state it got and its position (root - 1)."""

    def observe(self, result):
        super().observe(result)
        if result.started:
            self.seen = []

    def propose(self, request):
        if self._hidden is not None:
            for b, h in enumerate(request.histories):
                if request.active[b] and self._known[b]:
                    self.seen.append((b, len(h) - 2, self._hidden[b].clone()))
        return super().propose(request)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_drafts_are_the_heads_top_tokens(tiny, tree):
    heads = random_heads(3, seed=1)
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]
    drafter = MedusaDrafter(tiny, heads, tree=tree, choices=choices)
    prompts = [[5, 17, 33, 2, 90, 41, 7], [64, 3, 9]]
    hidden = torch.randn(2, HIDDEN)
    run = drive.start(drafter, prompts, capacity=64, features=drive.features(hidden, [True, True]))
    draft = drafter.propose(drive.request(prompts, [3, 2], run, [True, True]))
    top = (heads(hidden) @ tiny.output.weight.T).topk(3, dim=-1).indices  # (2, 3 heads, 3)
    assert draft.tokens[:, 0].tolist() == [7, 9]
    if not tree:
        assert draft.is_chain and draft.num_nodes.tolist() == [4, 3]
        assert draft.tokens[0, 1:4].tolist() == top[0, :, 0].tolist()
        assert draft.tokens[1, 1:3].tolist() == top[1, :2, 0].tolist()
        return
    t = medusa_choices_to_tree(choices)
    assert draft.parents[0].tolist() == t.parents.tolist()
    assert draft.num_nodes.tolist() == [9, 7]  # sequence 1 asked for depth 2
    for i in range(1, 9):
        d, r = int(t.depths[i]), int(t.topk_index[i])
        assert draft.tokens[0, i] == top[0, d - 1, r]
    # a sequence without a hidden state, or inactive, gets no drafts
    run = drive.start(drafter, prompts, capacity=64, features=drive.features(hidden, [True, False]))
    assert drafter.propose(drive.request(prompts, [3, 3], run, [True, True])).num_nodes.tolist() == [9, 1]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_conditioned_drafts_follow_each_path(tiny, tree):
    """Token-conditioned heads: a node's children are the ranked tokens of the head state
    reached along the path to that node (root included), recomputed here node by node."""
    heads = random_heads(3, seed=2, conditioned=True)
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [1, 0, 0]]
    drafter = MedusaDrafter(tiny, heads, tree=tree, choices=choices)
    prompts = [[5, 17, 33, 2, 90, 41, 7], [64, 3, 9], [8]]
    hidden = torch.randn(3, HIDDEN)
    run = drive.start(drafter, prompts, capacity=64, features=drive.features(hidden, [True, True, True]))
    draft = drafter.propose(drive.request(prompts, [3, 2, 1], run, [True, True, True]))
    E, W_out = tiny.tok_embeddings.weight.detach(), tiny.output.weight.detach()

    def ranked(b, path):  # the head state after the path (root first), then its ranking
        state = hidden[b]
        for i, tok in enumerate(path):
            state = heads.step(i, state, E[tok])
        return (W_out @ state.float()).argsort(descending=True)

    assert draft.tokens[:, 0].tolist() == [7, 9, 8]
    if not tree:
        assert draft.is_chain and draft.num_nodes.tolist() == [4, 3, 2]
        for b in range(3):
            path = [prompts[b][-1]]
            for j in range(1, int(draft.num_nodes[b])):
                assert int(draft.tokens[b, j]) == int(ranked(b, path)[0])
                path.append(int(draft.tokens[b, j]))
        return
    t = medusa_choices_to_tree(choices)
    assert draft.num_nodes.tolist() == [11, 8, 4]
    for b in range(3):
        for i in range(1, int(draft.num_nodes[b])):
            path, p = [], int(t.parents[i])
            while p >= 0:
                path.insert(0, int(draft.tokens[b, p]))
                p = int(t.parents[p])
            assert int(draft.tokens[b, i]) == int(ranked(b, path)[int(t.topk_index[i])]), (b, i)


class TreeOracle(Drafter):
    """Drafts a wrong first child, then the right path (known greedy output) as the second
    child's chain: the last accepted node's index differs from its depth."""

    wants_hidden = True

    def __init__(self, prompts, future, depth=3):
        self.prompts, self.future, self.depth = prompts, future, depth

    def observe(self, result):
        super().observe(result)
        if result.started:
            self.seen = []
            self._pending = None
        if result.features is not None:
            self._pending = (result.features.last.clone(), list(result.features.valid))

    def propose(self, request):
        histories, active = request.histories, request.active
        if self._pending is not None:
            hidden, known = self._pending
            for b, h in enumerate(histories):
                if active[b] and known[b]:
                    self.seen.append((b, len(h) - 2, hidden[b]))
        trees = []
        for b, h in enumerate(histories):
            done = len(h) - len(self.prompts[b])
            right = self.future[b][done : done + self.depth]
            if not right or not active[b]:
                trees.append(([h[-1]], [-1]))
                continue
            wrong = (right[0] + 1) % V
            trees.append(([h[-1], wrong] + right, [-1, 0, 0] + list(range(2, len(right) + 1))))
        return Draft.from_lists(trees, is_chain=False)


@pytest.mark.parametrize("kind", ["medusa-chain", "medusa-tree", "oracle-tree"])
def test_engine_hands_over_the_last_accepted_hidden_state(tiny, kind):
    """Every hidden state a drafter receives is the target's final hidden state of the
    position before the root, as a teacher-forced forward over the final text gives it
    (after the prefill: the prompt's second-to-last token; one-token prompts get none)."""
    plain = SpeculativeDecoder(tiny).generate(PROMPTS, 14).tokens
    if kind == "oracle-tree":
        drafter = TreeOracle(PROMPTS, [g + [0] * 8 for g in plain])
    else:
        drafter = StepDrafter(tiny, random_heads(3), tree=kind == "medusa-tree")
    result = SpeculativeDecoder(tiny, drafter).generate(PROMPTS, 14, num_draft_tokens=3)
    assert result.tokens == plain
    if kind == "oracle-tree":
        assert result.stats.accepted_draft_tokens > 0.8 * result.stats.draft_tokens / 2
    positions = {b: [] for b in range(len(PROMPTS))}
    for b, pos, h in drafter.seen:
        full = PROMPTS[b] + plain[b]
        torch.testing.assert_close(h, final_hidden(tiny, full)[pos], rtol=1e-4, atol=1e-4)
        positions[b].append(pos)
    for b, p in enumerate(PROMPTS):
        assert (positions[b][0] == len(p) - 2) == (len(p) >= 2)  # the prefill's hidden state
        assert positions[b] == sorted(set(positions[b])) and len(positions[b]) >= 2


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("k", [1, 2, 5], ids=lambda k: f"K{k}")
def test_greedy_equals_plain_greedy(tiny, trained_heads, tree, k):
    """Ragged batch with a one-token prompt; K above the number of heads is cut to it."""
    plain = SpeculativeDecoder(tiny, stop_token_ids=[3]).generate(PROMPTS, 20)
    drafter = MedusaDrafter(tiny, trained_heads, tree=tree, choices=[[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 1]])
    result = SpeculativeDecoder(tiny, drafter, stop_token_ids=[3]).generate(PROMPTS, 20, num_draft_tokens=k)
    assert result.tokens == plain.tokens
    s = result.stats
    assert s.accepted_draft_tokens > 0
    assert len(s.proposed_at) <= min(k, 3)


def test_trained_heads_beat_zero_heads(tiny, trained_heads):
    """Self-distillation fits: on the text they were trained on, the trained heads' drafts
    are accepted far more often than untrained heads' (which lag by i + 1 tokens)."""
    mal = {}
    for name, heads in (("zero", MedusaHeads(HIDDEN, 3)), ("trained", trained_heads)):
        r = SpeculativeDecoder(tiny, MedusaDrafter(tiny, heads)).generate(train_prompts(), 24, num_draft_tokens=3)
        mal[name] = r.stats.mean_accepted_length
    assert mal["trained"] > mal["zero"] + 1.0, mal


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampling_keeps_the_target_distribution(tiny, trained_heads, tree):
    """Deterministic top-k drafts with q = None: each of the first 3 emitted tokens follows
    the target's marginal over many seeds."""
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    prompt = [5, 17, 33, 2, 90, 41, 7]
    B = 3000
    drafter = MedusaDrafter(tiny, trained_heads, tree=tree, choices=[[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]])
    result = SpeculativeDecoder(tiny, drafter).generate(
        [prompt] * B, 3, num_draft_tokens=3, sampling=sp, seeds=list(range(B))
    )
    out = torch.tensor(result.tokens)
    assert out.shape == (B, 3)
    s = result.stats
    assert s.accepted_draft_tokens > 0.1 * s.sequence_steps
    for j, marginal in enumerate(exact_marginals(tiny, prompt, sp, 3)):
        assert chi_square_pvalue(out[:, j], marginal) > P_THRESHOLD, f"token {j}"


# ---------------------------------------------------------------------------- context layer
def rope_by_hand(x, pos, theta=10000.0):
    """Rotary embedding of one vector x (head_dim,) at position pos: the pair (j, j + d/2)
    rotated by pos * theta^(-2j/d)."""
    d = x.shape[0]
    out = x.clone()
    for j in range(d // 2):
        a = pos * theta ** (-2 * j / d)
        c, s_ = torch.cos(torch.tensor(a)), torch.sin(torch.tensor(a))
        out[j] = x[j] * c - x[j + d // 2] * s_
        out[j + d // 2] = x[j + d // 2] * c + x[j] * s_
    return out


def context_by_hand(heads, hidden, nxt, valid, t):
    """s_0 at row t from the formula in ``MedusaHeads.contextualize``, loop by loop."""
    H, nh, hd, W = heads.hidden_size, heads.context_heads, heads.context_head_dim, heads.context_window
    rms = lambda v: v / torch.sqrt((v * v).mean() + 1e-6)  # noqa: E731
    C, O = heads.context_qkv.detach(), heads.context_out.detach()
    qkv = [C @ torch.cat([rms(hidden[j]), rms(nxt[j])]) for j in range(hidden.shape[0])]
    A = nh * hd
    out = torch.zeros(A)
    for n in range(nh):
        sl = slice(n * hd, (n + 1) * hd)
        q = rope_by_hand(qkv[t][:A][sl], t)
        keys = [j for j in range(hidden.shape[0]) if j <= t and t - j < W and (valid[j] or j == t)]
        scores = torch.stack([q @ rope_by_hand(qkv[j][A : 2 * A][sl], j) / hd**0.5 for j in keys])
        w = torch.softmax(scores, 0)
        out[sl] = sum(w[i] * qkv[j][2 * A :][sl] for i, j in enumerate(keys))
    return hidden[t] + O @ out


def test_context_layer_by_hand():
    """Window 3, 2 heads of dimension 4 on hidden size 6: the last 2 of 5 rows as queries,
    one padding row; rows outside the window or invalid do not matter; a shifted start
    position gives the same result (relative positions only)."""
    g = torch.Generator().manual_seed(7)
    heads = MedusaHeads(6, 2, context_window=3, context_heads=2, context_head_dim=4)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    assert heads.context_qkv.shape == (24, 12) and heads.context_out.shape == (6, 8)
    hidden, nxt = torch.randn(1, 5, 6, generator=g), torch.randn(1, 5, 6, generator=g)
    valid = torch.tensor([[True, True, False, True, True]])
    out = heads.contextualize(hidden, nxt, valid, num_queries=2)
    assert out.shape == (1, 2, 6)
    for i, t in enumerate((3, 4)):
        torch.testing.assert_close(
            out[0, i], context_by_hand(heads, hidden[0], nxt[0], valid[0], t), rtol=1e-4, atol=1e-4
        )
    # row 0 is outside both windows, row 2 invalid: changing them changes nothing
    h2, n2 = hidden.clone(), nxt.clone()
    h2[0, 0] += 5
    h2[0, 2] -= 3
    n2[0, 2] += 1
    torch.testing.assert_close(heads.contextualize(h2, n2, valid, num_queries=2), out)
    # three invalid rows in front (a later start): the same queries
    pad = torch.randn(1, 3, 6, generator=g)
    shifted = heads.contextualize(
        torch.cat([pad, hidden], 1),
        torch.cat([pad, nxt], 1),
        torch.cat([torch.zeros(1, 3, dtype=torch.bool), valid], 1),
        num_queries=2,
    )
    torch.testing.assert_close(shifted, out, rtol=1e-4, atol=1e-5)


def test_fresh_context_layer_is_the_identity():
    heads = MedusaHeads(HIDDEN, 2, token_conditioned=True, context_window=4)
    assert torch.count_nonzero(heads.context_qkv) > 0 and torch.count_nonzero(heads.context_out) == 0
    h = torch.randn(3, 5, HIDDEN)
    torch.testing.assert_close(heads.contextualize(h, torch.randn(3, 5, HIDDEN), num_queries=5), h)


def test_context_save_load_round_trip(tmp_path):
    heads = random_heads(2, seed=5, conditioned=True, context=4)
    heads.save(tmp_path / "ctx.pt")
    back = MedusaHeads.load(tmp_path / "ctx.pt")
    assert (back.context_window, back.context_heads, back.context_head_dim) == (4, 1, 64)
    for name, p in heads.named_parameters():
        torch.testing.assert_close(getattr(back, name), p.detach().half().float())
    # a format-2 file (no context layer) still loads
    state = {k: v.half() for k, v in random_heads(2, seed=6, conditioned=True).state_dict().items()}
    torch.save(
        {
            "config": {"format": 2, "hidden_size": HIDDEN, "num_heads": 2, "token_conditioned": True},
            "state_dict": state,
        },
        tmp_path / "f2.pt",
    )
    old = MedusaHeads.load(tmp_path / "f2.pt")
    assert old.token_conditioned and old.context_window == 0
    # heads without a context layer are still written as format 2
    old.save(tmp_path / "again.pt")
    assert torch.load(tmp_path / "again.pt", weights_only=True)["config"]["format"] == 2
    torch.save(
        {"config": {"format": 3, "hidden_size": HIDDEN, "num_heads": 2, "context_window": 4}, "state_dict": state},
        tmp_path / "broken.pt",
    )
    with pytest.raises(ValueError, match="config"):
        MedusaHeads.load(tmp_path / "broken.pt")


def test_context_bad_arguments(tiny):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="context_window"):
            MedusaHeads(HIDDEN, 2, context_window=bad)
    with pytest.raises(ValueError, match="context_heads"):
        MedusaHeads(HIDDEN, 2, context_window=2, context_heads=0)
    with pytest.raises(ValueError, match="context_head_dim"):
        MedusaHeads(HIDDEN, 2, context_window=2, context_head_dim=5)
    with pytest.raises(ValueError, match="context layer"):
        MedusaHeads(HIDDEN, 2).contextualize(torch.zeros(1, 2, HIDDEN), torch.zeros(1, 2, HIDDEN))
    heads = MedusaHeads(HIDDEN, 2, token_conditioned=True, context_window=3)
    with pytest.raises(ValueError, match="next_embeddings"):
        heads.contextualize(torch.zeros(1, 2, HIDDEN), torch.zeros(1, 3, HIDDEN))
    with pytest.raises(ValueError, match="num_queries"):
        heads.contextualize(torch.zeros(1, 2, HIDDEN), torch.zeros(1, 2, HIDDEN), num_queries=3)
    with pytest.raises(ValueError, match="valid"):
        heads.contextualize(torch.zeros(1, 2, HIDDEN), torch.zeros(1, 2, HIDDEN), torch.ones(1, 2))
    X, Y = torch.zeros(4, HIDDEN), torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="context"):
        train_medusa.train_heads(
            heads,
            tiny.output.weight,
            X,
            Y,
            TrainingOptions(steps=1, lr=1e-3, seed=0),
            batch=2,
            tokens=Y,
            embedding=tiny.tok_embeddings.weight,
        )


def test_context_states_stay_inside_each_sequence(tiny, tiny_data):
    """Training and tuning windows (``context_batch`` / ``context_states``) on the data
    layout of ``generate_data`` (example rows run on from one sequence into the next): each
    example's s_0 equals the context layer over its own sequence's rows alone, and a run of
    queries drawn across a sequence boundary does not count past it."""
    ex, W = tiny_data, 6
    heads = random_heads(3, seed=8, conditioned=True, context=W)
    E = tiny.tok_embeddings.weight.detach()
    seq = ex.seq_start[ex.rows]
    b = int((seq != seq[0]).nonzero()[0])  # the first example of the second sequence
    assert int(ex.rows[b]) == int(ex.rows[b - 1]) + 1  # no gap in the rows: the case to get right
    Z = train_medusa.context_states(heads, E, ex, segment=5)
    for m in range(ex.rows.shape[0]):
        r = int(ex.rows[m])
        lo = max(int(ex.seq_start[r]), r - W + 1)
        z = heads.contextualize(ex.states[lo : r + 1].float()[None], E[ex.next_tokens[lo : r + 1]][None])[0, 0]
        torch.testing.assert_close(Z[m], z, rtol=1e-4, atol=1e-4)
    z, cont = train_medusa.context_batch(heads, E, ex, ex.rows[b - 2 : b + 2][None])
    assert cont.tolist() == [[True, True, False, False]]
    torch.testing.assert_close(z[0, :2], Z[b - 2 : b], rtol=1e-4, atol=1e-4)
    assert train_medusa.run_starts(ex)[b] and not train_medusa.run_starts(ex)[b + 1]


class ContextOracle(TreeOracle):
    """TreeOracle (the last accepted node's index differs from its depth) that also takes
    the committed positions' hidden states (``StepResult.features.context``)."""

    context_window = 4

    def observe(self, result):
        super().observe(result)
        if result.started:
            self.context = []
        f = result.features
        if f is not None and f.context is not None:
            for b, (rows, first, a) in enumerate(zip(f.context, f.context_positions, f.valid)):
                if a and rows is not None:
                    self.context.append((b, int(first), rows.clone()))


@pytest.mark.parametrize("chunk", [3, 512], ids=["chunked-prefill", "one-prefill"])
def test_engine_hands_over_the_context(tiny, chunk):
    """features.context holds the last 4 fed prompt positions after the prefill (fewer for
    short prompts, none for a one-token prompt), then every step's accepted path (root
    first), consecutive with no gap, each row the target's hidden state as a teacher-forced
    pass over the final text gives it."""
    plain = SpeculativeDecoder(tiny).generate(PROMPTS, 14).tokens
    drafter = ContextOracle(PROMPTS, [g + [0] * 8 for g in plain])
    result = SpeculativeDecoder(tiny, drafter, prefill_chunk=chunk).generate(PROMPTS, 14, num_draft_tokens=3)
    assert result.tokens == plain and result.stats.accepted_draft_tokens > 0
    for b, p in enumerate(PROMPTS):
        calls = [(first, rows) for bb, first, rows in drafter.context if bb == b]
        full = p + plain[b]
        ref = final_hidden(tiny, full)
        if len(p) == 1:
            assert all(first >= 0 for first, _ in calls) and (not calls or calls[0][0] == 0)
        else:
            assert calls[0][0] == max(0, len(p) - 1 - 4) and calls[0][0] + calls[0][1].shape[0] == len(p) - 1
        for (f1, r1), (f2, _) in zip(calls, calls[1:]):
            assert f1 + r1.shape[0] == f2  # consecutive, no gap, no overlap
        end = calls[-1][0] + calls[-1][1].shape[0]
        assert end >= len(full) - 2 - 3  # up to the last step's path
        for first, rows in calls:
            torch.testing.assert_close(rows, ref[first : first + rows.shape[0]], rtol=1e-4, atol=1e-4)


class ContextStepDrafter(MedusaDrafter):
    """Records each s_0 the context layer gives and the position it belongs to (root - 1)."""

    def observe(self, result):
        super().observe(result)
        if result.started:
            self.seen = []

    def _context_state(self, histories, depth):
        out = super()._context_state(histories, depth)
        for b, h in enumerate(histories):
            if depth[b] > 0:
                self.seen.append((b, len(h) - 2, out[b].clone()))
        return out


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_context_drafts_use_the_recent_hidden_states(tiny, tree):
    """While decoding, s_0 is the context layer over the hidden states of the last W
    positions (teacher-forced over the final text) and the tokens that followed them; the
    output stays the greedy output."""
    W = 5
    heads = random_heads(3, seed=3, conditioned=True, context=W)
    plain = SpeculativeDecoder(tiny).generate(PROMPTS, 16).tokens
    drafter = ContextStepDrafter(tiny, heads, tree=tree, choices=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    result = SpeculativeDecoder(tiny, drafter, prefill_chunk=4).generate(PROMPTS, 16, num_draft_tokens=3)
    assert result.tokens == plain
    E = tiny.tok_embeddings.weight.detach()
    counted = set()
    for b, pos, s0 in drafter.seen:
        full = PROMPTS[b] + plain[b]
        lo = max(0, pos - W + 1)
        h = final_hidden(tiny, full)[lo : pos + 1]
        nxt = E[torch.tensor(full[lo + 1 : pos + 2])]
        # fp32; the hidden states differ by ~1e-5 between chunked and one-pass prefills, which
        # the random (scale 0.3) context weights amplify
        torch.testing.assert_close(s0, heads.contextualize(h[None], nxt[None])[0, 0], rtol=1e-3, atol=1e-3)
        counted.add(b)
    assert counted == {0, 1, 2, 3}
    # the one-token prompt has no context for its first step (nothing was fed), then does
    assert min(pos for b, pos, _ in drafter.seen if b == 1) == 0


def test_multi_draft_forwards_the_context(tiny):
    from specdec_kernels.decoding import MultiDrafter, NgramDrafter

    heads = random_heads(3, seed=3, conditioned=True, context=5)
    medusa = ContextStepDrafter(tiny, heads, tree=True, choices=[[0], [1], [0, 0]])
    multi = MultiDrafter([NgramDrafter(), medusa])
    assert multi.context_window == 5 and multi.wants_hidden
    plain = SpeculativeDecoder(tiny).generate(PROMPTS, 16).tokens
    assert SpeculativeDecoder(tiny, multi).generate(PROMPTS, 16, num_draft_tokens=3).tokens == plain
    assert len(medusa.seen) > 10


# ---------------------------------------------------------------------------- training
def test_best_tree_by_hand():
    # true ranks of 4 positions for 2 heads (-1: missing label)
    ranks = torch.tensor([[0, 0], [0, 1], [1, 0], [0, -1]])
    choices, expected = train_medusa.best_tree(ranks, max_nodes=3)
    assert choices == [(0,), (1,)]  # (0,) thrice, then (1,) / (0, 0) / (0, 1) once each: shortest first
    assert expected == pytest.approx(1 + (3 + 1) / 4)
    choices, expected = train_medusa.best_tree(ranks, max_nodes=10)
    assert choices == [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    assert expected == pytest.approx(1 + (3 + 1 + 1 + 1 + 1) / 4)


def test_examples_labels_by_hand():
    """Labels: past the prompt the greedy tokens themselves; inside the prompt the target's
    argmax one position earlier (here W_out = I and one-hot hidden states make it readable)."""
    Vh = 16
    W_out = torch.eye(Vh)
    prompt, gen = [1, 2, 3, 4, 5], [6, 7, 8]
    argmax = [9, 10, 11, 12, 6, 7, 8]  # what the target predicts after positions 0..6
    hidden = F.one_hot(torch.tensor(argmax), Vh).half()  # positions 0..6 (the last token's is never recorded)
    data = train_medusa.SelfDistilled([prompt + gen], [len(prompt)], [0], [hidden])
    ex = train_medusa.examples(data, 2, prompt=True, output_weight=W_out)
    X, Y, T, teacher, states = ex[:5]
    # where each example's h_t lies, the token after each recorded position, its sequence's first row
    assert ex.rows.tolist() == [0, 1, 2, 3, 4, 5] and torch.equal(states[ex.rows], X)
    assert ex.next_tokens.tolist() == [2, 3, 4, 5, 6, 7, 8] and ex.seq_start.tolist() == [0] * 7
    # position t: head 0 -> the prediction of token t + 2 = argmax after t + 1 (prompt) or the token
    expected = [[10, 11], [11, 12], [12, 6], [6, 7], [7, 8], [8, -100]]
    assert Y.tolist() == expected and torch.equal(X, hidden[:6])
    # the path tokens (what token-conditioned heads read) are the text itself: t + 1, t + 2
    assert T.tolist() == [[2, 3], [3, 4], [4, 5], [5, 6], [6, 7], [7, 8]]
    # soft labels: head i at t reads the target's distribution at t + i + 1, whose argmax is the label
    assert teacher.tolist() == [[1, 2], [2, 3], [3, 4], [4, 5], [5, 6], [6, -1]] and torch.equal(states, hidden)
    assert torch.equal((states[teacher[:, :1]].float() @ W_out.T).argmax(-1), Y[:, :1])
    X, Y, T, teacher, states = train_medusa.examples(data, 2, prompt=False)[
        :5
    ]  # from the prompt's second-to-last token on
    assert Y.tolist() == expected[3:] and torch.equal(X, hidden[3:6]) and T.tolist() == [[5, 6], [6, 7], [7, 8]]
    assert teacher.tolist() == [[4, 5], [5, 6], [6, -1]]
    # two sequences: the second's rows are offset by the first's recorded states
    two = train_medusa.SelfDistilled([prompt + gen] * 2, [len(prompt)] * 2, [0, 0], [hidden, hidden])
    ex2 = train_medusa.examples(two, 2, prompt=False)
    assert ex2.teacher[3:].tolist() == [[11, 12], [12, 13], [13, -1]]
    assert ex2.rows.tolist() == [3, 4, 5, 10, 11, 12] and ex2.seq_start.tolist() == [0] * 7 + [7] * 7
    with pytest.raises(ValueError, match="output_weight"):
        train_medusa.examples(data, 2, prompt=True)


def test_recorded_hidden_states_match_teacher_forcing(tiny):
    """The recorder's prefill hook (chunked prefill) and the engine's hand-over give every
    position's final hidden state (fp16), as one teacher-forced pass over the text does."""
    prompts = [[7], [3, 9], [5, 17, 33, 2, 90, 41, 7], [12, 99, 8, 12, 99, 8, 12, 99, 101]]
    recorder = train_medusa.HiddenRecorder()
    with torch.inference_mode():
        recorder.prepare(tiny, prompts)
        result = SpeculativeDecoder(tiny, recorder, prefill_chunk=3, stop_token_ids=[3]).generate(
            prompts, 9, num_draft_tokens=0
        )
    for b, p in enumerate(prompts):
        full = p + result.tokens[b]
        got = torch.stack(recorder.hidden[b]).float()
        assert got.shape[0] == len(full) - 2  # the last token's own hidden state is never needed
        torch.testing.assert_close(got, final_hidden(tiny, full)[: len(full) - 2], rtol=2e-3, atol=2e-3)


def test_split_keeps_the_bench_prompts_out():
    from specdec_kernels.decoding.prompts import spec_bench_questions

    qs = spec_bench_questions()
    train, tune, bench = train_medusa.split_questions(qs, 40)
    ids = lambda x: {q["question_id"] for q in x}  # noqa: E731
    assert {81, 82} <= ids(bench) and not {81, 82, 83, 84} & ids(train)
    assert {83, 84} <= ids(tune)
    cats = {q["category"] for q in qs}
    assert len(bench) == 2 * len(cats) and len(tune) == 2 * len(cats)
    assert not (ids(train) & ids(tune)) and not (ids(train) & ids(bench)) and not (ids(tune) & ids(bench))
    for c in cats:
        first4 = [q["question_id"] for q in qs if q["category"] == c][:4]
        assert set(first4[:2]) <= ids(bench) and set(first4[2:]) <= ids(tune)
        assert sum(q["category"] == c for q in train) <= 40


@pytest.mark.parametrize("kind", ["context", "conditioned", "medusa"])
def test_training_command_end_to_end(tmp_path, kind):
    out = tmp_path / "heads.pt"
    # token-conditioned heads with a context layer of window 32 by default
    flag = {
        "context": [],
        "conditioned": ["--context-window", "0"],
        "medusa": ["--no-token-conditioned", "--context-window", "0"],
    }[kind]
    assert (
        train_medusa.main(
            [
                "--random-model",
                "--steps",
                "2",
                "--batch",
                "8",
                "--heads",
                "2",
                "--new-tokens",
                "6",
                "--tree-nodes",
                "5",
                "--out",
                str(out),
                "--seed",
                "1",
            ]
            + flag
        )
        == 0
    )
    heads = load_medusa_heads(out)
    conditioned = kind != "medusa"
    assert heads.num_heads == 2 and torch.count_nonzero(heads.weight) > 0
    assert heads.token_conditioned == conditioned and heads.config["training"]["token_conditioned"] == conditioned
    assert heads.context_window == (32 if kind == "context" else 0)
    if kind == "context":
        assert torch.count_nonzero(heads.context_out) > 0  # trained together with the heads
    cfg = heads.config
    assert cfg["base_model"] == "tiny-random-llama" and cfg["training"]["steps"] == 2 and cfg["training"]["seed"] == 1
    assert 1 <= len(heads.tree_choices) <= 4 and all(len(c) <= 2 for c in heads.tree_choices)
    model = train_medusa.tiny_random_model(1)
    assert cfg["base_fingerprint"] == model_fingerprint(model)
    plain = SpeculativeDecoder(model).generate([[1, 2, 3]], 8).tokens
    assert (
        SpeculativeDecoder(model, MedusaDrafter(model, heads, tree=True))
        .generate([[1, 2, 3]], 8, num_draft_tokens=2)
        .tokens
        == plain
    )


# ---------------------------------------------------------------------------- the real model
REAL_PROMPTS = [
    "Rename the function add to plus:\n\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Give three tips for staying healthy.",
    "Say hello.",
]


@pytest.fixture(scope="module")
def real():
    return real_greedy(REAL_PROMPTS)


@real_only
def test_shipped_heads_load_and_draft(real):
    model, tok, prompts, greedy = real
    assert SHIPPED.exists()
    heads = load_medusa_heads()
    assert heads.hidden_size == model.args.hidden_size and heads.num_heads >= 2
    assert heads.config["base_fingerprint"] == model_fingerprint(model)
    assert heads.tree_choices and len(heads.tree_choices) >= 4
    assert SHIPPED.stat().st_size < 12 * 2**20  # a few MB: 4 heads and the context layer in fp16
    drafter = MedusaDrafter(model, tree=True)
    ids = prompts[1] + greedy[1][:10]
    h = final_hidden(model, ids)
    context = positions = None
    if heads.context_window:  # the committed positions before the root, as the engine hands them over
        first = max(0, len(ids) - 1 - heads.context_window)
        context, positions = [h[first : len(ids) - 1]], [first]
    run = drive.start(drafter, [ids], features=drive.features(h[-2:-1], [True], context, positions))
    draft = drafter.propose(drive.request([ids], [heads.num_heads], run, [True]))
    assert draft.num_nodes.item() == len(heads.tree_choices) + 1
    assert draft.tokens[0, 0] == ids[-1]
    assert 0 <= int(draft.tokens.max()) < model.args.vocab_size


@real_only
def test_shipped_heads_predict_the_greedy_text(real):
    """On the target's own greedy text (teacher forced), each shipped head's argmax at t is
    the token at t + i + 2 far more often than an untrained head's (the base head, lagging)."""
    model, tok, prompts, greedy = real
    heads = load_medusa_heads()
    hits = {"trained": [0] * heads.num_heads, "zero": [0] * heads.num_heads}
    total = [0] * heads.num_heads
    for p, g in zip(prompts, greedy):
        full = p + g
        h = final_hidden(model, full)
        with torch.inference_mode():
            emb = path_embeddings(model, full, heads.num_heads) if heads.token_conditioned else None
            s0 = h
            if heads.context_window:  # every position's s_0 over its window (the last has no next token)
                nxt = model.tok_embeddings.weight[torch.tensor(full[1:])]
                s0 = heads.contextualize(h[None, :-1], nxt[None], num_queries=len(full) - 1)[0]
                s0 = torch.cat([s0, h[-1:]])  # (the last row is never scored)
            for name, hd in (("trained", heads), ("zero", MedusaHeads(heads.hidden_size, heads.num_heads))):
                x = s0 if hd is heads else h
                best = hd.logits(x, model.output.weight, embeddings=emb if hd.token_conditioned else None).argmax(
                    -1
                )  # (T, k)
                for i in range(heads.num_heads):
                    ts = range(len(p) - 2, len(full) - i - 2)
                    hits[name][i] += sum(int(best[t, i]) == full[t + i + 2] for t in ts)
        for i in range(heads.num_heads):
            total[i] += len(range(len(p) - 2, len(full) - i - 2))
    acc = {n: [x / t for x, t in zip(v, total)] for n, v in hits.items()}
    # The shipped heads' head-0 top-1 accuracy on the held-out tuning prompts is about 0.2
    # (``config["training"]["tune_top1"]``) against about 0.02 for the lagging base head.
    # Here ~90 positions: a binomial standard deviation of about 0.04 at p = 0.2, so a
    # margin of 0.06 sits some 3 standard deviations below the expected gap of ~0.18.
    assert heads.config["training"]["tune_top1"][0] > 0.15
    assert acc["trained"][0] > acc["zero"][0] + 0.06, acc
    assert sum(acc["trained"]) > sum(acc["zero"]) + 0.08, acc


@real_only
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_real_greedy_equals_plain_greedy(real, tree):
    model = real[0]
    s = real_stats_equal_to_greedy(real, MedusaDrafter(model, tree=tree), 4)
    assert s.accepted_draft_tokens > 0 and s.mean_accepted_length > 1.0


@pytest.mark.parametrize("conditioned", [False, True], ids=["plain-heads", "token-conditioned"])
@pytest.mark.parametrize(
    "verify_cost, expect_small", [((1.0, 0.5), True), ((1.0, 0.0), False)], ids=["steep-cpu", "flat-gpu"]
)
def test_medusa_tree_is_sized_by_the_cost_and_stays_greedy(tiny, conditioned, verify_cost, expect_small):
    """``size_by_cost`` (the default): each step keeps the nodes of highest path probability
    that pay against the pass cost.  A steep cost (each extra token half a pass) keeps small
    trees, a flat one the whole tree up to depth K; a kept node's parent is always kept (the
    trees are valid) and the output is plain greedy either way."""
    from specdec_kernels.decoding.engine.adaptive import CostModelPolicy

    plain = SpeculativeDecoder(tiny).generate(PROMPTS, 12, 0).tokens
    drafter = MedusaDrafter(tiny, random_heads(3, conditioned=conditioned), tree=True, check_fingerprint=False)
    full = len(drafter.tree_parents)
    sizes = []
    original = drafter._tree_draft

    def recording(*args, **kwargs):
        draft = original(*args, **kwargs)
        sizes.extend(int(n) for n in draft.num_nodes)
        return draft

    drafter._tree_draft = recording
    policy = CostModelPolicy(0, 3, warmup=0, explore_every=0, draft_cost=(0.0, 0.01), verify_cost=verify_cost)
    decoder = SpeculativeDecoder(tiny, drafter)
    out = decoder.generate(PROMPTS, 12, policy)
    assert out.tokens == plain
    drafted = [n for n in sizes if n > 1]
    assert drafted
    if expect_small:
        assert max(drafted) <= 4 < full
    else:
        assert max(drafted) == full  # depth 3 reaches every node of the 3-head tree
    # the budget read the run's calibration, the policy's; the next run (a fixed K) binds none
    assert drafter.budget.calibration is policy.calibration
    decoder.generate(PROMPTS, 4, 2)
    assert drafter.budget.calibration is None and drafter.budget.paths is None
    with pytest.raises(TypeError, match="size_by_cost"):
        MedusaDrafter(tiny, random_heads(3), tree=True, size_by_cost=1)
    assert MedusaDrafter(tiny, random_heads(3), tree=True, size_by_cost=False).budget is None
