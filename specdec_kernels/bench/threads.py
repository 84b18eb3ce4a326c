"""`python -m specdec_kernels.bench.threads`: the decode steps' thread count on an idle and on a loaded machine.

Plain greedy decoding of SmolLM2-135M-Instruct (``load_smollm2()``, float32 weights; the products
in ``--numerics``: float32 by default, or int8, whose layers run in one parallel region) on a few
Spec-Bench prompts (first turn, chat template, batch 1) with ``threads=1``, ``threads=`` all of
torch's count, ``threads="auto"`` with one decoder kept for the whole run (as a server would
keep it: the measurement and its budget carry over between calls) and ``"auto"`` with a new
decoder per call (the worst case: every call measures anew), each idle and under a synthetic
load (``--load`` busy processes, default one per CPU, started before the loaded calls and
stopped after them).  Conditions alternate over ``--reps`` repetitions, the settings in a
seeded random order within each condition.  A call is stopped ``--cap`` seconds after its
prefill (more threads under load can be 50 times slower) and then counts the tokens it had
made in that time.

The thread choice governs the decode steps only; the prefill runs with torch's count in every
setting.  So per condition and setting: decode tokens/s (generated tokens / wall time after
the prefill) median, min and max over the calls; the median of call tokens/s (prefill
included); the mean 1-minute load average (other work on the machine shows there); how many
calls were capped; the counts "auto" ran its steps with (per call, at its end).  The table,
then one JSON line per row, on stdout; one line per call with ``--jsonl``; all stamped with
``specdec_kernels.bench.common.environment()``.

    python -m specdec_kernels.bench.threads [--ids 125,165] [--max-new-tokens 32] [--reps 3] [--cap 5]
                            [--load N] [--numerics float32|int8] [--jsonl FILE]
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

import torch

DEFAULT_IDS = (125, 165)


def _spin(stop) -> None:
    """Busy work until ``stop`` is set (checked every ~10^5 iterations)."""
    while not stop.is_set():
        for _ in range(100_000):
            pass


class Load:
    """``n`` busy processes while the context is open (killed on exit, whatever happens)."""

    def __init__(self, n: int):
        self.n = n
        self.ctx = multiprocessing.get_context("spawn")
        self.stop = self.ctx.Event()
        self.procs: List = []

    def __enter__(self) -> "Load":
        self.procs = [self.ctx.Process(target=_spin, args=(self.stop,), daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(0.5)  # let them start spinning
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()


class _Capped(Exception):
    pass


def timed_generate(decoder, prompt: List[int], max_new_tokens: int, cap: float) -> Dict:
    """One ``generate`` call whose decode steps are stopped after ``cap`` seconds.

    Returns: tokens, seconds (the call), decode_seconds (after the prefill), tokens_per_s
    (tokens / seconds), decode_tokens_per_s (tokens / decode_seconds), capped, the call's
    ``stats.threads`` as step_threads and its tokens as tokens_out (both absent when capped),
    and the 1-minute load average when the call ended."""
    made = [0]
    t0 = time.perf_counter()
    decode_start: List[float] = []

    def on_step(state):
        now = time.perf_counter()
        if not decode_start:
            decode_start.append(now)  # called first right after the prefill
        made[0] = len(state.generated(0))
        if now - decode_start[0] > cap and not state.finished:
            raise _Capped

    out: Dict = {"capped": False}
    try:
        result = decoder.generate([prompt], max_new_tokens, num_draft_tokens=0, on_step=on_step)
        out.update(step_threads=dict(result.stats.threads), tokens_out=result.tokens[0])
        made[0] = len(result.tokens[0])
    except _Capped:
        out["capped"] = True
    end = time.perf_counter()
    out.update(
        tokens=made[0],
        seconds=end - t0,
        decode_seconds=end - decode_start[0],
        tokens_per_s=made[0] / (end - t0),
        decode_tokens_per_s=made[0] / (end - decode_start[0]),
        loadavg=os.getloadavg()[0],
    )
    return out


def main(argv: Optional[List[str]] = None) -> int:
    from specdec_kernels.bench.common import ArgumentParser

    p = ArgumentParser(prog="python -m specdec_kernels.bench.threads", description=__doc__.split("\n\n")[0])
    p.add_argument("--ids", default=",".join(map(str, DEFAULT_IDS)), help="Spec-Bench question ids")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cap", type=float, default=5.0, help="seconds after which a call is stopped")
    p.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy processes of the loaded condition")
    p.add_argument(
        "--numerics",
        default="float32",
        choices=["float32", "int8"],
        help="Transformer.numerics of the decode (int8: 8-bit activations, llama.cpp's arithmetic)",
    )
    p.add_argument("--jsonl", default=None, help="write one JSON line per call here")
    args = p.parse_args(argv)

    from specdec_kernels.bench.common import (
        JsonlWriter,
        chat_prompt_ids,
        check_output_file,
        check_range,
        column,
        environment,
        format_table,
        spec_bench_ids,
        too_long,
    )
    from specdec_kernels.decoding import SpeculativeDecoder
    from specdec_kernels.decoding.loading import load_smollm2, smollm2_tokenizer
    from specdec_kernels.decoding.prompts import spec_bench_prompt

    # every flag before the model loads or a busy process starts (one line naming the flag)
    ids = spec_bench_ids(p, "--ids", args.ids)
    check_range(p, "--max-new-tokens", args.max_new_tokens, 1)
    check_range(p, "--reps", args.reps, 1)
    check_range(p, "--load", args.load, 1, 1024)
    if not 0 < args.cap < float("inf"):  # NaN included
        p.error(f"--cap must be a finite number of seconds > 0, got {args.cap}")
    check_output_file(p, "--jsonl", args.jsonl)
    problem = too_long(chat_prompt_ids(smollm2_tokenizer(), [spec_bench_prompt(i) for i in ids]), args.max_new_tokens)
    if problem:
        p.error(problem)

    model, tok = load_smollm2()
    model.numerics = args.numerics
    prompts = chat_prompt_ids(tok, [spec_bench_prompt(i) for i in ids])
    stops = [tok.eos_token_id]
    every = torch.get_num_threads()
    env = environment()
    writer = JsonlWriter(Path(args.jsonl), env) if args.jsonl else None
    kept = SpeculativeDecoder(model, stop_token_ids=stops)  # "auto", kept for the whole run
    settings = {
        "1": lambda: SpeculativeDecoder(model, stop_token_ids=stops, threads=1),
        str(every): lambda: SpeculativeDecoder(model, stop_token_ids=stops, threads=every),
        "auto": lambda: kept,
        "auto-new": lambda: SpeculativeDecoder(model, stop_token_ids=stops),
    }
    for name in ("1", str(every)):  # warm-up (first-call costs), idle
        settings[name]().generate([prompts[0]], 4, num_draft_tokens=0)
    print(f"# {env['device']}, load: {args.load} busy processes, torch threads {every}", file=sys.stderr)
    calls: List[Dict] = []
    greedy: Dict[int, List[int]] = {}
    order = random.Random(0)
    for rep in range(args.reps):
        conditions = ("idle", "loaded") if rep % 2 == 0 else ("loaded", "idle")
        for condition in conditions:
            with Load(args.load) if condition == "loaded" else contextlib.nullcontext():
                names = list(settings)
                order.shuffle(names)  # no setting always follows the same one
                for name in names:
                    for i, prompt in zip(ids, prompts):
                        r = timed_generate(settings[name](), prompt, args.max_new_tokens, args.cap)
                        out = r.pop("tokens_out", None)
                        if out is not None:
                            r["same_as_greedy"] = greedy.setdefault(i, out) == out
                        row = {"condition": condition, "threads": name, "id": i, "rep": rep, **r}
                        calls.append(row)
                        if writer:
                            writer.write(row)
                        print(
                            f"{condition:6s} {name:8s} id {i}: decode {r['decode_tokens_per_s']:6.2f} tok/s,"
                            f" call {r['tokens_per_s']:6.2f} tok/s, load avg {r['loadavg']:.1f}"
                            f"{' (capped)' if r['capped'] else ''} {r.get('step_threads', '')}",
                            file=sys.stderr,
                        )
    if writer:
        writer.close()
    rows = []
    for condition in ("idle", "loaded"):
        for name in settings:
            got = [c for c in calls if c["condition"] == condition and c["threads"] == name]
            speeds = [c["decode_tokens_per_s"] for c in got]
            used = Counter(n for c in got for n in (c.get("step_threads") or {}).values())
            rows.append(
                {
                    "condition": condition,
                    "threads": name,
                    "median": statistics.median(speeds),
                    "min": min(speeds),
                    "max": max(speeds),
                    "call_median": statistics.median(c["tokens_per_s"] for c in got),
                    "loadavg": statistics.mean(c["loadavg"] for c in got),
                    "calls": len(got),
                    "capped": sum(c["capped"] for c in got),
                    "chosen": " ".join(f"{n}:{k}" for n, k in sorted(used.items())) or "-",
                }
            )
    print(
        f"\n{env['device']}, torch {env['torch']}, commit {env['commit']}; SmolLM2-135M-Instruct {args.numerics}, plain"
        f" greedy, {args.max_new_tokens} tokens, Spec-Bench ids {ids}, {args.reps} reps; loaded: {args.load} busy"
        f" processes; decode: tokens / time after the prefill (which runs with torch's count in every setting);"
        f" call: tokens / time of the call"
    )
    print(
        format_table(
            rows,
            [
                column("condition"),
                column("threads"),
                column("median", "decode tok/s median", "{:.1f}"),
                column("min", fmt="{:.1f}"),
                column("max", fmt="{:.1f}"),
                column("call_median", "call tok/s median", "{:.1f}"),
                column("loadavg", "load avg", "{:.1f}"),
                column("calls"),
                column("capped"),
                column("chosen", "auto's count:calls"),
            ],
        )
    )
    from specdec_kernels.decoding.engine import threads as step_threads

    budget = step_threads.PROCESS_BUDGET
    for n, choice in kept.thread_choices.items():
        print(
            f"auto (kept decoder, torch's count {n}): {len(choice.rounds)} trial rounds, chose {[r['choice'] for r in choice.rounds]}"
        )
    print(
        f"trial steps of every auto decoder: {budget.trial_time:.2f} s of {budget.total_time:.2f} s of their steps"
        f" ({budget.trial_time / max(budget.total_time, 1e-9):.1%}; budget {budget.share:.0%})"
    )
    for r in rows:
        print(
            json.dumps(
                {
                    **env,
                    "bench": "threads",
                    "numerics": args.numerics,
                    "max_new_tokens": args.max_new_tokens,
                    "load": args.load,
                    **r,
                }
            )
        )
    if not all(c.get("same_as_greedy", True) for c in calls):
        print("ERROR: some call's tokens differ from another thread count's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
