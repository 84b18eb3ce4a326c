"""Checkout shim: ``python -m bench.flashinfer_side`` runs ``python -m specdec_kernels.bench.flashinfer_side``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("specdec_kernels.bench.flashinfer_side", run_name="__main__", alter_sys=True)
