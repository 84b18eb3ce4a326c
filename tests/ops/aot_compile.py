"""Compile every Triton kernel ahead of time for sm_80 and sm_90, without a GPU.

The specs come from ``specdec_kernels/bench/aot_specs.py`` (``AOT_SPECS``: per module of
``specdec_kernels.ops._triton``, dicts with ``kernel`` (the @triton.jit function),
``signature`` (argument name -> Triton type string such as "*fp32", "i32", or "constexpr"),
``constexprs`` (name -> value) and ``options``, built from the launchers' ``launch_config``),
one per specialisation worth checking (dtypes, block sizes).  Every function named
``_*_kernel`` in those modules must appear in at least one spec of its module.

The interpreter (TRITON_INTERPRET=1) must be off so the kernels are real JITFunctions, so
tests run this file in a subprocess:  python tests/ops/aot_compile.py [--archs 80,90]
It prints one JSON object: {"results": [{"kernel", "arch", "ok", "error"}], "missing": [...]}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys

_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # the repo root (the checkout's specdec_kernels lives there)


def _specs_by_module():
    """{module name: (module, its specs in specdec_kernels.bench.aot_specs.AOT_SPECS)} for every module of
    specdec_kernels.ops._triton."""
    import specdec_kernels.ops._triton as ops_pkg
    from specdec_kernels.bench.aot_specs import AOT_SPECS

    out = {}
    for info in pkgutil.iter_modules(ops_pkg.__path__):
        module = importlib.import_module(f"specdec_kernels.ops._triton.{info.name}")
        out[info.name] = (module, list(AOT_SPECS.get(info.name, [])))
    return out


def _compile(job):
    """Compile spec ``index`` of module ``name`` for ``arch``; runs in a worker process."""
    name, index, arch = job
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = _specs_by_module()[name][1][index]
    label = spec.get("name") or f"{name}.{spec['kernel'].__name__}"
    try:
        src = ASTSource(fn=spec["kernel"], signature=spec["signature"], constexprs=spec.get("constexprs", {}))
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=spec.get("options"))
        ok, error = "cubin" in compiled.asm, None
    except Exception as e:  # noqa: BLE001  (report every failure, then fail)
        ok, error = False, f"{type(e).__name__}: {e}"[:2000]
    return {"kernel": label, "arch": arch, "ok": ok, "error": error}


def main() -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, _ROOT)
    parser = argparse.ArgumentParser()
    parser.add_argument("--archs", default="80,90")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    args = parser.parse_args()

    from triton.runtime.jit import JITFunction

    from specdec_kernels.bench.aot_specs import AOT_SPECS

    by_module = _specs_by_module()
    missing = [
        f"specdec_kernels.bench.aot_specs.AOT_SPECS[{name!r}] (no such module)"
        for name in AOT_SPECS
        if name not in by_module
    ]
    jobs = []
    for name, (module, specs) in by_module.items():
        covered = {id(s["kernel"]) for s in specs}
        for attr, obj in vars(module).items():
            if (
                isinstance(obj, JITFunction)
                and attr.startswith("_")
                and attr.endswith("_kernel")
                and id(obj) not in covered
            ):
                missing.append(f"{name}.{attr}")
        jobs += [(name, i, int(a)) for i in range(len(specs)) for a in args.archs.split(",")]
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(_compile, jobs))
    else:
        results = [_compile(j) for j in jobs]
    print(json.dumps({"results": results, "missing": missing}))
    return 0 if all(r["ok"] for r in results) and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
