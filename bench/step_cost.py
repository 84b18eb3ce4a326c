"""`python -m bench.step_cost`: the target's cost of verifying K drafts relative to one decode step.

Speculative decoding pays off when verifying a block of N tokens costs little more than
decoding one.  This measures that ratio for the engine's forward (``specdec_kernels.decoding``
``Transformer``: tree_attention in every layer, static KV cache) with random weights at real
model sizes, so it runs where the real weights cannot travel (the GPU check):

* one plain decode step (N = 1) after a prefix of P cached tokens;
* verifying a chain of N tokens (mask None) and an N-node token tree (ancestor mask), N in 1..64.

It reports the median time per forward, its 20th/80th percentiles, and cost(N) / cost(1): the
ratio that the adaptive draft length and end-to-end projections use.  Writes a table,
``step_cost.jsonl`` and ``step_cost.png`` to --out.

    python -m bench.step_cost [--models smollm2-135m,llama3-8b] [--dtype bf16] [--prefix 1024]
                              [--sizes 1,2,4,8,16,32,64] [--device cuda] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List

import torch

from bench.common import environment, format_table, out_dir, pyplot_or_none, time_fn, write_jsonl
from specdec_kernels.decoding.model import ModelArgs, Transformer
from specdec_kernels.tree import ancestor_mask

MODELS = {
    # SmolLM2-135M-Instruct (the real model's shape) and Llama-3-8B
    "smollm2-135m": ModelArgs(
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama3-8b": ModelArgs(
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        rope_theta=500000.0,
    ),
    # a tiny shape for tests
    "tiny": ModelArgs(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128
    ),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def random_model(args: ModelArgs, dtype: torch.dtype, device: torch.device) -> Transformer:
    """A Transformer of this shape with small random weights, built directly on ``device``."""
    with torch.device(device):
        model = Transformer(args).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model.eval()


def bushy_tree(n: int) -> List[int]:
    """A tree of n nodes shaped like a Medusa / top-k tree: wide near the root."""
    parents = [-1]
    for i in range(1, n):
        parents.append((i - 1) // 4)  # each node gets up to 4 children, breadth first
    return parents


def measure(name: str, args: ModelArgs, dtype, device, prefix: int, sizes: List[int], min_time: float) -> List[Dict]:
    model = random_model(args, dtype, device)
    capacity = prefix + max(sizes)
    cache = model.new_kv_cache(1, capacity)
    cache.normal_(0.0, 1.0)  # a filled prefix: its contents do not change the cost
    seqlens = torch.tensor([prefix], dtype=torch.int32, device=device)
    rows = []
    base = None
    for n in sorted(set(sizes) | {1}):
        tokens = torch.randint(0, args.vocab_size, (1, n), device=device)
        for kind in ("chain", "tree") if n > 1 else ("decode",):
            parents = list(range(-1, n - 1)) if kind != "tree" else bushy_tree(n)
            mask = None if kind != "tree" else ancestor_mask(parents).to(device)
            depth = _depths(parents)
            positions = (prefix + depth).to(device)[None]

            def step():
                with torch.inference_mode():
                    return model(tokens, positions, cache, seqlens, mask)

            step()
            t = time_fn(step, device, min_time)
            if kind == "decode":
                base = t["median_us"]
            rows.append(
                {
                    "model": name,
                    "kind": kind,
                    "N": n,
                    "prefix": prefix,
                    "dtype": str(dtype).replace("torch.", ""),
                    **t,
                    "ratio_to_decode": t["median_us"] / base,
                }
            )
    model = cache = None  # free them before the next model is built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _depths(parents: List[int]) -> torch.Tensor:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return torch.tensor(depth)


def plot(rows: List[Dict], path, env) -> None:
    plt = pyplot_or_none(path)
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(7, 4))
    for model in dict.fromkeys(r["model"] for r in rows):
        for kind, style in (("chain", "-o"), ("tree", "--s")):
            pts = [(1, 1.0)] + [
                (r["N"], r["ratio_to_decode"]) for r in rows if r["model"] == model and r["kind"] == kind
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{model} {kind}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens verified per forward (N)")
    ax.set_ylabel("cost / one decode step")
    ax.set_title(f"verify cost vs decode, {env['device']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> List[Dict]:
    parser = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models", help=f"comma-separated from {list(MODELS)} (default: smollm2-135m, plus llama3-8b on GPU)"
    )
    parser.add_argument("--dtype", choices=list(DTYPES), help="default bf16 on GPU, fp32 on CPU")
    parser.add_argument("--prefix", type=int, default=1024, help="cached tokens before the block")
    parser.add_argument("--sizes", default="2,4,8,16,32,64", help="block sizes N besides 1")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--out")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds of timing per point on CPU")
    a = parser.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    names = (
        a.models.split(",")
        if a.models
        else (["smollm2-135m", "llama3-8b"] if device.type == "cuda" else ["smollm2-135m"])
    )
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    sizes = [int(s) for s in a.sizes.split(",") if s]
    env = environment()
    rows = []
    for name in names:
        print(f"# measuring {name} ({dtype}, prefix {a.prefix}) on {env['device']}", file=sys.stderr)
        rows += measure(name, MODELS[name], dtype, device, a.prefix, sizes, a.min_time)
    out = out_dir(a.out, "bench_out")
    write_jsonl(out / "step_cost.jsonl", rows, env)
    plot(rows, out / "step_cost.png", env)
    print(f"# bench.step_cost on {env['device']}, torch {env['torch']}, commit {env['commit']}")
    print(
        format_table(
            rows,
            [
                ("model", "model", "{}"),
                ("kind", "kind", "{}"),
                ("N", "N", "{}"),
                ("prefix", "prefix", "{}"),
                ("dtype", "dtype", "{}"),
                ("median us", "median_us", "{:.1f}"),
                ("p20 us", "p20_us", "{:.1f}"),
                ("p80 us", "p80_us", "{:.1f}"),
                ("cost / decode", "ratio_to_decode", "{:.2f}"),
            ],
        )
    )
    return rows


if __name__ == "__main__":
    main()
