"""``python -m specdec_kernels.bench.flashinfer_side``: our Triton kernels beside FlashInfer's, same shapes,
same run (CUDA only).

Three pairs, each checked before it is timed (``triton.testing.do_bench``, median; on CUDA both
as eager calls and as CUDA-graph replays, the kernels alone, where a side can be captured):

- ``rejection_sample`` (ours, chain, draft distributions) against FlashInfer's
  ``chain_speculative_sampling``: B requests of K = 4 drafts over V = 128,256, float32
  probabilities.  Checked: every output is a valid result (accepted drafts then one sampled
  token in the vocabulary, -1 after).  The two draw different random numbers, so tokens are
  not compared.
- ``sampling_probs`` (ours: temperature, top-k 50, top-p 0.9 from logits) against FlashInfer's
  ``softmax`` + ``top_k_renorm_probs`` + ``top_p_renorm_probs`` (the same distribution), and
  FlashInfer's ``top_k_top_p_sampling_from_probs`` (a sample, not a distribution: shown for
  scale).  Checked: the kept sets agree on at least 99.9% of the entries.
- ``tree_attention`` (ours, paged KV cache, a 16-node token tree as the mask) against FlashInfer's
  ``BatchPrefillWithPagedKVCacheWrapper`` with the same mask as ``custom_mask`` (planned once,
  outside the timing): Llama-3-8B heads (32 query, 8 KV, D = 128), bf16, page size 16.
  Checked: outputs agree within 2e-2.

Writes ``flashinfer.jsonl`` and prints one table of times and ratios ours / FlashInfer (below 1:
ours is faster).  FlashInfer (``flashinfer-python``, JIT-compiled on first use) travels as a
wheel in ``.whl/`` (``scripts/fetch_gpu_wheels.sh``); each pair runs on its own, so a pair whose
JIT compile fails or runs out of time leaves the others' figures.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List

import torch

V = 128256
BATCHES = (1, 8)
K = 4
TREE_NODES = 16
PREFIXES = (1024, 4096)
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def _time_us(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")) * 1e3


def _probs(shape, g, device):
    return torch.softmax(torch.randn(shape, generator=g, device=device) * 3, dim=-1)


def rejection_pairs(device) -> List[Dict]:
    import flashinfer.sampling as fs

    import specdec_kernels as sk

    rows = []
    for B in BATCHES:
        g = torch.Generator(device=device).manual_seed(B)
        target = _probs((B, K + 1, V), g, device)
        draft = 0.5 * _probs((B, K, V), g, device) + 0.5 * target[:, :K]
        tokens = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(B, K)
        seeds = torch.arange(B, device=device, dtype=torch.int64)
        offsets = torch.zeros(B, device=device, dtype=torch.int64)

        def ours():
            return sk.rejection_sample(
                target, draft, tokens, seeds=seeds, offsets=offsets, backend="triton", validate=False
            )

        ids32 = tokens.to(torch.int32)

        def theirs():
            return fs.chain_speculative_sampling(draft, ids32, target)

        out, acc = ours()
        f_out = theirs()
        f_out = f_out[0] if isinstance(f_out, tuple) else f_out
        for o in (out, f_out.long()):
            n = (o >= 0).sum(1)
            assert bool(((o >= 0).cumsum(1) == torch.arange(1, K + 2, device=device).clamp(max=n[:, None])).all())
            assert bool((o < V).all()) and bool((n >= 1).all())
            assert bool(((o[:, :K] == tokens) | (torch.arange(K, device=device)[None] >= n[:, None] - 1)).all())
        rows.append(
            _row(
                "rejection_sample",
                f"B={B} K={K} V={V} fp32",
                ours,
                theirs,
                "chain_speculative_sampling",
                nbytes=(target.numel() + draft.numel()) * 4,
            )
        )
    return rows


def sampling_pairs(device) -> List[Dict]:
    import flashinfer.sampling as fs

    import specdec_kernels as sk

    rows = []
    for B in BATCHES:
        g = torch.Generator(device=device).manual_seed(100 + B)
        logits = torch.randn(B, V, generator=g, device=device) * 3
        temperature = torch.full((B,), 0.8, device=device)
        top_k = torch.full((B,), 50, device=device, dtype=torch.int64)
        top_p = torch.full((B,), 0.9, device=device)

        def ours():
            return sk.sampling_probs(logits, temperature, top_k, top_p, backend="triton", validate=False)

        def theirs():
            p = fs.softmax(logits, temperature=temperature)
            return fs.top_p_renorm_probs(fs.top_k_renorm_probs(p, top_k.to(torch.int32)), top_p)

        a, b = ours(), theirs()
        agree = float(((a > 0) == (b > 0)).float().mean())
        assert agree >= 0.999, f"kept sets agree on {agree:.4%} only"
        rows.append(
            _row(
                "sampling_probs",
                f"B={B} V={V} fp32 top-k 50 top-p 0.9",
                ours,
                theirs,
                "softmax + top_k_renorm_probs + top_p_renorm_probs",
                nbytes=logits.numel() * 8,
                kept_set_agreement=agree,
            )
        )
        probs = torch.softmax(logits / 0.8, dim=-1)

        def sample():
            return fs.top_k_top_p_sampling_from_probs(probs, top_k.to(torch.int32), top_p)

        tok = sample()
        assert bool(((tok >= 0) & (tok < V)).all())
        rows.append(
            _row(
                "sampling_probs",
                f"B={B} V={V} fp32 top-k 50 top-p 0.9",
                ours,
                sample,
                "top_k_top_p_sampling_from_probs (samples one token)",
                nbytes=logits.numel() * 8,
            )
        )
    return rows


def attention_pairs(device) -> List[Dict]:
    import flashinfer

    import specdec_kernels as sk
    from specdec_kernels.tree import ancestor_mask

    rows = []
    dtype = torch.bfloat16
    for B in BATCHES:
        for prefix in PREFIXES:
            g = torch.Generator(device=device).manual_seed(B * prefix)
            N = TREE_NODES
            parents = [-1] + [(i - 1) // 2 for i in range(1, N)]  # a binary tree
            mask = ancestor_mask(parents).to(device)
            pages = -(-(prefix + N) // PAGE)
            pool = B * pages
            k_cache = torch.randn(pool, PAGE, KV_HEADS, HEAD_DIM, generator=g, device=device).to(dtype)
            v_cache = torch.randn(pool, PAGE, KV_HEADS, HEAD_DIM, generator=g, device=device).to(dtype)
            table = torch.randperm(pool, generator=g, device=device).to(torch.int32).reshape(B, pages)
            q = torch.randn(B, N, HEADS, HEAD_DIM, generator=g, device=device).to(dtype)
            seqlens = torch.full((B,), prefix, device=device, dtype=torch.int32)

            def ours():
                return sk.tree_attention(
                    q, k_cache, v_cache, seqlens, mask, block_table=table, kv_layout="NHD", validate=False
                )

            kv_len = prefix + N
            full = torch.cat([torch.ones(N, prefix, dtype=torch.bool, device=device), mask], dim=1)
            custom = full.flatten().repeat(B)
            qo_indptr = torch.arange(B + 1, device=device, dtype=torch.int32) * N
            kv_indptr = torch.arange(B + 1, device=device, dtype=torch.int32) * pages
            last = torch.full((B,), kv_len - (pages - 1) * PAGE, device=device, dtype=torch.int32)
            workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(
                qo_indptr,
                kv_indptr,
                table.flatten(),
                last,
                HEADS,
                KV_HEADS,
                HEAD_DIM,
                PAGE,
                custom_mask=custom,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
            q_flat = q.reshape(B * N, HEADS, HEAD_DIM)

            def theirs():
                return wrapper.run(q_flat, (k_cache, v_cache))

            a = ours().float().reshape(B * N, HEADS, HEAD_DIM)
            b = theirs().float()
            err = float((a - b).abs().max())
            assert err < 2e-2, f"outputs differ by {err}"
            kv_bytes = 2 * B * kv_len * KV_HEADS * HEAD_DIM * 2
            rows.append(
                _row(
                    "tree_attention",
                    f"B={B} prefix={prefix} N={N} H={HEADS}/{KV_HEADS} D={HEAD_DIM} bf16",
                    ours,
                    theirs,
                    "BatchPrefillWithPagedKVCacheWrapper (custom_mask)",
                    nbytes=kv_bytes + 2 * q.numel() * 2,
                    max_abs_diff=err,
                )
            )
    return rows


def _row(op: str, shape: str, ours, theirs, counterpart: str, nbytes: int, **extra) -> Dict:
    from specdec_kernels.bench.common import time_graph_replay

    t_ours, t_theirs = _time_us(ours), _time_us(theirs)
    # the kernels alone, each side captured in a CUDA graph (None where capture is refused)
    g_ours, g_theirs = (time_graph_replay(fn, torch.device("cuda")) for fn in (ours, theirs))
    g_ours, g_theirs = (g["median_us"] if g else None for g in (g_ours, g_theirs))
    return {
        "graph_ours_us": g_ours,
        "graph_flashinfer_us": g_theirs,
        "graph_ratio_ours_over_flashinfer": g_ours / g_theirs if g_ours and g_theirs else None,
        "op": op,
        "shape": shape,
        "flashinfer": counterpart,
        "ours_us": t_ours,
        "flashinfer_us": t_theirs,
        "ratio_ours_over_flashinfer": t_ours / t_theirs,
        "bytes": nbytes,
        "ours_gbps": nbytes / (t_ours * 1e-6) / 1e9,
        **extra,
    }


def format_row(r: Dict) -> str:
    """One line of the table: eager times and ratio, then the graph replays' ('-': not captured)."""
    ratio = r["ratio_ours_over_flashinfer"]
    graph = [r["graph_ours_us"], r["graph_flashinfer_us"], r["graph_ratio_ours_over_flashinfer"]]
    cells = ["-" if v is None else f"{v:.2f}" if i == 2 else f"{v:.1f}" for i, v in enumerate(graph)]
    return (
        f"{r['op']:<16} {r['shape']:<44} {r['flashinfer']:<52} {r['ours_us']:>8.1f} "
        f"{r['flashinfer_us']:>8.1f} {ratio:>8.2f}{'' if math.isfinite(ratio) else ' ?'}"
        f"                {cells[0]:>8} {cells[1]:>8} {cells[2]:>8}"
    )


