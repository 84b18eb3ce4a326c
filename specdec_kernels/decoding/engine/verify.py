"""One step's block for the target, and its verification, chosen from one table.

``build_block`` turns a drafter's ``Draft`` (host tensors) into what the target's pass reads:
tokens, parents, node counts and positions moved to the device without a read, the tree's
mask and depths built once per tree shape on the host (``draft.tree_structure``), the block
padded to its bucket's width with ``node_buckets``.

``verify`` then picks one of the paths of ``VERIFIERS`` by (mode, shape):

| mode | when | chain | tree |
|---|---|---|---|
| "greedy" | temperature 0, or sampling with the Gumbel coupling (greedy verification of the perturbed log-probabilities) | ``verify_greedy`` | ``verify_tree_greedy`` |
| "rejection" | sampling with ``coupling="rejection"`` (lossless: Leviathan et al. 2023, Chen et al. 2023; SpecInfer for trees) | ``rejection_sample`` | ``tree_rejection_sample`` |
| "typical" | ``typical=`` epsilon (Medusa's typical acceptance, lossy) | ``typical_acceptance`` | ``typical_acceptance`` |

The sampling paths' random numbers come from ``random_numbers``: each sequence's own CPU
generator ("generator") or the ops' counter-based Philox numbers from its seed and offset
("philox", computed on the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from specdec_kernels import (
    philox_uniforms,
    rejection_sample,
    sampling_probs,
    sequence_uniforms,
    tree_rejection_sample,
    verify_greedy,
    verify_tree_greedy,
)
from specdec_kernels.decoding.draft import Draft, tree_structure
from specdec_kernels.decoding.engine.state import DecodeState, node_bucket, to_device
from specdec_kernels.decoding.engine.typical import typical_acceptance


@dataclass
class Block:
    """The nodes one step feeds the target, on the device, and their host copies.

    Attributes:
        tokens, parents: (B, width) int64 on the device (padding nodes: token 0, each the child
            of the node before it in a chain, of the root in a tree).
        num_nodes: (B,) on the device; host_num_nodes the same on the host.
        probs: the draft's (B, width, V) probabilities on the device, or None.
        positions: (B, width) int64 rotary positions on the device; host_positions on the host.
        tree_mask: the ancestor mask on the device, or None for a chain.
        host_valid: (B, width) bool, the real nodes.
        depth: (B,) int64 on the host, each draft's depth.
        width: the pass's width; cut: the draft's own width, which results are cut back to.
        is_chain: the draft's shape.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    host_num_nodes: torch.Tensor
    probs: Optional[torch.Tensor]
    positions: torch.Tensor
    host_positions: torch.Tensor
    tree_mask: Optional[torch.Tensor]
    host_valid: torch.Tensor
    depth: torch.Tensor
    width: int
    cut: int
    is_chain: bool


def build_block(draft: Draft, seqlens: List[int], bucket_to: Optional[int], device) -> Block:
    """The target's inputs for ``draft`` after ``seqlens`` cached tokens per sequence (host
    lists): nothing is read from the device.  ``bucket_to``: None, or ``max_draft_nodes`` with
    ``node_buckets`` (the width is then padded up to ``node_bucket``)."""
    host_num_nodes = draft.num_nodes.cpu()
    counts = host_num_nodes.tolist()
    n = max(counts)
    host_tokens, host_parents = draft.tokens[:, :n].cpu(), draft.parents[:, :n].cpu()
    probs = to_device(draft.probs[:, :n], device) if draft.probs is not None else None
    B = host_tokens.shape[0]
    width = node_bucket(n, bucket_to) if bucket_to is not None else n
    if width > n:
        pad = width - n
        host_tokens = torch.nn.functional.pad(host_tokens, (0, pad))
        pad_parents = torch.arange(n - 1, width - 1) if draft.is_chain else torch.zeros(pad, dtype=torch.int64)
        host_parents = torch.cat([host_parents, pad_parents.to(host_parents.dtype).expand(B, pad)], dim=1)
        probs = torch.nn.functional.pad(probs, (0, 0, 0, pad)) if probs is not None else None
    if draft.is_chain:  # from host lists: a chain's depths are its node indices
        tree_mask = None
        host_positions = torch.tensor([[s + d for d in range(width)] for s in seqlens], dtype=torch.int64)
        host_valid = torch.tensor([[d < c for d in range(width)] for c in counts], dtype=torch.bool)
        depth = torch.tensor([c - 1 for c in counts], dtype=torch.int64)
    else:  # once per tree shape, from the host's parent lists (tree_structure)
        host_depths, tree_mask = tree_structure(host_parents, "cpu")[0], tree_structure(host_parents, device)[1]
        host_valid = torch.arange(width)[None, :] < host_num_nodes[:, None]
        host_positions = torch.tensor(seqlens, dtype=torch.int64)[:, None] + host_depths
        depth = torch.where(host_valid, host_depths, 0).max(dim=1).values
    return Block(
        tokens=to_device(host_tokens, device),
        parents=to_device(host_parents, device),
        num_nodes=to_device(host_num_nodes, device),
        host_num_nodes=host_num_nodes,
        probs=probs,
        positions=to_device(host_positions, device),
        host_positions=host_positions,
        tree_mask=tree_mask,
        host_valid=host_valid,
        depth=depth,
        width=width,
        cut=n,
        is_chain=draft.is_chain,
    )


