"""Checkout shim: ``python -m bench.threads`` runs ``python -m specdec_kernels.bench.threads``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("specdec_kernels.bench.threads", run_name="__main__", alter_sys=True)