def main(argv=None) -> int:
    from specdec_kernels.bench.common import ArgumentParser, out_dir

    p = ArgumentParser(prog="python -m specdec_kernels.bench.flashinfer_side", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_out", help="output folder (default bench_out/)")
    p.add_argument("--pairs", default="sampling,rejection,attention", help="comma-separated subset, in order")
    args = p.parse_args(argv)
    pairs = {"sampling": sampling_pairs, "rejection": rejection_pairs, "attention": attention_pairs}
    chosen = [x for x in args.pairs.split(",") if x]
    bad = [x for x in chosen if x not in pairs]
    if bad or not chosen:
        p.error(f"--pairs: unknown {bad}; valid: {', '.join(pairs)}" if bad else "--pairs names no pair")
    try:
        out_dir(args.out, "bench_out")  # checked before any work
    except ValueError as e:
        p.error(str(e))
    if not torch.cuda.is_available():
        print("bench.flashinfer_side: no CUDA device; nothing to compare", file=sys.stderr)
        return 2
    try:
        import flashinfer
    except ImportError as e:
        print(
            f"bench.flashinfer_side: FlashInfer is not installed ({e}); see scripts/fetch_gpu_wheels.sh",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": flashinfer.__version__}
    print(
        f"# ours / FlashInfer on {env['gpu']}, torch {env['torch']}, flashinfer {env['flashinfer']}; below 1: ours faster"
    )
    print(
        f"{'op':<16} {'shape':<44} {'FlashInfer counterpart':<52} {'ours us':>8} {'FI us':>8} {'ours/FI':>8}"
        f"  graph replay: {'ours us':>8} {'FI us':>8} {'ours/FI':>8}",
        flush=True,
    )
    status = 0
    with open(out / "flashinfer.jsonl", "w") as f:
        for name in chosen:  # rows are printed and written as each pair finishes
            t0 = time.perf_counter()
            try:
                got = pairs[name](device)
            except Exception:  # noqa: BLE001  (report, then go on with the other pairs)
                traceback.print_exc()
                print(f"# {name}: FAILED after {time.perf_counter() - t0:.0f} s", flush=True)
                status = 1
                continue
            for r in got:
                f.write(json.dumps({**env, **r}) + "\n")
                print(format_row(r), flush=True)
            f.flush()
            print(f"# {name}: {len(got)} rows in {time.perf_counter() - t0:.0f} s (JIT compile included)", flush=True)
    return status


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
