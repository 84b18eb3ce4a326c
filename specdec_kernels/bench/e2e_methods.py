"""The methods ``bench.e2e`` races, as its harness sees them, and the clock they time with.

A method (``Method``) is one way of decoding a prompt greedily at batch 1: ours, transformers'
or llama.cpp's (``FAMILIES``).  It runs on a ``Context`` (the loaded models) and returns a
``Run`` per generation: its tokens, the wall seconds of the generate call, and what the method
can count or time (target passes, accepted draft tokens, time to the first token, CPU seconds
of the decoding process).  ``_Clock`` measures the wall and CPU clocks of one call for the
methods that decode in this process.  Methods live in a registry (``METHODS``, filled by
``register``) that ``--methods`` selects from (``select_methods``); each rival's methods are
in a module of its own (``e2e_ours``, ``e2e_transformers``, ``e2e_llamacpp``), registered
when ``bench.e2e`` is imported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

FAMILIES = ("ours", "transformers", "llama.cpp")


@dataclass
class Context:
    """What a method runs on: our model and transformers' model with the same weights."""

    model: Any  # specdec_kernels.decoding.Transformer
    hf: Any  # transformers LlamaForCausalLM
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    eos_token_id: int
    num_draft_tokens: Optional[int] = None  # --num-draft-tokens: overrides the K of our drafting methods
    cache: Dict[str, Any] = field(default_factory=dict)  # per-method objects built once (drafters)
    threads: Optional[int] = None  # --threads (None: torch's count): llama.cpp's n_threads


@dataclass
class Run:
    """One generation: its tokens (a final EOS included), wall seconds, and what the method
    could count or time (None when it cannot): the wall and CPU seconds to its first new token
    and the CPU seconds of the whole call (the decoding process's, all threads)."""

    tokens: List[int]
    seconds: float
    target_passes: Optional[int] = None
    mean_accepted_length: Optional[float] = None
    draft_tokens: Optional[int] = None
    accepted_draft_tokens: Optional[int] = None
    extra: Dict[str, Any] = field(default_factory=dict)  # anything else worth a JSON field (policy, K chosen, ...)
    ttft_s: Optional[float] = None
    cpu_seconds: Optional[float] = None
    cpu_ttft_s: Optional[float] = None


@dataclass
class Method:
    """A decoding method of the benchmark.

    Attributes:
        name: the name used by --methods.
        family: "ours" (must reproduce our greedy tokens exactly), "transformers" or "llama.cpp".
        description: one line for the table (draft depth, layers, ...).
        run: ``run(ctx, prompt_ids, max_new_tokens) -> Run``: one greedy generation at batch 1,
            stopping at ``ctx.eos_token_id``; time only the generation itself.
        params: the settings, written to the JSON lines.
        default: run when --methods is not given.
        unavailable: ``f() -> reason or None``: why the method cannot run on this machine
            (a missing environment); the run then reports it as skipped, with the reason.
    """

    name: str
    family: str
    description: str
    run: Callable[[Context, List[int], int], Run]
    params: Dict[str, Any] = field(default_factory=dict)
    default: bool = True
    unavailable: Optional[Callable[[], Optional[str]]] = None


METHODS: Dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add a method to ``METHODS`` (its name must be new); returns it."""
    if method.family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {method.family!r}")
    if method.name in METHODS:
        raise ValueError(f"a method named {method.name!r} is registered already")
    METHODS[method.name] = method
    return method


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class _Clock:
    """Wall and CPU clocks (this process, all threads) of one generate call, from its creation:
    ``first()`` once the first new token exists, ``stop()`` at the end.  Also a transformers
    streamer: its first ``put`` is the prompt, its second the first new token."""

    def __init__(self):
        self.ttft = self.cpu_ttft = self.seconds = self.cpu = None
        self._puts = 0
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()

    def first(self) -> None:
        if self.ttft is None:
            self.ttft, self.cpu_ttft = time.perf_counter() - self._t0, time.process_time() - self._c0

    def stop(self) -> float:
        self.seconds, self.cpu = time.perf_counter() - self._t0, time.process_time() - self._c0
        return self.seconds

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2:
            self.first()

    def end(self) -> None:
        pass

    def fields(self) -> Dict[str, Optional[float]]:
        return {"ttft_s": self.ttft, "cpu_seconds": self.cpu, "cpu_ttft_s": self.cpu_ttft}


def _engine_run(tokens: List[int], seconds: float, stats: Any, extra: Dict[str, Any], **clocks) -> Run:
    """The ``Run`` of a generation by our engine (ours, or ours in transformers): the passes,
    accepted length and draft counts of its ``stats`` (``DecodeStats``); ``clocks``: the
    first-token and CPU times measured."""
    return Run(
        tokens,
        seconds,
        stats.target_passes,
        stats.mean_accepted_length,
        stats.draft_tokens,
        stats.accepted_draft_tokens,
        extra,
        **clocks,
    )


def select_methods(spec: Optional[str]) -> List[Method]:
    """The methods named in a comma-separated list (None: the default ones), in the order given.

    Raises:
        ValueError: an unknown name (the message lists the valid names) or an empty list.
    """
    if spec is None:
        return [m for m in METHODS.values() if m.default]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; valid names: {', '.join(METHODS)}")
    if not names:
        raise ValueError(f"--methods names no method; valid names: {', '.join(METHODS)}")
    return [METHODS[n] for n in dict.fromkeys(names)]
