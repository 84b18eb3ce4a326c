"""transformers' methods of ``bench.e2e``: ``generate`` on our weights, and our integration inside it.

What they measure: transformers' ``generate`` on the same SmolLM2 weights as our engine,
greedy, with its prompt lookup (``prompt_lookup_num_tokens``) and with layer-skip
self-speculation (``assistant_early_exit``); and our transformers integration
(``specdec_kernels.integrations.transformers.speculative_generate``) on transformers' model
with the same drafters.  Timed in this process by ``e2e_methods._Clock`` (transformers' own
methods show their first token through the streamer; our integration only the whole call);
target passes counted with a forward pre-hook on the model, the prefill included.  Their
tokens are compared with our greedy's and reported, not failed: transformers' arithmetic may
break floating-point ties differently.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Union

import torch

from specdec_kernels.bench.e2e_methods import Context, Method, Run, _Clock, _engine_run, _sync, register
from specdec_kernels.bench.e2e_ours import LAYERSKIP_LAYERS, LAYERSKIP_TREE

HF_PROMPT_LOOKUP = 10  # prompt_lookup_num_tokens
HF_EARLY_EXIT = LAYERSKIP_LAYERS  # assistant_early_exit (same layers as our layer-skip drafter)
HF_EARLY_EXIT_TOKENS = (
    4  # num_assistant_tokens: our layer-skip k_max (with the default, 20, a trial here ran at 0.22x hf-greedy)
)


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


def register_builtin() -> None:
    """Register transformers' methods and those of our integration in ``METHODS``."""
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
