"""Token-tree helpers: ancestor masks, depths, Medusa choices, merging drafts into a trie,
and conversion from and to SGLang's linked-list trees.

A token tree is a parent list in topological order: ``parents[0] = -1`` (node 0 is the root,
the last committed token) and ``0 <= parents[i] < i``.  Plain Python lists or int tensors are
accepted; tensors come back as int64 (or bool for masks) on the input's device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from specdec_kernels.checks import (
    INDEX_DTYPES, as_int, as_int_list, check_counts, check_parents, check_shape, check_tensor, want_value_checks,
)

Parents = Union[torch.Tensor, Sequence[int]]


def _as_parents(parents: Parents, device=None) -> torch.Tensor:
    if not isinstance(parents, torch.Tensor):
        rows = list(parents)
        if rows and all(isinstance(r, (list, tuple)) for r in rows):  # (batch, N) as nested lists
            parents = torch.tensor([as_int_list(f"parents[{b}]", r) for b, r in enumerate(rows)], dtype=torch.int64, device=device)
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

    The rotary position of node i is ``cache_seqlens - 1 + depth[i]`` when the root is the last
    committed token, so siblings share a position.

    Raises:
        ValueError/TypeError: parents not a topologically ordered parent list.
    """
    p = _as_parents(parents)
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
    p = _as_parents(parents)
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
    t = _as_parents(parents)
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


def merge_trees(root_token: int, trees: Sequence[Tuple[Sequence[int], Sequence[int]]], max_nodes: Optional[int] = None) -> TokenTree:
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
            raise ValueError(f"trees[{d}]: parents must satisfy 0 <= parents[i] < i (topological order); "
                             f"node {bad} has parent {parents[bad]}")
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


class SGLangTree(NamedTuple):
    """A SGLang linked-list tree renumbered into our parent-list form (``from_sglang_tree``).

    Shapes are for a batch, (B, N) and (B,); one (N,) tree gives (N,) and 0-d tensors.

    Attributes:
        parents: int64 (B, N), topological: parents[b, 0] = -1 and 0 <= parents[b, i] < i.
            Nodes at or past num_nodes[b] (unreachable from the root) get parent 0.
        order: int64 (B, N), a permutation of 0..N-1 per row: our node i is SGLang's local
            node order[b, i] (order[b, 0] = 0, the root).  Gather SGLang's per-node data into
            our order with it, e.g. ``candidates.gather(1, order)``.
        num_nodes: int64 (B,): nodes reachable from the root, root included (1..N).
        depths: int64 (B, N): depth of our node i (root 0), nondecreasing in i; -1 past
            num_nodes.
    """

    parents: torch.Tensor
    order: torch.Tensor
    num_nodes: torch.Tensor
    depths: torch.Tensor


def _check_links(name: str, t, shape=None, device=None) -> None:
    check_tensor(name, t, ndim=(1, 2), dtypes=INDEX_DTYPES, device=device)
    if shape is not None:
        check_shape(name, t, shape, "like retrive_next_token")
    if t.shape[-1] < 1:
        raise ValueError(f"{name} must hold at least the root (N >= 1), got shape {tuple(t.shape)}")
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: walking a token tree needs its link values")


