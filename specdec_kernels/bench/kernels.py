"""`python -m specdec_kernels.bench.kernels`: every op on every backend available here, checked, then timed.

For each op and shape: inputs from real model sizes (SmolLM2-135M, Llama-3-8B, Qwen2.5-7B),
every backend the op has and this machine can run (the Triton interpreter is never timed),
the result checked against ``specdec_kernels.reference`` before timing, then the median and
20th/80th percentiles in microseconds, the speed-up over the reference, and a roofline: the
bytes the op must move (inputs read once, outputs written once), the achieved GB/s, the ideal
time at the copy bandwidth measured in the same run, and the share of that ideal reached (on
GPU the figure that tells a slow kernel at a glance).  On CUDA each fast backend is also timed
as a CUDA-graph replay ("graph us"): an eager call of a small op times the host's work to
launch it, a replay its kernels alone.  Writes a table to stdout and
``kernels.jsonl`` + ``kernels.png`` to --out.

    python -m specdec_kernels.bench.kernels [--op NAME] [--dtype bf16|fp16|fp32] [--quick | --decode] [--out DIR] [--device cpu|cuda]
    python -m specdec_kernels.bench.kernels --static [--out DIR]   # GPU report without a GPU (specdec_kernels/bench/static.py)
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch

import specdec_kernels as sk
from specdec_kernels import _backend
from specdec_kernels.bench.common import (
    DTYPE,
    MODEL_SHAPES,
    TIME_US,
    check_device,
    column,
    copy_bandwidth_gbps,
    environment,
    format_table,
    out_dir,
    pyplot_or_none,
    time_fn,
    time_graph_replay,
    write_jsonl,
)
from specdec_kernels.tree import ancestor_mask

# the ops' view of each target model: vocabulary V, query heads H, KV heads Hkv, head dim D, layers L
MODELS = {
    m: dict(V=a.vocab_size, H=a.num_heads, Hkv=a.num_kv_heads, D=a.head_dim, L=a.num_layers)
    for m, a in MODEL_SHAPES.items()
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def random_tree(n: int, g: torch.Generator) -> torch.Tensor:
    """A bushy topological parent list of n nodes (each node's parent among the first half)."""
    parents = [-1] + [int(torch.randint(0, max(1, (i + 1) // 2), (1,), generator=g)) for i in range(1, n)]
    return torch.tensor(parents)


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@dataclass
class Entry:
    """One op's benchmark: shapes, inputs, the op's arguments among them, and how to check it."""

    op: str
    shapes: Callable[[bool], List[Dict]]
    make: Callable[[Dict, torch.dtype, torch.device], Dict]
    args: Tuple[str, ...]  # the op's arguments, by name, from the inputs
    optional: Tuple[str, ...] = ()  # arguments passed where the inputs hold them
    same: Callable[[object, object], bool] = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))
    baselines: Dict[str, Callable[[Dict], object]] = field(default_factory=dict)

    def call(self, inputs: Dict, backend: str) -> object:
        """``sk.<op>`` on ``backend`` with its arguments from ``inputs`` (by keyword)."""
        kwargs = {n: inputs[n] for n in self.args}
        kwargs.update(_args(inputs, *self.optional))
        return getattr(sk, self.op)(**kwargs, backend=backend)


def _drafts_from(logits, K, g):
    drafts = logits[:, :K].float().argmax(-1)
    flip = torch.rand(drafts.shape, generator=g, device="cpu").to(logits.device) < 0.2
    return torch.where(flip, (drafts + 1) % logits.shape[-1], drafts)


# The shape sets (``--quick``, ``--decode``, neither): "quick" for CI (the interpreter), "decode"
# the decode shapes of the GPU check (every op at B 1 / 8 / 64 and V 49152 / 128256, K 4, N 16),
# "full" everything.
DECODE_MODELS = ("smollm2-135m", "llama3-8b")


def _models(level):
    return ["smollm2-135m"] if level == "quick" else list(DECODE_MODELS if level == "decode" else MODELS)


def _verify_shapes(level):
    batches = [1, 8] if level == "quick" else [1, 8, 64]
    ks = [4, 8] if level == "full" else [4]
    return [dict(model=m, V=MODELS[m]["V"], B=b, K=k) for m in _models(level) for b in batches for k in ks]


def _make_verify(s, dtype, device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(s["B"], s["K"] + 1, s["V"], generator=g).to(device=device, dtype=dtype)
    return dict(target_logits=logits, draft_tokens=_drafts_from(logits, s["K"], g), bytes=nbytes(logits))


def _ragged_counts(B, K, g):
    """vLLM batches are ragged: per-request draft counts in 0..K, request 0 at K."""
    counts = torch.randint(0, K + 1, (B,), generator=g)
    counts[0] = K
    return counts


def _flat_rows(counts):
    """The [T + B, V] row of each flat draft t (t plus its request's index)."""
    B = counts.numel()
    return torch.arange(int(counts.sum())) + torch.repeat_interleave(torch.arange(B), counts)


def _make_verify_flattened(s, dtype, device):
    g = torch.Generator().manual_seed(0)
    counts = _ragged_counts(s["B"], s["K"], g)
    logits = torch.randn(int(counts.sum()) + s["B"], s["V"], generator=g).to(device=device, dtype=dtype)
    drafts = _drafts_from(logits[_flat_rows(counts).to(device)][None], int(counts.sum()), g)[0]
    return dict(
        target_logits=logits,
        draft_token_ids=drafts.to(torch.int32),
        cu_num_draft_tokens=counts.cumsum(0).to(device=device, dtype=torch.int32),
        max_spec_len=s["K"],
        bytes=nbytes(logits),
    )


def _tree_shapes(level):
    batches = [1, 8] if level == "quick" else [1, 8, 64]
    return [
        dict(model=m, V=MODELS[m]["V"], B=b, N=n)
        for m in _models(level)
        for b in batches
        for n in ([16, 64] if level == "full" else [16])
    ]


def _make_tree_verify(s, dtype, device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(s["B"], s["N"], s["V"], generator=g).to(device=device, dtype=dtype)
    parents = random_tree(s["N"], g)
    best = logits.float().argmax(-1)
    tokens = best.gather(1, parents.clamp(min=0).to(device)[None].expand(s["B"], -1)).clone()  # children match often
    return dict(target_logits=logits, tree_tokens=tokens, tree_parents=parents.to(device), bytes=nbytes(logits))


def _make_rejection(s, dtype, device):
    g = torch.Generator().manual_seed(0)
    B, K, V = s["B"], s["K"], s["V"]
    logits = torch.randn(B, K + 1, V, generator=g)
    target = torch.softmax(logits, -1).to(device)
    draft = torch.softmax(logits[:, :K] + torch.randn(B, K, V, generator=g), -1).to(device)
    tokens = torch.multinomial(draft.reshape(-1, V).cpu(), 1, generator=g).reshape(B, K).to(device)
    return dict(
        target_probs=target,
        draft_probs=draft,
        draft_tokens=tokens,
        uniform_samples=torch.rand(B, K, generator=g).to(device),
        sample_uniforms=torch.rand(B, generator=g).to(device),
        bytes=nbytes(target, draft),
    )


def _make_rejection_flattened(s, dtype, device):
    g = torch.Generator().manual_seed(0)
    B, K, V = s["B"], s["K"], s["V"]
    counts = _ragged_counts(B, K, g)
    T = int(counts.sum())
    logits = torch.randn(T + B, V, generator=g)
    target = torch.softmax(logits, -1).to(device)
    draft = torch.softmax(logits[_flat_rows(counts)] + torch.randn(T, V, generator=g), -1).to(device)
    tokens = torch.multinomial(draft.cpu(), 1, generator=g)[:, 0].to(device=device, dtype=torch.int32)
    return dict(
        target_probs=target,
        draft_probs=draft,
        draft_token_ids=tokens,
        cu_num_draft_tokens=counts.cumsum(0).to(device=device, dtype=torch.int32),
        max_spec_len=K,
        uniform_samples=torch.rand(T, generator=g).to(device),
        sample_uniforms=torch.rand(B, generator=g).to(device),
        bytes=nbytes(target, draft),
    )


def _make_tree_rejection(s, dtype, device):
    g = torch.Generator().manual_seed(0)
    B, N, V = s["B"], s["N"], s["V"]
    target = torch.softmax(torch.randn(B, N, V, generator=g), -1).to(device)
    parents = random_tree(N, g)
    tokens = target.argmax(-1).gather(1, parents.clamp(min=0).to(device)[None].expand(B, -1)).clone()
    return dict(
        target_probs=target,
        tree_tokens=tokens,
        tree_parents=parents.to(device),
        uniform_samples=torch.rand(B, N - 1, generator=g).to(device),
        sample_uniforms=torch.rand(B, generator=g).to(device),
        bytes=nbytes(target),
    )


def _make_sampling(s, dtype, device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(s["B"], s["K"] + 1, s["V"], generator=g).to(device=device, dtype=dtype)
    return dict(logits=logits, temperature=0.7, top_k=50, top_p=0.9, bytes=nbytes(logits) + logits.numel() * 4)


def _attention_shapes(level):
    if level == "quick":
        return [
            dict(model="smollm2-135m", B=1, N=n, prefix=p, **MODELS["smollm2-135m"]) for n in (1, 16) for p in (512,)
        ]
    if level == "decode":
        return [dict(model=m, B=b, N=16, prefix=4096, **MODELS[m]) for m in DECODE_MODELS for b in (1, 8, 64)]
    out = []
    for m in ("smollm2-135m", "llama3-8b"):
        for b in (1, 8):
            for n in (1, 16, 64):
                for p in (4096, 16384):
                    out.append(dict(model=m, B=b, N=n, prefix=p, **MODELS[m]))
    return out


def _make_attention(s, dtype, device):
    g = torch.Generator().manual_seed(0)
    B, N, H, Hkv, D, P = s["B"], s["N"], s["H"], s["Hkv"], s["D"], s["prefix"]
    S = P + N
    q = torch.randn(B, N, H, D, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(device=device, dtype=dtype)
    mask = ancestor_mask(random_tree(N, g)).to(device)
    seqlens = torch.full((B,), P, dtype=torch.int32, device=device)
    kv_bytes = 2 * B * Hkv * S * D * k.element_size()
    return dict(q=q, k_cache=k, v_cache=v, cache_seqlens=seqlens, tree_mask=mask, bytes=kv_bytes + 2 * nbytes(q))


def _sdpa_dense(i):
    """torch's scaled_dot_product_attention given the equivalent dense mask (the GPU baseline)."""
    from specdec_kernels.reference.tree_attention import visible_keys

    q, k, v = i["q"], i["k_cache"], i["v_cache"]
    B, N, H, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    mask = visible_keys(i["cache_seqlens"], i["tree_mask"], N, S)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1), attn_mask=mask
    )
    return out.transpose(1, 2)


def _paged_attention_shapes(level):
    """The dense shapes, the cache paged in blocks of 16 slots (NHD, vLLM's default)."""
    return [dict(s, block_size=16) for s in _attention_shapes(level)]


def _make_paged_attention(s, dtype, device):
    """The dense inputs with each sequence's blocks scattered through a shuffled block table
    into a pool with 10% spare blocks (what a serving engine's pool looks like)."""
    i = _make_attention(s, dtype, device)
    k, v = i["k_cache"], i["v_cache"]
    B, Hkv, S, D = k.shape
    bs = s["block_size"]
    M = -(-S // bs)
    num_blocks = B * M + max(1, B * M // 10)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))[: B * M].view(B, M)
    table = table.to(device=device, dtype=torch.int32)
    pools = []
    for t in (k, v):
        dense = torch.zeros(B, Hkv, M * bs, D, dtype=dtype, device=device)
        dense[:, :, :S] = t
        pool = torch.zeros(num_blocks, bs, Hkv, D, dtype=dtype, device=device)
        pool[table.reshape(-1).long()] = dense.view(B, Hkv, M, bs, D).permute(0, 2, 3, 1, 4).reshape(B * M, bs, Hkv, D)
        pools.append(pool)
    return dict(i, k_cache=pools[0], v_cache=pools[1], block_table=table, bytes=i["bytes"] + nbytes(table))


def _sdpa_paged(i):
    """The plain PyTorch way: gather the blocks into a dense cache, then _sdpa_dense."""
    from specdec_kernels.reference.tree_attention import gather_paged_kv

    k = gather_paged_kv(i["k_cache"], i["block_table"], "NHD")
    v = gather_paged_kv(i["v_cache"], i["block_table"], "NHD")
    return _sdpa_dense(dict(i, k_cache=k, v_cache=v))


def _compact_shapes(level):
    """Dense rows, then the same shapes on a paged cache (block_size 16, NHD)."""
    if level == "quick":
        dense = [dict(model="smollm2-135m", B=4, S=2048, M=8, **MODELS["smollm2-135m"])]
    else:
        dense = [dict(model=m, B=b, S=2048, M=8, **MODELS[m]) for m in ("smollm2-135m", "llama3-8b") for b in (1, 4, 8)]
    return dense + [dict(s, block_size=16) for s in dense]


def _make_compact(s, dtype, device):
    g = torch.Generator().manual_seed(0)
    L, B, Hkv, S, D, M = s["L"], s["B"], s["Hkv"], s["S"], s["D"], s["M"]
    paged = {}
    if s.get("block_size"):  # the same tokens in a pool of shuffled [block_size, Hkv, D] blocks (NHD)
        bs = s["block_size"]
        num_blocks = B * (S // bs)
        cache = torch.randn(L, 2, num_blocks, bs, Hkv, D, generator=g).to(device=device, dtype=dtype)
        table = torch.randperm(num_blocks, generator=g).reshape(B, S // bs).to(device=device, dtype=torch.int32)
        paged = dict(block_table=table, kv_layout="NHD")
    else:
        cache = torch.randn(L, 2, B, Hkv, S, D, generator=g).to(device=device, dtype=dtype)
    seqlens = torch.full((B,), S // 2, dtype=torch.int64, device=device)
    indices = (torch.arange(M) + torch.randint(0, 3, (B, M), generator=g).cumsum(1)).to(device)
    counts = torch.randint(M // 2, M + 1, (B,), generator=g).to(device)
    moved = int(counts.sum()) * L * 2 * Hkv * D * cache.element_size()
    return dict(
        kv_cache=cache, cache_seqlens=seqlens, accepted_indices=indices, num_slots=counts, bytes=2 * moved, **paged
    )


def _index_select_loop(i):
    """The plain PyTorch way: per layer, index_select the accepted rows and copy_ them back
    (paged: of the pool seen as [num_blocks * block_size, Hkv, D] rows, at physical slots)."""
    cache, seqlens, idx, counts = i["kv_cache"], i["cache_seqlens"], i["accepted_indices"], i["num_slots"]
    if "block_table" in i:
        table, bs = i["block_table"].long(), cache.shape[3]
        src, dst = [], []
        for b in range(table.shape[0]):
            n, start = int(counts[b]), int(seqlens[b])
            for slots, out in ((start + idx[b, :n], src), (start + torch.arange(n, device=idx.device), dst)):
                out.append(table[b, slots // bs] * bs + slots % bs)
        src, dst = torch.cat(src), torch.cat(dst)
        for pool in cache.flatten(0, 1):
            rows = pool.flatten(0, 1)  # a view: the pool is contiguous
            rows.index_copy_(0, dst, rows.index_select(0, src))
        return
    for layer in cache.flatten(0, 1):
        for b in range(layer.shape[0]):
            n, start = int(counts[b]), int(seqlens[b])
            layer[b, :, start : start + n].copy_(layer[b].index_select(1, start + idx[b, :n]))


SHOWN = ("model", "B", "K", "N", "prefix", "block_size", "S", "M")


def _args(i, *names):
    return {n: i[n] for n in names if n in i}


SAMPLE_UNIFORMS = ("uniform_samples", "sample_uniforms")  # a sampling op's coins, where given
ATTENTION = ("q", "k_cache", "v_cache", "cache_seqlens", "tree_mask")


def _attention_close(a, b) -> bool:
    return torch.allclose(a[0].float(), b[0].float(), atol=2e-2, rtol=2e-2)


ENTRIES = [
    Entry("verify_greedy", _verify_shapes, _make_verify, ("target_logits", "draft_tokens")),
    Entry(
        "verify_greedy_flattened",
        _verify_shapes,
        _make_verify_flattened,
        ("target_logits", "draft_token_ids", "cu_num_draft_tokens", "max_spec_len"),
    ),
    Entry("verify_tree_greedy", _tree_shapes, _make_tree_verify, ("target_logits", "tree_tokens", "tree_parents")),
    Entry(
        "rejection_sample",
        _verify_shapes,
        _make_rejection,
        ("target_probs", "draft_probs", "draft_tokens"),
        SAMPLE_UNIFORMS,
    ),
    Entry(
        "rejection_sample_flattened",
        _verify_shapes,
        _make_rejection_flattened,
        ("target_probs", "draft_probs", "draft_token_ids", "cu_num_draft_tokens", "max_spec_len"),
        SAMPLE_UNIFORMS,
    ),
    Entry(
        "tree_rejection_sample",
        _tree_shapes,
        _make_tree_rejection,
        ("target_probs", "tree_tokens", "tree_parents"),
        SAMPLE_UNIFORMS,
    ),
    Entry(
        "sampling_probs",
        _verify_shapes,
        _make_sampling,
        ("logits", "temperature", "top_k", "top_p"),
        same=lambda a, b: torch.allclose(a[0], b[0], atol=1e-5, rtol=1e-4),
    ),
    Entry(
        "tree_attention",
        _attention_shapes,
        _make_attention,
        ATTENTION,
        same=_attention_close,
        baselines={"sdpa_dense_mask": _sdpa_dense},
    ),
    Entry(
        "tree_attention",
        _paged_attention_shapes,
        _make_paged_attention,  # paged KV cache (block_table)
        ATTENTION + ("block_table",),
        same=_attention_close,
        baselines={"sdpa_dense_mask": _sdpa_paged},
    ),
    Entry(
        "compact_kv_cache",
        _compact_shapes,
        _make_compact,
        ("kv_cache", "cache_seqlens", "accepted_indices", "num_slots"),
        ("block_table", "kv_layout"),
        baselines={"index_select_loop": _index_select_loop},
    ),
]


def backends_here(op: str, device: torch.device) -> List[str]:
    """The op's backends that run here; the Triton interpreter is never timed."""
    implemented = importlib.import_module(f"specdec_kernels.ops.{op}").IMPLEMENTED
    usable = [b for b in implemented if _backend._can_run(b, op, device) is None]
    return [b for b in usable if not (b == "triton" and device.type != "cuda")]


def _fresh(entry: Entry, inputs: Dict) -> Dict:
    """In-place ops run on a copy so every call sees the same input."""
    if entry.op != "compact_kv_cache":
        return inputs
    return {**inputs, "kv_cache": inputs["kv_cache"].clone()}


def _result(entry: Entry, inputs: Dict, fn) -> object:
    fresh = _fresh(entry, inputs)
    out = fn(fresh)
    return (fresh["kv_cache"],) if entry.op == "compact_kv_cache" else (out if isinstance(out, tuple) else (out,))


def run(args) -> List[Dict]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    entries = [e for e in ENTRIES if args.op in (None, e.op)]
    if not entries:
        raise SystemExit(f"--op must be one of {[e.op for e in ENTRIES]}")
    try:
        out = out_dir(args.out, "bench_out")  # checked before the work, not after it
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    env = environment()
    copy_bw = copy_bandwidth_gbps(device)
    level = "quick" if args.quick else "decode" if args.decode else "full"
    jobs = [(e, s) for e in entries for s in e.shapes(level)]
    try:
        from tqdm import tqdm

        jobs_iter = tqdm(jobs, desc="bench.kernels", file=sys.stderr, disable=None)
    except ImportError:
        jobs_iter = jobs
    rows = []
    min_time = 0.2 if level == "full" else 0.05
    for entry, shape in jobs_iter:
        inputs = entry.make(shape, dtype, device)
        ref_fn = lambda i, e=entry: e.call(i, "reference")  # noqa: E731
        expected = _result(entry, inputs, ref_fn)
        candidates = {f"{b}": (lambda i, b=b, e=entry: e.call(i, b)) for b in backends_here(entry.op, device)}
        candidates.update(entry.baselines)
        timings = {}
        for name, fn in candidates.items():
            got = _result(entry, inputs, fn)
            if not entry.same(got, expected):
                raise SystemExit(f"{entry.op} {shape}: backend {name} disagrees with the reference; not timing it")
            work = _fresh(entry, inputs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            timings[name] = time_fn(lambda fn=fn, w=work: fn(w), device, min_time)
            # on CUDA also the kernels alone (graph replay): eager calls at small sizes time
            # the host's per-call work, not the kernels
            graph = time_graph_replay(lambda fn=fn, w=work: fn(w), device) if name != "reference" else None
            if graph is not None:
                timings[name].update({f"graph_{k}": v for k, v in graph.items()})
        ref_us = timings["reference"]["median_us"]
        # roofline: the bytes that must move (inputs read once, outputs written once) at the
        # copy bandwidth measured in this run; the share of it a backend reaches
        ideal_us = inputs["bytes"] / (copy_bw * 1e9) * 1e6 if copy_bw > 0 else None
        for name, t in timings.items():
            gbps = inputs["bytes"] / (t["median_us"] * 1e-6) / 1e9
            graph_us = t.get("graph_median_us")
            graph_gbps = inputs["bytes"] / (graph_us * 1e-6) / 1e9 if graph_us else None
            # one line per measurement as it is made: a run cut short by a time limit keeps them
            print(
                f"# measured {entry.op} [{' '.join(f'{k}={v}' for k, v in shape.items() if k in SHOWN)}] {name}: "
                f"median {t['median_us']:.1f} us, {gbps:.1f} GB/s"
                + (f"; graph replay {graph_us:.1f} us, {graph_gbps:.1f} GB/s" if graph_us else ""),
                flush=True,
            )
            rows.append(
                {
                    "op": entry.op,
                    "backend": name,
                    "dtype": str(dtype).replace("torch.", ""),
                    "shape": shape,
                    "shape_str": " ".join(f"{k}={v}" for k, v in shape.items() if k in SHOWN),
                    **t,
                    "speedup_vs_reference": ref_us / t["median_us"],
                    "bytes": inputs["bytes"],
                    "gbps": gbps,
                    "graph_gbps": graph_gbps,
                    "ideal_us": ideal_us,
                    # the kernels' share where a graph replay timed them alone
                    "copy_bw_share": ideal_us / (graph_us or t["median_us"]) if ideal_us else None,
                }
            )
    write_jsonl(out / "kernels.jsonl", rows, {**env, "copy_bandwidth_gbps": copy_bw})
    plot(rows, out / "kernels.png", env)
    print(f"# bench.kernels on {env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    print(
        f"# roofline: copy bandwidth measured in this run {copy_bw:.0f} GB/s (read + write of one large copy); "
        "'ideal us' = bytes that must move / that bandwidth, '% roofline' = ideal / median (the graph "
        "replay's median where one was measured: CUDA, backends other than the reference)"
    )
    print(
        format_table(
            rows,
            [
                column("op"),
                column("shape_str", "shape"),
                column("backend"),
                DTYPE,
                *TIME_US,
                column("speedup_vs_reference", "x ref", "{:.2f}"),
                column("bytes", fmt="{:.3g}"),
                column("gbps", "GB/s", "{:.1f}"),
                column("graph_median_us", "graph us", "{:.1f}"),
                column("graph_gbps", "graph GB/s", "{:.1f}"),
                column("ideal_us", "ideal us", "{:.1f}"),
                column("copy_bw_share", "% roofline", "{:.0%}"),
            ],
        )
    )
    print(f"# wrote {out / 'kernels.jsonl'} and {out / 'kernels.png'}")
    return rows


def plot(rows: List[Dict], path, env) -> None:
    """Speed-up over the reference per op, shape and backend (log scale).

    Only ops with a fast path measured here get a panel; the others are named in a note under
    the title (e.g. on CPU, ops whose only backend here is the reference), so no panel is
    empty.  The title sits above the panels (figure-level layout), never over them.
    """
    plt = pyplot_or_none(path)
    if plt is None:
        return

    ops = sorted({r["op"] for r in rows})
    drawn = [op for op in ops if any(r["op"] == op and r["backend"] != "reference" for r in rows)]
    missing = [op for op in ops if op not in drawn]
    title = f"specdec_kernels on {env['device']} (commit {env['commit']})"
    if missing:
        title += "\nno fast path measured here (reference only): " + ", ".join(missing)
    fig, axes = plt.subplots(
        max(1, len(drawn)), 1, figsize=(11, 2.6 * max(1, len(drawn)) + 0.6), squeeze=False, layout="constrained"
    )
    if not drawn:
        axes[0, 0].axis("off")
        axes[0, 0].text(0.5, 0.5, "no fast path measured on this machine", ha="center", va="center")
    for ax, op in zip(axes[:, 0], drawn):
        mine = [r for r in rows if r["op"] == op and r["backend"] != "reference"]
        shapes = list(dict.fromkeys(r["shape_str"] for r in mine))
        backends = list(dict.fromkeys(r["backend"] for r in mine))
        width = 0.8 / max(1, len(backends))
        for j, b in enumerate(backends):
            xs = [shapes.index(r["shape_str"]) + j * width for r in mine if r["backend"] == b]
            ys = [r["speedup_vs_reference"] for r in mine if r["backend"] == b]
            ax.bar(xs, ys, width, label=b)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(op, fontsize=9)
        ax.set_ylabel("x reference")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
        ax.set_xticklabels(shapes, rotation=20, fontsize=6, ha="right")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    from specdec_kernels.bench.common import ArgumentParser

    parser = ArgumentParser(prog="python -m specdec_kernels.bench.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--op", help="one op only")
    parser.add_argument("--dtype", choices=list(DTYPES), help="logits/cache dtype (default bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--quick", action="store_true", help="small set of shapes (CI)")
    parser.add_argument(
        "--decode",
        action="store_true",
        help="the decode shapes of the GPU check: every op at B 1/8/64 and V 49152/128256, K 4, N 16",
    )
    parser.add_argument("--out", help="output folder (default bench_out/)")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument(
        "--static",
        action="store_true",
        help="no timing: compile every launcher configuration for sm_90 and sm_80 and report registers, "
        "spills, shared memory and occupancy (specdec_kernels/bench/static.py; no GPU needed)",
    )
    args = parser.parse_args(argv)
    ops = list(dict.fromkeys(e.op for e in ENTRIES))
    if args.op is not None and args.op not in ops:
        parser.error(f"--op must be one of {', '.join(ops)}, got {args.op!r}")
    if args.quick and args.decode:
        parser.error("--quick and --decode are two shape sets: give one")
    if args.static and (args.op or args.dtype or args.quick or args.decode or args.device):
        parser.error("--static compiles every launcher configuration: it takes --out only")
    check_device(parser, "--device", args.device)
    try:
        out_dir(args.out, "bench_out")  # checked before any work
    except ValueError as e:
        parser.error(str(e))
    if args.static:
        from specdec_kernels.bench import static

        try:
            out = out_dir(args.out, "bench_out")
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        static.main(out)
        return
    run(args)


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