@dataclass
class Verification:
    """How a decoder verifies: its ``typical`` epsilon and alpha (None: lossless) and its
    ``random_source`` ("generator" or "philox")."""

    typical: Optional[float] = None
    typical_alpha: Optional[float] = None
    random_source: str = "generator"


def verify(logits: torch.Tensor, state: DecodeState, block: Block, how: Verification) -> Tuple[torch.Tensor, ...]:
    """The step's verification of the target's ``logits`` (B, width, V) for ``block``:
    (output_tokens (B, width), accepted_nodes (B, width), num_accepted (B,)) on the device."""
    sp = state.sampling
    if sp.greedy:
        mode = "greedy"
    elif how.typical is not None:
        mode = "typical"
    elif state.coupling is not None:
        mode = "greedy"
        # the Gumbel coupling: node i predicts token index positions[i] + 1; greedy verification
        # of log p + G accepts a draft exactly when it is the target's sample
        target_probs = sampling_probs(logits, sp.temperature, sp.top_k, sp.top_p)
        index = torch.where(block.host_valid, block.host_positions + 1, -1)  # on the host: no read
        logits = state.coupling.perturb(target_probs.log(), index)
    else:
        mode = "rejection"
    if mode != "greedy":
        logits = sampling_probs(logits, sp.temperature, sp.top_k, sp.top_p)  # the target's probabilities
    out = VERIFIERS[mode, "chain" if block.is_chain else "tree"](logits, state, block, how)
    if block.is_chain:  # chain verifiers return no nodes: the accepted prefix's
        out, num_accepted = out
        index = torch.arange(block.width, device=out.device).expand(out.shape[0], block.width)
        return out, torch.where(index <= num_accepted[:, None], index, -1), num_accepted
    return out


def _greedy_chain(logits, state, block, how):
    return verify_greedy(logits, block.tokens[:, 1:], block.num_nodes - 1)


def _greedy_tree(logits, state, block, how):
    return verify_tree_greedy(logits, block.tokens, block.parents, block.num_nodes)


def _rejection_chain(probs, state, block, how):
    draft_probs = block.probs[:, : block.width - 1] if block.probs is not None else None
    randoms = random_numbers(state, block, how.random_source)
    return rejection_sample(probs, draft_probs, block.tokens[:, 1:], block.num_nodes - 1, **randoms)


def _rejection_tree(probs, state, block, how):
    randoms = random_numbers(state, block, how.random_source)
    return tree_rejection_sample(probs, block.tokens, block.parents, block.probs, block.num_nodes, **randoms)


def _typical(probs, state, block, how):
    randoms = random_numbers(state, block, how.random_source)
    if "seeds" in randoms:  # the sample uniform: stream 1 at the sequence's offset
        finals = philox_uniforms(randoms["seeds"], randoms["offsets"], 1, 1)[:, 0]
    else:
        finals = randoms["sample_uniforms"]
    return typical_acceptance(
        probs,
        block.tokens,
        block.parents,
        block.num_nodes,
        posterior_threshold=how.typical,
        posterior_alpha=how.typical_alpha,
        sample_uniforms=finals,
    )


def _typical_chain(probs, state, block, how):
    out, _, num_accepted = _typical(probs, state, block, how)
    return out, num_accepted


# (mode, shape) -> the verification path: the one place where a step's path is chosen
VERIFIERS: Dict[Tuple[str, str], Callable] = {
    ("greedy", "chain"): _greedy_chain,
    ("greedy", "tree"): _greedy_tree,
    ("rejection", "chain"): _rejection_chain,
    ("rejection", "tree"): _rejection_tree,
    ("typical", "chain"): _typical_chain,
    ("typical", "tree"): _typical,
}


def random_numbers(state: DecodeState, block: Block, source: str) -> Dict[str, torch.Tensor]:
    """The random-number arguments of this step's sampling op: ``uniform_samples`` and
    ``sample_uniforms`` drawn from each sequence's own generator ("generator": its coins, one
    per draft node, then its sample uniform; finished sequences draw nothing), or ``seeds`` and
    this step's ``offsets`` ("philox"; each sequence's offset then moves past the max(C_b, 1)
    numbers it used, C_b its draft count).  Either way sequence b's numbers depend on its own
    seed and draft counts only, never on the batch.  Any value in [0, 1) is safe, 0 included:
    the accept test ``u q(x) < p(x)`` never accepts p(x) = 0, and the inverse-CDF sample takes
    the first token whose CDF exceeds u * total."""
    counts = block.host_num_nodes.tolist()
    device = block.tokens.device
    if source == "philox":
        offsets = to_device(torch.tensor(state.philox_offsets, dtype=torch.int64), device)
        state.philox_offsets = [o + max(c - 1, 1) for o, c in zip(state.philox_offsets, counts)]
        return {"seeds": state.philox_seeds, "offsets": offsets}
    generators = [None if done else g for g, done in zip(state.generators, state.done)]
    coins, finals = sequence_uniforms(generators, [c - 1 for c in counts], block.width - 1)
    return {"uniform_samples": to_device(coins, device), "sample_uniforms": to_device(finals, device)}
