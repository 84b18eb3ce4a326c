"""`python -m specdec_kernels.bench.step_graphs`: a whole verification step, eager against captured.

One ``SpeculativeDecoder.step`` (the draft handed in, the target's pass, greedy verification,
acceptance, KV compaction, the advance) timed step by step, with the target's pass run eagerly
and with it captured per bucket and replayed (``cuda_graphs=True``, issue #55: a step's eager
time within 10% of its replay).  The target is a random-weight model of a real shape cut to a
few layers (default: Llama-3-8B's dimensions, 4 layers, bfloat16 on CUDA); the drafter hands in
a fixed token tree (a Medusa-like bushy tree of N nodes, or a chain) of random tokens, so every
step feeds the same shape.  Before timing, both modes' emitted tokens are checked equal.

On CPU it runs the tiny shape with ``EagerGraph`` standing in for the CUDA graph (the same code
path, no capture): a smoke test of the benchmark, whose figures are not graph figures.

Writes a table, ``step_graphs.jsonl`` and ``step_graphs.png`` to --out.

    python -m specdec_kernels.bench.step_graphs [--model llama3-8b] [--layers 4] [--batch 1,8]
                              [--nodes 16,64] [--prefix 512] [--steps 30] [--device cuda] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Dict, List, Tuple

import torch

from specdec_kernels.bench.common import (
    MODEL_SHAPES,
    check_device,
    column,
    environment,
    format_table,
    int_list,
    out_dir,
    pyplot_or_none,
    save_figure,
    write_jsonl,
)
from specdec_kernels.bench.step_cost import MODELS, bushy_tree, random_model
from specdec_kernels.decoding import Draft, Drafter, SpeculativeDecoder
from specdec_kernels.decoding.draft import DraftRequest
from specdec_kernels.decoding.engine.graphs import CapturedPasses, EagerGraph

SHAPES = {**MODELS, **{k: v for k, v in MODEL_SHAPES.items() if k not in MODELS}}


class FixedTreeDrafter(Drafter):
    """Proposes the same tree shape every step (``parents``, root first) with random tokens
    drawn from its own generator: a drafter whose cost is nil and whose shape never changes."""

    name = "fixed-tree"

    def __init__(self, parents: List[int], vocab_size: int, seed: int = 0):
        self.parents, self.vocab_size = list(parents), vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, request: DraftRequest) -> Draft:
        """The fixed tree below every active sequence's root (random tokens, whatever K),
        the root alone for the others."""
        n = len(self.parents)
        histories = request.histories
        draws = torch.randint(0, self.vocab_size, (len(histories), n - 1), generator=self.generator).tolist()
        trees = [
            ([h[-1]] + (row if a else []), self.parents if a else [-1])
            for h, row, a in zip(histories, draws, request.active)
        ]
        return Draft.from_lists(trees, is_chain=None)


def _steps(model, parents, batch: int, prefix: int, steps: int, graphs: bool) -> Dict:
    """``steps`` timed steps after 3 warm-up ones (the captures happen there): per-step seconds
    and the emitted tokens."""
    device = model.device
    drafter = FixedTreeDrafter(parents, model.args.vocab_size)
    on_cuda = device.type == "cuda"
    dec = SpeculativeDecoder(model, drafter, cuda_graphs=graphs and on_cuda, node_buckets=True, threads=None)
    if graphs and not on_cuda:
        dec._passes = CapturedPasses(model, EagerGraph)  # the CPU stand-in (module docstring)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.args.vocab_size, (prefix,), generator=g).tolist() for _ in range(batch)]
    warm = 3
    state = dec.start(prompts, warm + steps + 2, seeds=list(range(batch)))
    times = []
    for i in range(warm + steps):
        if on_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec.step(state, len(parents) - 1)  # ends with the step's one device read: synchronised
        if i >= warm:
            times.append(time.perf_counter() - t0)
    passes = dec._passes
    return {
        "times": times,
        "tokens": [list(h) for h in state.histories],
        "captures": passes.captures if passes is not None else 0,
        "replays": passes.replays if passes is not None else 0,
    }


def _median_p20_p80(seconds: List[float]) -> Tuple[float, float, float]:
    """Median, 20th and 80th percentiles of per-step times, in microseconds (the quintile cuts
    of ``statistics.quantiles``, inclusive of the extremes: a list of one gives it thrice)."""
    us = [t * 1e6 for t in seconds]
    if len(us) == 1:
        return us[0], us[0], us[0]
    cuts = statistics.quantiles(us, n=5, method="inclusive")
    return statistics.median(us), cuts[0], cuts[3]


def run(args) -> List[Dict]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = args.model or ("llama3-8b" if device.type == "cuda" else "tiny")
    shape = dataclasses.replace(SHAPES[name], num_layers=min(args.layers, SHAPES[name].num_layers))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = random_model(shape, dtype, device)
    rows = []
    for batch in args.batch:
        for n in args.nodes:
            for kind in ("tree", "chain"):
                parents = bushy_tree(n) if kind == "tree" else list(range(-1, n - 1))
                eager = _steps(model, parents, batch, args.prefix, args.steps, graphs=False)
                graph = _steps(model, parents, batch, args.prefix, args.steps, graphs=True)
                if eager["tokens"] != graph["tokens"]:
                    raise SystemExit(f"step_graphs: B={batch} {kind} N={n}: the captured steps emitted other tokens")
                e, g = _median_p20_p80(eager["times"]), _median_p20_p80(graph["times"])
                med_e, med_g = e[0], g[0]
                row = {
                    "model": f"{name}-{shape.num_layers}L",
                    "dtype": str(dtype).replace("torch.", ""),
                    "batch": batch,
                    "kind": kind,
                    "nodes": n,
                    "prefix": args.prefix,
                    "eager_us": med_e,
                    "eager_p20_us": e[1],
                    "eager_p80_us": e[2],
                    "graph_us": med_g,
                    "graph_p20_us": g[1],
                    "graph_p80_us": g[2],
                    "eager_over_graph": med_e / med_g,
                    "captures": graph["captures"],
                    "replays": graph["replays"],
                    "graph_mechanism": "cuda-graph" if device.type == "cuda" else "eager stand-in (CPU)",
                }
                print(
                    f"# measured B={batch} {kind} N={n}: eager {med_e:.0f} us, graph {med_g:.0f} us "
                    f"({row['eager_over_graph']:.2f}x), {row['captures']} captures",
                    flush=True,
                )
                rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdec_kernels.bench.step_graphs", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", choices=sorted(SHAPES), default=None, help="default: llama3-8b on CUDA, tiny on CPU")
    p.add_argument("--layers", type=int, default=4, help="layers of the model kept (default 4)")
    p.add_argument("--batch", default="1,8", help="batch sizes (default 1,8)")
    p.add_argument("--nodes", default="16,64", help="draft nodes per sequence, root included (default 16,64)")
    p.add_argument("--prefix", type=int, default=512, help="prompt tokens per sequence (default 512)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per case (default 30)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--out", default=None, help="output folder (default bench_out/)")
    args = p.parse_args(argv)
    check_device(p, "--device", args.device)
    args.batch = int_list(p, "--batch", args.batch, 1, 256)
    args.nodes = int_list(p, "--nodes", args.nodes, 2, 128)
    for flag, value, low in (("--layers", args.layers, 1), ("--prefix", args.prefix, 1), ("--steps", args.steps, 1)):
        if value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    out = out_dir(args.out, "bench_out")
    rows = run(args)
    env = environment()
    print(
        f"# whole verification steps, eager against captured passes, on {env.get('device', '?')}, commit {env.get('commit', '?')}"
    )
    print(
        format_table(
            rows,
            [
                column("model"),
                column("dtype"),
                column("batch", "B"),
                column("kind"),
                column("nodes", "N"),
                column("eager_us", "eager us", "{:.0f}"),
                column("graph_us", "graph us", "{:.0f}"),
                column("eager_over_graph", "eager/graph", "{:.2f}"),
                column("graph_mechanism", "graph"),
            ],
        )
    )
    write_jsonl(out / "step_graphs.jsonl", rows, env)
    plt = pyplot_or_none(out / "step_graphs.png")
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"B{r['batch']} {r['kind']} {r['nodes']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["eager_us"] for r in rows], 0.4, label="eager")
        ax.bar([i + 0.2 for i in x], [r["graph_us"] for r in rows], 0.4, label=rows[0]["graph_mechanism"])
        ax.set_xticks(list(x), labels, rotation=30, fontsize=7)
        ax.set_ylabel("us per step (median)")
        ax.legend(fontsize=8)
        save_figure(fig, out / "step_graphs.png", f"{rows[0]['model']} {rows[0]['dtype']}, {env.get('device', '?')}")
    print(f"# wrote {out / 'step_graphs.jsonl'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
