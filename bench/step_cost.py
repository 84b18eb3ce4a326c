"""Checkout shim: ``python -m bench.step_cost`` runs ``python -m specdec_kernels.bench.step_cost``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("specdec_kernels.bench.step_cost", run_name="__main__", alter_sys=True)
