"""What ``speculative_generate`` needs to honour ``model.generate``'s arguments inside our decode
loop: transformers' own logits processors applied to every scored node with that node's
context, transformers' stopping criteria checked after every emitted token, the streamer fed
whole columns, generate's ``num_assistant_tokens_schedule``.

Logits processors.  ``generate`` calls its ``LogitsProcessorList`` once per new token with
``input_ids`` (batch, length): the (left-padded) prompt and the tokens so far.  A speculative
step scores many nodes per row, each with its own context: the row's padding, the tokens in
its KV cache, then the node's ancestors in the block.  ``ProcessedModel`` wraps the model the
engine calls (the target, an assistant model, the target's early exit) and hands every returned
logit row through the row's processors with exactly that context, so the target distribution
of every node is the one ``generate`` would sample from (or take the argmax of) at that point,
and a model drafter samples from its own logits processed the same way: verification stays
lossless.  The tokens behind the cache slots are tracked from what each forward writes
(``cache_seqlens[b] + i`` for block node i) and, once decoding runs, from the committed
histories, which the compaction of accepted nodes leaves at slots 0 .. len - 1.

Processors see one row at a time (input_ids of shape (1, length)).  transformers' processors
that hold per-row state (repetition penalty's ``prompt_ignore_length``, the prefix constraint's
batch index) get a per-row copy; the few that need the whole batch or run a model themselves
are refused (``BATCH_PROCESSORS``).  A caller's own processors must be row-wise (a row's
scores depending on that row's input_ids only), as speculation needs.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from transformers.generation import logits_process as lp

from specdec_kernels.decoding.draft import SamplingParams

# transformers' processors that need the whole batch, run a model of their own, or keep state
# across calls (one call per generated token assumed): refused rather than applied per node
BATCH_PROCESSORS = tuple(
    getattr(lp, name)
    for name in (
        "ClassifierFreeGuidanceLogitsProcessor",
        "UnbatchedClassifierFreeGuidanceLogitsProcessor",
        "SynthIDTextWatermarkLogitsProcessor",
        "WatermarkLogitsProcessor",
        "WhisperTimeStampLogitsProcessor",
        "WhisperNoSpeechDetection",
        "AlternatingCodebooksLogitsProcessor",
        "BarkEosPrioritizerLogitsProcessor",
        "DiaClassifierFreeGuidanceLogitsProcessor",
        "DiaEOSChannelFilterLogitsProcessor",
        "DiaEOSDelayPatternLogitsProcessor",
    )
    if hasattr(lp, name)
)


def row_processors(processors: Sequence, batch: int) -> List[lp.LogitsProcessorList]:
    """One ``LogitsProcessorList`` per row, to be called with that row's input_ids (1, length).

    Raises:
        ValueError: a processor that needs the whole batch (``BATCH_PROCESSORS``).
    """
    rows = [lp.LogitsProcessorList() for _ in range(batch)]
    for p in processors:
        if isinstance(p, BATCH_PROCESSORS):
            raise ValueError(
                f"logits processor {type(p).__name__} needs the whole batch or keeps state across calls; "
                "speculative decoding applies processors row by row to every draft node"
            )
        for b, row in enumerate(rows):
            q = p
            if isinstance(p, lp.RepetitionPenaltyLogitsProcessor) and isinstance(p.prompt_ignore_length, torch.Tensor):
                if p.prompt_ignore_length.shape[0] != batch:
                    raise ValueError(
                        f"repetition penalty: prompt_ignore_length holds {p.prompt_ignore_length.shape[0]} rows, "
                        f"the batch {batch}"
                    )
                q = copy.copy(p)
                q.prompt_ignore_length = p.prompt_ignore_length[b : b + 1]
            elif isinstance(p, lp.PrefixConstrainedLogitsProcessor):
                q = copy.copy(p)
                fn, group = p._prefix_allowed_tokens_fn, max(1, p._num_beams)
                q._prefix_allowed_tokens_fn = lambda _i, sent, fn=fn, b=b // group: fn(b, sent)
                q._num_beams = 1
            row.append(q)
    return rows


def kernel_sampling(processors: Sequence, do_sample: bool) -> Optional[SamplingParams]:
    """The ``SamplingParams`` of our fused ``sampling_probs`` when ``processors`` are exactly what
    it computes (nothing when greedy; temperature, top-k, top-p in transformers' order, keeping
    at least one token, when sampling); None when they must run as transformers' processors."""
    if not do_sample:
        return SamplingParams() if len(processors) == 0 else None
    temperature, top_k, top_p = 1.0, None, None
    order = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper)
    last = -1
    for p in processors:
        kind = next((i for i, t in enumerate(order) if type(p) is t), None)
        if kind is None or kind <= last or getattr(p, "min_tokens_to_keep", 1) != 1:
            return None
        last = kind
        if kind == 0:
            temperature = float(p.temperature)
        elif kind == 1:
            top_k = int(p.top_k)
        else:
            top_p = float(p.top_p)
    return SamplingParams(temperature, top_k, top_p)


