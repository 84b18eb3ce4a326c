"""``python -m specdec_kernels.bench.kernels --static`` or ``python -m specdec_kernels.bench.static``: a GPU report without a GPU.

Compiles, for sm_90 (H100/H200) and sm_80 (A100), every Triton kernel configuration that the
launchers choose at realistic shapes on a GPU of a given SM count (``launcher_specs``: the
vocabularies of Llama-3 / Qwen2 / SmolLM2 / Llama-2, batches 1 to 256, draft trees up to 64
nodes, head dims 64 and 128 with the GQA groups of SmolLM2 and Llama-3-8B), runs ``ptxas -v``
(the one Triton ships) on each kernel's PTX, and reports per kernel and configuration:
registers per thread, spilled bytes (stores and loads), stack, shared memory (static and
Triton's dynamic), warps, and the occupancy those allow (resident blocks and warps per SM, and
the limiting resource), from the CUDA occupancy rules of each architecture, and the
multiply-adds the compiler fused (``fp_contractions``: the verification and sampling kernels
must have none, or their float64 arithmetic would round differently from the reference's).
Writes ``static.jsonl`` beside the table.

The configurations are each launcher's own ``launch_config`` at those shapes, for an SM count
given as an argument (default 132, an H100 / H200 SXM), turned into compilation specs by
``specdec_kernels/bench/aot_specs.py``, so the report follows the launchers when they change.
``tests/bench/test_static_report.py`` fails when any default configuration spills registers or a
verification/sampling kernel has a fused multiply-add.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from specdec_kernels.bench.common import column

# Realistic shapes (target models users run with speculative decoding)
VOCABS = {"llama3": 128256, "qwen2": 151936, "smollm2": 49152, "llama2": 32000}
BATCHES = (1, 8, 64, 256)
TREE_NODES = (8, 64)
# H, Hkv, D, dtype: SmolLM2 and Llama-3-8B in bf16, Gemma-2B's D = 256 in bf16 (the largest
# tiles), SmolLM2 in fp32 (IEEE dots; fp32 at D = 256 spills, see tree attention's block_sizes)
ATTENTION_MODELS = {
    "smollm2": (9, 3, 64, "bf16"),
    "llama3-8b": (32, 8, 128, "bf16"),
    "gemma-2b": (8, 1, 256, "bf16"),
    "smollm2-fp32": (9, 3, 64, "fp32"),
}


@dataclass(frozen=True)
class Arch:
    """Per-SM limits of one architecture (CUDA occupancy calculator values)."""

    name: str
    capability: int
    max_warps: int = 64
    max_blocks: int = 32
    registers: int = 65536
    reg_unit: int = 256  # registers are allocated per warp in units of 256
    smem_per_sm: int = 233472
    smem_per_block: int = 232448
    smem_reserved: int = 1024  # per block, by the driver
    smem_unit: int = 128


ARCHS = {
    90: Arch("sm_90 (H100/H200)", 90),
    80: Arch("sm_80 (A100)", 80, smem_per_sm=167936, smem_per_block=166912),
}


def occupancy(registers: int, warps: int, smem_bytes: int, arch: Arch) -> Dict[str, object]:
    """Resident blocks per SM for a kernel and what limits them.

    Args:
        registers: registers per thread (ptxas).
        warps: warps per block.
        smem_bytes: shared memory per block in bytes (static + dynamic).
        arch: the SM's limits.

    Returns:
        {"blocks_per_sm", "warps_per_sm", "occupancy" (resident / maximum warps), "limiter"}.
    """
    per_warp = -(-max(registers, 1) * 32 // arch.reg_unit) * arch.reg_unit
    limits = {
        "warps": arch.max_warps // warps,
        "blocks": arch.max_blocks,
        "registers": (arch.registers // per_warp) // warps,
    }
    smem = -(-(smem_bytes + arch.smem_reserved) // arch.smem_unit) * arch.smem_unit
    limits["shared memory"] = arch.smem_per_sm // smem if smem_bytes <= arch.smem_per_block else 0
    limiter = min(limits, key=lambda k: limits[k])
    blocks = limits[limiter]
    return {
        "blocks_per_sm": blocks,
        "warps_per_sm": blocks * warps,
        "occupancy": blocks * warps / arch.max_warps,
        "limiter": limiter,
    }


def _ptxas() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else "ptxas"


_USAGE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "static_smem": re.compile(r"(\d+) bytes smem"),
}


def ptxas_usage(ptx: str) -> Dict[str, int]:
    """Resource usage of a PTX kernel as ``ptxas -v`` reports it (for the PTX's own target).

    Returns:
        {"registers", "spill_stores", "spill_loads", "stack", "static_smem"} in registers per
        thread and bytes.

    Raises:
        RuntimeError: ptxas failed.
    """
    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.MULTILINE)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run(
            [
                _ptxas(),
                "-v",
                "-lineinfo",
                f"--gpu-name={target.group(1) if target else 'sm_90a'}",
                src,
                "-o",
                os.path.join(tmp, "k.cubin"),
            ],
            capture_output=True,
            text=True,
        )
    if proc.returncode:
        raise RuntimeError(f"ptxas failed: {proc.stderr[-2000:]}")
    log = proc.stderr + proc.stdout
    return {k: int(m.group(1)) if (m := rx.search(log)) else 0 for k, rx in _USAGE.items()}


_PTX_FMA = re.compile(r"^\s*(?:@%p\d+\s+)?fma\.\w+\.f(?:32|64)\b", re.MULTILINE)
_PTX_MUL = re.compile(r"^\s*(?:@%p\d+\s+)?mul(?:\.ftz)?(?:\.sat)?\.f(32|64)\s+(%\w+)\s*,", re.MULTILINE)
_PTX_ADD = re.compile(r"^\s*(?:@%p\d+\s+)?(?:add|sub)(?:\.\w+)*\.f(32|64)\s+%\w+\s*,([^;]*);", re.MULTILINE)


def fp_contractions(ptx: str) -> int:
    """Places where a multiply and an add round once instead of twice in a kernel's PTX: FMA
    instructions (LLVM's contraction under Triton's default ``enable_fp_fusion``) plus
    multiplies without a rounding modifier (``mul[.ftz][.sat].f32/f64``, which ptxas may fuse) whose result
    feeds an ``add``/``sub`` of the same type.  ``mul.rn`` (``_mul_rn``) is never fused.  Float
    division and ``exp`` expand into FMAs only in SASS, so they do not count."""
    muls = {(m.group(2), m.group(1)) for m in _PTX_MUL.finditer(ptx)}
    fed = sum(1 for m in _PTX_ADD.finditer(ptx) for reg in re.findall(r"%\w+", m.group(2)) if (reg, m.group(1)) in muls)
    return len(_PTX_FMA.findall(ptx)) + fed


def _dedupe(specs: List[dict]) -> List[dict]:
    """One spec per configuration name; ``shapes`` lists every shape that chose it."""
    by_name: Dict[str, dict] = {}
    for s in specs:
        if s["name"] in by_name:
            by_name[s["name"]]["shapes"] += f"; {s['shapes']}"
        else:
            by_name[s["name"]] = dict(s)
    return list(by_name.values())


# What Triton's JIT specializes at a real launch (triton/runtime/jit.py): an int argument
# equal to 1 becomes a constant, and pointers (16-byte aligned) and ints divisible by 16 carry
# a divisibility hint, which decides vectorised loads.  At the realistic shapes the head-dim
# strides are 1 and the vocabulary, row strides and other strides are multiples of 16.
_ONES = {
    "_tree_attention_fwd_kernel": ("stride_qd", "stride_kd", "stride_vd", "stride_od"),
    "_tree_attention_combine_kernel": ("stride_od",),
}
_DIV16 = {
    "_tree_attention_fwd_kernel": (
        "stride_qb",
        "stride_qn",
        "stride_qh",
        "stride_kb",
        "stride_kh",
        "stride_ks",
        "stride_vb",
        "stride_vh",
        "stride_vs",
        "stride_ob",
        "stride_on",
        "stride_oh",
    ),
    "_tree_attention_combine_kernel": ("stride_ob", "stride_on", "stride_oh"),
    "_argmax_partials_kernel": ("V", "stride_b", "stride_r"),
    "_rejection_partials_kernel": ("V", "stride_tb", "stride_tk", "stride_db", "stride_dk"),
    "_rejection_sample_kernel": ("V", "stride_tb", "stride_tk", "stride_db", "stride_dk"),
    "_sampling_search_kernel": ("V", "stride_lr"),
    "_sampling_write_kernel": ("V", "stride_lr"),
    "_tree_mass_kernel": ("V", "stride_tb", "stride_tn"),
    "_tree_sample_kernel": ("V", "stride_tb", "stride_tn", "stride_db", "stride_dn"),
}


def as_launched(spec: dict) -> dict:
    """The spec with the JIT's specializations of a realistic launch: ``_ONES`` arguments as
    constants 1, divisibility-by-16 attributes on pointers and the ``_DIV16`` arguments."""
    fn = spec["kernel"]
    name = fn.__name__
    signature = dict(spec["signature"])
    constexprs = dict(spec.get("constexprs", {}))
    for arg in _ONES.get(name, ()):
        if arg in signature and signature[arg] != "constexpr":
            signature[arg] = "constexpr"
            constexprs[arg] = 1
    div = set(_DIV16.get(name, ()))
    attrs = {}
    for arg, ty in signature.items():
        if (ty.startswith("*") or arg in div) and ty != "constexpr":
            attrs[(fn.arg_names.index(arg),)] = [["tt.divisibility", 16]]
    return {**spec, "signature": signature, "constexprs": constexprs, "attrs": attrs}


def launcher_specs(sm_count: Optional[int] = None) -> List[dict]:
    """The configurations the launchers choose on a GPU of ``sm_count`` SMs (default
    ``aot_specs.TARGET_SM_COUNT``, an H100 / H200) at the realistic shapes above, as specs
    (``kernel``, ``signature``, ``constexprs``, ``options``, ``name``, ``shapes``): each
    launcher's own ``launch_config`` at that shape, through the builders of ``specdec_kernels.bench.aot_specs``."""
    from specdec_kernels.bench import aot_specs as aot
    from specdec_kernels.ops._triton import rejection_sample as rs
    from specdec_kernels.ops._triton import sampling_probs as sp
    from specdec_kernels.ops._triton import tree_attention as ta
    from specdec_kernels.ops._triton import tree_rejection_sample as trs
    from specdec_kernels.ops._triton import verify_greedy as vg
    from specdec_kernels.ops._triton import verify_tree_greedy as vtg

    sms = aot.TARGET_SM_COUNT if sm_count is None else int(sm_count)
    specs: List[dict] = []

    def add(items, shape: str):
        for s in items if isinstance(items, list) else [items]:
            specs.append({**s, "shapes": shape})

    for model, V in VOCABS.items():
        for B in BATCHES:
            shape = f"{model} V={V} B={B}"
            # verification: the split argmax over the B * (K + 1) rows (BLOCK_V and warps do not
            # depend on the rows)
            argmax = vg.argmax_launch_config(B, V, sms)
            for f in ("bf16", "fp32"):
                add(aot.argmax_spec(f, argmax, f"verify_greedy.argmax_partials {f} BLOCK_V={argmax.block_v}"), shape)
            # chain rejection sampling (K <= 15), padded and flattened (vLLM), bf16 probabilities
            cfg = rs.launch_config(B, 15, V, sms)
            for flat in (False, True):
                for has_draft in (True, False):
                    add(
                        aot.rejection_specs(
                            has_draft,
                            cfg,
                            prob="*bf16",
                            tok="*i32" if flat else "*i64",
                            flat=flat,
                            bonus_ids=flat and not has_draft,
                            cu="*i32" if flat else "*i64",
                        ),
                        shape,
                    )
            # sampling_probs: top-k and top-p on, and temperature alone
            cfg = sp.launch_config(B, V, sms)
            add(aot.sampling_probs_specs(True, True, cfg, "*bf16"), shape)
            add(aot.sampling_probs_specs(False, False, cfg, "*fp32"), shape)
            # tree rejection sampling, with and without draft distributions
            for n in TREE_NODES:
                for has_draft in (True, False):
                    cfg = trs.launch_config(B, n, V, sms, has_draft=has_draft)
                    add(aot.tree_rejection_specs(has_draft, cfg, prob="*bf16"), f"{shape} N={n}")
    accept = vg.launch_config(1, 32, 31, VOCABS["llama3"], sms)
    for i, c, flat, bonus_ids in aot.ACCEPT_VARIANTS:
        add(aot.accept_spec(i, c, flat, bonus_ids, accept), "K <= 31")
    for n in TREE_NODES:
        walk = vtg.launch_config(1, n, VOCABS["llama3"], sms)
        add([aot.tree_walk_spec(i, walk, f" BLOCK_N={walk.block_n}") for i in ("i32", "i64")], f"N={n}")
    # tree attention: decode (N = 1), chains and trees, split and not, dense and paged
    for model, (H, Hkv, D, dtype) in ATTENTION_MODELS.items():
        G = H // Hkv
        for n in (1, 8, 64):
            mask = ta.MASK_CAUSAL if n <= 8 else ta.MASK_BOOL
            for split in (False, True):
                cfg = ta.launch_config(1, Hkv, n, G, D, sms, ieee=dtype == "fp32", num_splits=2 if split else 1)
                for paged in (False, True):
                    add(
                        aot.tree_attention_fwd_spec(dtype, D, mask, cfg, paged=paged),
                        f"{model} H={H} Hkv={Hkv} D={D} N={n}",
                    )
        cfg = ta.launch_config(1, Hkv, 1, G, D, sms, ieee=dtype == "fp32", num_splits=2)
        add(aot.tree_attention_combine_spec(dtype, D, cfg), f"{model} D={D}")
    return [as_launched(s) for s in _dedupe(specs)]


def compile_spec(spec: dict, capability: int) -> Dict[str, object]:
    """Compile one spec for ``capability`` (80 or 90) and measure its resources.

    Returns:
        A report row: kernel name, arch, warps, registers, spills, stack, shared memory and
        occupancy, or ``error`` when compilation failed.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row: Dict[str, object] = {
        "kernel": spec["name"],
        "function": spec["kernel"].__name__,
        "arch": capability,
        "shapes": spec.get("shapes", ""),
    }
    try:
        src = ASTSource(
            fn=spec["kernel"],
            signature=spec["signature"],
            constexprs=spec.get("constexprs", {}),
            attrs=spec.get("attrs"),
        )
        compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=spec.get("options"))
        usage = ptxas_usage(compiled.asm["ptx"])
        usage["fp_contractions"] = fp_contractions(compiled.asm["ptx"])
        warps = int(compiled.metadata.num_warps)
        dynamic = int(compiled.metadata.shared)
        row.update(
            usage,
            warps=warps,
            dynamic_smem=dynamic,
            **occupancy(usage["registers"], warps, usage["static_smem"] + dynamic, ARCHS[capability]),
        )
    except Exception as e:  # noqa: BLE001  (every failure is reported)
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
    return row


def _job(args):
    index, capability, sm_count = args
    return compile_spec(launcher_specs(sm_count)[index], capability)


def collect(
    archs: Sequence[int] = (90, 80), jobs: Optional[int] = None, sm_count: Optional[int] = None
) -> List[Dict[str, object]]:
    """``compile_spec`` for every launcher configuration (``launcher_specs(sm_count)``) and
    architecture, in worker processes (the Triton interpreter switched off in them)."""
    os.environ.pop("TRITON_INTERPRET", None)
    work = [(i, a, sm_count) for i in range(len(launcher_specs(sm_count))) for a in archs]
    jobs = jobs or os.cpu_count() or 1
    if jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
            return list(pool.map(_job, work))
    return [_job(w) for w in work]


COLUMNS = [
    column("kernel"),
    column("arch", fmt="sm_{}"),
    column("warps"),
    column("registers", "regs"),
    column("spill_stores", "spill st"),
    column("spill_loads", "spill ld"),
    column("stack"),
    column("fp_contractions", "fma"),
    column("static_smem", "smem static"),
    column("dynamic_smem", "smem dyn"),
    column("blocks_per_sm", "blocks/SM"),
    column("occupancy", fmt="{:.0%}"),
    column("limiter", "limited by"),
]


def main(
    out_dir, archs: Sequence[int] = (90, 80), sm_count: Optional[int] = None, jobs: Optional[int] = None
) -> List[Dict[str, object]]:
    """Compile, print the table and write ``static.jsonl`` into ``out_dir``; exit status 1
    when a configuration fails to compile.  ``sm_count``: the GPU the launchers choose for
    (default ``specdec_kernels.bench.aot_specs.TARGET_SM_COUNT``)."""
    from specdec_kernels.bench.aot_specs import TARGET_SM_COUNT
    from specdec_kernels.bench.common import environment, format_table, write_jsonl

    sm_count = TARGET_SM_COUNT if sm_count is None else sm_count
    rows = collect(archs, jobs, sm_count)
    env = environment()
    write_jsonl(out_dir / "static.jsonl", rows, env)
    print(
        f"# bench.kernels --static: Triton {env['triton']}, commit {env['commit']}; ptxas -v of each launcher "
        f"configuration at realistic shapes for a GPU of {sm_count} SMs (no GPU needed)"
    )
    print(format_table([r for r in rows if "error" not in r], COLUMNS))
    failed = [r for r in rows if "error" in r]
    for r in failed:
        print(f"# FAILED {r['kernel']} sm_{r['arch']}: {r['error']}", file=sys.stderr)
    spills = [r for r in rows if r.get("spill_stores") or r.get("spill_loads")]
    print(
        f"# {len(rows)} kernel configurations, {len(failed)} failed, {len(spills)} spill registers; "
        f"fma: multiplies fused with an add (allowed in tree attention only)"
    )
    print(f"# wrote {out_dir / 'static.jsonl'}")
    if failed:
        raise SystemExit(1)
    return rows


def cli(argv=None) -> None:
    """``python -m specdec_kernels.bench.static [--out DIR] [--archs 90,80] [--sm-count N] [--jobs J]``."""
    from specdec_kernels.bench.aot_specs import TARGET_SM_COUNT
    from specdec_kernels.bench.common import ArgumentParser, check_range, int_list, out_dir

    parser = ArgumentParser(prog="python -m specdec_kernels.bench.static", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="output folder (default bench_out/)")
    parser.add_argument("--archs", default="90,80", help="compute capabilities, comma-separated (default 90,80)")
    parser.add_argument(
        "--sm-count",
        type=int,
        default=TARGET_SM_COUNT,
        help=f"SMs of the GPU the launchers choose for (default {TARGET_SM_COUNT}: H100 / H200 SXM)",
    )
    parser.add_argument("--jobs", type=int, help="worker processes (default: one per CPU)")
    args = parser.parse_args(argv)
    archs = int_list(parser, "--archs", args.archs, 0)
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        parser.error(f"--archs takes {', '.join(map(str, sorted(ARCHS)))}, got {args.archs!r}")
    check_range(parser, "--sm-count", args.sm_count, 1)
    check_range(parser, "--jobs", args.jobs, 1, 1024)
    try:
        out = out_dir(args.out, "bench_out")
    except ValueError as e:
        parser.error(str(e))
    main(out, archs, args.sm_count, args.jobs)


if __name__ == "__main__":
    from specdec_kernels.cli import run_main

    run_main(cli)  # Ctrl-C at any moment: status 130, one line
