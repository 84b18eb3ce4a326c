"""What one decoding run holds and the small host/device helpers of its steps.

* ``DecodeState``: a batch's histories, KV cache, cache lengths (device and host copies),
  generators or Philox seeds/offsets, statistics; ``StepRecord``: what one step did;
  ``GenerationResult``: ``generate``'s return value;
* ``make_generators``: one seeded CPU generator per sequence;
* ``to_device`` / ``to_host_once``: queued host-to-device moves and the step's one
  device-to-host copy; ``node_bucket``: the padded block widths of ``node_buckets=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from specdec_kernels.checks import as_int, as_int_list
from specdec_kernels.decoding.coupling import GumbelCoupling
from specdec_kernels.decoding.draft import SamplingParams
from specdec_kernels.decoding.engine.stats import DecodeStats
from specdec_kernels.decoding.paged import PagedKVCache


def per_sequence(name: str, value, batch: int) -> List[int]:
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
# the drafter's generators are seeded apart from the verification's (``make_generators`` offset)
DRAFT_SEED_OFFSET = 0x5DEECE66D


def make_generators(seeds, batch: int, offset: int = 0) -> List[torch.Generator]:
    """One CPU ``torch.Generator`` per sequence: seeds[b] (a list or tuple of ints), or seed + b
    (an int, numpy integers included), or seeds drawn from torch's global generator (None).
    A generator's seed is the given seed (plus ``offset``) modulo 2**63.

    Raises:
        TypeError: seeds none of those (a string, floats, bools).
        ValueError: not one seed per prompt."""
    if seeds is None:
        seeds = [int(torch.randint(0, 2**62, ()).item()) for _ in range(batch)]
    elif isinstance(seeds, (str, bytes)):
        raise TypeError(f"seeds must be None, an int or one int per prompt, got {type(seeds).__name__} {seeds!r}")
    elif not hasattr(seeds, "__iter__"):
        seeds = [as_int("seeds", seeds) + b for b in range(batch)]
    else:
        seeds = as_int_list("seeds", seeds)
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
    # the drafter's view of this run (``draft.DraftRun``), made by ``start``
    draft_run: Optional[object] = None
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

    @classmethod
    def new(
        cls,
        histories: List[List[int]],
        limits: List[int],
        kv_cache,
        sampling: SamplingParams,
        seeds,
        vocab_size: int,
        random_source: str = "generator",
    ) -> "DecodeState":
        """A batch's state before its prefill: the KV cache (dense tensor or ``PagedKVCache``,
        on the target's device), one verification generator per sequence from ``seeds``
        (``make_generators``), the Gumbel coupling of a sampling run with
        ``coupling="gumbel"``, and with ``random_source="philox"`` each sequence's Philox key
        (its seed's bit pattern, on the device) and offset 0."""
        paged = isinstance(kv_cache, PagedKVCache)
        device = kv_cache.pool.device if paged else kv_cache.device
        B = len(histories)
        state = cls(
            histories=histories,
            prompt_lengths=[len(h) for h in histories],
            max_new_tokens=limits,
            kv_cache=kv_cache,
            cache_seqlens=torch.zeros(B, dtype=torch.int32, device=device),
            done=[m == 0 for m in limits],
            generators=make_generators(seeds, B),
            sampling=sampling,
        )
        if not sampling.greedy and sampling.coupling == "gumbel":
            state.coupling = GumbelCoupling([g.initial_seed() for g in state.generators], vocab_size)
        if random_source == "philox":  # a seed's bit pattern as a Philox key
            keys = [(g.initial_seed() + 2**63) % 2**64 - 2**63 for g in state.generators]
            state.philox_seeds = torch.tensor(keys, dtype=torch.int64, device=device)
            state.philox_offsets = [0] * B
        state.stats.kv_cache_bytes = kv_cache.nbytes if paged else kv_cache.numel() * kv_cache.element_size()
        return state

    def frozen_histories(self) -> Tuple[Tuple[int, ...], ...]:
        """The committed tokens per sequence as tuples: what the drafter is handed
        (``DraftRequest.histories``, ``StepResult.histories``), so that nothing it does to them
        reaches the engine's own lists (a copy of B histories per call: about 10 us for 4,096
        tokens)."""
        return tuple(tuple(h) for h in self.histories)

    def emit(self, out, num_accepted, depth, active, stop_token_ids, stop_check) -> List[List[int]]:
        """Commit a verified step: per active sequence b, its accepted drafts and the bonus token
        (``out[b, : num_accepted[b] + 1]``, host tensors from the verifier), cut at
        ``max_new_tokens``, after the first stop token (the sequence ends) and where
        ``stop_check`` says; appended to ``histories[b]``, the Gumbel coupling told, the
        statistics recorded (``depth[b]``: the draft's depth).  Returns the tokens each sequence
        emitted ([] for inactive ones).

        Raises:
            ValueError: ``stop_check`` returned neither None nor an int in 1..len(new)."""
        emitted: List[List[int]] = []
        out_rows, accepted, depths = out.tolist(), num_accepted.tolist(), depth.tolist()
        for b in range(self.batch_size):
            if not active[b]:
                emitted.append([])
                continue
            new = out_rows[b][: accepted[b] + 1]
            new = new[: self.max_new_tokens[b] - len(self.generated(b))]
            for i, t in enumerate(new):
                if t in stop_token_ids:
                    new = new[: i + 1]
                    self.done[b] = True
                    break
            if stop_check is not None and new:
                keep = stop_check(b, self.histories[b], new)
                if keep is not None:
                    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= len(new):
                        raise ValueError(f"stop_check must return None or an int in 1..{len(new)}, got {keep!r}")
                    new = new[:keep]
                    self.done[b] = True
            self.histories[b].extend(new)
            if self.coupling is not None:
                self.coupling.commit(b, len(self.histories[b]))
            if len(self.generated(b)) >= self.max_new_tokens[b]:
                self.done[b] = True
            self.stats.record(depths[b], accepted[b], len(new))
            emitted.append(new)
        return emitted

    def record_step(self, ks, active, draft, depth, num_accepted, clock: List[float], model_tokens: int) -> None:
        """A step's statistics and ``last_step`` (``StepRecord``): ``clock`` holds its start,
        drafted, verified, advanced and observed times (seconds, ``time.perf_counter``);
        ``model_tokens`` the drafter's running count of tokens fed through its model."""
        t0, t1, t2, t3, t4 = clock
        stats = self.stats
        stats.target_passes += 1
        nodes = draft.num_nodes.tolist()
        stats.draft_tokens += sum(n - 1 for n, a in zip(nodes, active) if a)
        stats.draft_time += (t1 - t0) + (t4 - t3)
        stats.verify_time += t2 - t1
        stats.bookkeeping_time += t3 - t2
        stats.draft_lengths.extend(k for k, a in zip(ks, active) if a)
        stats.draft_model_tokens = int(model_tokens)
        self.last_step = StepRecord(
            ks=ks,
            depths=depth.tolist(),
            num_nodes=nodes,
            num_accepted=num_accepted.tolist(),
            active=active,
            block_width=max(nodes),
            draft_time=(t1 - t0) + (t4 - t3),
            verify_time=t2 - t1,
        )


@dataclass
class GenerationResult:
    """tokens[b]: the generated tokens of prompt b (a final stop token included)."""

    tokens: List[List[int]]
    stats: DecodeStats


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
