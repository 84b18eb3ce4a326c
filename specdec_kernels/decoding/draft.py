"""The drafter interface: propose a chain or a token tree per sequence, observe the result.

A step of speculative decoding (Leviathan et al. 2023; Chen et al. 2023; tree drafts as in
SpecInfer, Miao et al. 2024):

1. ``drafter.propose(request)`` (a ``DraftRequest``: histories, draft depths, active flags,
   the run) returns a ``Draft``: for each sequence a token tree whose node 0 is the root (its
   last committed token) and whose other nodes are draft tokens, in topological order.  A
   chain is the tree with parents ``[-1, 0, 1, ...]``.
2. The engine feeds the whole block to the target model once and verifies it.
3. ``drafter.observe(result)`` (a ``StepResult``: the accepted nodes and counts, and the
   target's argmax or hidden states where the drafter declared it needs them) tells the
   drafter what was accepted (e.g. to compact its own KV cache).  The prefill's result
   (``result.started``) begins a run.

Those two methods are the whole contract (``Drafter``).

Drafters that pick tokens deterministically (n-gram lookup, greedy drafting) hand over no
distribution (``Draft.probs is None``; the verifier treats q as one-hot).  A drafter that
samples passes the distribution it sampled from (``sampling_probs`` of its logits, with the
same temperature / top-k / top-p as the target).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
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
        order is a subtree); probs and tokens are kept as they are.  Returns ``self`` where no
        sequence has more nodes than its limit (the common case: no tensor op).

        Raises:
            ValueError: not one limit per sequence."""
        limits = [max(1, int(m)) for m in max_nodes]
        if len(limits) != self.batch_size:
            raise ValueError(f"max_nodes must hold one limit per sequence ({self.batch_size}), got {len(limits)}")
        if self.num_nodes.device.type == "cpu" and all(n <= m for n, m in zip(self.num_nodes.tolist(), limits)):
            return self
        limit = torch.tensor(limits, dtype=torch.int64, device=self.num_nodes.device)
        return Draft(self.tokens, self.parents, torch.minimum(self.num_nodes, limit), self.probs, self.is_chain)

    @staticmethod
    def from_lists(trees: Sequence[tuple], device="cpu", is_chain: Optional[bool] = None) -> "Draft":
        """From per-sequence (tokens, parents) lists (each with its root first); padding nodes
        are token 0 with parent 0.  One tensor is built per field (host lists, then one copy)."""
        N = max(len(t) for t, _ in trees)
        if N == 0:
            raise ValueError("from_lists: every tree is empty; a draft holds at least its root")
        tokens, parents, num = [], [], []
        chain = True
        for t, p in trees:
            t, p = [int(v) for v in t], [int(v) for v in p]
            n = len(t)
            if len(p) != n:
                raise ValueError(f"from_lists: a tree's tokens ({n}) and parents ({len(p)}) differ in length")
            tokens.append(t + [0] * (N - n))
            parents.append(p + [0] * (N - n) if n else [-1] + [0] * (N - 1))
            num.append(n)
            chain = chain and p == list(range(-1, n - 1))
        return Draft(
            torch.tensor(tokens, dtype=torch.int64, device=device),
            torch.tensor(parents, dtype=torch.int64, device=device),
            torch.tensor(num, dtype=torch.int64, device=device),
            None,
            chain if is_chain is None else is_chain,
        )


def chain_parents(n: int) -> List[int]:
    """Parent list of a chain of n nodes (root included)."""
    return list(range(-1, n - 1))


@dataclass(frozen=True)
class DraftRun:
    """What stays fixed for one ``generate`` call, as a drafter sees it.

    Attributes:
        capacity: KV-cache slots per sequence (a drafter's own cache needs no more).
        sampling: the run's ``SamplingParams`` (a sampling drafter draws with the same
            temperature / top-k / top-p as the target).
        generators: one CPU ``torch.Generator`` per sequence for the drafter's own sampling
            (seeded from the request's seed, apart from the verifier's), or None.
        coupling: the run's ``GumbelCoupling`` in a sampling run with the Gumbel coupling, else
            None: a drafter that samples draws with ``coupling.noise(b, t)`` (``argmax log q +
            G``, the Gumbel-top-k for several children), so that its drafts match the target's
            own samples.
        cache_layout: the engine's ``paged.CacheLayout`` (dense, paged, prefix sharing): a
            drafter with a KV cache of its own lays it out the same way.
        target: the target model (a ``Transformer``), or None when the drafter may not read it.
        target_kv_cache: the target's KV cache (dense tensor or ``PagedKVCache``), offered to a
            drafter that runs the target's own layers (layer skip); None when another drafter
            of a composite already took it.
        stats: the run's ``DecodeStats`` (a composite drafter records per-drafter counters
            in ``stats.drafters``), or None.
        calibration: the run's ``engine.calibration.Calibration`` (one object, whose
            measurements grow step by step) when the draft-length policy is a cost model
            (``CostModelPolicy``): the target pass's measured cost by node count and the
            measured acceptance, which a drafter that sizes its trees by cost
            (``adaptive.TreeBudget``) reads and where it keeps its tree calibration; else None
            (a fixed K, another policy, a caller's own ``start``/``step`` loop: a budget then
            keeps ``max_nodes``).
    """

    capacity: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generators: Optional[Sequence[torch.Generator]] = None
    coupling: Optional[object] = None
    cache_layout: Optional[object] = None
    target: Optional[object] = None
    target_kv_cache: Optional[object] = None
    stats: Optional[object] = None
    calibration: Optional[object] = None


