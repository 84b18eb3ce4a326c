"""Every default invocation of the CLI against plain greedy decoding: is the default the fast choice?

    python -m specdec_kernels.bench.defaults [--numerics float32,int8] [--max-new-tokens 64]
                                             [--rounds 2] [--threads 1] [--out DIR]

For each drafter the CLI offers, with only ``--drafter`` (and the documented extras: ``--tree``
for prompt lookup, the prompt-lookup-else-EAGLE fallback), built through the CLI's own code
(``generate.parse_args``, ``build_drafter``, ``draft_schedule``: the drafter's default
policy, which also sizes its trees), on the main job's demo prompts (``bench.e2e``'s
``DEMO``), in each numerics: tokens per second against our plain greedy decoding in the same
numerics, the runs interleaved per prompt and round.  The docs promise that no default
invocation is slower than ``TARGET`` (0.9x) plain greedy on the machine where it runs; the
table marks those that are.  Every run's tokens are checked against plain greedy first
(speculation is lossless, so they must be equal).

Writes ``defaults.txt`` (the table), ``defaults.jsonl`` and ``defaults.png`` to ``--out``
(default ``bench_out/``).  Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from specdec_kernels.bench.common import (
    ArgumentParser,
    check_range,
    column,
    cpu_model,
    environment,
    format_table,
    out_dir,
    pyplot_or_none,
    save_figure,
    write_jsonl,
)

TARGET = 0.9  # the slowest a default invocation may be, as a ratio to plain greedy
# label -> the CLI's drafter flags (everything else at its default)
INVOCATIONS: Dict[str, List[str]] = {
    "ngram": ["--drafter", "ngram"],
    "ngram --tree": ["--drafter", "ngram", "--tree"],
    "layerskip": ["--drafter", "layerskip"],
    "draft-model": ["--drafter", "draft-model"],
    "medusa": ["--drafter", "medusa"],
    "medusa-tree": ["--drafter", "medusa-tree"],
    "eagle": ["--drafter", "eagle"],
    "eagle-tree": ["--drafter", "eagle-tree"],
    "lookahead": ["--drafter", "lookahead"],
    "ngram else eagle": ["--drafter", "multi", "--drafters", "ngram,eagle", "--fallback", "--min-ngram", "2"],
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The flags, every one checked before the model loads (exit 2, one line naming it)."""
    p = ArgumentParser(prog="python -m specdec_kernels.bench.defaults", description=__doc__.split("\n\n")[0])
    p.add_argument("--numerics", default="float32,int8", help="comma-separated: float32, int8")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per prompt (default: the demo's)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over every invocation (median taken)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the demo's 1 by default)")
    p.add_argument("--methods", default=None, help=f"comma-separated subset of: {', '.join(INVOCATIONS)}")
    p.add_argument("--out", default=None, help="output folder (default bench_out/)")
    args = p.parse_args(argv)
    args.numerics = [n.strip() for n in args.numerics.split(",") if n.strip()]
    bad = [n for n in args.numerics if n not in ("float32", "int8")]
    if bad or not args.numerics:
        p.error(f"--numerics must list float32 and/or int8, got {bad or args.numerics}")
    args.methods = list(INVOCATIONS) if args.methods is None else [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in args.methods if m not in INVOCATIONS]
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {list(INVOCATIONS)}")
    check_range(p, "--rounds", args.rounds, 1, 100)
    check_range(p, "--threads", args.threads, 1, 1024)
    if args.max_new_tokens is not None:
        check_range(p, "--max-new-tokens", args.max_new_tokens, 1, 4096)
    return args


def demo_prompts(tok) -> List[List[int]]:
    """The main job's demo prompts (``bench.e2e``'s DEMO: the first Spec-Bench question of each
    of its categories), through the chat template."""
    from specdec_kernels.bench.e2e import DEMO
    from specdec_kernels.decoding.prompts import spec_bench_questions
    from specdec_kernels.decoding.training.data import chat_ids

    questions = spec_bench_questions()
    out = []
    for category in DEMO["categories"]:
        q = next(q for q in questions if q["category"] == category)
        out.append(chat_ids(tok, q["turns"][0]))
    return out