class ProcessedModel:
    """The engine's model interface (``HFCausalLM``'s) around ``inner``, with every returned logit
    row handed through its row's transformers logits processors with that node's context.

    Args:
        inner: an ``HFCausalLM`` (or anything with its call interface).
        rows: per row, a ``LogitsProcessorList`` (``row_processors``) applied in the forward; None:
            logits are returned unchanged.
        prefixes: per row, the token ids ``generate``'s input_ids hold before the row's tokens
            (its left padding).
        record: keep the latest forward's tokens, tree and logits (``last``), for scores.
    """

    _specdec_decode_target = True

    def __init__(self, inner, rows: Optional[List], prefixes: List[List[int]], record: bool = False):
        self.inner = inner
        self.args = inner.args
        self.rows = rows
        self.prefixes = prefixes
        self.record = record
        self.state = None  # the engine's DecodeState, once decoding runs (set by the caller's on_step)
        self._slots: List[List[int]] = [[] for _ in prefixes]  # the token behind each cache slot
        self._synced = [0] * len(prefixes)  # committed tokens already written into _slots
        self.last: Optional[Dict] = None

    @property
    def device(self) -> torch.device:
        """The wrapped model's device."""
        return self.inner.device

    @property
    def dtype(self) -> torch.dtype:
        """The wrapped model's dtype."""
        return self.inner.dtype

    def new_kv_cache(self, batch: int, capacity: int, num_layers: Optional[int] = None) -> torch.Tensor:
        """The wrapped model's ``new_kv_cache`` (``[L, 2, batch, Hkv, capacity, D]``)."""
        return self.inner.new_kv_cache(batch, capacity, num_layers)

    def context(self, b: int, slots: int, path: List[int]) -> List[int]:
        """Row b's input_ids as ``generate`` would hold them: padding, the first ``slots`` cached
        tokens, then ``path`` (block tokens)."""
        return self.prefixes[b] + self._slots[b][:slots] + path

    def _sync(self) -> None:
        """Committed tokens sit at slots 0 .. len - 1 of every cache (compaction put them there)."""
        if self.state is None:
            return
        for b, h in enumerate(self.state.histories):
            s = self._slots[b]
            start = self._synced[b]
            if len(s) < len(h):
                s.extend([0] * (len(h) - len(s)))
            s[start : len(h)] = h[start:]
            self._synced[b] = len(h)

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        tree_mask: Optional[torch.Tensor] = None,
        **options: Any,
    ) -> Optional[torch.Tensor]:
        """``HFCausalLM.__call__`` (the same arguments; ``options``: its keyword-only ones),
        then the processors (see the class)."""
        logits = self.inner(tokens, positions, kv_cache, cache_seqlens, tree_mask, **options)
        logit_rows = options.get("logit_rows")
        B, N = tokens.shape
        host = options.get("host_seqlens")  # the loop's host copy: no read of cache_seqlens
        starts = [int(s) for s in (host if host is not None else cache_seqlens.tolist())]
        block = tokens.tolist()
        self._sync()
        for b in range(B):
            s = self._slots[b]
            if len(s) < starts[b] + N:
                s.extend([0] * (starts[b] + N - len(s)))
            s[starts[b] : starts[b] + N] = block[b]
        if logits is None or (self.rows is None and not self.record):
            return logits
        if tree_mask is None:
            paths = [[list(range(j + 1)) for j in range(N)]] * B
        else:
            m = tree_mask.cpu().bool()
            m = m.expand(B, N, N) if m.dim() == 2 else m
            paths = [[torch.nonzero(m[b, j]).flatten().tolist() for j in range(N)] for b in range(B)]
        which = logit_rows.tolist() if logit_rows is not None else [list(range(logits.shape[1]))] * B
        out = logits
        if self.rows is not None:
            out = logits.clone()
            done = self.state.done if self.state is not None else [False] * B
            for b in range(B):
                if done[b]:
                    continue
                for r, j in enumerate(which[b]):
                    ids = torch.tensor([self.context(b, starts[b], [block[b][a] for a in paths[b][j]])])
                    out[b, r] = self.rows[b](ids.to(logits.device), logits[b, r : r + 1].clone())[0]
        if self.record:
            self.last = dict(block=block, paths=paths, starts=starts, raw=logits, processed=out, which=which)
        return out


