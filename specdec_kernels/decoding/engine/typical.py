"""Typical acceptance (LOSSY): Medusa's posterior threshold instead of rejection sampling.

Cai et al. 2024, "Medusa", §2.3.1: at temperature > 0 a draft token x following node i is
accepted when

    p_i(x) > min(epsilon, delta * exp(-H(p_i)))

where p_i is the target's distribution after node i and H its entropy (nats).  The
accepted path is the longest root-to-node path whose tokens all pass (ties: the lowest
node index); the bonus token is then sampled from the target's distribution at the last
accepted node.  Defaults follow Medusa's code: posterior_threshold epsilon = 0.09 and
posterior_alpha delta = sqrt(epsilon) = 0.3.

This is **lossy**: the output no longer follows the target distribution exactly (tokens
that are likely enough are accepted outright, which favours the drafter's picks and skews
towards high-probability text, as low-temperature sampling does).  It accepts longer
blocks than lossless rejection sampling when the drafter is good.  The engine uses it only
when asked (``SpeculativeDecoder(..., typical=epsilon)``) and only at temperature > 0
(greedy verification is already exact).

Documented choices: p_i is the distribution the engine samples from
(``sampling_probs``: temperature, then top-k / top-p), and its entropy is taken over the
tokens with p > 0 (Medusa adds 1e-5 inside the logarithm of the temperature-scaled
softmax).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from specdec_kernels.checks import (
    INDEX_DTYPES,
    as_real,
    check_counts,
    check_parents,
    check_probs,
    check_shape,
    check_tensor,
    check_uniforms,
    clamp_uniforms,
)
from specdec_kernels.reference import sample_from_weights

DEFAULT_POSTERIOR_THRESHOLD = 0.09


def mass(x: torch.Tensor) -> torch.Tensor:
    """Non-negative sampling weights: negative entries and NaN carry no mass."""
    return torch.where(x > 0, x, 0)


def typical_thresholds(target_probs: torch.Tensor, posterior_threshold: float, posterior_alpha: float) -> torch.Tensor:
    """min(epsilon, delta * exp(-H(p))) per row.

    Args:
        target_probs: Shape (..., V), float: distributions (negative / NaN entries carry no
            mass; rows are normalised here).
        posterior_threshold: epsilon, in (0, 1].
        posterior_alpha: delta, > 0.

    Returns:
        Shape (...), float64.
    """
    p = mass(target_probs.to(torch.float64))
    total = p.sum(-1, keepdim=True)
    p = p / torch.where(total > 0, total, torch.ones_like(total))
    logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
    entropy = -(p * logp).sum(-1)
    return torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))


def typical_acceptance(
    target_probs: torch.Tensor,
    tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor,
    num_nodes: Optional[torch.Tensor] = None,
    *,
    posterior_threshold: float = DEFAULT_POSTERIOR_THRESHOLD,
    posterior_alpha: Optional[float] = None,
    sample_uniforms: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Typical acceptance over token trees (chains are trees): LOSSY, see the module docstring.

    Args:
        target_probs: Shape (B, N, V), float32/float16/bfloat16: row i is the target's sampling
            distribution after node i (``sampling_probs`` of the verify pass's logits).
        tree_tokens: Shape (B, N), int32/int64: node 0 is the root, nodes 1.. are draft tokens.
        tree_parents: Shape (N,) or (B, N), int: parents[0] = -1, 0 <= parents[i] < i.
        num_nodes: Shape (B,), int in 1..N: nodes per sequence (None: all N).
        posterior_threshold: epsilon in (0, 1] (Medusa's default 0.09).
        posterior_alpha: delta > 0 (default sqrt(epsilon)).
        sample_uniforms: Shape (B,), float in [0, 1): the uniform of each sequence's bonus
            token (inverse-CDF sampling); drawn from ``generator`` when None.
        generator: torch.Generator for sample_uniforms.

    Returns:
        output_tokens: Shape (B, N), int64: the accepted draft tokens, then the bonus token,
            then -1.
        accepted_nodes: Shape (B, N), int64: the accepted path's node indices (0 first),
            then -1.
        num_accepted: Shape (B,), int64: accepted draft tokens (the sequence emits
            num_accepted + 1 tokens).

    Raises:
        ValueError: epsilon NaN or outside (0, 1], delta <= 0 or not finite, shapes that do not match, a
            malformed parent list, counts outside 1..N, uniforms outside [0, 1).
        TypeError: wrong dtypes; epsilon or delta not a real number (a bool included).

    Example: root distribution p_0 = (0.5, 0.3, 0.2) has H = 1.0297 nats, so with
    epsilon 0.09 (delta 0.3) the threshold is min(0.09, 0.3 * 0.357) = 0.09 and a draft
    token 2 (p = 0.2) is accepted while a token with p = 0.05 would not be.
    """
    inputs = (target_probs, tree_tokens, tree_parents, num_nodes, posterior_threshold, posterior_alpha)
    alpha, parents, n, sample_uniforms = _checked_args(*inputs, sample_uniforms, generator)
    B, N, V = target_probs.shape
    rows = torch.arange(B, device=target_probs.device)
    tokens = tree_tokens.to(torch.int64)
    p = mass(target_probs.to(torch.float64))
    best, best_depth, depth = _deepest_typical_node(
        p, tokens, parents, n, typical_thresholds(p, posterior_threshold, alpha)
    )
    accepted_nodes = _path_to(best, depth, parents)
    below = accepted_nodes[:, 1:]  # the accepted drafts, in path order
    output = torch.full((B, N), -1, dtype=torch.int64, device=target_probs.device)
    output[:, : N - 1] = torch.where(below >= 0, tokens.gather(1, below.clamp(min=0)), -1)
    bonus = sample_from_weights(p[rows, best], sample_uniforms)
    output[rows, best_depth] = bonus
    return output, accepted_nodes, best_depth