@dataclass(frozen=True)
class DraftRequest:
    """What ``Drafter.propose`` is asked for, once per step (its ``state``).

    Attributes:
        histories: per sequence, its committed token ids (prompt and generated; B tuples, the
            engine's copies: nothing a drafter does to them reaches the engine); the last one is
            the root of this step's draft.
        num_draft_tokens: ONE INT PER SEQUENCE: the most draft tokens sequence b may get this
            step (the depth of a tree); it changes from step to step (the draft-length policy),
            and 0 asks for the root alone.
        active: per sequence, still running; a finished sequence's row is ignored (give it the
            root alone).
        run: the run's ``DraftRun``.
    """

    histories: Sequence[Sequence[int]]
    num_draft_tokens: Sequence[int]
    active: Sequence[bool]
    run: DraftRun

    @property
    def batch_size(self) -> int:
        return len(self.histories)


@dataclass(frozen=True)
class TargetFeatures:
    """The target's hidden states a drafter declared it needs (``wants_hidden``,
    ``context_window``, ``feature_layers``), of the positions just committed.

    Attributes:
        last: (B, H') the target's final hidden state (after its final norm) at the position
            just before the next root: of the last accepted node after a step, of the prompt's
            second-to-last token after the prefill.  H' = hidden_size * (1 + len(feature_layers)):
            with ``feature_layers`` the outputs of those target layers are appended, in that
            order (EAGLE-3's multi-layer features).  Rows where ``valid[b]`` is False are
            meaningless.
        context: with ``context_window`` W > 0, per sequence (n_b, H') the hidden states of its
            newly committed positions ``context_positions[b]`` .. + n_b - 1 (after the prefill the
            last W fed prompt positions, after a step the accepted path, root first), or None
            (none, or not active); None when the drafter has no context window.
        context_positions: per sequence, the cache position of ``context[b]``'s first row.
        valid: per sequence, whether its ``last`` row (and ``context[b]``) holds a hidden state:
            False for a sequence that is not running, or after the prefill of a one-token
            prompt (no position was fed).
    """

    last: torch.Tensor
    valid: Sequence[bool]
    context: Optional[Sequence[Optional[torch.Tensor]]] = None
    context_positions: Optional[Sequence[int]] = None


@dataclass(frozen=True)
class StepResult:
    """What a step produced, as ``Drafter.observe`` receives it; the prefill is the step that
    starts a run (``started``: no draft was verified, the histories are the prompts).

    Attributes:
        histories: per sequence, its committed tokens after the step (the next roots last;
            tuples, the engine's copies).
        active: per sequence, still running after the step (after the prefill: all).
        run: the run's ``DraftRun`` (new with every ``generate`` call).
        accepted_nodes: (B, N) int64 on the host, the accepted path in the draft's node indices
            (root first, then -1); None after the prefill.
        num_accepted: (B,) int64 on the host, accepted draft tokens (root not counted, the
            ops' meaning); None after the prefill.
        num_nodes: (B,) int64 on the host, the nodes each sequence's verified draft had; None
            after the prefill.
        target_argmax: (B, N) int64 on the host, the target's most likely next token at every
            node of the verified draft, at any temperature (lookahead's Jacobi update); only
            for a drafter with ``wants_target_argmax``, else None.  Entries at or past
            ``num_nodes[b]`` are meaningless.
        features: the hidden states the drafter declared it needs (``TargetFeatures``), else
            None.
    """

    histories: Sequence[Sequence[int]]
    active: Sequence[bool]
    run: DraftRun
    accepted_nodes: Optional[torch.Tensor] = None
    num_accepted: Optional[torch.Tensor] = None
    num_nodes: Optional[torch.Tensor] = None
    target_argmax: Optional[torch.Tensor] = None
    features: Optional[TargetFeatures] = None

    @property
    def started(self) -> bool:
        """True for the prefill's result: a new run begins (reset per-batch state)."""
        return self.accepted_nodes is None

    @property
    def batch_size(self) -> int:
        return len(self.histories)


