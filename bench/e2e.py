"""Checkout shim: ``python -m bench.e2e`` runs ``python -m specdec_kernels.bench.e2e``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("specdec_kernels.bench.e2e", run_name="__main__", alter_sys=True)
