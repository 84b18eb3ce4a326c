"""The drafter interface: propose a chain or a token tree per sequence, observe the result.

A step of speculative decoding (Leviathan et al. 2023; Chen et al. 2023; tree drafts as in
SpecInfer, Miao et al. 2024):

1. ``drafter.propose(histories, num_draft_tokens, active)`` returns a ``Draft``: for each
   sequence a token tree whose node 0 is the root (its last committed token) and whose other
   nodes are draft tokens, in topological order.  A chain is the tree with parents
   ``[-1, 0, 1, ...]``.
2. The engine feeds the whole block to the target model once and verifies it.
3. ``drafter.observe(accepted_nodes, num_accepted)`` tells the drafter which nodes were
   accepted (e.g. to compact its own KV cache).

Drafters that pick tokens deterministically (n-gram lookup, greedy drafting) hand over no
distribution (``Draft.probs is None``; the verifier treats q as one-hot).  A drafter that
samples passes the distribution it sampled from (``sampling_probs`` of its logits, with the
same temperature / top-k / top-p as the target).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from specdec_kernels import sampling_probs
from specdec_kernels.checks import sampling_temperature, sampling_top_k, sampling_top_p, temperature_is_greedy
from specdec_kernels.reference import sample_from_weights
from specdec_kernels.tree import ancestor_mask


@dataclass
class SamplingParams:
    """Temperature, top-k and top-p, applied to target and drafter alike (``sampling_probs``).

    temperature 0 is greedy decoding (verified with ``verify_greedy`` / ``verify_tree_greedy``).

    ``coupling`` says how a sampling run (temperature > 0) draws its tokens:

    * ``"gumbel"`` (default): the position-keyed Gumbel coupling of ``coupling.py``.  A
      sequence's token at index t is ``argmax(log p_t + G(seed, t))``, so a seeded request's
      tokens depend only on its seed, prompt and these parameters: not on the drafter, K,
      an adaptive policy's choices, the batch or the machine's timing, and they equal plain
      sampling without drafts.
    * ``"rejection"``: lossless rejection sampling with ``max(0, p - q)`` residuals
      (``rejection_sample`` / ``tree_rejection_sample``), the best acceptance for drafters
      that sample their drafts.  The coins a step draws depend on its K, so the tokens do too:
      the engine takes it only with a fixed K (``num_draft_tokens`` and no adaptive policy).

    Attributes:
        temperature: a finite real number >= 0.  A positive temperature <= 2**-150 rounds to
            0 in the float32 kernels: greedy decoding (``greedy`` says so); one above
            float32's largest value (3.4e38) acts as that value.
        top_k: None or an int >= 0 (None and 0 disable it; no bools, no floats).
        top_p: None or a real number in (0, 1]; a positive value below float32's smallest
            normal (e.g. 1e-50) acts as that value (the most probable token and its ties).
        coupling: "gumbel" (default) or "rejection", as above.

    Every field is checked at construction, exactly as given (``specdec_kernels.checks``'s
    sampling checks, which ``sampling_probs`` applies too), so a bad value fails here and not
    in ``generate`` after the prefill.

    Raises:
        TypeError: a field of the wrong type (a bool or a string; a float top_k), named.
        ValueError: NaN or infinite temperature, a negative temperature or top_k, top_p NaN
            or outside (0, 1], an unknown coupling, named.
    """

    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    coupling: str = "gumbel"

    def __post_init__(self):
        sampling_temperature("temperature", self.temperature, finite=True)
        if self.top_k is not None:
            sampling_top_k("top_k", self.top_k)
        if self.top_p is not None:
            sampling_top_p("top_p", self.top_p)
        if self.coupling not in ("gumbel", "rejection"):
            raise ValueError(f"coupling must be 'gumbel' or 'rejection', got {self.coupling!r}")

    @property
    def greedy(self) -> bool:
        """Greedy decoding: temperature 0, or one that rounds to 0 in float32."""
        return temperature_is_greedy(self.temperature)


_TREE_SHAPES: "OrderedDict[tuple, Tuple[torch.Tensor, torch.Tensor]]" = OrderedDict()
MAX_TREE_SHAPES = 64  # distinct parent lists kept (a static tree drafter has one per batch size)


def tree_structure(parents: torch.Tensor, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The depths (B, N) int64 and ancestor mask (B, N, N) bool of parent lists (B, N), on
    ``device``: computed once per distinct parent lists held on the host and kept (at most
    ``MAX_TREE_SHAPES``, least recently used dropped), so a drafter whose tree shape repeats
    (a static EAGLE or Medusa tree) costs a dictionary lookup per step instead of the
    per-node loops of ``ancestor_mask`` and of the depths (issue #55: built once per tree
    shape; a device's entry is a copy of the host's, so each shape is computed once).  Parents
    on another device are computed each time (their values would be a host read).  The returned tensors are shared: read them, never write into them.

    The depth of node i is the number of its ancestors: its mask row's count minus one."""
    key = None
    if parents.device.type == "cpu":
        parents = parents.contiguous()
        key = (tuple(parents.shape), parents.dtype, str(torch.device(device)), parents.numpy().tobytes())
        hit = _TREE_SHAPES.get(key)
        if hit is not None:
            _TREE_SHAPES.move_to_end(key)
            return hit
    if key is not None and torch.device(device).type != "cpu":  # the host's entry, copied over
        depths, mask = tree_structure(parents, "cpu")
    else:
        mask = ancestor_mask(parents)
        depths = mask.sum(dim=-1, dtype=torch.int64) - 1
    hit = (depths.to(device, non_blocking=True), mask.to(device, non_blocking=True))
    if key is not None:
        _TREE_SHAPES[key] = hit
        if len(_TREE_SHAPES) > MAX_TREE_SHAPES:
            _TREE_SHAPES.popitem(last=False)
    return hit


