"""The checks of ``SpeculativeDecoder``'s options, in one function, before anything is built.

``check_options`` raises a ValueError or TypeError naming the option; the decoder's docstring
says what each option means.
"""

from __future__ import annotations

import inspect
from typing import FrozenSet

from specdec_kernels.checks import as_int, as_int_list, as_real, layer_indices
from specdec_kernels.decoding.draft import Drafter, SamplingParams
from specdec_kernels.decoding.engine.adaptive import resolve_policy
from specdec_kernels.decoding.engine.state import per_sequence
from specdec_kernels.decoding.model import Transformer

# where the sampling ops' random numbers come from (``SpeculativeDecoder(random_source=...)``)
RANDOM_SOURCES = ("generator", "philox")


def check_options(model, drafter: Drafter, options: dict) -> FrozenSet[int]:
    """Check the decoder's ``options`` (its keyword arguments by name) against ``model`` (our
    ``Transformer`` or an adapter with its call interface) and ``drafter`` (a ``Drafter``;
    ``NoDrafter()`` for none).  Returns the stop token ids as a frozenset.

    Raises:
        TypeError: a model or drafter of the wrong type; stop_token_ids not a sequence of ints;
            stop_check not callable; an int option not an int; typical or typical_alpha not a
            real number; node_buckets or cuda_graphs not a bool; feature_layers not ints.
        ValueError: the rest, as ``SpeculativeDecoder`` documents.
    """
    if not _is_target(model):
        raise TypeError(f"model must be a specdec_kernels.decoding.Transformer, got {type(model).__name__}")
    if not isinstance(drafter, Drafter):
        raise TypeError(
            f"drafter must be a Drafter (e.g. NgramDrafter()) or None, got {type(drafter).__name__} {drafter!r}"
        )
    V = model.args.vocab_size
    stops = options["stop_token_ids"]
    if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
        raise TypeError(f"stop_token_ids must be a sequence of token ids, got {type(stops).__name__} {stops!r}")
    stops = as_int_list("stop_token_ids", stops)
    if stops and (min(stops) < 0 or max(stops) >= V):
        raise ValueError(f"stop_token_ids must lie in [0, {V}), got {sorted(stops)}")
    if options["stop_check"] is not None and not callable(options["stop_check"]):
        raise TypeError(f"stop_check must be callable or None, got {type(options['stop_check']).__name__}")
    for name in ("prefill_chunk", "max_draft_nodes"):
        if as_int(name, options[name]) < 1:
            raise ValueError(f"{name} must be >= 1, got {options[name]}")
    resolve_policy(options["policy"], drafter)  # raises on a bad policy now rather than later
    _check_typical(options["typical"], options["typical_alpha"])
    if options["share_prefix"] and options["block_size"] is None:
        raise ValueError("share_prefix=True needs a paged cache: give block_size (e.g. 16)")
    threads = options["threads"]
    if not (
        threads is None
        or threads == "auto"
        or (isinstance(threads, int) and not isinstance(threads, bool) and 1 <= threads <= 1024)
    ):
        raise ValueError(f"threads must be 'auto', None or an int in 1..1024, got {threads!r}")
    if not isinstance(options["random_source"], str) or options["random_source"] not in RANDOM_SOURCES:
        raise ValueError(f"random_source must be one of {RANDOM_SOURCES}, got {options['random_source']!r}")
    _check_graphs(model, options)
    check_drafter(drafter)
    vocab = getattr(drafter, "vocab_size", None)
    if vocab is not None and vocab != V:
        raise ValueError(f"the drafter's vocabulary ({vocab}) differs from the target's ({V})")
    if getattr(drafter, "wants_hidden", False):  # read here, once
        layer_indices("drafter.feature_layers", getattr(drafter, "feature_layers", ()), model.args.num_layers)
    return frozenset(stops)


