"""The speculative decoding loop: prefill, draft, verify, accept, compact.

One step per target forward pass (see ``model.py`` for the position convention):

1. the drafter proposes a chain or a token tree per sequence (root = last committed token);
2. the target model scores the whole block in one pass through ``tree_attention``;
3. verification: ``verify_greedy`` / ``verify_tree_greedy`` at temperature 0; when sampling,
   with ``sampling_probs`` giving the target's distribution, either the same greedy
   verification of the Gumbel-perturbed log-probabilities (the default coupling,
   ``coupling.py``: a seeded sequence's tokens do not depend on the drafts, K or the batch) or
   lossless ``rejection_sample`` / ``tree_rejection_sample`` (``coupling="rejection"``;
   Leviathan et al. 2023, Chen et al. 2023, SpecInfer);
4. the accepted drafts and the bonus token are emitted (cut at a stop token and at
   ``max_new_tokens``); the accepted nodes' K/V are moved into place with
   ``compact_kv_cache``; ``cache_seqlens`` advances by the accepted drafts plus the root.

Sequences of a batch accept different numbers of tokens and finish independently.  The
draft length K may come from a draft-length policy consulted every step (``adaptive.py``);
``typical=`` replaces lossless rejection sampling by Medusa's typical acceptance (LOSSY,
``typical.py``).

The KV caches (the target's and every model drafter's) are dense by default; with
``block_size=`` they are paged (``paged.py``: a block pool and block tables, written and read
through the table), and with ``share_prefix=True`` prompts of a batch that begin with the same
tokens (a common system prompt) share the KV blocks of that prefix, computed once, with
copy-on-write of the block where they diverge.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from specdec_kernels import (
    compact_kv_cache,
    philox_uniforms,
    rejection_sample,
    sampling_probs,
    tree_rejection_sample,
    verify_greedy,
    verify_tree_greedy,
)
from specdec_kernels.checks import INDEX_DTYPES, as_int, as_int_list, as_real, layer_indices
from specdec_kernels.decoding.coupling import GumbelCoupling
from specdec_kernels.decoding.draft import Draft, Drafter, NoDrafter, SamplingParams, tree_structure
from specdec_kernels.decoding.engine.adaptive import (
    CostModelPolicy,
    DraftLengthPolicy,
    FixedPolicy,
    LinearCost,
    resolve_policy,
)
from specdec_kernels.decoding.engine.graphs import CapturedPasses, CudaGraph
from specdec_kernels.decoding.engine.stats import DecodeStats
from specdec_kernels.decoding.engine.threads import ThreadChoice
from specdec_kernels.decoding.engine.typical import typical_acceptance
from specdec_kernels.decoding.model import Transformer
from specdec_kernels.decoding.paged import CacheLayout, PagedKVCache, length_groups


def _drafter_tree(drafter) -> List[Any]:
    """The drafter and, recursively, the sub-drafters it holds (``MultiDrafter.drafters``: a
    list or tuple of drafters; any other ``drafters`` attribute is not followed)."""
    out: List[Any] = []
    todo, seen = [drafter], set()
    while todo:
        d = todo.pop(0)
        if d is None or id(d) in seen:  # each drafter once, even in a cycle
            continue
        seen.add(id(d))
        out.append(d)
        subs = getattr(d, "drafters", None)
        if isinstance(subs, (list, tuple)):
            todo.extend(subs)
    return out


def _per_sequence(name: str, value, batch: int) -> List[int]:
    """An int for every sequence, or a sequence (list, tuple, 1-D tensor) of ``batch`` ints."""
    if isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.dim() == 1):
        out = as_int_list(name, value)
        if len(out) != batch:
            raise ValueError(f"{name} must be an int or one per sequence ({batch}), got {len(out)} values")
        return out
    return [as_int(name, value)] * batch


DraftSchedule = Union[int, Sequence[int], Callable[[int, "DecodeState"], Union[int, Sequence[int]]]]
# where the sampling ops' random numbers come from (``SpeculativeDecoder(random_source=...)``)
RANDOM_SOURCES = ("generator", "philox")
_DRAFT_SEED_OFFSET = 0x5DEECE66D


def make_generators(seeds, batch: int, offset: int = 0) -> List[torch.Generator]:
    """One CPU ``torch.Generator`` per sequence: seeds[b] (a list), or seed + b (an int), or
    seeds drawn from torch's global generator (None)."""
    if seeds is None:
        seeds = [int(torch.randint(0, 2**62, ()).item()) for _ in range(batch)]
    elif isinstance(seeds, int):
        seeds = [seeds + b for b in range(batch)]
    else:
        seeds = [int(s) for s in seeds]
        if len(seeds) != batch:
            raise ValueError(f"seeds must hold one seed per prompt ({batch}), got {len(seeds)}")
    return [torch.Generator().manual_seed((s + offset) % 2**63) for s in seeds]


@dataclass
class StepRecord:
    """What one ``step`` did, per sequence (``DecodeState.last_step``; draft-length policies
    learn from it).

    Attributes:
        ks: K requested (after the cut at max_new_tokens; 0 for finished sequences).
        depths: depth of the draft the drafter made (<= K).
        num_nodes: nodes fed, root included.
        num_accepted: accepted draft tokens.
        active: the sequence was unfinished at the start of the step.
        block_width: nodes fed per sequence in the target pass (the batch's widest draft).
        draft_time, verify_time: seconds of the drafter (propose and observe) and of the
            target pass with verification, for the whole batch.
    """

    ks: List[int]
    depths: List[int]
    num_nodes: List[int]
    num_accepted: List[int]
    active: List[bool]
    block_width: int
    draft_time: float
    verify_time: float


@dataclass
class DecodeState:
    """The state of a batch being decoded (see ``SpeculativeDecoder.start``).

    Attributes:
        histories: per sequence, the committed tokens (prompt then generated); the last one
            is the root of the next draft and is not yet in the KV cache.
        prompt_lengths: per sequence.
        max_new_tokens: per sequence.
        kv_cache: (L, 2, B, Hkv, S, D) the target's KV cache, or a ``PagedKVCache``.
        cache_seqlens: (B,) int32, tokens in the cache per sequence (= len(history) - 1 while
            the sequence is unfinished).
        host_seqlens: the same lengths as a host list, kept by the loop beside cache_seqlens so
            that a step reads none from the device; a caller that changes cache_seqlens itself
            sets this to None (the next step then reads cache_seqlens once).
        done: per sequence, finished (stop token or max_new_tokens).
        generators: one torch.Generator per sequence for verification (sampling).
        coupling: the run's ``GumbelCoupling`` (sampling with ``coupling="gumbel"``), else None.
        stats: the run's ``DecodeStats``.
        last_step: the ``StepRecord`` of the latest step (None before the first).
    """

    histories: List[List[int]]
    prompt_lengths: List[int]
    max_new_tokens: List[int]
    kv_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    done: List[bool]
    generators: List[torch.Generator]
    sampling: SamplingParams
    stats: DecodeStats = field(default_factory=DecodeStats)
    last_step: Optional[StepRecord] = None
    # the target pass's measured cost by nodes per sequence, kept by the decoder across calls of
    # the same kind (numerics, threads, batch size): adaptive policies start from it
    pass_costs: Optional[object] = None
    coupling: Optional[GumbelCoupling] = None
    # per sequence, the drafter's source that drafts next (``Drafter.draft_sources``), set by
    # ``generate`` before a policy with ``per_source`` chooses K; None: one source
    draft_sources: Optional[List[int]] = None
    # the host's copy of cache_seqlens (kept by the loop beside the device tensor, so that a
    # step reads no length from the device); None: read from cache_seqlens once
    host_seqlens: Optional[List[int]] = None
    # random_source="philox": (B,) int64 seeds on the device, and each sequence's next Philox
    # offset on the host (advanced by the numbers a step used, so it never reads the device)
    philox_seeds: Optional[torch.Tensor] = None
    philox_offsets: Optional[List[int]] = None

    @property
    def batch_size(self) -> int:
        return len(self.histories)

    @property
    def capacity(self) -> int:
        if isinstance(self.kv_cache, PagedKVCache):
            return self.kv_cache.capacity
        return self.kv_cache.shape[-2]

    def generated(self, b: int) -> List[int]:
        return self.histories[b][self.prompt_lengths[b] :]

    @property
    def finished(self) -> bool:
        return all(self.done)


