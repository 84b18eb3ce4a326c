"""The C++ CPU tree attention (``specdec_native::tree_attention``) at SmolLM2-135M's decode shape: one
sequence, 9 query heads over 3 KV heads (GQA), head dim 64, fp32, N = 1 / 4 / 8 query nodes
over a prefix of S keys, 30 calls per timing, one per layer.  ``--layers 1``: every call reads
the same layer's cache (it stays in L2); ``--layers 30`` (default): a cache per layer, as a
decode step reads them (from memory once they outgrow the caches).

    PYTHONPATH=. python scripts/attention_cpu_layers.py [--layers 30] [--prefix 1024] [--threads 1]

Prints the median microseconds per call (``torch.utils.benchmark``, at least 0.5 s of runs).
"""

import argparse

import torch
from torch.utils import benchmark

from specdec_kernels import _native


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if not 1 <= args.layers <= 30 or args.prefix < 1 or args.threads < 1:
        p.error("--layers must lie in 1..30, --prefix and --threads must be >= 1")
    if not _native.load():
        raise SystemExit("the C++ extension is not built (pip install --no-build-isolation -e .)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    H, Hkv, D, S = 9, 3, 64, args.prefix
    ks = [torch.randn(1, Hkv, S + 64, D) for _ in range(args.layers)]
    vs = [torch.randn(1, Hkv, S + 64, D) for _ in range(args.layers)]
    lens = torch.tensor([S])
    for N in (1, 4, 8):
        q = torch.randn(1, N, H, D)

        def run():
            for i in range(30):
                torch.ops.specdec_native.tree_attention(
                    q, ks[i % args.layers], vs[i % args.layers], lens, None, D**-0.5
                )

        t = benchmark.Timer("run()", globals={"run": run}).blocked_autorange(min_run_time=0.5)
        print(f"layers={args.layers} prefix={S} N={N}: {t.median / 30 * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()