def check_drafter(drafter: Drafter) -> None:
    """A ``Drafter`` (``check_options`` checks the type first) whose ``propose`` takes one
    request and whose ``observe`` one step result (the contract of ``decoding/draft.py``).

    Raises:
        TypeError: ``propose`` or ``observe`` written for the older contract of several
            arguments (``propose(histories, num_draft_tokens, active)``), naming the drafter
            and the method.
    """
    for method in ("propose", "observe"):
        try:
            params = inspect.signature(getattr(drafter, method)).parameters.values()
        except (TypeError, ValueError):  # a builtin or C callable: not ours to read
            continue
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p for p in positional if p.default is p.empty]
        varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
        old = bool(positional) and positional[0].name in ("histories", "accepted_nodes")  # the old first arguments
        if len(required) > 1 or old or (not positional and not varargs):
            arg = "request: DraftRequest" if method == "propose" else "result: StepResult"
            raise TypeError(
                f"drafter {getattr(drafter, 'name', type(drafter).__name__)!r}: {method} must take one argument "
                f"({method}(self, {arg})), got {method}{inspect.signature(getattr(drafter, method))}; "
                "see docs/ENGINE.md, 'The drafter interface'"
            )


def _is_target(model) -> bool:
    # our Transformer, or an adapter with its call interface (integrations.transformers.HFCausalLM)
    return isinstance(model, Transformer) or getattr(type(model), "_specdec_decode_target", False)


def _check_typical(typical, typical_alpha) -> None:
    if typical is not None and not 0 < as_real("typical", typical) <= 1:
        raise ValueError(f"typical (the posterior threshold epsilon) must lie in (0, 1] or be None, got {typical}")
    if typical_alpha is not None and (typical is None or not 0 < as_real("typical_alpha", typical_alpha, finite=True)):
        raise ValueError(f"typical_alpha must be finite, > 0 and needs typical, got {typical_alpha}")


def _check_graphs(model, options: dict) -> None:
    for flag in ("node_buckets", "cuda_graphs"):
        if not isinstance(options[flag], bool):
            raise TypeError(f"{flag} must be a bool, got {options[flag]!r}")
    if options["cuda_graphs"]:
        if not isinstance(model, Transformer) or model.device.type != "cuda":
            raise ValueError(
                "cuda_graphs=True needs a specdec_kernels.decoding.Transformer on a CUDA device, got "
                f"{type(model).__name__} on {getattr(model, 'device', 'an unknown device')}"
            )
        if options["block_size"] is not None:
            raise ValueError("cuda_graphs=True needs a dense KV cache (block_size=None)")


def check_requests(vocab_size: int, prompts, max_new_tokens, sampling):
    """``SpeculativeDecoder.start``'s requests, checked before anything is allocated.

    Args:
        vocab_size: V, the target's vocabulary.
        prompts: token ids per sequence (non-empty sequences of ints in [0, V)).
        max_new_tokens: an int >= 0, or one per prompt.
        sampling: a ``SamplingParams`` or None (greedy).

    Returns:
        (histories, limits, sampling): the prompts as lists of ints, max_new_tokens per
        sequence, the sampling parameters.

    Raises:
        ValueError: no prompts, an empty prompt, token ids outside [0, V), max_new_tokens < 0
            or not one per prompt.
        TypeError: non-integer token ids or max_new_tokens, sampling not a SamplingParams.
    """
    histories = [as_int_list(f"prompts[{b}]", p) for b, p in enumerate(prompts)]
    if not histories:
        raise ValueError("prompts must hold at least one prompt")
    for b, h in enumerate(histories):
        if not h:
            raise ValueError(f"prompts[{b}] is empty (a prompt needs at least one token)")
        if min(h) < 0 or max(h) >= vocab_size:
            raise ValueError(f"prompts[{b}] holds token ids outside [0, {vocab_size})")
    limits = per_sequence("max_new_tokens", max_new_tokens, len(histories))
    if min(limits) < 0:
        raise ValueError(f"max_new_tokens must be >= 0, an int or one per prompt, got {max_new_tokens}")
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
    return histories, limits, sampling or SamplingParams()
