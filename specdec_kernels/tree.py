"""Token-tree helpers: ancestor masks, depths, Medusa choices, merging drafts into a trie,
(SGLang's linked-list trees are converted in ``specdec_kernels.serving.sglang``).

A token tree is a parent list in topological order: ``parents[0] = -1`` (node 0 is the root,
the last committed token) and ``0 <= parents[i] < i``.  Plain Python lists or int tensors are
accepted; tensors come back as int64 (or bool for masks) on the input's device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from specdec_kernels.checks import as_int, as_int_list, check_parents

__all__ = [
    "MedusaTree",
    "Parents",
    "TokenTree",
    "ancestor_mask",
    "as_parents",
    "medusa_choices_to_tree",
    "merge_chains",
    "merge_trees",
    "path_to",
    "tree_depths",
]

# a parent list: a list of ints (or of such lists, a batch) or an integer tensor (N,) / (B, N)
Parents = Union[torch.Tensor, Sequence[int]]


def as_parents(parents: Parents, device=None) -> torch.Tensor:
    """A parent list (or a batch of them) as a checked int64 tensor.

    Args:
        parents: a list of ints, a list of such lists (batch, N), or an integer tensor of shape
            (N,) or (batch, N); ``parents[..., 0] = -1`` and ``0 <= parents[..., i] < i``.
        device: where a list is placed (a tensor keeps its device).

    Returns:
        int64 tensor of the input's shape.

    Raises:
        TypeError: a non-integer entry.  ValueError: wrong rank, no root, not topological.
    """
    if not isinstance(parents, torch.Tensor):
        rows = list(parents)
        if rows and all(isinstance(r, (list, tuple)) for r in rows):  # (batch, N) as nested lists
            parents = torch.tensor(
                [as_int_list(f"parents[{b}]", r) for b, r in enumerate(rows)], dtype=torch.int64, device=device
            )
        else:
            parents = torch.tensor(as_int_list("parents", rows), dtype=torch.int64, device=device)
    if parents.dim() not in (1, 2):
        raise ValueError(f"parents must have shape (N,) or (batch, N), got {tuple(parents.shape)}")
    if parents.shape[-1] == 0:
        raise ValueError("parents must hold at least the root (parents[0] = -1), got an empty list")
    batch = parents.shape[0] if parents.dim() == 2 else 1
    return check_parents("parents", parents, batch, parents.shape[-1], parents.device, True).reshape(parents.shape)


def tree_depths(parents: Parents) -> torch.Tensor:
    """Depth of every node (root 0): int64, shape of ``parents`` ((N,) or (batch, N)).

    The rotary position of node i is ``cache_seqlens[b] + depth[i]``, with ``cache_seqlens``
    as ``tree_attention`` and ``compact_kv_cache`` take it: the tokens already in the KV cache
    before the block, i.e. the committed tokens but the root.  The root (node 0, the last
    committed token, whose K/V the block's forward writes) sits at slot and position
    ``cache_seqlens[b]``, node i at slot ``cache_seqlens[b] + i`` and position
    ``cache_seqlens[b] + depth[i]``; siblings share a position.  For a chain depth[i] = i:
    slot and position agree.

    Raises:
        ValueError/TypeError: parents not a topologically ordered parent list.
    """
    p = as_parents(parents)
    flat = p.reshape(-1, p.shape[-1])
    depth = torch.zeros_like(flat)
    for i in range(1, flat.shape[1]):
        depth[:, i] = depth.gather(1, flat[:, i : i + 1]).squeeze(1) + 1
    return depth.reshape(p.shape)


def ancestor_mask(parents: Parents) -> torch.Tensor:
    """mask[i, j] true when node j is node i or one of its ancestors.

    Args:
        parents: (N,) or (batch, N) parent list, parents[0] = -1, 0 <= parents[i] < i.

    Returns:
        bool tensor (N, N) or (batch, N, N): the ``tree_mask`` of ``tree_attention``.

    Raises:
        ValueError/TypeError: parents not a topologically ordered parent list.
    """
    p = as_parents(parents)
    flat = p.reshape(-1, p.shape[-1])
    B, N = flat.shape
    mask = torch.eye(N, dtype=torch.bool, device=p.device).repeat(B, 1, 1)
    for i in range(1, N):
        mask[:, i] |= mask[torch.arange(B, device=p.device), flat[:, i]]
    return mask.reshape(*p.shape[:-1], N, N)


def path_to(parents: Parents, node: int) -> List[int]:
    """Node indices from the root to ``node`` inclusive, for one (N,) parent list.

    Raises:
        ValueError/TypeError: parents not one topologically ordered (N,) parent list, or node
            outside 0..N-1.
    """
    t = as_parents(parents)
    if t.dim() != 1:
        raise ValueError(f"path_to takes one (N,) parent list, got shape {tuple(t.shape)}")
    p = t.tolist()
    node = as_int("node", node)
    if not 0 <= node < len(p):
        raise ValueError(f"node must lie in 0..{len(p) - 1}, got {node}")
    path = [node]
    while p[path[-1]] >= 0:
        path.append(p[path[-1]])
    return path[::-1]


@dataclass
class MedusaTree:
    """A static tree from Medusa-style choice paths.

    Attributes:
        parents: int64 (N,), node 0 is the root.
        depths: int64 (N,); node i (> 0) is drawn from Medusa head depths[i] - 1.
        topk_index: int64 (N,); node i is the topk_index[i]-th best token of that head (root -1).
        choices: the sorted choice paths, choices[i - 1] belongs to node i.
    """

    parents: torch.Tensor
    depths: torch.Tensor
    topk_index: torch.Tensor
    choices: List[Tuple[int, ...]] = field(default_factory=list)


def medusa_choices_to_tree(choices: Sequence[Sequence[int]]) -> MedusaTree:
    """Parent list from Medusa choice paths, e.g. ``[[0], [0, 0], [1], [0, 1]]``.

    Each path names the top-k rank taken at each depth (Cai et al. 2024, "Medusa").  Nodes are
    ordered by depth then lexicographically, as Medusa does, so parents come first.

    Raises:
        ValueError: an empty or negative path, a duplicate, or a path whose prefix is missing.
    """
    paths = []
    for c in choices:
        path = tuple(as_int_list("choices", c))
        if not path or min(path) < 0:
            raise ValueError(f"choices must be non-empty paths of non-negative ranks, got {list(c)}")
        paths.append(path)
    if len(set(paths)) != len(paths):
        raise ValueError("choices must not repeat a path")
    paths.sort(key=lambda p: (len(p), p))
    index: Dict[Tuple[int, ...], int] = {(): 0}
    parents, depths, topk = [-1], [0], [-1]
    for i, path in enumerate(paths, start=1):
        if path[:-1] not in index:
            raise ValueError(f"choices: the prefix {list(path[:-1])} of {list(path)} is missing")
        index[path] = i
        parents.append(index[path[:-1]])
        depths.append(len(path))
        topk.append(path[-1])
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return MedusaTree(as_t(parents), as_t(depths), as_t(topk), paths)


@dataclass
class TokenTree:
    """A token tree built by merging drafts: tokens[0] is the root; parents topological.

    ``sources[i]`` is the set of draft indices (the position in the merged list) that
    proposed node i, for statistics per drafter.
    """

    tokens: List[int]
    parents: List[int]
    sources: List[set]

    def __len__(self) -> int:
        return len(self.tokens)

    def mask(self) -> torch.Tensor:
        return ancestor_mask(self.parents)

    def depths(self) -> torch.Tensor:
        return tree_depths(self.parents)


def merge_trees(
    root_token: int, trees: Sequence[Tuple[Sequence[int], Sequence[int]]], max_nodes: Optional[int] = None
) -> TokenTree:
    """Merge several draft trees below one root into one trie (shared prefixes deduplicated).

    Args:
        root_token: the last committed token.
        trees: (tokens, parents) pairs; each draft's node 0 is its root and is identified with
            ``root_token`` (its token is ignored); parents topological.
        max_nodes: keep at most this many nodes (root included), drafts in the given order,
            nodes breadth-first within each draft; None keeps all.

    Returns:
        TokenTree; siblings never share a token.

    Raises:
        ValueError: a draft with a malformed parent list or mismatched lengths, a negative
            token, max_nodes < 1.
        TypeError: non-integer tokens, parents or max_nodes.
    """
    if max_nodes is not None:
        max_nodes = as_int("max_nodes", max_nodes)
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1 (the root) or None, got {max_nodes}")
    root_token = as_int("root_token", root_token)
    if root_token < 0:
        raise ValueError(f"root_token must be a token id >= 0, got {root_token}")
    out = TokenTree([root_token], [-1], [set(range(len(trees)))])
    child_of: Dict[Tuple[int, int], int] = {}
    for d, (tokens, parents) in enumerate(trees):
        tokens, parents = as_int_list(f"trees[{d}] tokens", tokens), as_int_list(f"trees[{d}] parents", parents)
        if min(tokens[1:], default=0) < 0:
            raise ValueError(f"trees[{d}]: draft tokens must be ids >= 0, got {min(tokens[1:])}")
        if len(tokens) != len(parents):
            raise ValueError(f"trees[{d}]: tokens and parents differ in length ({len(tokens)} vs {len(parents)})")
        if not tokens:
            continue
        # the parent list's rule, checked on the Python list (a tensor check costs more than the merge)
        if parents[0] != -1:
            raise ValueError(f"trees[{d}]: parents[0] must be -1 (node 0 is the root), got {parents[0]}")
        bad = next((i for i in range(1, len(parents)) if not 0 <= parents[i] < i), None)
        if bad is not None:
            raise ValueError(
                f"trees[{d}]: parents must satisfy 0 <= parents[i] < i (topological order); "
                f"node {bad} has parent {parents[bad]}"
            )
        where = {0: 0}
        for i in range(1, len(tokens)):
            parent = where.get(parents[i])
            if parent is None:  # its parent was cut by max_nodes
                continue
            key = (parent, int(tokens[i]))
            node = child_of.get(key)
            if node is None:
                if max_nodes is not None and len(out) >= max_nodes:
                    continue
                node = len(out)
                child_of[key] = node
                out.tokens.append(int(tokens[i]))
                out.parents.append(parent)
                out.sources.append(set())
            out.sources[node].add(d)
            where[i] = node
    return out


def merge_chains(root_token: int, chains: Sequence[Sequence[int]], max_nodes: Optional[int] = None) -> TokenTree:
    """Merge several drafters' chains (token lists following the root) into one trie.

    Example: root 5 with chains [1, 2, 3] and [1, 4] gives tokens [5, 1, 2, 3, 4] and parents
    [-1, 0, 1, 2, 1].  See ``merge_trees`` for max_nodes and the sources of each node.

    Args:
        root_token: the last committed token (int >= 0).
        chains: each a sequence (or 1-D integer tensor) of draft token ids following the root.
        max_nodes: keep at most this many nodes, root included (None: all).

    Raises:
        ValueError: a negative token id, max_nodes < 1.
        TypeError: non-integer tokens or max_nodes.
    """
    trees = [([root_token] + as_int_list(f"chains[{i}]", c), list(range(-1, len(c)))) for i, c in enumerate(chains)]
    return merge_trees(root_token, trees, max_nodes)
