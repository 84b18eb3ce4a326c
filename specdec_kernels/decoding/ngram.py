"""N-gram drafting: prompt lookup decoding (Saxena 2023) over the prompt and the generated text."""
from __future__ import annotations

from typing import List, Sequence

import numpy as np

from specdec_kernels.decoding.draft import Draft, Drafter, chain_parents
from specdec_kernels.tree import merge_chains


def ngram_continuations(history: Sequence[int], max_tokens: int, max_ngram: int = 3, min_ngram: int = 1, limit: int = 1) -> List[List[int]]:
    """Continuations of the history's suffix found earlier in the history.

    For n from ``max_ngram`` down to ``min_ngram``, every earlier occurrence of the last n
    tokens (most recent first) proposes the up to ``max_tokens`` tokens that followed it.
    Distinct continuations are collected until ``limit`` are found.

    Args:
        history: token ids; its last token is the root of the draft.
        max_tokens: the most tokens per continuation (K).
        max_ngram, min_ngram: the suffix lengths tried, longest first (1 <= min <= max).
        limit: how many distinct continuations to return at most.

    Returns:
        A list of token lists (each non-empty, at most ``max_tokens`` long), best first.
    """
    if max_tokens < 1 or limit < 1:
        return []
    arr = np.asarray(history, dtype=np.int64)
    found: List[List[int]] = []
    seen = set()
    for n in range(min(max_ngram, len(arr) - 1), min_ngram - 1, -1):
        suffix = arr[-n:]
        # windows that end before the last token, so that at least one token follows them
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        for start in hits[::-1]:
            cont = arr[start + n : start + n + max_tokens].tolist()
            key = tuple(cont)
            if key in seen:
                continue
            # a continuation that is a prefix of one already found adds nothing to a trie
            if any(tuple(f[: len(cont)]) == key for f in found):
                continue
            seen.add(key)
            found.append(cont)
            if len(found) >= limit:
                return found
    return found


class NgramDrafter(Drafter):
    """Prompt lookup / n-gram drafting: copy what followed the latest match of the suffix.

    Deterministic (``Draft.probs`` is None: the verifier treats q as one-hot).  With
    ``tree=True`` up to ``max_chains`` distinct continuations (different matches, longer
    n-grams first) are merged into one token tree with ``specdec_kernels.tree.merge_chains``.

    Args:
        max_ngram, min_ngram: suffix lengths tried, longest first.
        tree: merge several matches into a tree instead of proposing one chain.
        max_chains: continuations merged in tree mode.
        max_nodes: tree nodes at most (root included), None for no limit.

    Raises:
        ValueError: min_ngram < 1, max_ngram < min_ngram, max_chains < 1.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, *, tree: bool = False, max_chains: int = 4, max_nodes=None):
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if max_chains < 1:
            raise ValueError(f"max_chains must be >= 1, got {max_chains}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tree, self.max_chains, self.max_nodes = tree, max_chains, max_nodes

    def propose(self, histories, num_draft_tokens, active) -> Draft:
        trees = []
        for h, k, a in zip(histories, num_draft_tokens, active):
            root = h[-1]
            chains = ngram_continuations(h, k, self.max_ngram, self.min_ngram, self.max_chains if self.tree else 1) if a else []
            if not chains:
                trees.append(([root], [-1]))
            elif not self.tree:
                trees.append(([root] + chains[0], chain_parents(len(chains[0]) + 1)))
            else:
                merged = merge_chains(root, chains, self.max_nodes)
                trees.append((merged.tokens, merged.parents))
        return Draft.from_lists(trees, is_chain=None if self.tree else True)
