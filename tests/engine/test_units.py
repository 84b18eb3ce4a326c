"""Pieces of the decoding engine without a model: n-gram lookup, the n-gram drafter's drafts,
static draft trees, Draft helpers, statistics."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import DecodeStats, Draft, NgramDrafter, ngram_continuations
from specdec_kernels.decoding.draft import chain_parents
from specdec_kernels.decoding.drafters.model_drafter import tree_shape
from specdec_kernels.tree import ancestor_mask
from tests.engine.drive import request, run_for

#               0  1  2  3  4  5  6  7  8  9 10 11
HISTORY = [5, 6, 7, 8, 5, 6, 9, 1, 5, 6, 7, 2, 5, 6]


def test_longest_then_most_recent_match():
    # suffix (5, 6): occurrences at 0, 4, 8 -> most recent first: continuations after 8, 4, 0
    assert ngram_continuations(HISTORY, 3, max_ngram=2) == [[7, 2, 5]]
    assert ngram_continuations(HISTORY, 3, max_ngram=2, limit=3) == [[7, 2, 5], [9, 1, 5], [7, 8, 5]]
    # a 3-gram (2, 5, 6) never occurred before: the 2-gram decides
    assert ngram_continuations(HISTORY, 2, max_ngram=3) == [[7, 2]]
    # the 1-gram (6,) adds matches only after all 2-gram ones
    assert ngram_continuations(HISTORY, 1, max_ngram=2, limit=5) == [[7], [9]]  # [7] again is dropped


def test_continuation_limits():
    assert ngram_continuations(HISTORY, 8, max_ngram=2)[0] == [7, 2, 5, 6]  # stops at the end of the history
    assert ngram_continuations(HISTORY, 8, max_ngram=2, tokens_per_match=1) == [[7, 2]]
    assert ngram_continuations(HISTORY, 0, max_ngram=2) == []
    assert ngram_continuations([1, 2, 3], 4) == []  # no earlier occurrence of 3
    assert ngram_continuations([4], 4) == []
    # a continuation that is a prefix of one already found adds nothing
    assert ngram_continuations([1, 2, 1, 2, 3, 1], 2, max_ngram=1, limit=4) == [[2, 3], [2, 1]]


def _brute_continuations(history, max_tokens, max_ngram, min_ngram, limit):
    """ngram_continuations' rule written out with plain loops (the reference of the numpy search)."""
    found = []
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        suffix = history[-n:]
        for start in range(len(history) - 1 - n, -1, -1):  # most recent first, ends before the last
            if history[start : start + n] != suffix:
                continue
            cont = history[start + n : start + n + max_tokens]
            if any(f[: len(cont)] == cont for f in found):
                continue
            found.append(cont)
            if len(found) >= limit:
                return found
    return found


def test_continuations_match_a_brute_force_search():
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        length = int(torch.randint(1, 40, (1,), generator=g))
        alphabet = int(torch.randint(1, 5, (1,), generator=g))  # small alphabets: many repeats
        history = torch.randint(0, alphabet, (length,), generator=g).tolist()
        max_ngram = int(torch.randint(1, 6, (1,), generator=g))
        min_ngram = int(torch.randint(1, max_ngram + 1, (1,), generator=g))
        k, limit = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        want = _brute_continuations(history, k, max_ngram, min_ngram, limit)
        assert ngram_continuations(history, k, max_ngram, min_ngram, limit) == want, (
            history,
            k,
            max_ngram,
            min_ngram,
            limit,
        )


def test_ngram_drafts_for_tells_whether_propose_drafts():
    """drafts_for(history) is true exactly where propose drafts at K >= 1, for every K 1..8,
    chain and tree, over random histories of small alphabets (many repeats)."""
    g = torch.Generator().manual_seed(1)
    drafted = 0
    for trial in range(300):
        history = torch.randint(
            0, int(torch.randint(1, 6, (1,), generator=g)), (int(torch.randint(1, 30, (1,), generator=g)),), generator=g
        ).tolist()
        max_ngram = int(torch.randint(1, 6, (1,), generator=g))
        min_ngram = int(torch.randint(1, max_ngram + 1, (1,), generator=g))
        for tree in (False, True):
            drafter = NgramDrafter(max_ngram, min_ngram, tree=tree)
            want = drafter.drafts_for(history)
            for k in range(1, 9):
                n = int(drafter.propose(request([history], [k], run_for([history]))).num_nodes[0])
                assert (n > 1) == want, (history, max_ngram, min_ngram, tree, k)
            drafted += want
    assert 100 < drafted < 500  # both outcomes occur often