class Drafter:
    """Base class of drafters: ``propose(request) -> Draft`` and ``observe(result)``.

    The engine calls ``observe`` once after the prefill (``result.started``: a new run, reset
    per-batch state; ``result.features`` holds the prompt's hidden states where declared), then
    per step ``propose`` with a ``DraftRequest`` and ``observe`` with the step's ``StepResult``.
    That is the whole contract between the engine and a drafter (issue #57); what else a
    drafter declares are class attributes:

    * ``name``: used by the engine's error messages and statistics;
    * ``default_k`` and ``drafts_free``: its default draft length and whether its drafts cost
      no model pass of its own (the adaptive policies' start);
    * ``wants_hidden`` (with ``context_window`` and ``feature_layers``) and
      ``wants_target_argmax``: what ``StepResult.features`` and ``target_argmax`` carry.

    The base ``observe`` keeps the run (``self.run``; ``sampling``, ``generators`` and
    ``coupling`` read it): an override calls ``super().observe(result)``.  Two optional
    capabilities sit outside the contract: ``chain_begin`` / ``chain_extend`` (a member of an
    ``EnsembleDrafter``) and ``draft_sources`` (per-source statistics of ``CostModelPolicy``).
    """

    name = "drafter"
    #: the drafter's default draft length: the K of ``policy="fixed"`` and the cap of the
    #: adaptive policies (``adaptive.default_policy``), declared by each drafter
    default_k = 4
    #: True for drafts that cost no model pass of their own (prompt lookup, lookahead): the
    #: cost model then starts at K = 4 instead of a short warm-up from K = 1
    drafts_free = False
    wants_hidden = False  # True: StepResult.features holds the target's hidden states
    context_window = 0  # > 0 (with wants_hidden): features.context holds the committed positions'
    #: with wants_hidden: target layers whose outputs the engine appends to the final hidden
    #: state it hands over (``Transformer.forward``'s ``hidden_layers``; EAGLE-3's features)
    feature_layers: Tuple[int, ...] = ()
    wants_target_argmax = False  # True: StepResult.target_argmax is set (lookahead decoding)
    #: cost counters a drafter with a model keeps: tokens fed through it, bytes of its own KV cache
    model_tokens = 0
    kv_cache_bytes = 0
    run: Optional[DraftRun] = None

    def propose(self, request: DraftRequest) -> Draft:
        """This step's draft: per sequence a chain or a token tree below its root
        (``request.histories[b][-1]``), at most ``request.num_draft_tokens[b]`` deep.

        Args:
            request: the batch's histories, draft depths and active flags, and the run.

        Returns:
            A ``Draft`` with one row per sequence (the engine checks it and names the drafter
            in a ``ValueError`` / ``TypeError`` when it does not fit).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement propose(self, request) -> Draft")

    def observe(self, result: StepResult) -> None:
        """What the step accepted (or, with ``result.started``, that a run begins).  The base
        keeps ``result.run``; an override calls it."""
        if result.started:
            self.run = result.run

    @property
    def sampling(self) -> SamplingParams:
        """The run's sampling parameters (greedy before the first run)."""
        return self.run.sampling if self.run is not None else SamplingParams()

    @property
    def generators(self) -> Optional[Sequence[torch.Generator]]:
        """The run's per-sequence generators for the drafter's own sampling."""
        return self.run.generators if self.run is not None else None

    @property
    def coupling(self):
        """The run's ``GumbelCoupling``, or None."""
        return self.run.coupling if self.run is not None else None

    # ------------------------------------------------------------------ chain distributions
    # Optional, outside the contract: drafters that implement these two methods can take part
    # in ensemble averaging (``EnsembleDrafter``), where someone else picks the chain.
    def chain_begin(self, request: DraftRequest, vocab_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Start a chain below each root and return this drafter's distribution of its first
        draft token, instead of drafting.

        The chain's tokens are then chosen by the caller and handed over one depth at a time
        (``chain_extend``); ``observe`` follows as after ``propose`` (the draft is that
        chain).  Distributions follow the run's ``SamplingParams`` like the drafter's own
        sampled drafts (``draft_distribution``: ``sampling_probs`` of its logits; at
        temperature 0 the softmax at temperature 1).

        Args:
            request: as for ``propose``; depth d is asked for when d <= num_draft_tokens[b].
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

    def propose(self, request: DraftRequest) -> Draft:
        return Draft.from_lists([([h[-1]], [-1]) for h in request.histories])