@dataclass
class Draft:
    """Token trees for a batch, padded to N nodes.

    Attributes:
        tokens: (B, N) int64 (int32 is taken too; the engine refuses other dtypes, which the
            embedding cannot index with); tokens[b, 0] is the root (last committed token);
            entries at or past num_nodes[b] are padding (0).
        parents: (B, N) int64 (or int32) parent lists (parents[b, 0] = -1, 0 <= parents[b, i] < i); a
            padding node's parent is 0.
        num_nodes: (B,) int64 in 1..N: the root plus the sequence's draft tokens.
        probs: (B, N, V) float32 or None.  Row i is the distribution node i's children were
            sampled from (for a chain: row j is the distribution of draft j + 1); None when
            the drafts were chosen deterministically.
        is_chain: every sequence's tree is a chain (parents[b, i] = i - 1).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    probs: Optional[torch.Tensor] = None
    is_chain: bool = True

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def depths(self) -> torch.Tensor:
        """(B, N) int64 depth of every node (root 0), on the parents' device."""
        if self.is_chain:
            return torch.arange(self.width, device=self.tokens.device).expand(self.batch_size, -1)
        return tree_structure(self.parents, self.parents.device)[0]

    def mask(self) -> Optional[torch.Tensor]:
        """The ancestor mask (B, N, N) for ``tree_attention``, or None for chains."""
        return None if self.is_chain else tree_structure(self.parents, self.parents.device)[1]

    def truncate(self, max_nodes: Sequence[int]) -> "Draft":
        """Keep at most max_nodes[b] nodes (>= 1) per sequence (a prefix of a topological
        order is a subtree); probs and tokens are kept as they are."""
        limit = torch.tensor(list(max_nodes), dtype=torch.int64, device=self.num_nodes.device).clamp(min=1)
        return Draft(self.tokens, self.parents, torch.minimum(self.num_nodes, limit), self.probs, self.is_chain)

    @staticmethod
    def from_lists(trees: Sequence[tuple], device="cpu", is_chain: Optional[bool] = None) -> "Draft":
        """From per-sequence (tokens, parents) lists (each with its root first)."""
        B = len(trees)
        N = max(len(t) for t, _ in trees)
        tokens = torch.zeros(B, N, dtype=torch.int64)
        parents = torch.zeros(B, N, dtype=torch.int64)
        parents[:, 0] = -1
        num = torch.empty(B, dtype=torch.int64)
        chain = True
        for b, (t, p) in enumerate(trees):
            n = len(t)
            tokens[b, :n] = torch.tensor(t, dtype=torch.int64)
            parents[b, :n] = torch.tensor(p, dtype=torch.int64)
            num[b] = n
            chain = chain and list(p) == list(range(-1, n - 1))
        return Draft(
            tokens.to(device), parents.to(device), num.to(device), None, chain if is_chain is None else is_chain
        )


def chain_parents(n: int) -> List[int]:
    """Parent list of a chain of n nodes (root included)."""
    return list(range(-1, n - 1))