def cli_decoder(model, flags: List[str], stop: int):
    """(decoder, num_draft_tokens) exactly as ``python -m specdec_kernels.generate <flags>`` makes them."""
    from specdec_kernels import generate
    from specdec_kernels.decoding import SpeculativeDecoder

    args = generate.parse_args(["--prompt", "x", *flags])
    drafter = generate.build_drafter(args, model)
    schedule = generate.draft_schedule(args, drafter)
    return SpeculativeDecoder(model, drafter, stop_token_ids=[stop], threads=args.threads or "auto"), schedule


def run(args: argparse.Namespace) -> List[Dict]:
    from specdec_kernels.bench.e2e import DEMO
    from specdec_kernels.decoding import SpeculativeDecoder, loading

    torch.set_num_threads(args.threads)
    model, tok = loading.load_smollm2()
    prompts = demo_prompts(tok)
    new = args.max_new_tokens or DEMO["max_new_tokens"]
    stop = tok.eos_token_id
    rows = []
    for numerics in args.numerics:
        model.numerics = numerics
        plain = SpeculativeDecoder(model, None, stop_token_ids=[stop])
        plain.generate([prompts[0][-8:]], 2)  # warm-up
        greedy = [plain.generate([p], new).tokens[0] for p in prompts]
        # one decoder per invocation, kept across rounds and prompts, as a user keeps one
        decoders = {m: cli_decoder(model, INVOCATIONS[m], stop) for m in args.methods}
        times: Dict[str, List[float]] = {m: [] for m in ["plain greedy", *args.methods]}
        tokens: Dict[str, int] = {m: 0 for m in times}
        for _ in range(args.rounds):
            spent = {m: 0.0 for m in times}
            for i, prompt in enumerate(prompts):
                for m in times:
                    dec, schedule = (plain, 0) if m == "plain greedy" else decoders[m]
                    t = time.perf_counter()
                    out = dec.generate([prompt], new, schedule)
                    spent[m] += time.perf_counter() - t
                    if out.tokens[0] != greedy[i]:
                        raise AssertionError(f"{m} ({numerics}) gave other tokens than plain greedy on prompt {i}")
                    tokens[m] += len(out.tokens[0])
            for m in times:
                times[m].append(spent[m])
        per_round = {m: tokens[m] / args.rounds for m in times}
        base = per_round["plain greedy"] / statistics.median(times["plain greedy"])
        for m in times:
            rate = per_round[m] / statistics.median(times[m])
            rows.append(
                {
                    "numerics": numerics,
                    "method": m,
                    "cli": " ".join(INVOCATIONS.get(m, ["--drafter", "none"])),
                    "tokens_per_s": rate,
                    "x_plain": rate / base,
                    "spread_s": max(times[m]) - min(times[m]),
                    "below_target": rate / base < TARGET,
                    "rounds": args.rounds,
                    "prompts": len(prompts),
                    "max_new_tokens": new,
                    "threads": args.threads,
                }
            )
        model.numerics = "float32"
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        out = out_dir(args.out, "bench_out")  # checked before any work
    except ValueError as e:
        print(f"python -m specdec_kernels.bench.defaults: error: --out: {e}", file=sys.stderr)
        return 2
    rows = run(args)
    env = {**environment(), "cpu": cpu_model()}
    table = format_table(
        rows,
        [
            column("numerics"),
            column("method"),
            column("tokens_per_s", "tokens/s", "{:.1f}"),
            column("x_plain", "x plain greedy", "{:.2f}"),
            column("below_target", f"< {TARGET}x"),
        ],
    )
    header = f"Default invocations against plain greedy ({env['cpu']}, commit {env.get('commit', '?')}, {args.threads} thread(s))"
    print(header)
    print(table)
    (out / "defaults.txt").write_text(header + "\n" + table + "\n")
    write_jsonl(out / "defaults.jsonl", rows, env)
    plt = pyplot_or_none(out / "defaults.png")
    if plt is not None:
        fig, ax = plt.subplots(figsize=(9, 4))
        labels = [f"{r['method']} ({r['numerics']})" for r in rows if r["method"] != "plain greedy"]
        values = [r["x_plain"] for r in rows if r["method"] != "plain greedy"]
        ax.barh(labels, values)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.axvline(TARGET, color="r", lw=0.8, ls="--")
        ax.set_xlabel("tokens/s, x plain greedy (same numerics)")
        save_figure(fig, out / "defaults.png", header)
    below = [f"{r['method']} ({r['numerics']})" for r in rows if r["below_target"]]
    print(f"below {TARGET}x plain greedy: {', '.join(below) if below else 'none'}")
    return 0


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)