@dataclass
class GenerationResult:
    """tokens[b]: the generated tokens of prompt b (a final stop token included)."""

    tokens: List[List[int]]
    stats: DecodeStats


THREADS_ENV = "SPECDEC_ENGINE_THREADS"  # forces the thread count of threads="auto" (an int), or "auto"


class _StepThreads:
    """The intra-op thread count of the decode steps of one ``generate`` call.

    ``"auto"`` on CPU: the candidates are 1, half and all of ``torch.get_num_threads()`` (the
    threads torch would use), chosen per step shape class ("tokens<=N": the verified block's
    size rounded up to a power of two) by the decoder's ``threads.ThreadChoice`` for that
    count, which lives as long as the decoder: a new class runs with one thread (the safe
    default) and is the reference; a count with more threads is timed on a few steps and
    wins only if every one of them was clearly faster (``threads.MARGIN``) than the median
    of fewer threads, the first step that is not ending the trial; trials take at most
    ``threads.BUDGET`` of the process's decoding time (``threads.PROCESS_BUDGET``), so a
    loaded machine, where OpenMP threads wait on each other and two threads were measured 50
    times slower than one, pays for one slow trial and then amortises it, also where every
    call makes a new decoder; a chosen count above one that becomes slower than one thread
    was (load that starts after the choice) is dropped after two steps.  Under
    torch.compile or a dispatch mode nothing is measured and torch's count is kept.  An int
    pins the count; None leaves torch's setting alone.  torch's setting is restored when the
    call ends.  $SPECDEC_ENGINE_THREADS forces a count for "auto".  The count never changes
    results.
    """

    def __init__(self, threads, device: torch.device, stats: DecodeStats, choices: Dict[int, ThreadChoice]):
        self.saved = torch.get_num_threads()
        self.stats = stats
        self.fixed: Optional[int] = None
        self.choice: Optional[ThreadChoice] = None
        if threads is None or device.type != "cpu":
            return
        if threads != "auto":
            self.fixed = int(threads)
            return
        forced = os.environ.get(THREADS_ENV, "auto")
        if forced not in ("", "auto"):
            if not forced.isdigit() or not 1 <= int(forced) <= 1024:
                raise ValueError(f"${THREADS_ENV} must be 'auto' or an int in 1..1024, got {forced!r}")
            self.fixed = int(forced)
            return
        candidates = sorted({1, max(1, self.saved // 2), self.saved})
        if len(candidates) > 1:
            self.choice = choices.get(self.saved)
            if self.choice is None:
                self.choice = choices[self.saved] = ThreadChoice(candidates)

    def run(self, step: Callable[[], object], k, state) -> None:
        if self.choice is None:
            if self.fixed is not None:
                torch.set_num_threads(self.fixed)
                self.stats.threads.setdefault("all", self.fixed)
            step()
            return
        if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
            self.restore()  # nothing to measure: torch's count
            step()
            return
        ks = k if isinstance(k, (list, tuple)) else [k] * state.batch_size
        tokens = sum(int(x) + 1 for x, done in zip(ks, state.done) if not done)
        key = f"tokens<={1 << max(0, tokens - 1).bit_length()}"
        n = self.choice.count(key)
        torch.set_num_threads(n)
        t = time.perf_counter()
        step()
        self.choice.record(key, n, time.perf_counter() - t)
        self.stats.threads[key] = self.choice.chosen(key)

    def restore(self) -> None:
        if torch.get_num_threads() != self.saved:
            torch.set_num_threads(self.saved)


def _feature_layer_kwargs(drafter: Drafter, model) -> Dict[str, Tuple[int, ...]]:
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


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor moved to ``device`` without waiting for the device: ``non_blocking``, so
    that on CUDA the copy is queued behind the stream's work instead of synchronising it (a
    pageable source is staged before the call returns, so the host may reuse it at once)."""
    return t.to(device, non_blocking=True)


def node_bucket(n: int, max_nodes: int) -> int:
    """The width a block of ``n`` nodes per sequence is padded to with ``node_buckets``: the
    next power of two, at most ``max_nodes`` (itself a bucket when it is no power of two), and
    never below n.  E.g. with max_nodes 128: 1, 2, 4, 4, 8, 8, 8, 8, 16, ... for n = 1, 2, ..."""
    return max(n, min(1 << max(n - 1, 0).bit_length(), max_nodes))


def to_host_once(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Int64 tensors of one batch, (B,) or (B, W), copied to the host in one device-to-host
    copy (one synchronisation on CUDA instead of one per tensor): packed as the columns of one
    (B, sum W) tensor, then split back into views of the host copy, each of its own shape."""
    cols = [t if t.dim() == 2 else t[:, None] for t in tensors]
    host = torch.cat([c.to(torch.int64) for c in cols], dim=1).cpu()
    parts = host.split([c.shape[1] for c in cols], dim=1)
    return [(p if t.dim() == 2 else p[:, 0]).contiguous() for p, t in zip(parts, tensors)]


class SpeculativeDecoder:
    """Speculative decoding of a Llama-family ``Transformer`` with any ``Drafter``.

    Args:
        model: the target model.
        drafter: a ``Drafter`` (n-gram, layer-skip, draft model, ...); None decodes plainly,
            one token per target pass.
        stop_token_ids: tokens that end a sequence (emitted, then the sequence stops), e.g.
            the tokenizer's EOS.
        stop_check: None, or ``stop_check(b, history, new) -> Optional[int]`` called each step
            for every sequence that emits tokens, after the cuts at a stop token and at
            max_new_tokens: ``history`` the committed tokens of sequence b before this step,
            ``new`` (non-empty) the tokens it is about to emit.  None emits them all; an int i
            in 1..len(new) emits ``new[:i]`` and ends the sequence (e.g. stop strings, a
            caller's stopping criteria).
        prefill_chunk: prompt tokens fed per prefill pass.
        max_draft_nodes: the most tree nodes (root included) one step may feed; drafts are
            cut to it (and to the cache's capacity).
        policy: the draft-length policy ``generate`` uses when it is given no
            ``num_draft_tokens``: "auto" (default: ``adaptive.default_policy`` of the drafter,
            a cost model of the measured acceptance and pass cost, which also sizes the trees
            of drafters with a tree budget, so that a default run drafts only where drafting
            pays on the machine at hand; with ``coupling="rejection"``, whose tokens depend on
            K, the drafter's fixed default K instead), None (a fixed K of 4), "heuristic",
            "cost-model", "fixed", or a ``DraftLengthPolicy``.
        typical: None (default): lossless verification.  A float epsilon in (0, 1]: at
            temperature > 0 use typical acceptance (Medusa, Cai et al. 2024, §2.3.1: accept
            x when p(x) > min(epsilon, delta * exp(-H(p)))) for chains and trees.  LOSSY:
            the output no longer follows the target distribution exactly.  Greedy runs are
            unaffected.  Medusa's default is 0.09.
        typical_alpha: delta of typical acceptance (default sqrt(epsilon)).
        block_size: None (default): dense KV caches.  An int in 1..256: paged KV caches with
            blocks of that many slots (``paged.PagedKVCache``), for the target and for model
            drafters with caches of their own (a layer-skip drafter runs on the target's).
        share_prefix: with ``block_size``: prompts of a batch that share at least
            ``block_size`` leading tokens share their KV blocks (target and model drafters),
            computed once.  Greedy outputs are those of decoding each prompt alone.
        threads: intra-op threads of the decode steps on CPU.  "auto" (default): one thread
            unless more (half or all of ``torch.get_num_threads()``) were measured clearly
            faster on this decoder's own steps, per step shape class; trials of more threads
            take at most 5% of the process's decoding time and the measurements are kept
            across ``generate`` calls (see ``_StepThreads`` and ``engine.threads``; on a
            machine with other load fewer threads can be many times faster); an int pins it; None leaves torch's setting.  ``stats.threads``
            says what the steps ran with.  The count never changes the tokens.
        node_buckets: False (default): a step feeds the target as many nodes per sequence as
            its widest draft.  True: that width is padded up to the next bucket (``node_bucket``:
            1, 2, 4, 8, ... up to ``max_draft_nodes``) with nodes whose outputs are discarded, so
            that the steps' shapes come from a few buckets (what replaying a captured CUDA graph
            per bucket needs).  The tokens are the same either way: a row of a pass does not
            depend on the other rows.  On CPU the padding costs its rows' compute.
        cuda_graphs: True: the target's verification pass of each shape class (batch, bucket
            width, chain or tree) is captured as a CUDA graph on its first step and replayed
            after (``engine.graphs``; implies ``node_buckets``).  Needs our ``Transformer`` on
            a CUDA device and a dense KV cache (no ``block_size``).  The tokens are those of
            the eager steps.
        random_source: where rejection sampling's random numbers come from.  "generator"
            (default): each sequence's coins and sample uniform are drawn from its own CPU
            ``torch.Generator`` (seeded by ``seeds``) and copied to the device.  "philox":
            counter-based, computed on the device inside the sampling kernels from the
            sequence's seed and a per-sequence offset that the loop advances by the numbers
            each step used (``seeds``/``offsets`` of ``rejection_sample`` and
            ``tree_rejection_sample``; ``specdec_kernels.philox_uniforms`` defines them): no
            random number crosses from the host, as a CUDA-graph step wants.  Either way a
            sequence's tokens depend only on its own seed, and the output follows the target
            distribution; the two sources give different tokens for the same seed.  Greedy
            runs and the Gumbel coupling (which takes no coins) are unaffected.

    Raises:
        ValueError: cuda_graphs without a Transformer on CUDA or with block_size; random_source
            neither "generator" nor "philox"; threads is none
            of those; typical outside (0, 1] or NaN; typical_alpha
            not finite and > 0, or without typical; prefill_chunk or max_draft_nodes < 1; a
            drafter whose ``feature_layers`` are not distinct layers of the model (read here,
            once).
        TypeError: typical or typical_alpha not a real number (a bool included); node_buckets or
            cuda_graphs not a bool;
            prefill_chunk or max_draft_nodes not an int; ``feature_layers`` not a sequence
            of ints.

    Example::

        model, tok = load_smollm2()
        decoder = SpeculativeDecoder(model, NgramDrafter(), stop_token_ids=[tok.eos_token_id])
        result = decoder.generate([prompt_ids], max_new_tokens=128, num_draft_tokens=6)
        print(tok.decode(result.tokens[0]), result.stats.summary())
    """

    def __init__(
        self,
        model: Transformer,
        drafter: Optional[Drafter] = None,
        *,
        stop_token_ids: Sequence[int] = (),
        stop_check: Optional[Callable[[int, List[int], List[int]], Optional[int]]] = None,
        prefill_chunk: int = 512,
        max_draft_nodes: int = 128,
        policy="auto",
        typical: Optional[float] = None,
        typical_alpha: Optional[float] = None,
        block_size: Optional[int] = None,
        share_prefix: bool = False,
        threads: Union[int, str, None] = "auto",
        node_buckets: bool = False,
        cuda_graphs: bool = False,
        random_source: str = "generator",
    ):
        # our Transformer, or an adapter with its call interface (integrations.transformers.HFCausalLM)
        if not isinstance(model, Transformer) and not getattr(type(model), "_specdec_decode_target", False):
            raise TypeError(f"model must be a specdec_kernels.decoding.Transformer, got {type(model).__name__}")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(
                f"drafter must be a Drafter (e.g. NgramDrafter()) or None, got {type(drafter).__name__} {drafter!r}"
            )
        self.model = model
        self.drafter = drafter if drafter is not None else NoDrafter()
        # the target layers whose outputs a drafter that wants hidden states also gets (EAGLE-3)
        self._layer_kwargs = _feature_layer_kwargs(self.drafter, model)
        if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
            raise TypeError(
                f"stop_token_ids must be a sequence of token ids, got {type(stop_token_ids).__name__} {stop_token_ids!r}"
            )
        stops = as_int_list("stop_token_ids", stop_token_ids)
        if stops and (min(stops) < 0 or max(stops) >= model.args.vocab_size):
            raise ValueError(f"stop_token_ids must lie in [0, {model.args.vocab_size}), got {sorted(stops)}")
        self.stop_token_ids = frozenset(stops)
        if stop_check is not None and not callable(stop_check):
            raise TypeError(f"stop_check must be callable or None, got {type(stop_check).__name__}")
        self.stop_check = stop_check
        if as_int("prefill_chunk", prefill_chunk) < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if as_int("max_draft_nodes", max_draft_nodes) < 1:
            raise ValueError(f"max_draft_nodes must be >= 1, got {max_draft_nodes}")
        self.prefill_chunk = prefill_chunk
        self.max_draft_nodes = max_draft_nodes
        self._hidden: Optional[torch.Tensor] = None  # the verified block's hidden states, for wants_hidden
        self._target_argmax: Optional[torch.Tensor] = None  # the block's argmax tokens, for wants_target_argmax
        resolve_policy(policy, self.drafter)  # raises on a bad policy now rather than later
        self.policy = policy
        if typical is not None and not 0 < as_real("typical", typical) <= 1:
            raise ValueError(f"typical (the posterior threshold epsilon) must lie in (0, 1] or be None, got {typical}")
        if typical_alpha is not None and (
            typical is None or not 0 < as_real("typical_alpha", typical_alpha, finite=True)
        ):
            raise ValueError(f"typical_alpha must be finite, > 0 and needs typical, got {typical_alpha}")
        self.typical = typical
        self.typical_alpha = typical_alpha
        if share_prefix and block_size is None:
            raise ValueError("share_prefix=True needs a paged cache: give block_size (e.g. 16)")
        self.cache_layout = CacheLayout(
            paged=block_size is not None, block_size=block_size or 16, share_prefix=bool(share_prefix)
        )
        if not (
            threads is None
            or threads == "auto"
            or (isinstance(threads, int) and not isinstance(threads, bool) and 1 <= threads <= 1024)
        ):
            raise ValueError(f"threads must be 'auto', None or an int in 1..1024, got {threads!r}")
        self.threads = threads
        if random_source not in RANDOM_SOURCES:
            raise ValueError(f"random_source must be one of {RANDOM_SOURCES}, got {random_source!r}")
        self.random_source = random_source
        for flag, value in (("node_buckets", node_buckets), ("cuda_graphs", cuda_graphs)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {value!r}")
        self._passes: Optional[CapturedPasses] = None  # the captured verification passes
        if cuda_graphs:
            if not isinstance(model, Transformer) or model.device.type != "cuda":
                raise ValueError(
                    "cuda_graphs=True needs a specdec_kernels.decoding.Transformer on a CUDA device, got "
                    f"{type(model).__name__} on {getattr(model, 'device', 'an unknown device')}"
                )
            if block_size is not None:
                raise ValueError("cuda_graphs=True needs a dense KV cache (block_size=None)")
            self._passes = CapturedPasses(model, CudaGraph.factory())
        self.node_buckets = node_buckets or cuda_graphs
        # torch's thread count -> the step thread choice of threads="auto", kept across calls
        self.thread_choices: Dict[int, ThreadChoice] = {}
        self.pass_costs: dict = {}  # (numerics, threads, batch, threads arg) -> LinearCost of the target pass
        self._in_use = threading.Lock()  # one generate at a time: the drafter holds a run's state
        vocab = getattr(self.drafter, "vocab_size", None)
        if vocab is not None and vocab != model.args.vocab_size:
            raise ValueError(f"the drafter's vocabulary ({vocab}) differs from the target's ({model.args.vocab_size})")

    # ------------------------------------------------------------------ public loop
    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Union[int, Sequence[int]] = 128,
        num_draft_tokens: Union[DraftSchedule, DraftLengthPolicy, None] = None,
        sampling: Optional[SamplingParams] = None,
        seeds=None,
        on_step: Optional[Callable[[DecodeState], None]] = None,
    ) -> GenerationResult:
        """Generate for a batch of prompts until every sequence stops.

        Args:
            prompts: token ids per sequence (non-empty lists; lengths may differ).
            max_new_tokens: an int, or one per prompt.
            num_draft_tokens: the draft depth K per step: an int, a list (one per sequence),
                ``schedule(step, state)`` returning either, or a ``DraftLengthPolicy``
                (``adaptive.py``) consulted every step.  None: the decoder's ``policy``
                (by default "auto"), or K = 4 when it is None.
            sampling: temperature / top-k / top-p and coupling; default greedy.
            seeds: per-sequence seeds (list), a base seed (int; sequence b uses seed + b) or
                None.  With the default Gumbel coupling sequence b's sampled tokens depend
                only on its own seed, prompt and ``sampling``: not on the drafter, K, the
                policy, the batch or the machine's timing.  With ``coupling="rejection"`` they
                also depend on the K of each step, which must then be fixed by the caller.
            on_step: called with the state after the prefill and after every step (streaming,
                progress; ``state.generated(b)`` holds sequence b's tokens so far).

        Returns:
            GenerationResult(tokens, stats).

        Raises:
            ValueError: ``coupling="rejection"`` with an adaptive draft-length policy (its K
                would depend on the batch and the machine's timing, and so would the
                tokens); and as ``start``.
            RuntimeError: this decoder is decoding already (another thread, or a call from
                ``on_step``): one ``generate`` at a time per decoder; decoders in several
                threads may share one model.
        """
        if not self._in_use.acquire(blocking=False):
            raise RuntimeError(
                f"this SpeculativeDecoder (drafter {getattr(self.drafter, 'name', type(self.drafter).__name__)!r}) "
                "is decoding already, in another thread or in an on_step callback: its drafter and caches hold "
                "that run's state; make one decoder per thread (they may share the model)"
            )
        try:
            return self._generate(prompts, max_new_tokens, num_draft_tokens, sampling, seeds, on_step)
        finally:
            self._in_use.release()

    def _generate(self, prompts, max_new_tokens, num_draft_tokens, sampling, seeds, on_step) -> GenerationResult:
        """``generate``'s body (the caller holds ``_in_use``)."""
        t0 = time.perf_counter()
        if num_draft_tokens is None:
            rejection = (
                isinstance(sampling, SamplingParams) and not sampling.greedy and sampling.coupling == "rejection"
            )
            if rejection and isinstance(self.policy, str) and self.policy == "auto":
                num_draft_tokens = resolve_policy("fixed", self.drafter)  # K must not follow the timing
            else:
                num_draft_tokens = resolve_policy(self.policy, self.drafter) or 4
        policy = num_draft_tokens if isinstance(num_draft_tokens, DraftLengthPolicy) else None
        if (
            isinstance(sampling, SamplingParams)
            and not sampling.greedy
            and sampling.coupling == "rejection"
            and policy is not None
            and not isinstance(policy, FixedPolicy)
            and not isinstance(self.drafter, NoDrafter)
        ):
            raise ValueError(
                f"sampling.coupling='rejection' needs a fixed draft length: the {policy.describe()} policy "
                "chooses K from the batch's acceptance and the measured costs, and rejection sampling's "
                "tokens depend on K; pass num_draft_tokens=<int>, or use coupling='gumbel'"
            )
        state = self.start(prompts, max_new_tokens, sampling, seeds)
        if policy is not None:
            kind = (getattr(self.model, "numerics", None), torch.get_num_threads(), state.batch_size, self.threads)
            state.pass_costs = self.pass_costs.setdefault(kind, LinearCost())
            policy.start(state)
            state.stats.policy = policy.describe()
        # a drafter that sizes its tree by the measured step cost (``adaptive.TreeBudget``),
        # alone or inside a ``MultiDrafter``, reads it from this run's cost-model policy
        budgets = [d.budget for d in _drafter_tree(self.drafter) if getattr(d, "budget", None) is not None]
        threads = None
        try:  # the budgets let go of the policy however the run ends
            for budget in budgets:
                budget.cost = policy if isinstance(policy, CostModelPolicy) else None
            step = 0
            if on_step is not None:
                on_step(state)
            threads = _StepThreads(self.threads, self.model.device, state.stats, self.thread_choices)
            while not state.finished:
                sources_time = 0.0
                if policy is not None:
                    if getattr(policy, "per_source", False):  # which source drafts, before K
                        t = time.perf_counter()
                        state.draft_sources = self._draft_sources(state)
                        sources_time = time.perf_counter() - t
                    k = policy.choose(state)
                else:
                    k = num_draft_tokens(step, state) if callable(num_draft_tokens) else num_draft_tokens
                threads.run(lambda: self.step(state, k), k, state)
                if policy is not None:
                    # asking the drafter for its sources is part of drafting: timed as such
                    state.last_step.draft_time += sources_time
                    state.stats.draft_time += sources_time
                    policy.update(state, state.last_step)
                step += 1
                if on_step is not None:
                    on_step(state)
        finally:
            if threads is not None:
                threads.restore()
            for budget in budgets:
                budget.cost = None
        state.stats.total_time = time.perf_counter() - t0
        return GenerationResult([state.generated(b) for b in range(state.batch_size)], state.stats)

    @torch.inference_mode()
    def start(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Union[int, Sequence[int]] = 128,
        sampling: Optional[SamplingParams] = None,
        seeds=None,
    ) -> DecodeState:
        """Allocate the KV cache, prefill the prompts (all but their last token) and reset the
        drafter.  Step the returned state with ``step``.

        Raises:
            ValueError: no prompts, an empty prompt, token ids outside the vocabulary,
                max_new_tokens < 0 or not one per prompt, or a prompt plus its
                max_new_tokens longer than the model's positions.
            TypeError: non-integer token ids or max_new_tokens, sampling not a SamplingParams.
        """
        histories = [as_int_list(f"prompts[{b}]", p) for b, p in enumerate(prompts)]
        B = len(histories)
        if B == 0:
            raise ValueError("prompts must hold at least one prompt")
        V = self.model.args.vocab_size
        for b, h in enumerate(histories):
            if not h:
                raise ValueError(f"prompts[{b}] is empty (a prompt needs at least one token)")
            if min(h) < 0 or max(h) >= V:
                raise ValueError(f"prompts[{b}] holds token ids outside [0, {V})")
        limits = _per_sequence("max_new_tokens", max_new_tokens, B)
        if min(limits) < 0:
            raise ValueError(f"max_new_tokens must be >= 0, an int or one per prompt, got {max_new_tokens}")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        sampling = sampling or SamplingParams()
        lengths = [len(h) for h in histories]
        # the longest sequence this batch can reach (per sequence: its prompt plus its limit)
        capacity = max(n + m for n, m in zip(lengths, limits)) + self.max_draft_nodes + 1
        if capacity > self.model.args.max_position + self.max_draft_nodes + 1:
            raise ValueError(f"prompt plus max_new_tokens exceed the model's {self.model.args.max_position} positions")
        if self.cache_layout.paged:
            # the shared prefix never reaches the positions whose hidden states a Medusa-style
            # drafter needs from this sequence's own prefill (its context window, its last token)
            keep = (
                max(1, int(getattr(self.drafter, "context_window", 0) or 0))
                if getattr(self.drafter, "wants_hidden", False)
                else 0
            )
            prefixes = [h[: max(0, len(h) - 1 - keep)] for h in histories]
            kv_cache = PagedKVCache.allocate(self.model, prefixes, capacity, self.cache_layout)
        else:
            kv_cache = self.model.new_kv_cache(B, capacity)
        state = DecodeState(
            histories=histories,
            prompt_lengths=lengths,
            max_new_tokens=limits,
            kv_cache=kv_cache,
            cache_seqlens=torch.zeros(B, dtype=torch.int32, device=self.model.device),
            done=[m == 0 for m in limits],
            generators=make_generators(seeds, B),
            sampling=sampling,
        )
        if not sampling.greedy and sampling.coupling == "gumbel":
            state.coupling = GumbelCoupling([g.initial_seed() for g in state.generators], V)
        if self.random_source == "philox":  # a seed's bit pattern as a Philox key
            keys = [(g.initial_seed() + 2**63) % 2**64 - 2**63 for g in state.generators]
            state.philox_seeds = torch.tensor(keys, dtype=torch.int64, device=self.model.device)
            state.philox_offsets = [0] * B
        state.stats.kv_cache_bytes = (
            kv_cache.nbytes if isinstance(kv_cache, PagedKVCache) else kv_cache.numel() * kv_cache.element_size()
        )
        t = time.perf_counter()
        prefill_hidden = self._prefill(state)
        state.stats.prefill_time = time.perf_counter() - t
        t = time.perf_counter()
        if hasattr(self.drafter, "set_cache_layout"):  # model drafters lay out their caches like the target's
            self.drafter.set_cache_layout(self.cache_layout)
        if hasattr(self.drafter, "bind_target_cache"):  # layer-skip drafters read the target's own cache
            self.drafter.bind_target_cache(self.model, kv_cache)
        self.drafter.coupling = state.coupling
        self.drafter.start(histories, capacity, sampling, make_generators(seeds, B, _DRAFT_SEED_OFFSET))
        if hasattr(self.drafter, "bind_stats"):  # e.g. MultiDrafter's per-drafter counters, fresh each run
            self.drafter.bind_stats(state.stats)
        if prefill_hidden is not None:
            last, has, context, first = prefill_hidden
            if context is not None:
                self.drafter.observe_context(context, first, has)
            self.drafter.observe_hidden(last, has)
        state.stats.draft_time += time.perf_counter() - t
        state.stats.kv_cache_bytes += int(getattr(self.drafter, "kv_cache_bytes", 0))
        return state

    def _prefill(self, state: DecodeState):
        """Feed every prompt but its last token (the first root), in chunks, as chains.

        With a shared-prefix paged cache, in two phases: the leaders from position 0, then
        (after the copy-on-write of partly shared blocks) the followers from the end of the
        prefix they share, attending to the leader's blocks of it.

        For a drafter that ``wants_hidden`` returns (hidden (B, hidden_size; wider with its
        ``feature_layers``) of each prompt's last fed token, has_hidden per sequence, context,
        first): with a ``context_window`` W > 0, context[b] holds the hidden states of the
        last W fed positions of sequence b (from position first[b]), else context is None;
        for other drafters None."""
        device = self.model.device
        fed = [n - 1 for n in state.prompt_lengths]
        B = state.batch_size
        wants = getattr(self.drafter, "wants_hidden", False)
        window = int(getattr(self.drafter, "context_window", 0) or 0) if wants else 0
        width = self.model.args.hidden_size * (1 + len(self._layer_kwargs.get("hidden_layers", ())))
        last = torch.zeros(B, width, dtype=self.model.dtype, device=device) if wants else None
        first = [max(0, f - max(window, 1)) for f in fed]  # the fed positions whose hidden states are kept
        kept: List[List[torch.Tensor]] = [[] for _ in range(B)]
        cache = state.kv_cache
        paged = isinstance(cache, PagedKVCache)
        starts = cache.prefill_starts() if paged else [0] * B
        if paged:
            # the leaders, then (after the copy-on-write of partly shared blocks) the followers;
            # each in groups of similar length (a block table row is cheap to select), so that
            # padding ragged prompts to the longest costs little
            todo = [f - s for f, s in zip(fed, starts)]
            phases = length_groups(cache.leaders, todo)
            if cache.followers:  # None: the copy-on-write, once the leaders are in the cache
                phases += [None] + length_groups(cache.followers, todo)
        else:
            phases = [list(range(B))]
        for rows_b in phases:
            if rows_b is None:
                cache.copy_shared_tails()
                continue
            sub = cache.rows(rows_b) if paged and rows_b != list(range(B)) else cache
            R = len(rows_b)
            longest = max(fed[b] - starts[b] for b in rows_b)
            for c in range(0, longest, self.prefill_chunk):
                n = min(self.prefill_chunk, longest - c)
                block = torch.zeros(R, n, dtype=torch.int64)
                for r, b in enumerate(rows_b):
                    part = state.histories[b][starts[b] + c : min(starts[b] + c + n, fed[b])]
                    block[r, : len(part)] = torch.tensor(part, dtype=torch.int64)
                base = torch.tensor([starts[b] + c for b in rows_b], dtype=torch.int64)
                positions = base[:, None] + torch.arange(n)
                seqlens = base.to(device=device, dtype=torch.int32)
                no_rows = torch.zeros(R, 0, dtype=torch.int64, device=device)
                if not wants:
                    self.model(block.to(device), positions.to(device), sub, seqlens, None, logit_rows=no_rows)
                else:  # the hidden states of each prompt's kept positions in this chunk, no head
                    lo = [starts[b] + c for b in rows_b]
                    want = [range(max(first[b], lo[r]), min(fed[b], lo[r] + n)) for r, b in enumerate(rows_b)]
                    m = max(1, max(len(w) for w in want))
                    rows = torch.tensor(
                        [
                            [(w[min(i, len(w) - 1)] - lo[r]) if len(w) else 0 for i in range(m)]
                            for r, w in enumerate(want)
                        ],
                        dtype=torch.int64,
                        device=device,
                    )
                    _, hidden = self.model(
                        block.to(device),
                        positions.to(device),
                        sub,
                        seqlens,
                        None,
                        logit_rows=rows,
                        return_hidden=True,
                        compute_logits=False,
                        **self._layer_kwargs,
                    )
                    for r, (b, w) in enumerate(zip(rows_b, want)):
                        if len(w):
                            kept[b].append(hidden[r, : len(w)])
                state.stats.prefill_passes += 1
                state.stats.prefill_tokens += R * n
        state.stats.shared_prefill_tokens = sum(starts)
        state.cache_seqlens = torch.tensor(fed, dtype=torch.int32, device=device)
        state.host_seqlens = list(fed)
        if not wants:
            return None
        context = [torch.cat(k) if k else None for k in kept]
        for b, rows in enumerate(context):
            if rows is not None:
                last[b] = rows[-1]
        return last, [f > 0 for f in fed], (context if window else None), first

    @torch.inference_mode()
    def step(self, state: DecodeState, num_draft_tokens: Union[int, Sequence[int]] = 4) -> List[List[int]]:
        """One target forward pass for every unfinished sequence.

        Args:
            state: from ``start``.
            num_draft_tokens: K for this step, an int or one per sequence (0 = no drafts).

        Returns:
            The tokens each sequence emitted in this step ([] for finished sequences).
        """
        B = state.batch_size
        stats = state.stats
        ks = _per_sequence("num_draft_tokens", num_draft_tokens, B)
        if min(ks) < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, an int or one per sequence, got {num_draft_tokens}")
        active = [not d for d in state.done]
        if not any(active):
            return [[] for _ in range(B)]
        # Never draft past what max_new_tokens leaves (the bonus token covers one).
        ks = [
            max(0, min(k, state.max_new_tokens[b] - len(state.generated(b)) - 1)) if active[b] else 0
            for b, k in enumerate(ks)
        ]

        t0 = time.perf_counter()
        draft = self._checked(self.drafter.propose(state.histories, ks, active), state, active)
        # the cache lengths from the host's copy: no read of the device's cache_seqlens
        if state.host_seqlens is None:
            state.host_seqlens = [int(s) for s in state.cache_seqlens.tolist()]
        seqlens = state.host_seqlens  # replaced, never changed in place
        room = [min(self.max_draft_nodes, state.capacity - s) for s in seqlens]
        draft = draft.truncate([r if a else 1 for r, a in zip(room, active)])
        t1 = time.perf_counter()
        stats.draft_time += t1 - t0

        out, accepted_nodes, num_accepted, depth, device_accepted = self._verify(state, draft, seqlens)
        stats.target_passes += 1
        stats.draft_tokens += int((draft.num_nodes - 1)[torch.tensor(active)].sum())
        t2 = time.perf_counter()
        stats.verify_time += t2 - t1

        emitted = self._emit(state, out, num_accepted, depth, active)
        keep = [a and not d for a, d in zip(active, state.done)]  # still running after this step
        filled = [n + 1 if k else 0 for n, k in zip(num_accepted.tolist(), keep)]  # slots per sequence
        device_advance = to_device(torch.tensor(filled, dtype=torch.int64), state.cache_seqlens.device)
        if not draft.is_chain and any(keep):
            if isinstance(state.kv_cache, PagedKVCache):
                state.kv_cache.compact(state.cache_seqlens, device_accepted, device_advance)
            else:
                compact_kv_cache(state.kv_cache, state.cache_seqlens, device_accepted, device_advance)
        state.cache_seqlens += device_advance.to(torch.int32)
        state.host_seqlens = [s + a for s, a in zip(seqlens, filled)]
        t3 = time.perf_counter()
        if self._target_argmax is not None:  # e.g. lookahead decoding's Jacobi update
            self.drafter.observe_target_argmax(self._target_argmax, draft.num_nodes.clone(), keep)
            self._target_argmax = None
        self.drafter.observe(accepted_nodes, num_accepted, keep)
        if self._hidden is not None:  # the hidden state of each sequence's last accepted node
            if getattr(self.drafter, "context_window", 0):  # and of the whole accepted path
                nodes = to_device(accepted_nodes, self._hidden.device)
                first = seqlens  # where each accepted path starts in the cache
                path = [self._hidden[b, nodes[b, : int(num_accepted[b]) + 1]] if keep[b] else None for b in range(B)]
                self.drafter.observe_context(path, first, keep)
            last = accepted_nodes.gather(1, num_accepted[:, None].to(accepted_nodes.dtype)).clamp(min=0)[:, 0]
            rows = torch.arange(B, device=self._hidden.device)
            self.drafter.observe_hidden(self._hidden[rows, to_device(last, self._hidden.device)], keep)
            self._hidden = None
        t4 = time.perf_counter()
        stats.draft_time += t4 - t3
        stats.bookkeeping_time += t3 - t2
        stats.draft_lengths.extend(k for k, a in zip(ks, active) if a)
        stats.draft_model_tokens = int(getattr(self.drafter, "model_tokens", 0))
        state.last_step = StepRecord(
            ks=ks,
            depths=depth.tolist(),
            num_nodes=draft.num_nodes.tolist(),
            num_accepted=num_accepted.tolist(),
            active=active,
            block_width=int(draft.num_nodes.max()),
            draft_time=(t1 - t0) + (t4 - t3),
            verify_time=t2 - t1,
        )
        return emitted

    # ------------------------------------------------------------------ internals
    def _draft_sources(self, state: DecodeState) -> Optional[List[int]]:
        """The drafter's ``draft_sources`` for the next step, checked: None, or one int >= 0
        per sequence."""
        fn = getattr(self.drafter, "draft_sources", None)
        sources = fn(state.histories, [not d for d in state.done]) if fn is not None else None
        if sources is None:
            return None
        name = getattr(self.drafter, "name", type(self.drafter).__name__)
        bad = ValueError(
            f"drafter {name!r}: draft_sources must return None or one int >= 0 per sequence "
            f"({state.batch_size}), got {sources!r}"
        )
        try:
            sources = as_int_list("draft_sources", sources)
        except TypeError:
            raise bad from None
        if len(sources) != state.batch_size or min(sources, default=0) < 0:
            raise bad
        return sources

    def _checked(self, draft, state: DecodeState, active: List[bool]) -> Draft:
        """A drafter's proposal, checked before the target sees it (a custom drafter's bug
        should name the drafter, not surface as an embedding index error or a wrong output):
        a ``Draft`` with one row per sequence, at least the root, the root equal to the last
        committed token of every running sequence, draft tokens inside the vocabulary.

        Raises:
            TypeError: not a ``Draft``; tokens or parents not int64 / int32 (the dtypes the
                embedding and the verifiers index with: uint8, int8, int16, float and bool
                are refused here, naming the drafter, instead of failing inside the
                embedding), num_nodes not integers.
            ValueError: shapes, counts, parents, roots or token ids that do not fit.
        """
        name = getattr(self.drafter, "name", type(self.drafter).__name__)
        if not isinstance(draft, Draft):
            raise TypeError(f"drafter {name!r}: propose must return a Draft, got {type(draft).__name__}")
        B, V = state.batch_size, self.model.args.vocab_size
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
        if min(n) < 1 or max(n) > draft.tokens.shape[1]:
            raise ValueError(
                f"drafter {name!r}: num_nodes must lie in 1..{draft.tokens.shape[1]} (the root counts), got {n}"
            )
        N = draft.tokens.shape[1]
        if draft.parents.shape != (B, N):
            raise ValueError(
                f"drafter {name!r}: Draft.parents must have shape (B={B}, N={N}) like tokens, "
                f"got {tuple(draft.parents.shape)}"
            )
        parents = draft.parents.cpu().to(torch.int64)
        node = torch.arange(N)
        bad_parent = (node[None, 1:] <= parents[:, 1:]) | (parents[:, 1:] < 0)
        bad_parent = torch.cat([(parents[:, :1] != -1), bad_parent], dim=1)
        if bad_parent.any():
            b, i = (int(v) for v in bad_parent.nonzero()[0])
            raise ValueError(
                f"drafter {name!r}: Draft.parents must satisfy parents[b, 0] = -1 and 0 <= parents[b, i] < i "
                f"(padding nodes too); sequence {b}, node {i} has parent {int(parents[b, i])}"
            )
        if draft.is_chain:
            used_nodes = node[None, 1:] < torch.tensor(n)[:, None]
            if (used_nodes & (parents[:, 1:] != node[None, :-1])).any():
                raise ValueError(
                    f"drafter {name!r}: Draft.is_chain is True but the parents are not a chain (parents[b, i] = i - 1)"
                )
        if draft.probs is not None:
            p = draft.probs
            if not isinstance(p, torch.Tensor) or not p.is_floating_point() or p.shape != (B, N, V):
                raise ValueError(
                    f"drafter {name!r}: Draft.probs must be a float tensor (B={B}, N={N}, V={V}) or None, got "
                    f"{tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}"
                )
        tokens = draft.tokens.cpu()
        roots = tokens[:, 0].tolist()
        for b in range(B):
            if active[b] and roots[b] != state.histories[b][-1]:
                raise ValueError(
                    f"drafter {name!r}: sequence {b}'s draft root is {roots[b]}, not its last committed "
                    f"token {state.histories[b][-1]}"
                )
        used = torch.arange(tokens.shape[1]) < torch.tensor(n)[:, None]
        bad = used & ((tokens < 0) | (tokens >= V))
        if bad.any():
            b, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"drafter {name!r}: draft token {int(tokens[b, i])} (sequence {b}, node {i}) "
                f"is outside the vocabulary [0, {V})"
            )
        return draft

    def _verify(self, state: DecodeState, draft: Draft, seqlens: List[int]):
        """Target pass over the block and verification, reading the device once: returns
        (output_tokens, accepted_nodes, num_accepted, depth of each sequence's draft) on the host,
        from one device-to-host copy, and accepted_nodes on the device (for the compaction).
        ``draft`` is the host's (its values are read here for free); ``seqlens`` the cache
        lengths, from the host.  With ``node_buckets`` the block is padded to its bucket's width
        (padding nodes: token 0, each the child of the node before it in a chain, of the root in a
        tree) and the results cut back to the draft's width."""
        device = self.model.device
        host_num_nodes = draft.num_nodes.cpu()
        n = int(host_num_nodes.max())
        host_tokens, host_parents = draft.tokens[:, :n].cpu(), draft.parents[:, :n].cpu()
        probs = to_device(draft.probs[:, :n], device) if draft.probs is not None else None
        B = host_tokens.shape[0]
        width = node_bucket(n, self.max_draft_nodes) if self.node_buckets else n
        if width > n:
            pad = width - n
            host_tokens = torch.nn.functional.pad(host_tokens, (0, pad))
            pad_parents = torch.arange(n - 1, width - 1) if draft.is_chain else torch.zeros(pad, dtype=torch.int64)
            host_parents = torch.cat([host_parents, pad_parents.to(host_parents.dtype).expand(B, pad)], dim=1)
            probs = torch.nn.functional.pad(probs, (0, 0, 0, pad)) if probs is not None else None
        tokens, parents = to_device(host_tokens, device), to_device(host_parents, device)
        num_nodes = to_device(host_num_nodes, device)
        n, cut = width, n  # the pass's width; the draft's, which the results are cut back to
        if draft.is_chain:
            host_depths, tree_mask = torch.arange(n).expand(B, n), None
        else:  # once per tree shape, from the host's parent lists (tree_structure)
            host_depths, tree_mask = tree_structure(host_parents, "cpu")[0], tree_structure(host_parents, device)[1]
        host_valid = torch.arange(n)[None, :] < host_num_nodes[:, None]
        depth = torch.where(host_valid, host_depths, 0).max(dim=1).values
        host_positions = torch.tensor(seqlens, dtype=torch.int64)[:, None] + host_depths
        positions = to_device(host_positions, device)
        self._hidden = None
        wants_hidden = getattr(self.drafter, "wants_hidden", False)
        if self._passes is not None:  # the captured pass of this shape class, replayed
            out = self._passes.run(
                tokens,
                positions,
                state.kv_cache,
                state.cache_seqlens,
                tree_mask,
                return_hidden=wants_hidden,
                hidden_layers=self._layer_kwargs.get("hidden_layers", ()),
            )
            logits, self._hidden = out if wants_hidden else (out, None)
        elif wants_hidden:  # final hidden states for the drafter
            logits, self._hidden = self.model(
                tokens,
                positions,
                state.kv_cache,
                state.cache_seqlens,
                tree_mask,
                return_hidden=True,
                host_seqlens=seqlens,
                **self._layer_kwargs,
            )
        else:  # [B, n, V]
            logits = self.model(tokens, positions, state.kv_cache, state.cache_seqlens, tree_mask, host_seqlens=seqlens)

        target_argmax = logits.argmax(dim=-1) if getattr(self.drafter, "wants_target_argmax", False) else None
        sp = state.sampling
        if not sp.greedy and state.coupling is not None and self.typical is None:
            # the Gumbel coupling: node i predicts token index positions[i] + 1; greedy
            # verification of log p + G accepts a draft exactly when it is the target's sample
            target_probs = sampling_probs(logits, sp.temperature, sp.top_k, sp.top_p)
            index = torch.where(host_valid, host_positions + 1, -1)  # on the host: no read
            logits = state.coupling.perturb(target_probs.log(), index)
        if sp.greedy or (state.coupling is not None and self.typical is None):
            if draft.is_chain:
                out, num_accepted = verify_greedy(logits, tokens[:, 1:], num_nodes - 1)
            else:
                out, accepted_nodes, num_accepted = verify_tree_greedy(logits, tokens, parents, num_nodes)
        else:
            target_probs = sampling_probs(logits, sp.temperature, sp.top_k, sp.top_p)
            host_counts = host_num_nodes.tolist()
            randoms = self._randoms(state, host_counts, n, device)
            if self.typical is not None:  # lossy: Medusa's typical acceptance
                if "seeds" in randoms:  # the sample uniform: stream 1 at the sequence's offset
                    finals = philox_uniforms(randoms["seeds"], randoms["offsets"], 1, 1)[:, 0]
                else:
                    finals = randoms["sample_uniforms"]
                out, accepted_nodes, num_accepted = typical_acceptance(
                    target_probs,
                    tokens,
                    parents,
                    num_nodes,
                    posterior_threshold=self.typical,
                    posterior_alpha=self.typical_alpha,
                    sample_uniforms=finals,
                )
            elif draft.is_chain:
                out, num_accepted = rejection_sample(
                    target_probs,
                    probs[:, : n - 1] if probs is not None else None,
                    tokens[:, 1:],
                    num_nodes - 1,
                    **randoms,
                )
            else:
                out, accepted_nodes, num_accepted = tree_rejection_sample(
                    target_probs, tokens, parents, probs, num_nodes, **randoms
                )
        if draft.is_chain:
            index = torch.arange(n, device=device).expand(B, n)
            accepted_nodes = torch.where(index <= num_accepted[:, None], index, -1)
        if cut < n:  # the padding's rows go (no accepted path reaches them)
            out, accepted_nodes = out[:, :cut], accepted_nodes[:, :cut]
            target_argmax = target_argmax[:, :cut] if target_argmax is not None else None
            self._hidden = self._hidden[:, :cut] if self._hidden is not None else None
        if self._passes is not None and self._hidden is not None:  # the graph's buffer: the
            self._hidden = self._hidden.clone()  # drafter reads it past the next replay
        # the step's one read of the device: its results in one device-to-host copy
        results = [out, accepted_nodes, num_accepted] + ([target_argmax] if target_argmax is not None else [])
        host = to_host_once(results)
        if target_argmax is not None:
            self._target_argmax = host[3]
        return host[0], host[1], host[2], depth, accepted_nodes

    def _randoms(self, state: DecodeState, num_nodes: List[int], n: int, device) -> Dict[str, torch.Tensor]:
        """The random-number arguments of this step's sampling op, per ``random_source``:
        ``uniform_samples`` and ``sample_uniforms`` drawn from each sequence's own generator
        ("generator"), or ``seeds`` and this step's ``offsets`` ("philox"; each sequence's
        offset then moves past the max(C_b, 1) numbers it used, C_b its draft count).  Either
        way sequence b's numbers depend on its own seed and draft counts only."""
        if self.random_source == "philox":
            offsets = to_device(torch.tensor(state.philox_offsets, dtype=torch.int64), device)
            state.philox_offsets = [o + max(c - 1, 1) for o, c in zip(state.philox_offsets, num_nodes)]
            return {"seeds": state.philox_seeds, "offsets": offsets}
        coins, finals = self._uniforms(state, num_nodes, n)
        return {"uniform_samples": to_device(coins, device), "sample_uniforms": to_device(finals, device)}

    @staticmethod
    def _uniforms(state: DecodeState, num_nodes: List[int], n: int):
        """Each sequence draws its own coins (one per draft node) then its sample uniform from
        its own generator, so its tokens do not depend on the rest of the batch.  Any value in
        [0, 1) is safe, 0 included: the accept test ``u q(x) < p(x)`` never accepts p(x) = 0,
        and the inverse-CDF sample takes the first token whose CDF exceeds u * total."""
        B = state.batch_size
        coins = torch.zeros(B, n - 1)
        finals = torch.zeros(B)
        for b, g in enumerate(state.generators):
            if state.done[b]:
                continue
            coins[b, : num_nodes[b] - 1] = torch.rand(num_nodes[b] - 1, generator=g)
            finals[b] = torch.rand(1, generator=g)[0]
        return coins, finals

    def _emit(self, state: DecodeState, out, num_accepted, depth, active) -> List[List[int]]:
        emitted: List[List[int]] = []
        out_rows, accepted, depths = out.tolist(), num_accepted.tolist(), depth.tolist()
        for b in range(state.batch_size):
            if not active[b]:
                emitted.append([])
                continue
            new = out_rows[b][: accepted[b] + 1]
            new = new[: state.max_new_tokens[b] - len(state.generated(b))]
            for i, t in enumerate(new):
                if t in self.stop_token_ids:
                    new = new[: i + 1]
                    state.done[b] = True
                    break
            if self.stop_check is not None and new:
                keep = self.stop_check(b, state.histories[b], new)
                if keep is not None:
                    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= len(new):
                        raise ValueError(f"stop_check must return None or an int in 1..{len(new)}, got {keep!r}")
                    new = new[:keep]
                    state.done[b] = True
            state.histories[b].extend(new)
            if state.coupling is not None:
                state.coupling.commit(b, len(state.histories[b]))
            if len(state.generated(b)) >= state.max_new_tokens[b]:
                state.done[b] = True
            state.stats.record(depths[b], accepted[b], len(new))
            emitted.append(new)
        return emitted