def from_sglang_tree(
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    *,
    validate: Optional[bool] = None,
) -> SGLangTree:
    """Renumber SGLang's first-child / next-sibling trees into parent lists.

    SGLang's speculative kernels (sgl-kernel ``build_tree_kernel_efficient``,
    ``verify_tree_greedy``, ``tree_speculative_sampling_target_only``) store a tree of N local
    nodes (node 0 the root, the last verified token) as two linked lists per node: the first
    child and the next sibling, -1 ending a list.  They try a node's children in list order;
    our ops try them in index order.  This walks the tree breadth-first from the root, a
    node's children in list order, and numbers the nodes in the order met, so that:

    * our parent list is topological (parents[i] < i) and nodes are sorted by depth;
    * the children of every node get consecutive indices in SGLang's list order, so our ops
      try them in the same order as SGLang's kernels and verification results are the same;
    * nodes not reachable from the root (padding rows with -1 links, a sibling of the root,
      nodes SGLang's tree builder skipped) are counted out of ``num_nodes`` and placed last,
      in ascending SGLang index.

    A tree that ``build_tree_kernel_efficient`` built (children in ascending index order,
    parents before children, depth-sorted) comes back with ``order`` the identity when its
    nodes are already breadth-first.

    Vectorised over the batch with tensor ops on the input's device: at most 2N - 1 steps (one
    node placed or one child list started per step and row), no value read on the host except
    for the value checks (and, on CPU tensors only, an early exit once every row is done).
    Each step is some 25 small tensor ops, so the walk is launch-bound on CUDA: for N = 64
    about 3,000 ops (about 50 ms on one CPU thread, batch 64; not measured on a GPU).

    Args:
        retrive_next_token: Shape (batch, N) or (N,), int32/int64: local index of node i's
            first child, or -1.
        retrive_next_sibling: Same shape and device, int32/int64: local index of node i's
            next sibling, or -1.  The root's entry is never read.
        validate: check link values (default: on CPU tensors; on CUDA it costs a sync).

    Returns:
        SGLangTree(parents, order, num_nodes, depths).

    Raises:
        TypeError: not integer tensors.
        ValueError: wrong rank or shapes, N = 0, and when values are checked: a link outside
            -1..N-1, or a link that reaches a node already in the tree (a cycle, the root, a
            node with two parents), naming the argument that holds the link.  Unchecked, an
            out-of-range link ends its list and a row's walk stops at a link to a node it has
            already reached, so the result is always a valid tree (the part walked so far).

    Example:
        The root's children listed as [3, 1] (node 3 first), node 1 with child 2, node 3 with
        child 4: next_token = [3, 2, -1, 4, -1], next_sibling = [-1, -1, -1, 1, -1] give
        order = [0, 3, 1, 4, 2], parents = [-1, 0, 0, 1, 2], depths = [0, 1, 1, 2, 2].
    """
    _check_links("retrive_next_token", retrive_next_token)
    device = retrive_next_token.device
    _check_links("retrive_next_sibling", retrive_next_sibling, tuple(retrive_next_token.shape), device)
    batch_shape, N = tuple(retrive_next_token.shape[:-1]), retrive_next_token.shape[-1]
    links = {
        "retrive_next_token": retrive_next_token.reshape(-1, N).to(torch.int64),
        "retrive_next_sibling": retrive_next_sibling.reshape(-1, N).to(torch.int64),
    }
    check = want_value_checks(validate, retrive_next_token, retrive_next_sibling)
    if check:
        for name, t in links.items():
            out_of_range = (t < -1) | (t >= N)
            if out_of_range.any():
                b, i = (int(v) for v in out_of_range.nonzero()[0])
                raise ValueError(f"{name} must hold local node indices in -1..{N - 1}, got {int(t[b, i])} at [{b}, {i}]")
    # unchecked, an out-of-range link ends its list
    next_token, next_sibling = (torch.where((t >= 0) & (t < N), t, -1) for t in links.values())
    B = next_token.shape[0]

    def take(t, idx):  # t[b, idx[b]] per row
        return t.gather(1, idx[:, None]).squeeze(1)

    i64 = dict(dtype=torch.int64, device=device)
    spare = torch.full((B,), N, **i64)

    def put(t, idx, value, where):  # t[b, idx[b]] = value[b] where where[b]; column N is spare
        t.scatter_(1, torch.where(where, idx, spare)[:, None], value[:, None])

    order = torch.zeros((B, N + 1), **i64)  # our index -> SGLang index (placed nodes)
    ours = torch.full((B, N + 1), -1, **i64)  # SGLang index -> our index, -1 until placed
    ours[:, 0] = 0
    parents = torch.zeros((B, N + 1), **i64)
    parents[:, 0] = -1
    depths = torch.full((B, N + 1), -1, **i64)
    depths[:, 0] = 0
    count = torch.ones(B, **i64)  # nodes placed
    expanding = torch.zeros(B, **i64)  # our index of the node whose child list is walked
    cand = next_token[:, 0].clone()  # the next node of that list (SGLang index), -1 at its end
    done = torch.zeros(B, dtype=torch.bool, device=device)
    if check:  # where a row's walk met a node twice: for the error message only
        holder = torch.zeros(B, **i64)  # the SGLang node whose link gave cand
        via_sibling = torch.zeros(B, dtype=torch.bool, device=device)
        bad_kind = torch.zeros(B, **i64)  # 1: a next_token link, 2: a next_sibling link
        bad_holder = torch.zeros(B, **i64)
        bad_target = torch.zeros(B, **i64)
    host_shortcuts = device.type == "cpu"  # elsewhere no value is read on the host

    # Per step and row: place cand as the next node, or (at the end of a list) start the
    # child list of the next placed node.  N - 1 placements and N list starts at most.
    for _ in range(2 * N - 1):
        live = ~done
        emit = live & (cand >= 0)
        c = cand.clamp(min=0)
        clash = emit & (take(ours, c) >= 0)
        new = emit & ~clash
        if check:
            bad_kind = torch.where(clash, torch.where(via_sibling, 2, 1), bad_kind)
            bad_holder = torch.where(clash, holder, bad_holder)
            bad_target = torch.where(clash, c, bad_target)
        put(order, count, c, new)  # count < N whenever a new node is placed
        put(ours, c, count, new)
        put(parents, count, expanding, new)
        put(depths, count, take(depths, expanding) + 1, new)
        count = count + new.to(torch.int64)
        advance = live & (cand < 0)
        more = advance & (expanding + 1 < count)
        expanding = torch.where(more, expanding + 1, expanding)
        head_holder = take(order, expanding)
        cand = torch.where(new, take(next_sibling, c), torch.where(more, take(next_token, head_holder), -1))
        if check:
            holder = torch.where(new, c, torch.where(more, head_holder, holder))
            via_sibling = torch.where(new, True, torch.where(more, False, via_sibling))
        done = done | clash | (advance & ~more)
        if host_shortcuts and bool(done.all()):
            break

    if check and bool((bad_kind > 0).any()):
        b = int((bad_kind > 0).nonzero()[0, 0])
        name = "retrive_next_sibling" if int(bad_kind[b]) == 2 else "retrive_next_token"
        raise ValueError(
            f"{name} does not describe a tree: in row {b}, node {int(bad_holder[b])} links to node "
            f"{int(bad_target[b])}, which the walk from the root has already reached (a cycle, a link "
            f"to the root, or a node with two parents)"
        )
    ours, parents, depths = ours[:, :N], parents[:, :N], depths[:, :N]
    # placed nodes keep their index, the others follow in ascending SGLang index
    key = torch.where(ours >= 0, ours, N + torch.arange(N, **i64))
    order = key.argsort(dim=1)
    shape = batch_shape + (N,)
    return SGLangTree(parents.reshape(shape), order.reshape(shape), count.reshape(batch_shape), depths.reshape(shape))


