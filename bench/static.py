"""Checkout shim: ``python -m bench.static`` runs ``python -m specdec_kernels.bench.static``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("specdec_kernels.bench.static", run_name="__main__", alter_sys=True)
