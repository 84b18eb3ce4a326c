"""Compile every Triton kernel ahead of time for sm_80 and sm_90, without a GPU.

Each module of ``specdec_kernels.ops`` that has Triton kernels lists them in ``AOT_SPECS``:
dicts with ``kernel`` (the @triton.jit function), ``signature`` (argument name -> Triton type
string such as "*fp32", "i32", or "constexpr") and ``constexprs`` (name -> value), one per
specialisation worth checking (dtypes, block sizes).  Every function named ``_*_kernel`` in
those modules must appear in at least one spec.

The interpreter (TRITON_INTERPRET=1) must be off so the kernels are real JITFunctions, so
tests run this file in a subprocess:  python tests/aot_compile.py [--archs 80,90]
It prints one JSON object: {"results": [{"kernel", "arch", "ok", "error"}], "missing": [...]}.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys


def main() -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    parser = argparse.ArgumentParser()
    parser.add_argument("--archs", default="80,90")
    args = parser.parse_args()

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
    import specdec_kernels.ops as ops_pkg

    results, missing = [], []
    for info in pkgutil.iter_modules(ops_pkg.__path__):
        module = importlib.import_module(f"specdec_kernels.ops.{info.name}")
        specs = getattr(module, "AOT_SPECS", [])
        covered = {id(s["kernel"]) for s in specs}
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and name.startswith("_") and name.endswith("_kernel") and id(obj) not in covered:
                missing.append(f"{info.name}.{name}")
        for spec in specs:
            label = spec.get("name") or f"{info.name}.{spec['kernel'].__name__}"
            for arch in (int(a) for a in args.archs.split(",")):
                try:
                    src = ASTSource(fn=spec["kernel"], signature=spec["signature"], constexprs=spec.get("constexprs", {}))
                    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=spec.get("options"))
                    ok, error = "cubin" in compiled.asm, None
                except Exception as e:  # noqa: BLE001  (report every failure, then fail)
                    ok, error = False, f"{type(e).__name__}: {e}"[:2000]
                results.append({"kernel": label, "arch": arch, "ok": ok, "error": error})
    print(json.dumps({"results": results, "missing": missing}))
    return 0 if all(r["ok"] for r in results) and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