def to_sglang_tree(
    parents: Parents,
    num_nodes: Union[None, int, torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """SGLang's first-child / next-sibling lists of our parent lists (the inverse of
    ``from_sglang_tree`` up to its breadth-first renumbering).

    Each node's children are listed in ascending index order, the order our ops try them, so
    SGLang's kernels on the lists and our ops on ``parents`` verify alike.  (SGLang's
    ``retrive_index`` for the same (batch, N) layout is ``torch.arange(B * N).view(B, N)``.)

    Args:
        parents: (N,) or (batch, N) parent list, parents[0] = -1, 0 <= parents[i] < i (a list
            or an int tensor).
        num_nodes: nodes at or past this count are left out (their links -1, nothing links to
            them): an int or 0-d tensor for one (N,) tree, a (batch,) int tensor for a batch;
            None for all N.

    Returns:
        (retrive_next_token, retrive_next_sibling): int64, the shape of ``parents``, on its
        device; -1 ends a list.

    Raises:
        ValueError/TypeError: parents not a topologically ordered parent list, num_nodes of
            the wrong type, shape or outside 0..N.
    """
    p = _as_parents(parents)
    N = p.shape[-1]
    flat = p.reshape(-1, N)
    B = flat.shape[0]
    if num_nodes is None:
        n = torch.full((B,), N, dtype=torch.int64, device=p.device)
    elif isinstance(num_nodes, torch.Tensor):
        if num_nodes.dim() == 0 and p.dim() == 1:
            num_nodes = num_nodes.reshape(1)
        n = check_counts("num_nodes", num_nodes, B, N, p.device, None)
    else:
        count = as_int("num_nodes", num_nodes)
        if not 0 <= count <= N:
            raise ValueError(f"num_nodes must lie in 0..{N}, got {count}")
        n = torch.full((B,), count, dtype=torch.int64, device=p.device)
    next_token = torch.full_like(flat, -1)
    next_sibling = torch.full_like(flat, -1)
    for i in range(N - 1, 0, -1):  # prepend node i to its parent's list: lists end ascending
        live = i < n
        parent = flat[:, i : i + 1]
        first = next_token.gather(1, parent).squeeze(1)
        next_sibling[:, i] = torch.where(live, first, -1)
        next_token.scatter_(1, parent, torch.where(live, i, first)[:, None])
    return next_token.reshape(p.shape), next_sibling.reshape(p.shape)
