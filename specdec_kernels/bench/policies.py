"""`python -m specdec_kernels.bench.policies`: draft-length policies, multi-draft and typical acceptance on
SmolLM2-135M-Instruct, on a few Spec-Bench prompts (first turn, chat template, batch 1).

Greedy part: every method decodes each prompt to --max-new-tokens (or EOS) and is checked
token for token against our plain greedy output; per method the table gives tokens/s
(generated tokens / wall time of the generate calls, summed over prompts), the mean
accepted length (tokens per target pass, bonus included), the mean K requested and the
speed-up over plain greedy.

Typical part (--typical): at --temperature, each drafter decodes losslessly (the engine's
default Gumbel coupling) and with typical acceptance (epsilon --typical, LOSSY), the same seeds; reported:
tokens/s, mean accepted length, and agreement with the greedy output (tokens equal at the
same position, and the length of the common prefix), as a measure of the quality cost.

    python -m specdec_kernels.bench.policies [--ids 125,165,...] [--max-new-tokens 64] [--threads 1]
                             [--methods plain,ngram-k8,...] [--typical 0.09 --temperature 0.3]
                             [--jsonl FILE]
"""

from __future__ import annotations

import json
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

DEFAULT_IDS = (125, 165, 245, 325, 405, 485)  # coding, translation, summarization, qa, math_reasoning, rag
LAYERSKIP_LAYERS = 24  # as bench.e2e: SmolLM2 was not trained for early exit


def methods(model) -> Dict[str, Callable]:
    """name -> () -> (drafter, num_draft_tokens)."""
    from specdec_kernels.decoding import LayerSkipDrafter, NgramDrafter
    from specdec_kernels.decoding.drafters.multi import MultiDrafter
    from specdec_kernels.decoding.engine.adaptive import CostModelPolicy, HeuristicPolicy

    ls = lambda: LayerSkipDrafter(model, LAYERSKIP_LAYERS)  # noqa: E731
    multi = lambda: MultiDrafter([NgramDrafter(), ls()])  # noqa: E731
    return {
        "plain": lambda: (None, 0),
        "ngram-k8": lambda: (NgramDrafter(), 8),
        "ngram-heuristic": lambda: (NgramDrafter(), HeuristicPolicy(4, 1, 8)),
        "ngram-cost": lambda: (NgramDrafter(), CostModelPolicy(0, 8)),
        "layerskip-k4": lambda: (ls(), 4),
        "layerskip-k2": lambda: (ls(), 2),
        "layerskip-heuristic": lambda: (ls(), HeuristicPolicy(2, 1, 4)),
        "layerskip-cost": lambda: (ls(), CostModelPolicy(0, 4)),
        "multi-k4": lambda: (multi(), 4),
        "multi-cost": lambda: (multi(), CostModelPolicy(0, 6)),
    }


