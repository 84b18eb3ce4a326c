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

The module reads top to bottom as that loop: ``generate`` (the draft-length schedule of
``adaptive.draft_schedule``, then ``_run_steps``), ``start`` (checks, the KV cache, the prefill
of ``prefill.py``, a cost-model policy's ``Calibration`` of the run (``calibration.py``), the
drafter's ``observe`` of the prefill's result) and ``step`` (``_draft``:
the drafter's ``propose``; ``_verify``, ``DecodeState.emit``, ``_advance``; ``_observe``: the drafter's
``observe`` of the step's ``StepResult``; ``DecodeState.record_step``).  The drafter is reached
through those two methods only (``draft.Drafter``).  What the loop leans on lives beside it:
the option and request checks (``options.py``), the run's state and host/device helpers
(``state.py``), the checks of a drafter's proposal (``draft_checks.py``), the block and the
table of verification paths (``verify.py``), the step thread choice (``threads.py``).

The KV caches (the target's and every model drafter's) are dense by default; with
``block_size=`` they are paged (``paged.py``: a block pool and block tables, written and read
through the table), and with ``share_prefix=True`` prompts of a batch that begin with the same
tokens (a common system prompt) share the KV blocks of that prefix, computed once, with
copy-on-write of the block where they diverge.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from specdec_kernels import compact_kv_cache
from specdec_kernels.decoding import draft as contract
from specdec_kernels.decoding.draft import Draft, Drafter, NoDrafter, SamplingParams
from specdec_kernels.decoding.engine.adaptive import CostModelPolicy, DraftLengthPolicy, draft_schedule
from specdec_kernels.decoding.engine.calibration import Calibration, LinearCost
from specdec_kernels.decoding.engine.draft_checks import (
    check_draft,
    check_draft_sources,
    drafter_name,
    feature_layer_kwargs,
)
from specdec_kernels.decoding.engine.graphs import CapturedPasses, CudaGraph
from specdec_kernels.decoding.engine.options import (  # noqa: F401 (RANDOM_SOURCES re-exported)
    RANDOM_SOURCES,
    check_options,
    check_requests,
)
from specdec_kernels.decoding.engine.prefill import new_kv_cache, prefill
from specdec_kernels.decoding.engine.state import (  # noqa: F401 (re-exported: the loop's vocabulary)
    DRAFT_SEED_OFFSET,
    DecodeState,
    DraftSchedule,
    GenerationResult,
    StepRecord,
    make_generators,
    node_bucket,
    per_sequence,
    to_device,
    to_host_once,
)
from specdec_kernels.decoding.engine.threads import THREADS_ENV, StepThreads, ThreadChoice  # noqa: F401
from specdec_kernels.decoding.engine.verify import Verification, build_block, verify
from specdec_kernels.decoding.model import Transformer
from specdec_kernels.decoding.paged import CacheLayout, PagedKVCache


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
            runs and the Gumbel coupling (which takes no coins) are unaffected; with
            ``typical``, which replaces the coupling, the sample uniform of typical
            acceptance comes from this source.

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
        options = {k: v for k, v in locals().items() if k not in ("self", "model", "drafter")}
        drafter = drafter if drafter is not None else NoDrafter()
        self.stop_token_ids = check_options(model, drafter, options)
        self.model, self.drafter = model, drafter
        # the target layers whose outputs a drafter that wants hidden states also gets (EAGLE-3)
        self._layer_kwargs = feature_layer_kwargs(self.drafter, model)
        self.stop_check = stop_check
        self.prefill_chunk, self.max_draft_nodes, self.policy = prefill_chunk, max_draft_nodes, policy
        self.typical, self.typical_alpha, self.random_source = typical, typical_alpha, random_source
        self.cache_layout = CacheLayout(
            paged=block_size is not None, block_size=block_size or 16, share_prefix=bool(share_prefix)
        )
        self.threads = threads
        self._hidden: Optional[torch.Tensor] = None  # the verified block's hidden states, for wants_hidden
        self._target_argmax: Optional[torch.Tensor] = None  # the block's argmax tokens, for wants_target_argmax
        # the captured verification passes
        self._passes = CapturedPasses(model, CudaGraph.factory()) if cuda_graphs else None
        self.node_buckets = node_buckets or cuda_graphs
        # torch's thread count -> the step thread choice of threads="auto", kept across calls
        self.thread_choices: Dict[int, ThreadChoice] = {}
        self.pass_costs: dict = {}  # (numerics, threads, batch, threads arg) -> LinearCost of the target pass
        self._in_use = threading.Lock()  # one generate at a time: the drafter holds a run's state

    @property
    def verification(self) -> Verification:
        """How this decoder verifies (``verify.Verification``: typical, its alpha, the random source)."""
        return Verification(self.typical, self.typical_alpha, self.random_source)

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
                f"this SpeculativeDecoder (drafter {drafter_name(self.drafter)!r}) "
                "is decoding already, in another thread or in an on_step callback: its drafter and caches hold "
                "that run's state; make one decoder per thread (they may share the model)"
            )
        try:
            return self._generate(prompts, max_new_tokens, num_draft_tokens, sampling, seeds, on_step)
        finally:
            self._in_use.release()

    def _generate(self, prompts, max_new_tokens, num_draft_tokens, sampling, seeds, on_step) -> GenerationResult:
        """``generate``'s body (the caller holds ``_in_use``), with the target's layers taken as
        fixed for the generation (``Transformer.weights_fixed``: its passes skip the per-pass
        check of every layer's weights, hooks and norms)."""
        fixed = getattr(self.model, "weights_fixed", None)
        with fixed() if fixed is not None else contextlib.nullcontext():
            return self._generate_fixed(prompts, max_new_tokens, num_draft_tokens, sampling, seeds, on_step)

    def _generate_fixed(self, prompts, max_new_tokens, num_draft_tokens, sampling, seeds, on_step) -> GenerationResult:
        t0 = time.perf_counter()
        schedule = draft_schedule(num_draft_tokens, self.policy, self.drafter, sampling)
        policy = schedule if isinstance(schedule, DraftLengthPolicy) else None
        state = self.start(prompts, max_new_tokens, sampling, seeds, _policy=policy)
        if policy is not None:
            policy.start(state)  # a cost model takes up the run's calibration (``_calibrate``)
            state.stats.policy = policy.describe()
        threads = None
        try:
            if on_step is not None:
                on_step(state)
            threads = StepThreads(self.threads, self.model.device, state.stats, self.thread_choices)
            self._run_steps(state, schedule, policy, threads, on_step)
        finally:
            if threads is not None:
                threads.restore()
        state.stats.total_time = time.perf_counter() - t0
        return GenerationResult([state.generated(b) for b in range(state.batch_size)], state.stats)

    def _run_steps(self, state: DecodeState, schedule, policy, threads: StepThreads, on_step) -> None:
        """Steps until every sequence stops: K from the policy (or the schedule), one ``step``
        under the step thread choice, the policy told what happened."""
        step = 0
        while not state.finished:
            sources_time = 0.0
            if policy is not None:
                if getattr(policy, "per_source", False):  # which source drafts, before K
                    t = time.perf_counter()
                    state.draft_sources = check_draft_sources(self.drafter, self._request(state, None))
                    sources_time = time.perf_counter() - t
                k = policy.choose(state)
            else:
                k = schedule(step, state) if callable(schedule) else schedule
            threads.run(lambda: self.step(state, k), k, state)
            if policy is not None:
                # asking the drafter for its sources is part of drafting: timed as such
                state.last_step.draft_time += sources_time
                state.stats.draft_time += sources_time
                policy.update(state, state.last_step)
            step += 1
            if on_step is not None:
                on_step(state)

    @torch.inference_mode()
    def start(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Union[int, Sequence[int]] = 128,
        sampling: Optional[SamplingParams] = None,
        seeds=None,
        *,
        _policy: Optional[DraftLengthPolicy] = None,
    ) -> DecodeState:
        """Allocate the KV cache, prefill the prompts (all but their last token) and reset the
        drafter.  Step the returned state with ``step``.

        ``generate`` passes its draft-length policy as ``_policy`` (private): the run's
        ``Calibration`` is then made before the drafter starts (``_calibrate``), so that it is
        in the ``DraftRun``; without it, as for a caller that steps the state itself,
        ``DraftRun.calibration`` is None.

        Raises:
            ValueError: no prompts, an empty prompt, token ids outside the vocabulary,
                max_new_tokens < 0 or not one per prompt, or a prompt plus its
                max_new_tokens longer than the model's positions.
            TypeError: non-integer token ids or max_new_tokens, sampling not a SamplingParams.
        """
        histories, limits, sampling = check_requests(self.model.args.vocab_size, prompts, max_new_tokens, sampling)
        V = self.model.args.vocab_size
        lengths = [len(h) for h in histories]
        # the longest sequence this batch can reach (per sequence: its prompt plus its limit)
        capacity = max(n + m for n, m in zip(lengths, limits)) + self.max_draft_nodes + 1
        if capacity > self.model.args.max_position + self.max_draft_nodes + 1:
            raise ValueError(f"prompt plus max_new_tokens exceed the model's {self.model.args.max_position} positions")
        kv_cache = new_kv_cache(self.model, self.drafter, histories, capacity, self.cache_layout)
        state = DecodeState.new(histories, limits, kv_cache, sampling, seeds, V, self.random_source)
        t = time.perf_counter()
        prefill_hidden = prefill(self.model, state, self.drafter, self.prefill_chunk, self._layer_kwargs)
        state.stats.prefill_time = time.perf_counter() - t
        calibration = self._calibrate(state, _policy) if _policy is not None else None
        t = time.perf_counter()
        self._start_drafter(state, capacity, seeds, prefill_hidden, calibration)
        state.stats.draft_time += time.perf_counter() - t
        state.stats.kv_cache_bytes += int(self.drafter.kv_cache_bytes)
        return state

    def _calibrate(self, state: DecodeState, policy: DraftLengthPolicy) -> Optional[Calibration]:
        """A policy's view of the decoder's past: ``state.pass_costs``, the target pass's cost
        curve measured by this decoder's earlier runs of the same kind (numerics, threads,
        batch size, threads argument); and for a cost-model policy the run's ``Calibration``
        (``CostModelPolicy.calibrate``, its verify cost that curve), else None."""
        kind = (getattr(self.model, "numerics", None), torch.get_num_threads(), state.batch_size, self.threads)
        state.pass_costs = self.pass_costs.setdefault(kind, LinearCost())
        return policy.calibrate(state) if isinstance(policy, CostModelPolicy) else None

    def _start_drafter(
        self, state: DecodeState, capacity: int, seeds, prefill_hidden, calibration: Optional[Calibration]
    ) -> None:
        """Begin the drafter's run: the ``DraftRun`` (its generators, the coupling, the cache
        layout, the target's cache to share, the run's calibration), then ``observe`` of the
        prefill's result (the prompts' hidden states where it wants them)."""
        B = state.batch_size
        state.draft_run = contract.DraftRun(
            capacity=capacity,
            sampling=state.sampling,
            generators=make_generators(seeds, B, DRAFT_SEED_OFFSET),
            coupling=state.coupling,
            cache_layout=self.cache_layout,
            target=self.model,
            target_kv_cache=state.kv_cache,
            stats=state.stats,
            calibration=calibration,
        )
        features = None
        if prefill_hidden is not None:
            last, has, context, first = prefill_hidden
            features = contract.TargetFeatures(last, tuple(has), context, tuple(first) if context is not None else None)
        active = [not d for d in state.done]
        self.drafter.observe(
            contract.StepResult(state.frozen_histories(), tuple(active), state.draft_run, features=features)
        )

    def _request(self, state: DecodeState, ks: Optional[List[int]]) -> contract.DraftRequest:
        """The drafter's request for this step (``ks`` None: the depths are not chosen yet)."""
        active = [not d for d in state.done]
        return contract.DraftRequest(
            state.frozen_histories(), tuple(ks if ks is not None else [0] * len(active)), tuple(active), state.draft_run
        )

    @torch.inference_mode()
    def step(self, state: DecodeState, num_draft_tokens: Union[int, Sequence[int]] = 4) -> List[List[int]]:
        """One target forward pass for every unfinished sequence: draft, verify, accept (emit),
        compact, advance, then the drafter observes the result.

        Args:
            state: from ``start``.
            num_draft_tokens: K for this step, an int or one per sequence (0 = no drafts).

        Returns:
            The tokens each sequence emitted in this step ([] for finished sequences).
        """
        B = state.batch_size
        ks = per_sequence("num_draft_tokens", num_draft_tokens, B)
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
        clock = [time.perf_counter()]
        draft, seqlens = self._draft(state, ks, active)
        clock.append(time.perf_counter())
        out, accepted_nodes, num_accepted, depth, device_accepted = self._verify(state, draft, seqlens)
        clock.append(time.perf_counter())
        emitted = state.emit(out, num_accepted, depth, active, self.stop_token_ids, self.stop_check)
        keep = [a and not d for a, d in zip(active, state.done)]  # still running after this step
        self._advance(state, draft, seqlens, num_accepted, device_accepted, keep)
        clock.append(time.perf_counter())
        self._observe(state, draft, seqlens, accepted_nodes, num_accepted, keep)
        clock.append(time.perf_counter())
        state.record_step(ks, active, draft, depth, num_accepted, clock, self.drafter.model_tokens)
        return emitted

    def _draft(self, state: DecodeState, ks: List[int], active: List[bool]) -> Tuple[Draft, List[int]]:
        """The drafter's proposal, checked and cut to the room each sequence has; and the
        cache lengths, from the host's copy (no read of the device's cache_seqlens)."""
        name = drafter_name(self.drafter)
        # the drafter sees copies it cannot change: the engine's own lists stay its own
        request = contract.DraftRequest(state.frozen_histories(), tuple(ks), tuple(active), state.draft_run)
        proposal = self.drafter.propose(request)
        draft = check_draft(proposal, name, state.histories, active, self.model.args.vocab_size)
        if state.host_seqlens is None:
            state.host_seqlens = [int(s) for s in state.cache_seqlens.tolist()]
        seqlens = state.host_seqlens  # replaced, never changed in place
        room = [min(self.max_draft_nodes, state.capacity - s) for s in seqlens]
        return draft.truncate([r if a else 1 for r, a in zip(room, active)]), seqlens

    def _advance(self, state: DecodeState, draft: Draft, seqlens, num_accepted, device_accepted, keep) -> None:
        """Move a tree's accepted nodes' K/V into place (``compact_kv_cache``) and advance the
        cache lengths (device tensor and host copy) by the accepted drafts plus the root."""
        filled = [n + 1 if k else 0 for n, k in zip(num_accepted.tolist(), keep)]  # slots per sequence
        device_advance = to_device(torch.tensor(filled, dtype=torch.int64), state.cache_seqlens.device)
        if not draft.is_chain and any(keep):
            if isinstance(state.kv_cache, PagedKVCache):
                state.kv_cache.compact(state.cache_seqlens, device_accepted, device_advance)
            else:
                compact_kv_cache(state.kv_cache, state.cache_seqlens, device_accepted, device_advance)
        state.cache_seqlens += device_advance.to(torch.int32)
        state.host_seqlens = [s + a for s, a in zip(seqlens, filled)]

    def _observe(self, state: DecodeState, draft: Draft, seqlens, accepted_nodes, num_accepted, keep) -> None:
        """Tell the drafter what the step produced (``StepResult``): the accepted nodes, and
        the target's argmax and hidden states where it declared it wants them."""
        features = None
        if self._hidden is not None:  # the hidden state of each sequence's last accepted node
            context = None
            if self.drafter.context_window:  # and of the whole accepted path
                nodes = to_device(accepted_nodes, self._hidden.device)
                B = state.batch_size
                context = [self._hidden[b, nodes[b, : int(num_accepted[b]) + 1]] if keep[b] else None for b in range(B)]
            last = accepted_nodes.gather(1, num_accepted[:, None].to(accepted_nodes.dtype)).clamp(min=0)[:, 0]
            rows = torch.arange(state.batch_size, device=self._hidden.device)
            last_hidden = self._hidden[rows, to_device(last, self._hidden.device)]
            positions = tuple(seqlens) if context is not None else None
            features = contract.TargetFeatures(last_hidden, tuple(keep), context, positions)
            self._hidden = None
        result = contract.StepResult(  # copies: what the drafter does to them stays its own
            state.frozen_histories(),
            tuple(keep),
            state.draft_run,
            accepted_nodes=accepted_nodes.clone(),
            num_accepted=num_accepted.clone(),
            num_nodes=draft.num_nodes.clone(),
            target_argmax=self._target_argmax,
            features=features,
        )
        self._target_argmax = None
        self.drafter.observe(result)

    def _verify(self, state: DecodeState, draft: Draft, seqlens: List[int]):
        """Target pass over the block and verification, reading the device once: returns
        (output_tokens, accepted_nodes, num_accepted, depth of each sequence's draft) on the host,
        from one device-to-host copy, and accepted_nodes on the device (for the compaction).
        ``draft`` is the host's; ``seqlens`` the cache lengths, from the host.  With
        ``node_buckets`` the block is padded to its bucket's width and the results cut back to
        the draft's width (``verify.build_block``)."""
        block = build_block(draft, seqlens, self.max_draft_nodes if self.node_buckets else None, self.model.device)
        logits = self._target_pass(state, block, seqlens)
        target_argmax = logits.argmax(dim=-1) if self.drafter.wants_target_argmax else None
        out, accepted_nodes, num_accepted = verify(logits, state, block, self.verification)
        cut = block.cut
        if cut < block.width:  # the padding's rows go (no accepted path reaches them)
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
        return host[0], host[1], host[2], block.depth, accepted_nodes

    def _target_pass(self, state: DecodeState, block, seqlens: List[int]) -> torch.Tensor:
        """The target's logits (B, width, V) for the block (replayed from a captured graph with
        ``cuda_graphs``); sets ``_hidden`` for a drafter that wants hidden states."""
        wants_hidden = self.drafter.wants_hidden
        args = (block.tokens, block.positions, state.kv_cache, state.cache_seqlens, block.tree_mask)
        self._hidden = None
        if self._passes is not None:  # the captured pass of this shape class, replayed
            out = self._passes.run(
                *args, return_hidden=wants_hidden, hidden_layers=self._layer_kwargs.get("hidden_layers", ())
            )
            logits, self._hidden = out if wants_hidden else (out, None)
        elif wants_hidden:  # final hidden states for the drafter
            logits, self._hidden = self.model(*args, return_hidden=True, host_seqlens=seqlens, **self._layer_kwargs)
        else:
            logits = self.model(*args, host_seqlens=seqlens)
        return logits
