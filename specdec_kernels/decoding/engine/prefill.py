"""The prefill: every prompt but its last token fed to the target in chunks, as chains.

With a shared-prefix paged cache, in two phases: the leaders from position 0, then (after the
copy-on-write of partly shared blocks) the followers from the end of the prefix they share,
attending to the leader's blocks of it.  A drafter that ``wants_hidden`` gets the hidden
states of each prompt's last fed token (and of a ``context_window`` of positions before it).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec_kernels.decoding.engine.state import DecodeState
from specdec_kernels.decoding.paged import PagedKVCache, length_groups


def new_kv_cache(model, drafter, histories: List[List[int]], capacity: int, layout):
    """The target's KV cache for these prompts (``capacity`` slots per sequence): dense, or
    paged (``layout.paged``; with ``layout.share_prefix`` prompts that begin alike share the
    blocks of their common prefix, ``PagedKVCache.allocate``).  The shared prefix stops short of
    the positions whose hidden states a drafter that ``wants_hidden`` needs from the sequence's
    own prefill (its ``context_window``, its last fed token)."""
    if not layout.paged:
        return model.new_kv_cache(len(histories), capacity)
    keep = max(1, int(drafter.context_window or 0)) if drafter.wants_hidden else 0
    prefixes = [h[: max(0, len(h) - 1 - keep)] for h in histories]
    return PagedKVCache.allocate(model, prefixes, capacity, layout)


def prefill(model, state: DecodeState, drafter, chunk: int, layer_kwargs: Dict[str, Tuple[int, ...]]):
    """Feed every prompt of ``state`` but its last token (the first root), ``chunk`` tokens per
    pass; set ``state.cache_seqlens`` / ``host_seqlens`` and the prefill statistics.

    Returns:
        For a drafter that ``wants_hidden``: (hidden (B, hidden_size; wider with
        ``layer_kwargs["hidden_layers"]``) of each prompt's last fed token, has_hidden per
        sequence, context, first): with a ``context_window`` W > 0, context[b] holds the hidden
        states of the last W fed positions of sequence b (from position first[b]), else context
        is None.  For other drafters None.
    """
    device = model.device
    fed = [n - 1 for n in state.prompt_lengths]
    B = state.batch_size
    wants = drafter.wants_hidden
    window = int(drafter.context_window or 0) if wants else 0
    first = [max(0, f - max(window, 1)) for f in fed]  # the fed positions whose hidden states are kept
    kept: List[List[torch.Tensor]] = [[] for _ in range(B)]
    cache = state.kv_cache
    paged = isinstance(cache, PagedKVCache)
    starts = cache.prefill_starts() if paged else [0] * B
    for rows_b in _phases(cache, fed, starts):
        if rows_b is None:  # the copy-on-write, once the leaders are in the cache
            cache.copy_shared_tails()
            continue
        sub = cache.rows(rows_b) if paged and rows_b != list(range(B)) else cache
        longest = max(fed[b] - starts[b] for b in rows_b)
        for c in range(0, longest, chunk):
            n = min(chunk, longest - c)
            lo = [starts[b] + c for b in rows_b]
            want = (
                [range(max(first[b], lo[r]), min(fed[b], lo[r] + n)) for r, b in enumerate(rows_b)] if wants else None
            )
            hidden = _feed(model, state, sub, rows_b, lo, fed, n, want, layer_kwargs)
            for r, b in enumerate(rows_b if wants else ()):
                if len(want[r]):
                    kept[b].append(hidden[r, : len(want[r])])
    state.stats.shared_prefill_tokens = sum(starts)
    state.cache_seqlens = torch.tensor(fed, dtype=torch.int32, device=device)
    state.host_seqlens = list(fed)
    if not wants:
        return None
    width = model.args.hidden_size * (1 + len(layer_kwargs.get("hidden_layers", ())))
    last = torch.zeros(B, width, dtype=model.dtype, device=device)
    context = [torch.cat(k) if k else None for k in kept]
    for b, rows in enumerate(context):
        if rows is not None:
            last[b] = rows[-1]
    return last, [f > 0 for f in fed], (context if window else None), first


def _phases(cache, fed: List[int], starts: List[int]) -> List[Optional[List[int]]]:
    """The row groups fed one after the other: all rows (dense cache); with a paged cache the
    leaders, then None (the copy-on-write of partly shared blocks) and the followers, each in
    groups of similar length (a block table row is cheap to select), so that padding ragged
    prompts to the longest costs little."""
    if not isinstance(cache, PagedKVCache):
        return [list(range(len(fed)))]
    todo = [f - s for f, s in zip(fed, starts)]
    phases: List[Optional[List[int]]] = list(length_groups(cache.leaders, todo))
    if cache.followers:
        phases += [None] + length_groups(cache.followers, todo)
    return phases


def _feed(model, state, cache, rows_b: List[int], lo: List[int], fed: List[int], n: int, want, layer_kwargs):
    """One prefill pass: n tokens of each sequence in ``rows_b`` from position lo[r] (padded past
    the prompt's end); returns the hidden states of the ``want`` positions (no head), or None."""
    device = model.device
    R = len(rows_b)
    block = torch.zeros(R, n, dtype=torch.int64)
    for r, b in enumerate(rows_b):
        part = state.histories[b][lo[r] : min(lo[r] + n, fed[b])]
        block[r, : len(part)] = torch.tensor(part, dtype=torch.int64)
    base = torch.tensor(lo, dtype=torch.int64)
    positions = (base[:, None] + torch.arange(n)).to(device)
    seqlens = base.to(device=device, dtype=torch.int32)
    state.stats.prefill_passes += 1
    state.stats.prefill_tokens += R * n
    if want is None:
        no_rows = torch.zeros(R, 0, dtype=torch.int64, device=device)
        model(block.to(device), positions, cache, seqlens, None, logit_rows=no_rows)
        return None
    m = max(1, max(len(w) for w in want))
    rows = _kept_rows(want, lo, m)
    _, hidden = model(
        block.to(device),
        positions,
        cache,
        seqlens,
        None,
        logit_rows=torch.tensor(rows, dtype=torch.int64, device=device),
        return_hidden=True,
        compute_logits=False,
        **layer_kwargs,
    )
    return hidden


def _kept_rows(want: Sequence[range], lo: List[int], m: int) -> List[List[int]]:
    """Per sequence, the block rows of its kept positions, padded to m with its last one."""
    return [[(w[min(i, len(w) - 1)] - lo[r]) if len(w) else 0 for i in range(m)] for r, w in enumerate(want)]
