"""Checkout shim: ``python -m bench.policies`` runs ``python -m specdec_kernels.bench.policies``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("specdec_kernels.bench.policies", run_name="__main__", alter_sys=True)