class Drafter:
    """Base class of drafters.  Subclasses implement ``propose`` and may use the hooks.

    The engine calls ``start`` once per generation, then ``propose`` / ``observe`` once per
    step.  ``histories[b]`` is sequence b's committed tokens (prompt and generated), whose
    last element is the root.  ``num_draft_tokens[b]`` is the most draft tokens the sequence
    may get this step (the depth of a tree); it may change from step to step, and 0 asks for
    no drafts (the draft is the root alone).
    """

    name = "drafter"
    #: the drafter's default draft length: the K of ``policy="fixed"`` and the cap of the
    #: adaptive policies (``adaptive.default_policy``), declared by each drafter
    default_k = 4
    #: True for drafts that cost no model pass of their own (prompt lookup, lookahead): the
    #: cost model then starts at K = 4 instead of a short warm-up from K = 1
    drafts_free = False
    wants_hidden = False  # True: the engine calls observe_hidden (Medusa-style drafters)
    context_window = 0  # > 0 (with wants_hidden): the engine also calls observe_context
    #: with wants_hidden: target layers whose outputs the engine appends to the final hidden
    #: state it hands over (``Transformer.forward``'s ``hidden_layers``; EAGLE-3's features)
    feature_layers: Tuple[int, ...] = ()
    wants_target_argmax = False  # True: the engine calls observe_target_argmax (lookahead decoding)
    #: set by the engine before ``start`` in a sampling run with the Gumbel coupling: a drafter
    #: that samples its drafts draws them with ``coupling.noise(b, t)`` (``argmax log q + G``,
    #: the Gumbel-top-k for several children), so that they match the target's own samples
    coupling = None

    def start(self, histories: Sequence[Sequence[int]], capacity: int, sampling: SamplingParams, generators) -> None:
        """Reset for a new batch: ``capacity`` cache slots per sequence; ``generators`` one
        ``torch.Generator`` per sequence for the drafter's own sampling."""
        self.sampling = sampling
        self.generators = generators

    def set_cache_layout(self, layout) -> None:
        """Called by the engine at construction with its ``paged.CacheLayout``: drafters with
        a KV cache of their own lay it out the same way (dense, paged, prefix sharing)."""
        self.cache_layout = layout

    def propose(
        self, histories: Sequence[Sequence[int]], num_draft_tokens: Sequence[int], active: Sequence[bool]
    ) -> Draft:
        raise NotImplementedError

    def draft_sources(self, histories: Sequence[Sequence[int]], active: Sequence[bool]) -> Optional[List[int]]:
        """Optional: per sequence, which of this drafter's sources would draft at the next
        ``propose`` given K >= 1 (an int >= 0, e.g. the index of the sub-drafter of a fallback
        ``MultiDrafter``), known before K is chosen, so that a draft-length policy keeps
        acceptance rates per source (``CostModelPolicy``); entries of inactive sequences are
        ignored.  None (the default): one source, or not known.  It must not change the
        drafter's state."""
        return None

    def observe(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, active: Sequence[bool]) -> None:
        """``accepted_nodes`` (B, N) int64: the accepted path (root first, then -1);
        ``num_accepted`` (B,): accepted drafts (root not counted)."""

    def observe_target_argmax(self, argmax: torch.Tensor, num_nodes: torch.Tensor, active: Sequence[bool]) -> None:
        """Called only when ``wants_target_argmax`` is true, after each target pass and
        before ``observe``: ``argmax`` (B, N) int64, the target's most likely next token at
        every node of the verified block (the draft's node indices; entries at or past
        ``num_nodes[b]`` are meaningless), whatever the sampling settings: what a Jacobi
        iteration needs of the tokens that rode in the pass.  ``active`` as for ``observe``."""

    def observe_hidden(self, hidden: torch.Tensor, active: Sequence[bool]) -> None:
        """Called only when ``wants_hidden`` is true: ``hidden`` (B, hidden_size), the
        target's final hidden state (after its final norm; with ``feature_layers``
        (B, hidden_size * (1 + len(feature_layers))): then the outputs of those layers,
        appended in that order) at the position just before the next root, i.e. of the last
        accepted node (after ``observe``), or of the prompt's second-to-last token (after
        ``start``, for the first root); rows where ``active[b]`` is false are meaningless
        (finished sequences, or a one-token prompt)."""

    def observe_context(
        self, hidden: Sequence[Optional[torch.Tensor]], first_positions: Sequence[int], active: Sequence[bool]
    ) -> None:
        """Called only when ``wants_hidden`` is true and ``context_window`` > 0, before
        ``observe_hidden``: ``hidden[b]`` (n_b, hidden_size; wider with ``feature_layers``,
        as for ``observe_hidden``), the target's final hidden states of sequence b's
        positions ``first_positions[b]`` .. + n_b - 1 (consecutive; None or n_b = 0: none),
        newly committed: after ``start`` the last ``context_window`` fed prompt positions
        (all but the last prompt token, the first root), after each step the accepted path
        (root first).  Entries where ``active[b]`` is false are meaningless."""

    # ------------------------------------------------------------------ chain distributions
    # Optional: drafters that implement these two methods can take part in ensemble
    # averaging (``MultiDrafter(ensemble=True)``), where someone else picks the chain.
    def chain_begin(
        self,
        histories: Sequence[Sequence[int]],
        num_draft_tokens: Sequence[int],
        active: Sequence[bool],
        vocab_size: int,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Start a chain below each root and return this drafter's distribution of its first
        draft token, instead of drafting.

        The chain's tokens are then chosen by the caller and handed over one depth at a time
        (``chain_extend``); the engine's ``observe`` follows as after ``propose`` (the draft
        is that chain).  Distributions follow the run's ``SamplingParams`` like the
        drafter's own sampled drafts (``draft_distribution``: ``sampling_probs`` of its
        logits; at temperature 0 the softmax at temperature 1).

        Args:
            histories, num_draft_tokens, active: as for ``propose``; depth d is asked for
                when d <= num_draft_tokens[b].
            vocab_size: V, the target's vocabulary.

        Returns:
            probs (B, V) float32, each row with ``has[b]`` a distribution; has (B,) bool,
            False where the drafter has no opinion (inactive, K = 0, nothing known).
        """
        raise NotImplementedError(f"{type(self).__name__} hands over no chain distributions")

    def chain_extend(self, tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append ``tokens`` (B,) int64 (the chain's token at the current depth) and return
        the distribution of the next one, as ``chain_begin``."""
        raise NotImplementedError(f"{type(self).__name__} hands over no chain distributions")

    @property
    def has_chain_distributions(self) -> bool:
        """True when the drafter implements ``chain_begin`` / ``chain_extend``."""
        return type(self).chain_begin is not Drafter.chain_begin and type(self).chain_extend is not Drafter.chain_extend


