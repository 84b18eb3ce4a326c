"""SGLang's tree form for greedy tree verification and tree rejection sampling.

SGLang's speculative decoding (sgl-kernel: ``build_tree_kernel_efficient``,
``verify_tree_greedy``, ``tree_speculative_sampling_target_only``) describes each request's
verify tree of N nodes by three (B, N) int64 tensors: ``retrive_index`` (the node's position
in the flat (B * N) per-token outputs, b * N + i), ``retrive_next_token`` (first child) and
``retrive_next_sibling`` (next sibling), -1 ending a list; ``candidates`` (B, N) holds the
token of every node (column 0 the root, the last verified token).  Its kernels return a flat
``predicts`` (B * N), ``accept_index`` (B, num_spec_step) and ``accept_token_num`` (B).

The two functions here take that form, renumber each tree into our parent lists with
``specdec_kernels.tree.from_sglang_tree`` (breadth-first, children in SGLang's list order,
so our ops try siblings in the same order) and run our registered ops
(``torch.ops.specdec.verify_tree_greedy`` and ``torch.ops.specdec.tree_rejection_sample``,
every backend), then write the results back in SGLang's form.  They add no kernel of their
own.  Costs beyond the op: the tree walk (at most 2N - 1 small tensor steps), one gather
that permutes the (B, N, V) rows into our node order (a copy, also when the order is already
the identity), and for the sampler one float64-accumulated row sum of the target rows.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple, Optional, Tuple, Union

import torch

from specdec_kernels import tree_rejection_sample, verify_tree_greedy
from specdec_kernels.checks import (
    FLOAT32_BELOW_ONE,
    FLOAT_DTYPES,
    INDEX_DTYPES,
    as_int,
    check_counts,
    check_probability_values,
    check_shape,
    check_tensor,
    check_uniforms,
    clamp_uniforms,
    want_value_checks,
)
from specdec_kernels.tree import Parents, as_parents

SGLangOutputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# SGLang's launcher floors threshold_acc at this value before dividing by it.
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
                raise ValueError(
                    f"{name} must hold local node indices in -1..{N - 1}, got {int(t[b, i])} at [{b}, {i}]"
                )
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
    p = as_parents(parents)
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


THRESHOLD_ACC_FLOOR = 1e-9


def _check_tree_args(candidates, retrive_index, retrive_next_token, retrive_next_sibling, num_spec_step, validate):
    check_tensor("candidates", candidates, ndim=2, dtypes=INDEX_DTYPES)
    B, N = candidates.shape
    if N < 1:
        raise ValueError(
            f"candidates must have N >= 1 columns (the root at least), got shape {tuple(candidates.shape)}"
        )
    device = candidates.device
    for name, t in (
        ("retrive_index", retrive_index),
        ("retrive_next_token", retrive_next_token),
        ("retrive_next_sibling", retrive_next_sibling),
    ):
        check_tensor(name, t, ndim=2, dtypes=INDEX_DTYPES, device=device)
        check_shape(name, t, (B, N), "one entry per tree node, like candidates")
    num_spec_step = as_int("num_spec_step", num_spec_step)
    if num_spec_step < 1:
        raise ValueError(
            f"num_spec_step must be >= 1 (the width of accept_index: the root and up to num_spec_step - 1 "
            f"drafts), got {num_spec_step}"
        )
    if want_value_checks(validate, retrive_index) and retrive_index.numel() > 0:
        lo, hi = int(retrive_index.min()), int(retrive_index.max())
        if lo < 0 or hi >= B * N:
            raise ValueError(
                f"retrive_index must lie in 0..{B * N - 1} (positions in the flat predicts of B * N entries), "
                f"got values in {lo}..{hi}"
            )
    return B, N, num_spec_step


def _rows(name: str, t, B: int, N: int, device, vocab: Optional[int] = None) -> torch.Tensor:
    """Per-node rows given as (B, N, V) or flat (B * N, V), returned as (B, N, V)."""
    check_tensor(name, t, ndim=(2, 3), dtypes=FLOAT_DTYPES, device=device)
    if t.dim() == 2:
        if t.shape[0] != B * N:
            raise ValueError(f"{name} must have shape ({B}, {N}, V) or ({B * N}, V), got {tuple(t.shape)}")
        t = t.reshape(B, N, t.shape[1])
    elif tuple(t.shape[:2]) != (B, N):
        raise ValueError(f"{name} must have shape ({B}, {N}, V) or ({B * N}, V), got {tuple(t.shape)}")
    if t.shape[2] < 1:
        raise ValueError(f"{name} must have a vocabulary of at least 1, got shape {tuple(t.shape)}")
    if vocab is not None and t.shape[2] != vocab:
        raise ValueError(f"{name} must have the vocabulary of target_probs ({vocab}), got shape {tuple(t.shape)}")
    return t


def _convert(retrive_next_token, retrive_next_sibling, num_spec_step, validate) -> Tuple[SGLangTree, torch.Tensor]:
    tree = from_sglang_tree(retrive_next_token, retrive_next_sibling, validate=validate)
    # SGLang accepts at most num_spec_step - 1 drafts: nodes deeper than that are never tried.
    # Numbered breadth-first, the nodes it can reach are a prefix: they are our num_nodes.
    num_nodes = ((tree.depths >= 0) & (tree.depths < num_spec_step)).sum(dim=1)
    return tree, num_nodes


def _in_our_order(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """rows[b, order[b, i]]: (B, N, V) rows permuted into our node order (a copy)."""
    return rows[torch.arange(rows.shape[0], device=rows.device)[:, None], order]


def _to_sglang_outputs(
    output_tokens, accepted_nodes, num_accepted, order, retrive_index, num_spec_step
) -> SGLangOutputs:
    B, N = output_tokens.shape
    if num_spec_step > N:
        pad = output_tokens.new_full((B, num_spec_step - N), -1)
        nodes, tokens = torch.cat([accepted_nodes, pad], 1), torch.cat([output_tokens, pad], 1)
    else:  # at most num_spec_step - 1 drafts were accepted: the rest is -1
        nodes, tokens = accepted_nodes[:, :num_spec_step], output_tokens[:, :num_spec_step]
    on_path = nodes >= 0
    flat_index = retrive_index.to(torch.int64).gather(1, order.gather(1, nodes.clamp(min=0)))
    accept_index = torch.where(on_path, flat_index, -1)
    total = B * N
    # predicts[retrive_index of the k-th accepted node] = the k-th emitted token; entries off
    # the path and out-of-range indices go to a spare slot past the end
    dest = torch.where(on_path & (flat_index >= 0) & (flat_index < total), flat_index, total)
    predicts = output_tokens.new_full((total + 1,), -1)
    predicts.scatter_(0, dest.reshape(-1), tokens.reshape(-1))
    return predicts[:total].to(torch.int32), accept_index.to(torch.int32), num_accepted.to(torch.int32)


def verify_tree_greedy_sglang(
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    num_spec_step: int,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> SGLangOutputs:
    """Greedy tree verification in SGLang's form, run by our ``verify_tree_greedy``.

    SGLang's ``verify_tree_greedy`` (sgl-kernel ``eagle_utils.cu``): from the root, walk the
    children of the last accepted node in sibling-list order and accept the first whose
    candidate equals the target's argmax at that node, at most num_spec_step - 1 times; write
    each accepted token at ``predicts[retrive_index of its parent]`` and finally the target's
    argmax at the last accepted node (the correction or bonus token) at
    ``predicts[retrive_index of that node]``.  SpecInfer / Medusa greedy tree verification.

    Args:
        candidates: Shape (batch, N), int32/int64: node i's token; column 0 is the root.
        retrive_index: Shape (batch, N), int32/int64 in 0..B*N-1: node i's position in the
            flat ``predicts`` (SGLang builds b * N + i).
        retrive_next_token: Shape (batch, N), int32/int64: first child (local index) or -1.
        retrive_next_sibling: Shape (batch, N), int32/int64: next sibling or -1.  Nodes not
            reachable from the root (padding with -1 links) are ignored.
        target_logits: Shape (batch, N, vocab) or (batch * N, vocab), float32/float16/
            bfloat16: row (b, i) scores the token after local node i.  (SGLang's kernel takes
            the argmax ``target_predict`` and reads it at the flat index retrive_index[b, i],
            which is b * N + i in every tree SGLang builds; here row (b, i) is read.)
        num_spec_step: SGLang's accept_index width (speculative_num_steps + 1): the root and
            up to num_spec_step - 1 accepted drafts.
        backend: our op's backend ("reference", "native", "triton"; None picks).
        validate: value checks (links, retrive_index range); default on CPU tensors only.

    Returns:
        predicts: Shape (batch * N,), int32: at the retrive_index of the k-th node of the
            accepted path (k = 0 the root) the k-th emitted token (the next accepted draft,
            or the target's token after the last accepted node); -1 elsewhere (SGLang leaves
            its caller's fill there).
        accept_index: Shape (batch, num_spec_step), int32: retrive_index of the accepted path,
            starting with the root, then -1.
        accept_token_num: Shape (batch,), int32: accepted drafts (the root not counted); a
            request emits accept_token_num + 1 tokens.

    Raises:
        TypeError: wrong dtypes or non-tensors.
        ValueError: wrong ranks or shapes, num_spec_step < 1, and when values are checked a
            link outside -1..N-1, a cycle or shared node in the lists, retrive_index outside
            0..B*N-1.

    The argmax follows torch.argmax (first maximum; NaN counts as the maximum), as the
    ``target_predict`` SGLang's caller computes.  Outputs are new tensors (SGLang's kernel
    fills caller buffers).  With ``validate=False`` nothing reads tensor values on the host.
    """
    B, N, S = _check_tree_args(
        candidates, retrive_index, retrive_next_token, retrive_next_sibling, num_spec_step, validate
    )
    logits = _rows("target_logits", target_logits, B, N, candidates.device)
    tree, num_nodes = _convert(retrive_next_token, retrive_next_sibling, S, validate)
    out = verify_tree_greedy(
        _in_our_order(logits, tree.order),
        candidates.gather(1, tree.order),
        tree.parents,
        num_nodes,
        backend=backend,
        validate=False,  # the converted tree is valid by construction
    )
    return _to_sglang_outputs(*out, tree.order, retrive_index, S)


def _threshold(name: str, value, low_open: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not ((0.0 < value) if low_open else (0.0 <= value)) or not value <= 1.0:
        raise ValueError(f"{name} must lie in {'(0' if low_open else '[0'}, 1], got {value}")
    return value


def _target_only_coins(p, tokens, tree, num_nodes, coins_sglang, threshold_single, threshold_acc) -> torch.Tensor:
    """Our per-node coins (B, N - 1) that make our deterministic-children test reproduce
    SGLang's target-only test given SGLang's per-node coins (B, N).

    SGLang at node c with coin u tries c's children x_1, x_2, ... and accepts x_k when
    u * threshold_acc <= P_k = p_c(x_1) + ... + p_c(x_k) (or p_c(x_k) >= threshold_single).
    Our op accepts child x_k, once x_1..x_{k-1} are rejected, when coin_k * T_k < p_c(x_k),
    T_k = total_c - P_{k-1} the mass left.  With coin_k = (u * threshold_acc - P_{k-1}) / T_k
    both tests agree (up to rounding at the boundary); coin_k = 0 where the single-token
    threshold accepts.  P counts each sibling token once (our op zeroes a rejected token).
    """
    B, N, V = p.shape
    if N == 1:
        return coins_sglang.new_zeros((B, 0))
    dev = p.device
    par = tree.parents[:, 1:]  # [B, N - 1]: child j + 1's parent, our index
    tok = tokens[:, 1:].to(torch.int64)
    in_vocab = (tok >= 0) & (tok < V)
    rows = torch.arange(B, device=dev)[:, None]
    p_x = p[rows, par, tok.clamp(0, V - 1)].to(torch.float64)
    p_x = torch.where(in_vocab & (p_x > 0), p_x, 0.0)  # negative and NaN entries carry no mass
    row_mass = torch.where(p > 0, p, torch.zeros_like(p)).sum(dim=-1, dtype=torch.float64)  # [B, N]
    u = coins_sglang.to(torch.float64).gather(1, tree.order.gather(1, par))  # SGLang's coin at the parent
    real = torch.arange(1, N, device=dev)[None, :] < num_nodes[:, None]
    # the first child with a given (parent, token): later ones remove no further mass
    key = par * (V + 1) + torch.where(in_vocab, tok, V)
    sorted_key, perm = key.sort(dim=1, stable=True)
    first_sorted = torch.ones_like(sorted_key, dtype=torch.bool)
    first_sorted[:, 1:] = sorted_key[:, 1:] != sorted_key[:, :-1]
    first = torch.zeros_like(first_sorted).scatter(1, perm, first_sorted)
    removed = torch.where(first & real, p_x, 0.0)
    exclusive = removed.cumsum(dim=1) - removed
    # breadth-first numbering keeps siblings consecutive: the mass removed before a child is
    # the prefix sum since its parent's first child
    child = torch.arange(N - 1, device=dev).expand(B, -1)
    first_child = torch.full((B, N), N - 1, dtype=torch.int64, device=dev).scatter_reduce(
        1, par, child, reduce="amin", include_self=True
    )
    before = exclusive - exclusive.gather(1, first_child.gather(1, par).clamp(max=N - 2))
    left = row_mass.gather(1, par) - before
    coin = torch.where(left > 0, (u * max(threshold_acc, THRESHOLD_ACC_FLOOR) - before) / left, 0.0)
    coin = torch.where(in_vocab & (p_x >= threshold_single), 0.0, coin)
    return torch.nan_to_num(coin, nan=0.0).clamp(0.0, FLOAT32_BELOW_ONE).to(torch.float32)


def tree_rejection_sample_sglang(
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    *,
    num_spec_step: int,
    uniform_samples: Optional[torch.Tensor] = None,
    uniform_samples_for_final_sampling: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    backend: Optional[str] = None,
    validate: Optional[bool] = None,
) -> SGLangOutputs:
    """Tree rejection sampling in SGLang's form, run by our ``tree_rejection_sample``.

    Without a draft distribution (``draft_probs`` None, or SGLang's all-zero draft_probs,
    see below) this is SGLang's ``tree_speculative_sampling_target_only`` (sgl-kernel
    ``speculative_sampling.cuh``), the GPU form of EAGLE's sampling verification for
    deterministic (top-k) children: at the last accepted node c with coin u, walk c's
    children in sibling-list order and accept x_k when u <= p_c(x_1) + ... + p_c(x_k), i.e.
    x_k with probability p_c(x_k); when all are rejected (or c has none, or num_spec_step - 1
    drafts are accepted) sample the next token from p_c with the tried tokens removed, by
    inverse CDF with the final uniform.  Our op's deterministic-children rule (Chen et al. /
    Sequoia) with the coins mapped as below takes the same decisions, so given the same
    uniforms the tokens are SGLang's (except within float rounding of a boundary, for target
    rows that sum to 1: SGLang uses the probabilities as given, we normalise a row by its
    mass), and the target distribution is kept exactly.

    With a real ``draft_probs`` (not all zero) our SpecInfer rule runs instead: child x of
    node c is accepted with probability min(1, p'(x) / q_c(x)), the residual updated on
    rejection (see ``tree_rejection_sample``); lossless when the children were drawn from
    q_c.  (SGLang's target-only kernel ignores draft probabilities in its test.)

    Warning, all-zero draft probabilities: SGLang's callers pass ``draft_probs`` filled
    with zeros to mean "no draft distribution" (its kernel writes the rejected tokens'
    probabilities into it).  Our op would read zeros as q = 0, accept every child of
    positive probability and lose the target distribution.  So an all-zero ``draft_probs``
    is taken as None: this costs one reduction over it and one host synchronisation (pass
    None to skip both).  When values are checked, a ``draft_probs`` that is zero only in
    some rows of nodes with children raises ValueError.

    Random numbers (SGLang's): ``uniform_samples`` (B, N), column i the coin used at local
    node i's children (column 0 at the root's), and ``uniform_samples_for_final_sampling``
    (B,), the final sample's uniform, which is our op's ``sample_uniforms``.  Our op takes
    one coin per node; without draft_probs node j's coin is
    (u * threshold_acc - P) / (mass left) with u the coin of j's parent and P the target mass
    of j's earlier siblings (0 where threshold_single accepts), which reproduces SGLang's
    accumulated test; with draft_probs node j's coin is SGLang's column of j itself (the
    root's column is then unused).  Missing uniforms are drawn as SGLang's caller does:
    ``torch.rand(B, N)`` then ``torch.rand(B)`` from ``generator`` (default generator if None).

    Args:
        candidates, retrive_index, retrive_next_token, retrive_next_sibling, num_spec_step,
        backend, validate: as in ``verify_tree_greedy_sglang``.
        target_probs: Shape (batch, N, vocab) or (batch * N, vocab), float32/float16/bfloat16:
            row (b, i) is the target's distribution after local node i.  NaN and negative
            entries carry no mass (with validate=True they are refused, infinities too, as
            ``tree_rejection_sample`` refuses them).
        draft_probs: Same shape, or None: row (b, i) the distribution node i's children were
            drawn from.  All zero means None (see the warning above); never modified.
        uniform_samples: Shape (batch, N), float32/float64 in [0, 1), or None.
        uniform_samples_for_final_sampling: Shape (batch,), float32/float64 in [0, 1), or None.
        generator: a torch.Generator for the uniforms that are not given.
        threshold_single, threshold_acc: SGLang's relaxations, implemented exactly but LOSSY
            below 1 (the default 1.0 is lossless): a child is also accepted when its target
            probability is at least threshold_single (in (0, 1]), and the accumulated test
            becomes u <= P_k / threshold_acc (threshold_acc in [0, 1], floored at 1e-9 as
            SGLang does).  Only without draft probabilities: with a real ``draft_probs``,
            thresholds other than 1 raise ValueError.

    Returns:
        predicts, accept_index, accept_token_num: as in ``verify_tree_greedy_sglang``; the
        token at the last accepted node is the sampled one.

    Raises:
        TypeError: wrong dtypes, non-tensors, a threshold that is not a real number, a
            generator that is not a torch.Generator.
        ValueError: wrong ranks or shapes, num_spec_step < 1, thresholds out of range or not
            1 with draft probabilities, and when values are checked: bad links, retrive_index
            out of range, uniforms outside [0, 1), partly zero draft_probs; with
            validate=True, a negative, NaN or infinite entry of target_probs or draft_probs in
            a row of the tree's nodes.

    Duplicate sibling tokens: SGLang counts a repeated token's probability again in its
    accumulated test (over-sampling that token); our op removes a rejected token once and
    never accepts a repeat, so tokens can differ from SGLang's there (ours stay lossless).
    """
    B, N, S = _check_tree_args(
        candidates, retrive_index, retrive_next_token, retrive_next_sibling, num_spec_step, validate
    )
    device = candidates.device
    p = _rows("target_probs", target_probs, B, N, device)
    V = p.shape[2]
    q = None if draft_probs is None else _rows("draft_probs", draft_probs, B, N, device, vocab=V)
    threshold_single = _threshold("threshold_single", threshold_single, low_open=True)
    threshold_acc = _threshold("threshold_acc", threshold_acc, low_open=False)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if uniform_samples is not None:
        check_uniforms("uniform_samples", uniform_samples, (B, N), device, validate)
        uniform_samples = clamp_uniforms(uniform_samples)
    if uniform_samples_for_final_sampling is not None:
        name = "uniform_samples_for_final_sampling"
        check_uniforms(name, uniform_samples_for_final_sampling, (B,), device, validate)
        uniform_samples_for_final_sampling = clamp_uniforms(uniform_samples_for_final_sampling)
    nonzero_rows = None
    if q is not None:
        nonzero_rows = (q != 0).any(dim=-1)  # [B, N]; NaN counts as non-zero
        if not bool(nonzero_rows.any()):  # the one host synchronisation: SGLang's "no draft probs"
            q = None
        elif threshold_single != 1.0 or threshold_acc != 1.0:
            raise ValueError(
                "threshold_single and threshold_acc other than 1.0 (SGLang's lossy relaxation) apply only "
                f"without draft probabilities, got {threshold_single} and {threshold_acc} with a non-zero draft_probs"
            )
    tree, num_nodes = _convert(retrive_next_token, retrive_next_sibling, S, validate)
    tokens = candidates.gather(1, tree.order)
    if validate:  # probabilities as tree_rejection_sample checks them: only when asked for
        ours = torch.arange(N, device=device)[None, :] < num_nodes[:, None]  # our node i is local node order[b, i]
        used = torch.zeros((B, N), dtype=torch.bool, device=device).scatter_(1, tree.order, ours)
        check_probability_values("target_probs", p, validate, used)
        if q is not None:
            check_probability_values("draft_probs", q, validate, used)
    if q is not None and want_value_checks(validate, q):
        # a node with children whose draft row is all zero would be read as q = 0 (lossy)
        real = (torch.arange(1, N, device=device)[None, :] < num_nodes[:, None]).to(torch.int64)
        has_children = (
            torch.zeros((B, N), dtype=torch.int64, device=device).scatter_add(1, tree.parents[:, 1:], real) > 0
        )
        empty = has_children & ~nonzero_rows.gather(1, tree.order)
        if bool(empty.any()):
            b, i = (int(v) for v in empty.nonzero()[0])
            raise ValueError(
                f"draft_probs must be all zero (SGLang's target-only call) or hold a distribution in every row "
                f"of a node with children; row [{b}, {int(tree.order[b, i])}] is all zero"
            )
    if uniform_samples is None:
        gen_device = generator.device if generator is not None else device
        uniform_samples = torch.rand((B, N), generator=generator, device=gen_device).to(device)
    if uniform_samples_for_final_sampling is None:
        gen_device = generator.device if generator is not None else device
        uniform_samples_for_final_sampling = torch.rand((B,), generator=generator, device=gen_device).to(device)
    p_ours = _in_our_order(p, tree.order)
    if q is None:
        coins = _target_only_coins(p_ours, tokens, tree, num_nodes, uniform_samples, threshold_single, threshold_acc)
    else:
        coins = uniform_samples.to(torch.float32).gather(1, tree.order)[:, 1:].contiguous()
    out = tree_rejection_sample(
        p_ours,
        tokens,
        tree.parents,
        None if q is None else _in_our_order(q, tree.order),
        num_nodes,
        uniform_samples=coins,
        sample_uniforms=uniform_samples_for_final_sampling.to(torch.float32),
        backend=backend,
        validate=False,  # tree valid by construction; uniforms checked above
    )
    return _to_sglang_outputs(*out, tree.order, retrive_index, S)
