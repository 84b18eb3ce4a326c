"""Checkout shim: ``python -m bench.kernels`` runs ``python -m specdec_kernels.bench.kernels``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("specdec_kernels.bench.kernels", run_name="__main__", alter_sys=True)