def main(argv: Optional[List[str]] = None) -> int:
    from specdec_kernels.bench.common import ArgumentParser

    p = ArgumentParser(prog="python -m specdec_kernels.bench.policies", description=__doc__.split("\n\n")[0])
    p.add_argument("--ids", default=",".join(map(str, DEFAULT_IDS)), help="Spec-Bench question ids")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", default=None, help="comma-separated subset of the greedy methods")
    p.add_argument(
        "--typical", type=float, default=None, help="run the typical-acceptance comparison with this epsilon (LOSSY)"
    )
    p.add_argument(
        "--temperature", type=float, default=None, help="with --typical: the sampling temperature (default 0.3)"
    )
    p.add_argument("--jsonl", default=None, help="append one JSON line per method here")
    args = p.parse_args(argv)

    from specdec_kernels.bench.common import chat_prompt_ids, check_output_file, check_range, spec_bench_ids, too_long
    from specdec_kernels.checks import sampling_temperature, temperature_is_greedy
    from specdec_kernels.decoding import SamplingParams, SpeculativeDecoder, Transformer
    from specdec_kernels.decoding.loading import load_checkpoint, smollm2_tokenizer
    from specdec_kernels.decoding.prompts import spec_bench_prompt

    # every flag and combination, before the model loads (one line naming the flag)
    ids = spec_bench_ids(p, "--ids", args.ids)
    check_range(p, "--max-new-tokens", args.max_new_tokens, 1)
    check_range(p, "--threads", args.threads, 1, 1024)
    if args.methods is not None:
        if args.typical is not None:
            p.error("--methods picks greedy methods; --typical runs its own comparison (ngram-k8, layerskip-k4)")
        unknown = [m for m in args.methods.split(",") if m not in methods(None)]
        if unknown or not args.methods.strip(","):
            p.error(f"--methods must name methods from {', '.join(methods(None))}, got {args.methods!r}")
    if args.typical is None and args.temperature is not None:
        p.error("--temperature is the sampling temperature of --typical's comparison: give --typical too")
    if args.typical is not None:
        check_range(p, "--typical", args.typical, 0.0, 1.0)
        if args.typical == 0:
            p.error("--typical must lie in (0, 1], got 0.0")
        args.temperature = 0.3 if args.temperature is None else args.temperature
        try:
            sampling_temperature("--temperature", args.temperature, finite=True)
        except ValueError as e:
            p.error(str(e))
        if temperature_is_greedy(args.temperature):
            p.error(f"--temperature must be > 0 with --typical (greedy runs verify exactly), got {args.temperature}")
    check_output_file(p, "--jsonl", args.jsonl)
    tok = smollm2_tokenizer()
    prompts = chat_prompt_ids(tok, [spec_bench_prompt(i) for i in ids])
    problem = too_long(prompts, args.max_new_tokens)
    if problem:
        p.error(problem)

    torch.set_num_threads(args.threads)
    config, sd, tok = load_checkpoint()
    model = Transformer.from_hf(config, sd)
    stops = [tok.eos_token_id]
    N = args.max_new_tokens
    SpeculativeDecoder(model, stop_token_ids=stops).generate([prompts[0]], 8)  # warm-up

    def run(drafter, k, sampling=None, typical=None):
        rows = []
        for i, prompt in enumerate(prompts):
            decoder = SpeculativeDecoder(model, drafter, stop_token_ids=stops, typical=typical)
            r = decoder.generate([prompt], N, num_draft_tokens=k() if callable(k) else k, sampling=sampling, seeds=[i])
            rows.append(r)
        return rows

    def summary(name, rows, greedy=None):
        tokens = sum(r.stats.tokens for r in rows)
        t = sum(r.stats.total_time for r in rows)
        steps = sum(r.stats.sequence_steps for r in rows)
        ks = [k for r in rows for k in r.stats.draft_lengths]
        out = {
            "method": name,
            "tokens": tokens,
            "tokens_per_s": tokens / t,
            "mean_accepted_length": tokens / steps,
            "mean_k": sum(ks) / len(ks) if ks else 0.0,
        }
        if greedy is not None:
            same = sum(sum(a == b for a, b in zip(r.tokens[0], g)) for r, g in zip(rows, greedy))
            prefix = []
            for r, g in zip(rows, greedy):
                n = 0
                while n < min(len(r.tokens[0]), len(g)) and r.tokens[0][n] == g[n]:
                    n += 1
                prefix.append(n)
            out.update(
                identical=all(r.tokens[0] == g for r, g in zip(rows, greedy)),
                same_position=same,
                greedy_tokens=sum(len(g) for g in greedy),
                common_prefix=prefix,
            )
        drafters = {}
        for r in rows:
            for d, c in r.stats.drafters.items():
                acc = drafters.setdefault(d, {})
                for key, v in c.items():
                    acc[key] = acc.get(key, 0) + v
        if drafters:
            out["drafters"] = drafters
        return out

    table = []
    plain_rows = run(None, 0)
    greedy = [r.tokens[0] for r in plain_rows]
    plain = summary("plain", plain_rows, greedy)
    table.append(plain)
    print(f"plain: {plain['tokens_per_s']:.2f} tokens/s", file=sys.stderr)
    wanted = args.methods.split(",") if args.methods else None
    if args.typical is None:
        for name, make in methods(model).items():
            if name == "plain" or (wanted and name not in wanted):
                continue
            drafter, k = make()
            policy_factory = (lambda name=name: methods(model)[name]()[1]) if not isinstance(k, int) else k
            row = summary(name, run(drafter, policy_factory), greedy)
            table.append(row)
            print(f"{name}: {row['tokens_per_s']:.2f} tokens/s, identical {row['identical']}", file=sys.stderr)
    else:
        sp = SamplingParams(temperature=args.temperature)
        for name in ("ngram-k8", "layerskip-k4"):
            drafter, k = methods(model)[name]()
            for mode, typical in (("lossless", None), (f"typical{args.typical:g}", args.typical)):
                row = summary(f"{name}-T{args.temperature:g}-{mode}", run(drafter, k, sp, typical), greedy)
                table.append(row)
                print(row["method"], f"{row['tokens_per_s']:.2f}", file=sys.stderr)

    base = plain["tokens_per_s"]
    print(f"\nSpec-Bench ids {ids}, max_new_tokens {N}, threads {args.threads}, CPU, float32")
    print(
        f"{'method':34s} {'tok/s':>7s} {'speed-up':>8s} {'acc.len':>7s} {'mean K':>6s}  greedy-identical / same-position"
    )
    for row in table:
        same = f"{row['identical']} / {row['same_position']}/{row['greedy_tokens']}" if "identical" in row else ""
        print(
            f"{row['method']:34s} {row['tokens_per_s']:7.2f} {row['tokens_per_s'] / base:8.2f} "
            f"{row['mean_accepted_length']:7.2f} {row['mean_k']:6.2f}  {same}"
        )
    if args.jsonl:
        with open(args.jsonl, "a", encoding="utf-8") as f:
            for row in table:
                f.write(
                    json.dumps({**row, "ids": ids, "max_new_tokens": N, "threads": args.threads, "time": time.time()})
                    + "\n"
                )
    return 0


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
