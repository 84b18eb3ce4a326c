"""N-gram drafting: prompt lookup decoding (Saxena 2023) over the prompt and the generated text."""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch

from specdec_kernels.decoding.draft import Draft, Drafter, DraftRequest, chain_parents
from specdec_kernels.tree import merge_chains


def _suffix_match_starts(arr: np.ndarray, last_hits: np.ndarray, n: int) -> np.ndarray:
    """Start indices (ascending) of the earlier occurrences of ``arr``'s last n tokens that end
    before its last token, from ``last_hits``: the indices before the last where its last
    token occurs (the candidates' ends; ``np.flatnonzero(arr[:-1] == arr[-1])``)."""
    ends = last_hits[last_hits >= n - 1]
    for t in range(1, n):
        ends = ends[arr[ends - t] == arr[-1 - t]]
    return ends - (n - 1)


def ngram_continuations(
    history: Sequence[int],
    max_tokens: int,
    max_ngram: int = 3,
    min_ngram: int = 1,
    limit: int = 1,
    tokens_per_match: Optional[int] = None,
) -> List[List[int]]:
    """Continuations of the history's suffix found earlier in the history.

    For n from ``max_ngram`` down to ``min_ngram``, every earlier occurrence of the last n
    tokens (most recent first) proposes the up to ``max_tokens`` tokens that followed it
    (at most ``tokens_per_match * n`` when that is given: a short match is trusted for a
    short way).  Distinct continuations are collected until ``limit`` are found.

    Args:
        history: token ids; its last token is the root of the draft.
        max_tokens: the most tokens per continuation (K).
        max_ngram, min_ngram: the suffix lengths tried, longest first (1 <= min <= max).
        limit: how many distinct continuations to return at most.
        tokens_per_match: cap on a continuation's length per matched token, None for none.

    Returns:
        A list of token lists (each non-empty, at most ``max_tokens`` long), best first.
    """
    if max_tokens < 1 or limit < 1:
        return []
    arr = np.asarray(history, dtype=np.int64)
    found: List[List[int]] = []
    seen = set()
    # occurrences that end before the last token, so that at least one token follows them
    last_hits = np.flatnonzero(arr[:-1] == arr[-1]) if len(arr) > 1 else arr[:0]
    for n in range(min(max_ngram, len(arr) - 1), min_ngram - 1, -1):
        hits = _suffix_match_starts(arr, last_hits, n)
        for start in hits[::-1]:
            take = max_tokens if tokens_per_match is None else min(max_tokens, tokens_per_match * n)
            cont = arr[start + n : start + n + take].tolist()
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


def ngram_next_counts(history: Sequence[int], max_ngram: int = 5, min_ngram: int = 1) -> Optional[dict]:
    """What followed the history's suffix earlier in the history: for the longest n in
    ``max_ngram`` .. ``min_ngram`` whose last-n-token suffix occurred before, ``{token:
    count}`` of the tokens that followed its earlier occurrences; None when no suffix recurs."""
    arr = np.asarray(history, dtype=np.int64)
    last_hits = np.flatnonzero(arr[:-1] == arr[-1]) if len(arr) > 1 else arr[:0]
    for n in range(min(max_ngram, len(arr) - 1), min_ngram - 1, -1):
        hits = _suffix_match_starts(arr, last_hits, n)
        if hits.size:
            tokens, counts = np.unique(arr[hits + n], return_counts=True)
            return dict(zip(tokens.tolist(), counts.tolist()))
    return None


