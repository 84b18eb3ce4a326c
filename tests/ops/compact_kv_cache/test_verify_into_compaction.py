"""Every verify op's outputs go into compact_kv_cache as they come (issue #58): verify's
``num_accepted`` counts the accepted drafts (root not counted), compaction fills
``num_accepted + 1`` slots; ``accepted_nodes`` is -1-padded.  Chains (padded and flattened)
and trees, dense and paged caches, each count form, against caches built by hand from paths
chosen by hand."""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.ops.compact_kv_cache.test_paged import from_paged, random_bytes, same_bytes, to_paged

L, B, H, S, D, V = 2, 3, 2, 24, 4, 32
SEQLENS = torch.tensor([0, 5, 9])

# Trees: per sequence the parents (padded with 0 past num_nodes), distinct tokens, and the
# path the target takes by hand (its argmax at each node of the path is the next node's token).
TREE_PARENTS = torch.tensor([[-1, 0, 0, 1, 2, 2, 4], [-1, 0, 1, 1, 0, 0, 0], [-1, 0, 0, 0, 0, 0, 0]])
TREE_TOKENS = torch.arange(10, 10 + 3 * 7).reshape(3, 7)
NUM_NODES = torch.tensor([7, 5, 3])
TREE_PATHS = [[0, 2, 4, 6], [0, 4], [0]]  # 3, 1 and 0 accepted drafts

# Chains: K = 4 drafts; accepted by hand: 2, 4 (all) and 0 drafts.
K = 4
DRAFTS = torch.arange(10, 10 + 3 * K).reshape(3, K)
NUM_DRAFTS = torch.tensor([4, 4, 2])
CHAIN_ACCEPTED = [2, 4, 0]


def _logits(argmax_rows):
    """(B, R, V) logits whose argmax at [b, r] is argmax_rows[b][r] (0 where not given:
    token 0 is no draft's)."""
    R = max(len(r) for r in argmax_rows)
    logits = torch.zeros(len(argmax_rows), R, V)
    for b, row in enumerate(argmax_rows):
        for r, token in enumerate(row):
            logits[b, r, token] = 5.0
    return logits


def tree_logits():
    rows = []
    for b, path in enumerate(TREE_PATHS):
        row = [0] * 7
        for node, child in zip(path, path[1:]):
            row[node] = int(TREE_TOKENS[b, child])
        rows.append(row)
    return _logits(rows)


def chain_logits():
    rows = []
    for b, n in enumerate(CHAIN_ACCEPTED):
        rows.append([int(DRAFTS[b, j]) for j in range(n)] + [0] * (K + 1 - n))
    return _logits(rows)


def one_hot(logits):
    """Target probabilities one-hot at the argmax: rejection sampling then accepts exactly
    the greedy path, whatever the coins."""
    return torch.nn.functional.one_hot(logits.argmax(-1), V).float()


def flat(per_row, counts):
    """Rows [B, K(+1), ...] as vLLM's flattened [T(+B), ...]: request b's first counts[b] rows."""
    return torch.cat([per_row[b, : int(counts[b])] for b in range(per_row.shape[0])])


def seeded():
    return dict(seeds=torch.tensor([7, 8, 9]), offsets=torch.tensor([0, 0, 0]))


def run_tree_greedy():
    _, nodes, n = sk.verify_tree_greedy(tree_logits(), TREE_TOKENS, TREE_PARENTS, NUM_NODES, validate=True)
    return nodes, n


def run_tree_rejection():
    probs = one_hot(tree_logits())
    _, nodes, n = sk.tree_rejection_sample(probs, TREE_TOKENS, TREE_PARENTS, None, NUM_NODES, validate=True, **seeded())
    return nodes, n


def chain_nodes(output_tokens, num_accepted):
    """A chain's accepted path in verify_tree_greedy's form: 0..num_accepted, then -1."""
    pos = torch.arange(output_tokens.shape[1])
    return torch.where(pos[None, :] <= num_accepted[:, None], pos, -1)


def run_greedy():
    out, n = sk.verify_greedy(chain_logits(), DRAFTS, NUM_DRAFTS, validate=True)
    return chain_nodes(out, n), n


def run_rejection():
    out, n = sk.rejection_sample(one_hot(chain_logits()), None, DRAFTS, NUM_DRAFTS, validate=True, **seeded())
    return chain_nodes(out, n), n


def _flat_args(target):
    """The chain batch in vLLM's flattened form: target rows [T + B, ...], drafts [T], cu [B]."""
    cu = NUM_DRAFTS.cumsum(0)
    return flat(target, NUM_DRAFTS + 1), flat(DRAFTS, NUM_DRAFTS), cu


def run_greedy_flattened():
    rows, drafts, cu = _flat_args(chain_logits())
    out, n = sk.verify_greedy_flattened(rows, drafts, cu, max_spec_len=K, validate=True)
    return chain_nodes(out, n), n


def run_rejection_flattened():
    rows, drafts, cu = _flat_args(one_hot(chain_logits()))
    out, n = sk.rejection_sample_flattened(rows, None, drafts, cu, max_spec_len=K, validate=True, **seeded())
    return chain_nodes(out, n), n


VERIFIERS = {
    "verify_tree_greedy": (run_tree_greedy, TREE_PATHS),
    "tree_rejection_sample": (run_tree_rejection, TREE_PATHS),
    "verify_greedy": (run_greedy, [list(range(n + 1)) for n in CHAIN_ACCEPTED]),
    "rejection_sample": (run_rejection, [list(range(n + 1)) for n in CHAIN_ACCEPTED]),
    "verify_greedy_flattened": (run_greedy_flattened, [list(range(n + 1)) for n in CHAIN_ACCEPTED]),
    "rejection_sample_flattened": (run_rejection_flattened, [list(range(n + 1)) for n in CHAIN_ACCEPTED]),
}