def test_ngram_drafter_chain_and_tree():
    histories = [HISTORY, [1, 2, 3], HISTORY]
    chain = NgramDrafter(2, tokens_per_match=None).propose(request(histories, [3, 3, 0], run_for(histories)))
    assert chain.is_chain and chain.probs is None
    assert chain.num_nodes.tolist() == [4, 1, 1]
    assert chain.tokens[0].tolist() == [6, 7, 2, 5] and chain.tokens[1, 0] == 3
    tree = NgramDrafter(2, tree=True, max_chains=3, max_nodes=None, tokens_per_match=None).propose(
        request(histories, [3, 3, 3], run_for(histories), [True, True, False])
    )
    assert not tree.is_chain
    # root 6; chains [7, 2, 5], [9, 1, 5], [7, 8, 5] share the first 7
    n = int(tree.num_nodes[0])
    assert tree.tokens[0, :n].tolist() == [6, 7, 2, 5, 9, 1, 5, 8, 5]
    assert tree.parents[0, :n].tolist() == [-1, 0, 1, 2, 0, 4, 5, 1, 7]
    assert tree.num_nodes[1:].tolist() == [1, 1]  # no match; inactive
    capped = NgramDrafter(2, tree=True, max_chains=3, max_nodes=5, tokens_per_match=None).propose(
        request(histories[:1], [3], run_for(histories[:1]))
    )
    assert capped.num_nodes.tolist() == [5]
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(2, 3)
    with pytest.raises(ValueError, match="max_nodes"):
        NgramDrafter(max_nodes=1)


@pytest.mark.parametrize(
    "widths,depth,max_nodes,parents",
    [
        ((), 3, 64, [-1, 0, 1, 2]),
        ((2,), 3, 64, [-1, 0, 0, 1, 2, 3, 4]),
        ((2, 2), 2, 64, [-1, 0, 0, 1, 1, 2, 2]),
        ((3, 1, 2), 3, 64, [-1, 0, 0, 0, 1, 2, 3, 4, 4, 5, 5, 6, 6]),
        ((2, 2), 3, 5, [-1, 0, 0, 1, 1]),
    ],
    ids=["chain", "w2", "w2-2", "w3-1-2", "cut"],
)
def test_tree_shape(widths, depth, max_nodes, parents):
    got, depths = tree_shape(widths, depth, max_nodes)
    assert got == parents
    assert depths == [0] + [depths[p] + 1 for p in got[1:]]


def test_draft_helpers():
    d = Draft.from_lists([([4, 5, 6], chain_parents(3)), ([7], [-1])])
    assert d.is_chain and d.mask() is None and d.depths()[0].tolist() == [0, 1, 2]
    assert d.tokens.tolist() == [[4, 5, 6], [7, 0, 0]] and d.parents[1].tolist() == [-1, 0, 0]
    t = Draft.from_lists([([4, 5, 6, 7], [-1, 0, 0, 1]), ([7, 8], [-1, 0])])
    assert not t.is_chain
    assert t.depths()[0].tolist() == [0, 1, 1, 2]
    assert torch.equal(t.mask()[0], ancestor_mask([-1, 0, 0, 1]))
    assert t.truncate([2, 9]).num_nodes.tolist() == [2, 2]
    assert t.truncate([0, 1]).num_nodes.tolist() == [1, 1]


