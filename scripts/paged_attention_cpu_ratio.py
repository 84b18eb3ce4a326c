"""Paged vs dense tree attention on CPU: dense "torch" (SDPA) vs paged "native" (C++ kernel,
block table read in place) vs paged "torch" (gather + SDPA), fp32, median of repeated calls.

Run with OMP_NUM_THREADS=1 for the single-thread numbers:
    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/paged_attention_cpu_ratio.py [NHD|HND]
(the pool layout, default NHD).  Prints one row per (B, prefix, N) with times in microseconds and the paged/dense ratios.
"""

import sys
import time

import torch

import specdec_kernels as sk


def median_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def main() -> None:
    torch.manual_seed(0)
    H, Hkv, D, bs = 9, 3, 64, 16
    layout = sys.argv[1] if len(sys.argv) > 1 else "NHD"
    print(f"threads={torch.get_num_threads()} H={H} Hkv={Hkv} D={D} block_size={bs} fp32 {layout}")
    print(
        f"{'B':>2} {'prefix':>6} {'N':>3} {'dense_us':>9} {'native_us':>9} {'ptorch_us':>9} {'native/dense':>12} {'torch/dense':>11}"
    )
    for B in (1, 4):
        for prefix in (512, 2048):
            for N in (1, 4, 16):
                S = prefix + N
                M = -(-S // bs) + 1
                cap = M * bs
                q = torch.randn(B, N, H, D)
                k = torch.randn(B, Hkv, cap, D)
                v = torch.randn(B, Hkv, cap, D)
                lens = torch.full((B,), prefix, dtype=torch.int32)
                nb = B * M + 5
                perm = torch.randperm(nb)[: B * M].view(B, M).to(torch.int32)
                pk = torch.randn(nb, bs, Hkv, D)
                pv = torch.randn(nb, bs, Hkv, D)
                for b in range(B):
                    for j in range(M):
                        pk[perm[b, j]] = k[b, :, j * bs : (j + 1) * bs].transpose(0, 1)
                        pv[perm[b, j]] = v[b, :, j * bs : (j + 1) * bs].transpose(0, 1)
                if layout == "HND":
                    pk, pv = pk.transpose(1, 2).contiguous(), pv.transpose(1, 2).contiguous()
                reps = 200 if B * prefix <= 2048 else 60
                dense = median_us(lambda: sk.tree_attention(q, k, v, lens, backend="torch", validate=False), reps)
                nat = median_us(
                    lambda: sk.tree_attention(
                        q, pk, pv, lens, block_table=perm, kv_layout=layout, backend="native", validate=False
                    ),
                    reps,
                )
                pt = median_us(
                    lambda: sk.tree_attention(
                        q, pk, pv, lens, block_table=perm, kv_layout=layout, backend="torch", validate=False
                    ),
                    reps,
                )
                a = sk.tree_attention(q, k, v, lens, backend="torch")
                c = sk.tree_attention(q, pk, pv, lens, block_table=perm, kv_layout=layout, backend="native")
                assert torch.allclose(a, c, atol=1e-4, rtol=1e-4)
                print(
                    f"{B:>2} {prefix:>6} {N:>3} {dense:9.1f} {nat:9.1f} {pt:9.1f} {nat / dense:12.2f} {pt / dense:11.2f}"
                )


if __name__ == "__main__":
    main()
