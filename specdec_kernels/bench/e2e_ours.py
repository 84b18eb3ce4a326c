"""Our engine's methods of ``bench.e2e``: ``SpeculativeDecoder`` on SmolLM2, plain and with each drafter.

What they measure: our engine's greedy decoding, plain (``greedy``) and with every drafter of
``specdec_kernels.decoding`` (n-gram / prompt lookup chain and tree, layer-skip, the shipped
Medusa and EAGLE heads, lookahead, drafters merged or mixed, a cut-down copy of the target as
a draft model), at a fixed draft depth K or with the engine's draft-length policy; each again
with 8-bit activations (``-int8``).  Timed in this process by ``e2e_methods._Clock``: the
wall and CPU seconds of the generate call and of its first new token, and the engine's own
counts (``DecodeStats``: target passes, accepted length, draft tokens, K chosen, threads).
Every method of ours must reproduce our plain greedy tokens in its numerics
(``greedy_baseline``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

from specdec_kernels.bench.e2e_methods import METHODS, Context, Method, Run, _Clock, _engine_run, _sync, register

# Our drafters run with the engine's defaults (``NgramDrafter()``, the drafters' ``default_k``,
# ``adaptive.default_policy``); what the engine leaves open is chosen here:
LAYERSKIP_LAYERS = 24  # of 30, as in the engine's tests: SmolLM2 was not trained for early exit
LAYERSKIP_TREE = (2, 2)
DRAFT_MODEL_LAYERS = 20
# ngram-eagle-adaptive: the shortest suffix match for which prompt lookup drafts before the
# EAGLE head (2 and 3 measured alike on the tuning prompts, docs/MEASUREMENTS.md 2026-12-05)
FALLBACK_MIN_NGRAM = 2
# eagle-tree-16, ngram-eagle-tree-16: the EAGLE head's dynamic tree at 16 nodes, root included
TREE16 = {"top_k": 4, "max_nodes": 16}
INT8_SUFFIX = "-int8"
_OURS_CALLS: Dict[str, tuple] = {}  # name -> the arguments of ours(), to build the int8 twins


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
        k_max: the largest K of the adaptive policy (default: the drafter's ``default_k``).
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


def register_builtin() -> None:
    """Register the methods of ours in ``METHODS``, in the order ``--methods`` lists them."""
    from specdec_kernels.decoding import DraftModelDrafter, LayerSkipDrafter, NgramDrafter
    from specdec_kernels.decoding.drafters.eagle import SHIPPED as EAGLE_SHIPPED
    from specdec_kernels.decoding.drafters.eagle import TREE_DEFAULT_K, EagleDrafter
    from specdec_kernels.decoding.drafters.lookahead import LookaheadDrafter
    from specdec_kernels.decoding.drafters.medusa import SHIPPED, MedusaDrafter
    from specdec_kernels.decoding.drafters.multi import MultiDrafter

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

    ngram_k, model_k, multi_k = NgramDrafter.default_k, LayerSkipDrafter.default_k, MultiDrafter.default_k
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
    medusa_k = MedusaDrafter.default_k
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
    eagle_k, tree_k = EagleDrafter.default_k, TREE_DEFAULT_K
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
    la_k = LookaheadDrafter.default_k
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


def register_int8_twins() -> None:
    """Register every method of ours again with 8-bit activations (``Transformer.numerics =
    "int8"``), run on request (--methods, --demo): greedy-int8, ngram-chain-int8, ..."""
    for name, (make, description, kwargs) in list(_OURS_CALLS.items()):
        if kwargs["numerics"] == "float32" and name + INT8_SUFFIX not in METHODS:
            register(
                ours(
                    name + INT8_SUFFIX,
                    make,
                    description + ", int8 activations",
                    **{**kwargs, "numerics": "int8", "default": False},
                )
            )
