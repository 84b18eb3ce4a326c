"""The loop's checks of what a drafter hands it, before the target sees it.

A custom drafter's bug should name the drafter, not surface as an embedding index error or a
wrong output: ``check_draft`` checks a proposal (types, shapes, parents, roots, token ids) and
``check_draft_sources`` the per-sequence source ids of a drafter with several sources.  Both
read only host tensors (a drafter's proposal lives on the host).  ``feature_layer_kwargs``
checks the target layers a drafter asks hidden states of.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec_kernels.checks import INDEX_DTYPES, as_int_list, layer_indices
from specdec_kernels.decoding.draft import Draft, Drafter, DraftRequest

PROBS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the verifiers read of Draft.probs


def drafter_name(drafter) -> str:
    """The name a message gives a drafter: its ``name``, else its class name."""
    return getattr(drafter, "name", type(drafter).__name__)


def check_draft_sources(drafter, request: DraftRequest) -> Optional[List[int]]:
    """``drafter.draft_sources(request)`` checked: None (no such method, or one source), or
    one int >= 0 per sequence.

    Raises:
        ValueError: anything else, naming the drafter.
    """
    fn = getattr(drafter, "draft_sources", None)
    histories = request.histories
    sources = fn(request) if fn is not None else None
    if sources is None:
        return None
    bad = ValueError(
        f"drafter {drafter_name(drafter)!r}: draft_sources must return None or one int >= 0 per sequence "
        f"({len(histories)}), got {sources!r}"
    )
    try:
        sources = as_int_list("draft_sources", sources)
    except TypeError:
        raise bad from None
    if len(sources) != len(histories) or min(sources, default=0) < 0:
        raise bad
    return sources


def check_draft(draft, name: str, histories: Sequence[List[int]], active: List[bool], vocab_size: int) -> Draft:
    """A drafter's proposal, checked: a ``Draft`` with one row per sequence, at least the root,
    parents that form a tree (a chain when ``is_chain``), the root equal to the last committed
    token of every running sequence, draft tokens inside the vocabulary, probs (B, N, V) or None.

    Args:
        draft: what ``propose`` returned.
        name: the drafter's name, for the messages.
        histories: the committed tokens per sequence (B lists).
        active: per sequence, still running.
        vocab_size: V.

    Returns:
        ``draft``, unchanged.

    Raises:
        TypeError: not a ``Draft``; tokens or parents not int64 / int32 (the dtypes the
            embedding and the verifiers index with: uint8, int8, int16, float and bool are
            refused here, naming the drafter, instead of failing inside the embedding),
            num_nodes not integers.
        ValueError: shapes, counts, parents, roots or token ids that do not fit.
    """
    if not isinstance(draft, Draft):
        raise TypeError(f"drafter {name!r}: propose must return a Draft, got {type(draft).__name__}")
    B = len(histories)
    n = _check_layout(draft, name, B, vocab_size)
    # on host lists: a step's draft is small, and a handful of list reads cost less than the
    # dozen small tensor ops the same checks take on tensors
    tokens = draft.tokens.tolist()
    _check_parents(draft.parents.tolist(), draft.is_chain, name, n)
    for b in range(B):
        if active[b] and tokens[b][0] != histories[b][-1]:
            raise ValueError(
                f"drafter {name!r}: sequence {b}'s draft root is {tokens[b][0]}, not its last committed "
                f"token {histories[b][-1]}"
            )
    # every node a row declares, a finished sequence's too: its row is cut to the root, but the
    # block's other rows may be wider, and then its cut nodes ride in the pass as padding
    for b in range(B):
        for i, t in enumerate(tokens[b][: n[b]]):
            if not 0 <= t < vocab_size:
                raise ValueError(
                    f"drafter {name!r}: draft token {t} (sequence {b}, node {i}) is outside the vocabulary [0, {vocab_size})"
                )
    if draft.probs is not None:  # (B, N) bool: the declared nodes of running sequences
        used = [[a and i < nb for i in range(len(row))] for nb, a, row in zip(n, active, tokens)]
        _check_probs(draft, name, torch.tensor(used, dtype=torch.bool))
    return draft


def _check_layout(draft: Draft, name: str, B: int, V: int) -> List[int]:
    """The dtypes and shapes of a draft's tensors; returns num_nodes as a list."""
    for part in ("tokens", "parents", "num_nodes"):
        t = getattr(draft, part)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"drafter {name!r}: Draft.{part} must be a tensor, got {type(t).__name__}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"drafter {name!r}: Draft.{part} must hold integers (int64), got {t.dtype}")
        if part != "num_nodes" and t.dtype not in INDEX_DTYPES:
            raise TypeError(
                f"drafter {name!r}: Draft.{part} must be int64 or int32 (the dtypes the embedding and "
                f"the verifiers index with), got {t.dtype}; build it with dtype=torch.int64 or call .long()"
            )
    if draft.tokens.dim() != 2 or draft.tokens.shape[0] != B or draft.num_nodes.shape != (B,):
        raise ValueError(
            f"drafter {name!r}: a draft needs tokens (B={B}, N) and num_nodes (B,), got "
            f"{tuple(draft.tokens.shape)} and {tuple(draft.num_nodes.shape)}"
        )
    n = draft.num_nodes.tolist()
    N = draft.tokens.shape[1]
    if min(n) < 1 or max(n) > N:
        raise ValueError(f"drafter {name!r}: num_nodes must lie in 1..{N} (the root counts), got {n}")
    if draft.parents.shape != (B, N):
        raise ValueError(
            f"drafter {name!r}: Draft.parents must have shape (B={B}, N={N}) like tokens, "
            f"got {tuple(draft.parents.shape)}"
        )
    if draft.probs is not None:
        p = draft.probs
        if not isinstance(p, torch.Tensor) or not p.is_floating_point() or p.shape != (B, N, V):
            raise ValueError(
                f"drafter {name!r}: Draft.probs must be a float tensor (B={B}, N={N}, V={V}) or None, got "
                f"{tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}"
            )
        if p.dtype not in PROBS_DTYPES:
            raise TypeError(
                f"drafter {name!r}: Draft.probs must be float32, float16 or bfloat16 (what the verifiers read), "
                f"got {p.dtype}"
            )
    return n