def by_hand(dense, paths):
    """The cache after compaction, written out: slot start + i receives slot start + path[i]."""
    want = dense.clone()
    for b, path in enumerate(paths):
        start = int(SEQLENS[b])
        for i, node in enumerate(path):
            want[:, :, b, :, start + i] = dense[:, :, b, :, start + node]
    return want


COUNTS = {
    "num_accepted": lambda nodes, n: dict(num_accepted=n),  # verify's count as it comes
    "no_count": lambda nodes, n: {},  # the -1 padding ends each row
    "num_slots": lambda nodes, n: dict(num_slots=n + 1),  # the slots, root included
    "positional": lambda nodes, n: (n + 1,),  # the 4th positional argument: the slots
}


def compact(cache, nodes, n, count, **kw):
    extra = COUNTS[count](nodes, n)
    if isinstance(extra, tuple):
        sk.compact_kv_cache(cache, SEQLENS, nodes, *extra, validate=True, **kw)
    else:
        sk.compact_kv_cache(cache, SEQLENS, nodes, validate=True, **extra, **kw)


@pytest.mark.parametrize("count", list(COUNTS))
@pytest.mark.parametrize("layout", ["dense", "dense_layers", "paged_NHD", "paged_HND"])
@pytest.mark.parametrize("verifier", list(VERIFIERS))
def test_verify_outputs_compact_as_they_come(verifier, layout, count):
    run, paths = VERIFIERS[verifier]
    nodes, n = run()
    # the verifier found the paths chosen by hand (so the expectation below is independent of it)
    assert n.tolist() == [len(p) - 1 for p in paths]
    assert [row[: len(p)] for row, p in zip(nodes.tolist(), paths)] == paths
    assert all(v == -1 for row, p in zip(nodes.tolist(), paths) for v in row[len(p) :])
    dense = random_bytes((L, 2, B, H, S, D), torch.float32, seed=5)
    want = by_hand(dense, paths)
    if layout.startswith("paged"):
        kv_layout = layout.split("_")[1]
        pool, table = to_paged(dense, 4, kv_layout, seed=6)
        compact(pool, nodes, n, count, block_table=table, kv_layout=kv_layout)
        got = from_paged(pool, table, kv_layout, S)
    elif layout == "dense_layers":
        layers = [dense[l, kv].clone() for l in range(L) for kv in range(2)]
        compact(layers, nodes, n, count)
        got = torch.stack(layers).reshape(dense.shape)
    else:
        got = dense.clone()
        compact(got, nodes, n, count)
    assert same_bytes(got, want)
    # and the reference, with the same count forms
    ref = dense.clone()
    extra = COUNTS[count](nodes, n)
    if isinstance(extra, tuple):
        reference.compact_kv_cache(ref, SEQLENS, nodes, *extra)
    else:
        reference.compact_kv_cache(ref, SEQLENS, nodes, **extra)
    assert same_bytes(ref, want)


def test_a_count_reaching_into_the_padding_names_the_cause():
    """num_accepted= given the slot count (num_accepted + 1, the root counted twice; what the
    argument meant before it was split from num_slots): the count reaches into the -1
    padding, and the value checks say which count to pass instead of "index >= i"."""
    nodes, n = run_tree_greedy()
    cache = random_bytes((L, 2, B, H, S, D), torch.float32, seed=1)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"accepted_indices\[0, 4\] = -1 is padding, .* pass it as num_accepted="):
        sk.compact_kv_cache(cache, SEQLENS, nodes, num_accepted=n + 1)
    with pytest.raises(ValueError, match=r"is padding, but the count asks for 5 slots for sequence 0"):
        sk.compact_kv_cache(cache, SEQLENS, nodes, n + 2)
    assert same_bytes(cache, before)  # a refused call moves nothing


def test_both_counts_are_refused():
    nodes, n = run_tree_greedy()
    cache = torch.zeros(L, 2, B, H, S, D)
    with pytest.raises(ValueError, match="num_slots .* or num_accepted .*not both"):
        sk.compact_kv_cache(cache, SEQLENS, nodes, n + 1, num_accepted=n)
    with pytest.raises(ValueError, match="not both"):
        reference.compact_kv_cache(cache, SEQLENS, nodes, n + 1, num_accepted=n)


def test_num_accepted_range_names_its_meaning():
    nodes, _ = run_tree_greedy()
    cache = torch.zeros(L, 2, B, H, S, D)
    with pytest.raises(ValueError, match=r"num_accepted \(verify's count of accepted drafts.*must lie in 0\.\.6"):
        sk.compact_kv_cache(cache, SEQLENS, nodes, num_accepted=torch.tensor([7, 0, 0]))


def test_without_a_count_padding_ends_a_row_even_without_value_checks():
    """validate=False (the CUDA default) reads nothing on the host: the padding rule is
    computed on the device, with the same result."""
    nodes, _ = run_tree_greedy()
    dense = random_bytes((L, 2, B, H, S, D), torch.float32, seed=3)
    got = dense.clone()
    sk.compact_kv_cache(got, SEQLENS, nodes, validate=False)
    assert same_bytes(got, by_hand(dense, TREE_PATHS))
    registered = dense.clone()
    torch.ops.specdec.compact_kv_cache([registered], SEQLENS, nodes, None)
    assert same_bytes(registered, by_hand(dense, TREE_PATHS))