def draft_distribution(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """A drafter's next-token distribution from its logits (..., V): ``sampling_probs`` with
    the run's temperature / top-k / top-p, or at temperature 0 the plain softmax (greedy
    drafts take its argmax either way).  float32."""
    if sampling.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return sampling_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p).float()


def sample_tokens(probs: torch.Tensor, num_samples: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``num_samples`` tokens drawn with replacement from each row of ``probs``, never one of
    probability 0.

    ``torch.multinomial`` (whose stream and results this keeps) can return a token of
    probability 0 for some uniforms: with several samples it takes the first index whose
    cumulative sum is >= u, so token 0 when u is exactly 0 and p(0) = 0 (with one sample it
    takes the argmax of p over exponential draws, where a draw of 0 would make 0 / 0 a NaN).  A
    rejection-sampling verifier accepts such a draft whenever p(x) > 0 (its test is
    ``u q(x) < p(x)`` with q(x) = 0), which biases the output; so each such draw is redrawn
    here by inverse-CDF sampling (``sample_from_weights``, the first index whose cumulative
    sum exceeds u * total) with float64 uniforms from the same generator.

    Args:
        probs: Shape (V,) or (R, V), float: non-negative rows with positive sums (a drafter's
            distributions).
        num_samples: >= 1, per row.
        generator: the sequence's CPU torch.Generator (None: the default one).

    Returns:
        Shape (num_samples,) or (R, num_samples), int64 on probs' device, each token with
        probability > 0 in its row.
    """
    picks = torch.multinomial(probs, num_samples, replacement=True, generator=generator)
    rows, flat = probs.reshape(-1, probs.shape[-1]), picks.view(-1, num_samples)
    bad = ~(rows.gather(1, flat) > 0)
    if bool(bad.any()):
        which = bad.nonzero()[:, 0]  # the row of each bad draw, in the mask's (row-major) order
        u = torch.rand(len(which), generator=generator, dtype=torch.float64).to(probs.device)
        flat[bad] = sample_from_weights(rows[which], u)
    return picks


class NoDrafter(Drafter):
    """Plain autoregressive decoding: the draft is the root alone (one token per target pass)."""

    name = "none"
    default_k = 0

    def propose(self, histories, num_draft_tokens, active):
        return Draft.from_lists([([h[-1]], [-1]) for h in histories])