def test_stats():
    s = DecodeStats()
    s.record(depth=3, num_accepted=2, emitted=3)
    s.record(depth=3, num_accepted=0, emitted=1)
    s.record(depth=1, num_accepted=1, emitted=2)
    s.record(depth=0, num_accepted=0, emitted=1)
    assert s.sequence_steps == 4 and s.tokens == 7 and s.accepted_draft_tokens == 3
    assert s.mean_accepted_length == pytest.approx(7 / 4)
    assert s.proposed_at == [3, 2, 2] and s.accepted_at == [2, 1, 0]
    assert s.acceptance_rates == pytest.approx([2 / 3, 1 / 2, 0.0])
    s.total_time = 2.0
    assert s.tokens_per_second == pytest.approx(3.5)
    d = s.to_dict()
    assert d["mean_accepted_length"] == pytest.approx(1.75) and d["acceptance_rates"] == s.acceptance_rates
    assert "1.75 tokens/pass" in s.summary()
    assert DecodeStats().mean_accepted_length == 0.0 and DecodeStats().tokens_per_second == 0.0


def test_linear_paths_follow_a_fixed_rule_and_agree(monkeypatch):
    """``linear`` takes its CPU path by a rule (``linear_path``), never by timing: a packed weight
    reads its codes (float32, or 8-bit activations with numerics "int8"), any other float32
    weight takes the row-independent kernel, whatever the number of rows (a prefill chunk of 512
    takes the path of a decode step); other dtypes, input sizes not a multiple of 32 and
    $SPECDEC_LINEAR=f_linear take F.linear.  Every float32 path computes x @ W.T."""
    from specdec_kernels.decoding import model as m
    from specdec_kernels.decoding import packed

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g)
    # a weight that is exactly Q4_1-shaped: codes 0..15 times fp16 scales plus fp16 minimums
    d = torch.rand(300, 2, 1, generator=g).half().float() / 8
    codes = torch.randint(0, 16, (300, 2, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15  # as a Q4_1 quantiser leaves them: the block's min and max
    w_q = (codes.float() * d + torch.randn(300, 2, 1, generator=g).half().float()).reshape(300, 64)
    pw = packed.pack_weight(w_q)
    assert pw is not None and pw.kind == packed.AFFINE4
    packed.register(w_q, pw)
    monkeypatch.delenv(m.LINEAR_ENV, raising=False)
    odd = torch.randn(300, 48, generator=g)  # inputs not a multiple of 32: no kernel takes it
    for rows in (1, 2, 3, 17, 64, 65, 512):
        assert m.linear_path(rows, w) == "rowwise"
        assert m.linear_path(rows, w_q) == "packed"
        assert m.linear_path(rows, w_q, "int8") == "int8"
        assert m.linear_path(rows, w, "int8") == "rowwise"  # no codes: int8 has nothing to read
        assert m.linear_path(rows, odd) == "f_linear"
        assert m.linear_path(rows, w_q.double()) == "f_linear"
    assert m.linear_path(0, w) == "f_linear"  # an empty pass: nothing to compute
    for rows in (1, 2, 5, 16, 64, 65):
        x = torch.randn(rows, 64, generator=g)
        for weight in (w, w_q):
            want = torch.nn.functional.linear(x, weight)
            torch.testing.assert_close(m.linear(x, weight), want, rtol=1e-5, atol=1e-5)
            assert torch.equal(m.linear(x, weight), m.linear(x, weight))  # identical calls, identical bits
        # 8-bit activations: within the rounding of the activations (half a step of max|x| / 127
        # per input, times the weights' magnitudes)
        step = x.view(rows, 2, 32).abs().amax(-1) / 127
        bound = (step[:, None, :] / 2 * w_q.view(300, 2, 32).abs().sum(-1)[None]).sum(-1) + 1e-4
        assert ((m.linear(x, w_q, "int8") - x @ w_q.T).abs() <= bound).all()
    monkeypatch.setenv(m.LINEAR_ENV, "f_linear")
    assert m.linear_path(2, w_q) == "f_linear" and m.linear_path(2, w) == "f_linear"
    assert m.linear_path(2, w_q, "int8") == "int8"  # the numerics is the model's, not a speed choice
    monkeypatch.setenv(m.LINEAR_ENV, "fastest")
    with pytest.raises(ValueError, match="SPECDEC_LINEAR"):
        m.linear(torch.randn(2, 64), w)
    monkeypatch.delenv(m.LINEAR_ENV)
    with pytest.raises(ValueError, match="numerics"):
        m.linear(torch.randn(2, 64), w, "int4")
    packed.unregister(w_q)
    assert m.linear_path(2, w_q, "int8") == "rowwise"