class StopAndScore:
    """The engine's ``stop_check``: transformers' stopping criteria after every emitted token
    (row by row, input_ids (1, length) as ``generate`` holds them), and the scores / logits
    ``generate(output_scores=True / output_logits=True)`` returns, from the target's latest
    forward (``ProcessedModel.last``).

    Args:
        criteria: a ``StoppingCriteriaList`` (MaxLength and EOS left to the engine) or None.
        prefixes: per row, the token ids before the row's tokens in generate's input_ids.
        target: the target's ``ProcessedModel`` (record=True) when scores or logits are wanted.
        rows: per row, the processors of the scores (``row_processors``), for a target whose
            forward did not apply them (our fused sampling did); None: its output is the scores.
        scores, logits: keep them.
    """

    def __init__(
        self, criteria, prefixes: List[List[int]], target: Optional[ProcessedModel], rows, scores: bool, logits: bool
    ):
        batch = len(prefixes)
        self.criteria = criteria if criteria is not None and len(criteria) else None
        self.prefixes = prefixes
        self.target = target
        self.rows = rows
        self.want_scores = scores
        self.want_logits = logits
        self.scores: List[List[torch.Tensor]] = [[] for _ in range(batch)]
        self.logits: List[List[torch.Tensor]] = [[] for _ in range(batch)]

    @property
    def needed(self) -> bool:
        """Whether the engine must call it at all (criteria to check, or scores / logits to keep)."""
        return self.criteria is not None or self.want_scores or self.want_logits

    def _record(self, b: int, history: List[int], new: List[int]) -> None:
        last = self.target.last
        paths, block, start = last["paths"][b], last["block"][b], last["starts"][b]
        node, nodes = 0, [0]  # the node whose logits chose new[i]: the root, then along the accepted path
        for t in new[:-1]:
            child = next(
                (j for j in range(node + 1, len(paths)) if paths[j][:-1] == paths[node] and block[j] == t), None
            )
            if child is None:
                raise RuntimeError(f"row {b}: emitted token {t} is no child of node {node} of the verified block")
            node = child
            nodes.append(node)
        for i, j in enumerate(nodes):
            raw = last["raw"][b, j]
            if self.want_logits:
                self.logits[b].append(raw.clone())
            if self.want_scores:
                if self.rows is None:
                    self.scores[b].append(last["processed"][b, j].clone())
                else:
                    ids = torch.tensor([self.target.context(b, start, [block[a] for a in paths[j]])])
                    self.scores[b].append(self.rows[b](ids.to(raw.device), raw[None].clone())[0])

    def __call__(self, b: int, history: List[int], new: List[int]) -> Optional[int]:
        """The engine's ``stop_check``: keep the scores of ``new``, then None (emit them all) or
        how many of them to emit before row b stops (the first token a criterion fires on)."""
        before = len(self.scores[b]), len(self.logits[b])
        if self.want_scores or self.want_logits:
            self._record(b, history, new)
        keep = None
        if self.criteria is not None:
            prefix = self.prefixes[b]
            for i in range(len(new)):
                ids = torch.tensor([prefix + history + new[: i + 1]])
                seen = tuple(s[None] for s in self.scores[b][: before[0] + i + 1]) if self.want_scores else None
                if bool(self.criteria(ids, seen).any()):
                    keep = i + 1
                    break
        if keep is not None:
            del self.scores[b][before[0] + keep :]
            del self.logits[b][before[1] + keep :]
        return keep

    def tuples(self, width: int, vocab: int, device) -> Dict[str, Optional[tuple]]:
        """generate's ``scores`` / ``logits``: one (B, V) tensor per new position; a row's
        positions after it stopped (padding) hold NaN."""
        out: Dict[str, Optional[tuple]] = {"scores": None, "logits": None}
        for name, per_row, wanted in (
            ("scores", self.scores, self.want_scores),
            ("logits", self.logits, self.want_logits),
        ):
            if not wanted:
                continue
            steps = []
            for t in range(width):
                col = torch.full((len(per_row), vocab), float("nan"), dtype=torch.float32, device=device)
                for b, rows in enumerate(per_row):
                    if t < len(rows):
                        col[b] = rows[t].to(device)
                steps.append(col)
            out[name] = tuple(steps)
        return out


class StreamFeed:
    """``streamer.put`` of the new tokens as whole columns (B, n): a column goes out once every
    row has its token there (or has finished: then ``pad``), as ``generate`` emits one column
    per step."""

    def __init__(self, streamer, batch: int, pad: int):
        self.streamer = streamer
        self.batch = batch
        self.pad = pad
        self.sent = 0

    def __call__(self, state, final: bool = False) -> None:
        """Put the columns every row has reached since the last call (all of them when
        ``final`` or when every row has finished)."""
        gen = [state.generated(b) for b in range(self.batch)]
        running = [len(g) for g, d in zip(gen, state.done) if not d]
        ready = max(len(g) for g in gen) if final or not running else min(running)
        if ready <= self.sent:
            return
        block = torch.full((self.batch, ready - self.sent), self.pad, dtype=torch.int64)
        for b, g in enumerate(gen):
            part = g[self.sent : ready]
            if part:
                block[b, : len(part)] = torch.tensor(part, dtype=torch.int64)
        self.sent = ready
        self.streamer.put(block)


def heuristic_schedule(start: int) -> Callable:
    """generate's ``num_assistant_tokens_schedule="heuristic"``, per row: K grows by 2 after a
    step whose whole draft was accepted, else shrinks by 1 (at least 1)."""
    ks: List[int] = []

    def schedule(step: int, state) -> List[int]:
        if not ks:
            ks.extend([start] * state.batch_size)
        last = state.last_step
        if last is not None:
            for b in range(state.batch_size):
                if last.active[b]:
                    ks[b] = ks[b] + 2 if last.num_accepted[b] == last.depths[b] else max(1, ks[b] - 1)
        return list(ks)

    return schedule