def _checked_args(target_probs, tree_tokens, tree_parents, num_nodes, epsilon, delta, sample_uniforms, generator):
    """``typical_acceptance``'s checks: (delta, parents (B, N), counts (B,), uniforms (B,))."""
    if not 0 < as_real("posterior_threshold", epsilon) <= 1:
        raise ValueError(f"posterior_threshold must lie in (0, 1], got {epsilon}")
    alpha = math.sqrt(epsilon) if delta is None else float(as_real("posterior_alpha", delta, finite=True))
    if alpha <= 0:
        raise ValueError(f"posterior_alpha must be > 0, got {delta}")
    check_probs("target_probs", target_probs, 3)
    device = target_probs.device
    B, N, V = target_probs.shape
    if N < 1 or V < 1:
        raise ValueError(f"target_probs must have N >= 1 rows and V >= 1 tokens, got shape {tuple(target_probs.shape)}")
    check_tensor("tree_tokens", tree_tokens, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_shape("tree_tokens", tree_tokens, (B, N), "one token per tree node, like target_probs' rows")
    parents = check_parents("tree_parents", tree_parents, B, N, device, True)
    if num_nodes is None:
        num_nodes = torch.full((B,), N, dtype=torch.int64, device=device)
    n = check_counts("num_nodes", num_nodes, B, N, device, True)
    if sample_uniforms is None:
        sample_uniforms = torch.rand(B, generator=generator, dtype=torch.float64).to(device)
    return alpha, parents, n, clamp_uniforms(check_uniforms("sample_uniforms", sample_uniforms, (B,), device))


def _deepest_typical_node(p, tokens, parents, n, thresholds):
    """(best node, its depth, every node's depth) per sequence: the deepest node whose token and
    every ancestor's pass the typical test at their parents (the root when none does)."""
    B, N, V = p.shape
    device = p.device
    rows = torch.arange(B, device=device)
    total = p.sum(-1)
    # ok[b, j]: node j's token passes the test at its parent; path_ok: so do its ancestors
    path_ok = torch.zeros(B, N, dtype=torch.bool, device=device)
    path_ok[:, 0] = True
    depth = torch.zeros(B, N, dtype=torch.int64, device=device)
    best = torch.zeros(B, dtype=torch.int64, device=device)
    best_depth = torch.zeros(B, dtype=torch.int64, device=device)
    for j in range(1, N):
        par = parents[:, j]
        x = tokens[:, j]
        in_vocab = (x >= 0) & (x < V)
        prob = p[rows, par, x.clamp(0, V - 1)] / torch.where(total[rows, par] > 0, total[rows, par], 1.0)
        ok = in_vocab & (prob > thresholds[rows, par]) & (j < n)
        path_ok[:, j] = ok & path_ok[rows, par]
        depth[:, j] = depth[rows, par] + 1
        deeper = path_ok[:, j] & (depth[:, j] > best_depth)
        best = torch.where(deeper, j, best)
        best_depth = torch.where(deeper, depth[:, j], best_depth)
    return best, best_depth, depth


def _path_to(best, depth, parents):
    """(B, N) the path from the root to ``best``, walked up on the device (no host read): the
    node at depth d goes to column d, then -1; a spare column N takes finished walks' writes."""
    B, N = depth.shape
    rows = torch.arange(B, device=depth.device)
    path = torch.full((B, N + 1), -1, dtype=torch.int64, device=depth.device)
    cur, live = best, torch.ones(B, dtype=torch.bool, device=depth.device)
    for _ in range(N):
        at = cur.clamp(min=0)
        path[rows, torch.where(live, depth[rows, at], N)] = torch.where(live, cur, -1)
        cur = parents[rows, at].to(torch.int64)
        live = live & (cur >= 0)
    return path[:, :N]
