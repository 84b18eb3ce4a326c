"""Lookahead decoding as a drafter (Fu et al. 2024, "Break the Sequential Dependency of LLM
Inference Using Lookahead Decoding").

Greedy decoding is the fixed point of a Jacobi iteration over a window of future positions:
guess the next W tokens y_1..y_W, run the target over them in one pass, and take as the new
guess at each position the target's argmax given the guesses before it.  The iteration's
trajectory holds n-grams that the target itself produced; lookahead decoding collects them
into a pool keyed by their first token and verifies, each step, the n-grams whose first token
is the last committed one.  Both ride in the same target pass:

* the lookahead branch: the window y_1..y_W as a chain below the root (it is verified as a
  draft too, so a window that has converged is accepted outright);
* the verification branch: up to ``guesses`` (G) n-grams of ``ngram`` (N) tokens from the
  pool that start with the root, as chains below it;

merged into one token tree (``merge_chains``).  The target's argmax at every node of the pass
(``StepResult.target_argmax``, handed to ``observe``: ``wants_target_argmax``) gives o_0..o_W, o_i the target's next token after the
root and y_1..y_i.  Then:

* n-grams: (y_i, .., y_{i+N-2}, o_{i+N-2}) for every i (y_0 the root), each N tokens the
  target produced one from the other along the trajectory (their guesses came from earlier
  iterations, the last token from this one), go into the pool (newest first, at most G per
  first token);
* the Jacobi step: after m accepted drafts the root moves m + 1 positions, and the new window
  is o_{m+1}..o_W followed by m fresh guesses (tokens drawn from the history with the
  sequence's own generator, as lookahead decoding initialises its window).

When ``max_nodes`` cannot hold the whole tree, the branches given first keep their nodes: the
window by default (it keeps the Jacobi iteration going); with ``window_first=False`` the
n-grams, whose tokens the target produced or the history repeated.  On a CPU where a pass of
two tokens costs about what a pass of one does and every further token costs more (measured
with ``bench.e2e``), one draft node (``max_nodes=2``) holding the likeliest n-gram is what pays.

This is the one-level form of the paper's 2-D window (it keeps the newest level of the
trajectory and takes the earlier tokens of each n-gram from the guesses it fed), so the
window costs W nodes a pass instead of (N - 1) W.  Spec-Bench ran W = 7, N = 5, G = 7 on a
GPU, where a pass costs about the same for a few dozen nodes; on a CPU every node costs, so
the defaults here are smaller.  Drafts are deterministic (``Draft.probs`` is None): greedy
verification keeps greedy decoding's output and rejection sampling with q one-hot keeps
sampling exact (the Jacobi guesses are the target's argmax whatever the temperature).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec_kernels.checks import integer_at_least
from specdec_kernels.decoding.draft import Draft, Drafter, DraftRequest, StepResult
from specdec_kernels.decoding.drafters.merge import map_to_merged
from specdec_kernels.decoding.drafters.ngram import ngram_continuations
from specdec_kernels.tree import merge_chains


class LookaheadDrafter(Drafter):
    """Lookahead (Jacobi) decoding's window and n-gram pool (see the module docstring).

    Args:
        window: W, the Jacobi window (the lookahead branch's tokens per pass; cut to K).
        ngram: N, the n-gram size (N - 1 draft tokens per pooled n-gram; cut to K).
        guesses: G, the n-grams verified per step at most, and kept per first token.
        max_nodes: the merged tree's nodes at most, root included (which branches keep
            their nodes when it cuts: ``window_first``).
        pool_from_history: also verify the history's own n-grams (prompt lookup,
            ``ngram_continuations``); off in the paper's default.  A continuation of a
            suffix of 3 or more tokens that recurs in the history comes before the pooled
            n-grams (such a match predicts better than a Jacobi n-gram), a shorter one after
            them; G n-grams in all.
        window_first: when ``max_nodes`` cuts the tree, keep the window's nodes before the
            n-grams' (True, the default) or after them.

    Raises:
        ValueError: window < 1, ngram < 2, guesses < 0, max_nodes < 2.
        TypeError: window_first or pool_from_history not a bool.
    """

    STRONG_MATCH, LONGEST_MATCH = 3, 4  # history suffixes of 3-4 tokens (longest first) rank before the pool

    name = "lookahead"
    drafts_free = True
    wants_target_argmax = True

    def __init__(
        self,
        window: int = 4,
        ngram: int = 3,
        guesses: int = 2,
        *,
        max_nodes: int = 16,
        pool_from_history: bool = False,
        window_first: bool = True,
    ):
        for name, v, lo in (
            ("window", window, 1),
            ("ngram", ngram, 2),
            ("guesses", guesses, 0),
            ("max_nodes", max_nodes, 2),
        ):
            integer_at_least(name, v, lo)
        for name, v in (("pool_from_history", pool_from_history), ("window_first", window_first)):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {v!r}")
        self.window, self.ngram, self.guesses, self.max_nodes = int(window), int(ngram), int(guesses), int(max_nodes)
        self.pool_from_history, self.window_first = pool_from_history, window_first
        self._reset(0)

    def _reset(self, batch: int) -> None:
        self.pools: List[Dict[int, List[Tuple[int, ...]]]] = [{} for _ in range(batch)]
        self._windows: List[List[int]] = [[] for _ in range(batch)]
        self._outputs: List[Optional[List[int]]] = [None] * batch  # o_0.. of the last pass
        self._fed: List[List[int]] = [[] for _ in range(batch)]  # the window fed in the last pass
        self._root_len: List[int] = [0] * batch
        self._window_nodes: List[List[int]] = [[] for _ in range(batch)]
        self._roots: List[int] = [0] * batch
        self.ngrams_added = 0

    def observe(self, result: StepResult) -> None:
        """A new run (``result.started``) empties the pools and windows; after a step, keep
        o_0..o_w (``result.target_argmax`` (B, N) int64 at the root and the window's nodes,
        those at or past ``result.num_nodes[b]`` unknown) for the Jacobi step and pool the
        n-grams (y_i, .., y_{i+N-2}, o_{i+N-2})."""
        super().observe(result)
        if result.started:
            self._reset(result.batch_size)
            return
        if result.target_argmax is not None:
            self._observe_target_argmax(result.target_argmax, result.num_nodes)

    def _fill(self, b: int, history: Sequence[int], n: int) -> List[int]:
        """n fresh guesses: tokens drawn uniformly from the history."""
        if n <= 0:
            return []
        g = self.generators[b] if self.generators else None
        idx = torch.randint(0, len(history), (n,), generator=g).tolist()
        return [int(history[i]) for i in idx]

    def _next_window(self, b: int, history: Sequence[int]) -> List[int]:
        """The Jacobi step: the last pass's outputs past the accepted tokens, then fresh guesses."""
        out = self._outputs[b]
        keep: List[int] = []
        if out is not None:
            m = len(history) - self._root_len[b] - 1  # accepted drafts (the bonus is the new root)
            for o in out[m + 1 :]:
                if o < 0:  # unknown (cut from the pass)
                    break
                keep.append(int(o))
        self._outputs[b] = None
        keep = keep[: self.window]
        return keep + self._fill(b, history, self.window - len(keep))

    def propose(self, request: DraftRequest) -> Draft:
        """Per active sequence with K >= 1 the window (cut to K) and up to G n-grams (each
        cut to K) below its root, merged into one tree of at most ``max_nodes`` nodes; the
        root alone otherwise.  Deterministic: ``probs`` is None."""
        trees = []
        for b, (h, k, a) in enumerate(zip(request.histories, request.num_draft_tokens, request.active)):
            root = h[-1]
            self._window_nodes[b], self._fed[b] = [], []
            if not a or k < 1:
                self._outputs[b] = None
                trees.append(([root], [-1]))
                continue
            window = self._next_window(b, h)
            self._windows[b] = window
            fed = window[: min(self.window, k)]
            chains = self._ngrams(b, h, root, k)
            merged = merge_chains(root, [fed] + chains if self.window_first else chains + [fed], self.max_nodes)
            ids = map_to_merged(merged.tokens, merged.parents, [root] + fed, list(range(-1, len(fed))))
            cut = next((i for i, x in enumerate(ids) if x < 0), len(ids))
            self._window_nodes[b] = ids[:cut]  # node of the root, y_1, .. in the merged tree
            self._fed[b] = fed[: cut - 1]
            self._root_len[b] = len(h)
            self._roots[b] = root
            trees.append((merged.tokens, merged.parents))
        return Draft.from_lists(trees, is_chain=None)

    def _ngrams(self, b: int, history: Sequence[int], root: int, k: int) -> List[List[int]]:
        """The n-grams verified this step (at most G, each cut to K tokens): the pool's for the
        root, newest first; with ``pool_from_history`` the history's strong matches before
        them and its short ones after."""
        G, body = self.guesses, min(k, self.ngram - 1)
        pooled = [list(c[:k]) for c in self.pools[b].get(root, [])[:G]]
        if not self.pool_from_history or G == 0:
            return pooled
        chains = ngram_continuations(history, body, max(self.LONGEST_MATCH, self.ngram), self.STRONG_MATCH, G)
        chains += [c for c in pooled if c not in chains]
        if len(chains) < G:
            weak = ngram_continuations(history, body, min(self.ngram, self.STRONG_MATCH - 1), 1, G)
            chains += [c for c in weak if c not in chains]
        return chains[:G]

    def _observe_target_argmax(self, argmax: torch.Tensor, num_nodes: torch.Tensor) -> None:
        """Keep o_0..o_w (the target's argmax at the root and the window's nodes) for the
        Jacobi step and pool the n-grams (y_i, .., y_{i+N-2}, o_{i+N-2})."""
        rows = argmax.tolist()
        N = self.ngram
        for b, nodes in enumerate(self._window_nodes):
            if not nodes:
                continue
            n_b = int(num_nodes[b])  # the engine may have cut the draft: nodes past it were not fed
            out = [int(rows[b][n]) if n < n_b else -1 for n in nodes]  # o_0 .. o_w (-1: unknown)
            self._outputs[b] = out
            seq = [self._roots[b]] + self._fed[b]  # y_0 (the root) .. y_w
            for i in range(0, len(out) - N + 2):
                body = tuple(seq[i + 1 : i + N - 1]) + (out[i + N - 2],)
                if min(body) >= 0:
                    self._add(b, int(seq[i]), body)

    def _add(self, b: int, first: int, body: Tuple[int, ...]) -> None:
        pool = self.pools[b].setdefault(first, [])
        if body in pool:
            pool.remove(body)
        pool.insert(0, body)
        del pool[self.guesses :]
        self.ngrams_added += 1