class NgramDrafter(Drafter):
    """Prompt lookup / n-gram drafting: copy what followed the latest match of the suffix.

    Deterministic (``Draft.probs`` is None: the verifier treats q as one-hot).  With
    ``tree=True`` up to ``max_chains`` distinct continuations (different matches, longer
    n-grams first) are merged into one token tree with ``specdec_kernels.tree.merge_chains``.

    The defaults suit a CPU, where every verified node costs about an eighth of a target
    pass (SmolLM2-135M on 2 cores): matches up to 5 tokens, a continuation of at most 2 tokens
    per matched token, trees of 2 continuations and 8 nodes.  On a GPU, where a pass costs
    about the same for a few dozen nodes, wider trees and longer continuations pay.

    Args:
        max_ngram, min_ngram: suffix lengths tried, longest first.
        tree: merge several matches into a tree instead of proposing one chain.
        max_chains: continuations merged in tree mode.
        max_nodes: tree nodes at most (root included), None for no limit.
        tokens_per_match: a continuation found with an n-token match is cut to
            ``tokens_per_match * n`` tokens (besides K); None proposes K tokens.

    Raises:
        ValueError: min_ngram < 1, max_ngram < min_ngram, max_chains < 1, max_nodes < 2,
            tokens_per_match < 1.
    """

    name = "ngram"
    default_k = 8
    drafts_free = True

    def __init__(
        self,
        max_ngram: int = 5,
        min_ngram: int = 1,
        *,
        tree: bool = False,
        max_chains: int = 2,
        max_nodes: Optional[int] = 8,
        tokens_per_match: Optional[int] = 2,
    ):
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if max_chains < 1:
            raise ValueError(f"max_chains must be >= 1, got {max_chains}")
        if max_nodes is not None and max_nodes < 2:
            raise ValueError(f"max_nodes must be >= 2 or None, got {max_nodes}")
        if tokens_per_match is not None and tokens_per_match < 1:
            raise ValueError(f"tokens_per_match must be >= 1 or None, got {tokens_per_match}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tree, self.max_chains, self.max_nodes = tree, max_chains, max_nodes
        self.tokens_per_match = tokens_per_match

    def drafts_for(self, history: Sequence[int]) -> bool:
        """Whether ``propose`` drafts anything for this history at any K >= 1: some suffix of
        ``min_ngram`` .. ``max_ngram`` tokens occurred earlier (every earlier occurrence is
        followed by at least one token).  A fallback ``MultiDrafter`` asks it before K is
        chosen (``draft_sources``)."""
        return bool(ngram_continuations(history, 1, self.max_ngram, self.min_ngram, 1, self.tokens_per_match))

    def chain_begin(self, request: DraftRequest, vocab_size: int):
        """The n-gram distribution of the first draft token (``Drafter.chain_begin``): the
        tokens that followed the longest recurring suffix, in proportion to their counts
        (``ngram_next_counts``); no opinion where no suffix recurs.

        Args:
            request: the batch's histories, draft depths and active flags.
            vocab_size: V.

        Returns:
            probs (B, V) float32 and has (B,) bool, as ``Drafter.chain_begin``.
        """
        self._chain_paths = [list(h) for h in request.histories]
        self._chain_ks = [int(k) if a else 0 for k, a in zip(request.num_draft_tokens, request.active)]
        self._chain_depth = 0
        self._chain_vocab = int(vocab_size)
        return self._chain_distribution()

    def chain_extend(self, tokens):
        """Append the chain's tokens ``tokens`` (B,) int64 and return the next n-gram
        distribution: probs (B, V) float32 and has (B,) bool."""
        for path, t in zip(self._chain_paths, tokens.tolist()):
            path.append(int(t))
        self._chain_depth += 1
        return self._chain_distribution()

    def _chain_distribution(self):
        B, d = len(self._chain_paths), self._chain_depth + 1
        probs = torch.zeros(B, self._chain_vocab)
        has = torch.zeros(B, dtype=torch.bool)
        for b, path in enumerate(self._chain_paths):
            if self._chain_ks[b] < d:
                continue
            counts = ngram_next_counts(path, self.max_ngram, self.min_ngram)
            if counts:
                tok = torch.tensor(list(counts))
                if int(tok.max()) >= self._chain_vocab:  # ids outside the vocabulary: no opinion
                    continue
                c = torch.tensor(list(counts.values()), dtype=torch.float32)
                probs[b, tok] = c / c.sum()
                has[b] = True
        return probs, has

    def propose(self, request: DraftRequest) -> Draft:
        """Per sequence the continuation of its latest suffix match (``tree=False``: a chain of
        at most ``request.num_draft_tokens[b]`` tokens), or up to ``max_chains`` of them merged
        into a tree of at most ``max_nodes`` nodes (``tree=True``); the root alone where
        nothing matches or the sequence is inactive.  Deterministic: ``probs`` is None."""
        trees = []
        for h, k, a in zip(request.histories, request.num_draft_tokens, request.active):
            root = h[-1]
            limit = self.max_chains if self.tree else 1
            chains = (
                ngram_continuations(h, k, self.max_ngram, self.min_ngram, limit, self.tokens_per_match) if a else []
            )
            if not chains:
                trees.append(([root], [-1]))
            elif not self.tree:
                trees.append(([root] + chains[0], chain_parents(len(chains[0]) + 1)))
            else:
                merged = merge_chains(root, chains, self.max_nodes)
                trees.append((merged.tokens, merged.parents))
        return Draft.from_lists(trees, is_chain=None if self.tree else True)