def _check_probs(draft: Draft, name: str, used: torch.Tensor) -> None:
    """Draft.probs (when given) holds distributions: finite, non-negative values, and every
    drafted node of a running sequence has q > 0 in its parent's row (it was drawn from it).  A
    q of 0 or NaN at a drafted token would have rejection sampling accept it whatever the
    target says (its test is ``u q(x) < p(x)``): not lossless.  Reads the host's probs; one
    pass over B x N x V values."""
    p = draft.probs
    if p is None:
        return
    if not bool(((p >= 0) & (p < float("inf"))).all()):
        raise ValueError(f"drafter {name!r}: Draft.probs must hold finite values >= 0 (distributions)")
    tokens, parents = draft.tokens.to(p.device, torch.int64), draft.parents.to(p.device, torch.int64)
    rows = torch.arange(tokens.shape[0], device=p.device)[:, None]
    q = p[rows, parents.clamp(min=0), tokens.clamp(0, p.shape[-1] - 1)]  # q of each node's token
    used = used.to(p.device)  # (B, N) bool: the declared nodes of running sequences
    used[:, 0] = False  # the root was not drawn
    bad = used & ~(q > 0)
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"drafter {name!r}: draft token {int(tokens[b, i])} (sequence {b}, node {i}) has probability "
            f"{float(q[b, i])} in Draft.probs row {int(parents[b, i])}, the distribution it was drawn from: "
            "a drafted token needs q > 0 there (with q = 0 rejection sampling would accept it unchecked)"
        )


def _check_parents(parents: List[List[int]], is_chain: bool, name: str, n: List[int]) -> None:
    """parents[b][0] = -1 and 0 <= parents[b][i] < i for every node (host lists); a chain
    (parents[b][i] = i - 1 for the declared nodes) when ``is_chain``."""
    for b, row in enumerate(parents):
        for i, p in enumerate(row):
            if (p != -1) if i == 0 else not 0 <= p < i:
                raise ValueError(
                    f"drafter {name!r}: Draft.parents must satisfy parents[b, 0] = -1 and 0 <= parents[b, i] < i "
                    f"(padding nodes too); sequence {b}, node {i} has parent {p}"
                )
    if is_chain and any(row[i] != i - 1 for row, nb in zip(parents, n) for i in range(1, nb)):
        raise ValueError(
            f"drafter {name!r}: Draft.is_chain is True but the parents are not a chain (parents[b, i] = i - 1)"
        )


def feature_layer_kwargs(drafter: Drafter, model) -> Dict[str, Tuple[int, ...]]:
    """``{"hidden_layers": drafter.feature_layers}`` for the target's forward when the drafter
    wants hidden states and names layers, else {} (so targets without the argument, such as
    transformers models, are called as before).

    Raises:
        ValueError, TypeError: feature_layers not distinct ints in [0, the model's layers)
            (``checks.layer_indices``).
    """
    layers = getattr(drafter, "feature_layers", ()) if getattr(drafter, "wants_hidden", False) else ()
    layers = layer_indices("drafter.feature_layers", layers, getattr(model.args, "num_layers", None))
    return {"hidden_layers": layers} if layers else {}
