"""Checkout shim: ``python -m bench.vllm`` runs ``python -m specdec_kernels.bench.vllm``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("specdec_kernels.bench.vllm", run_name="__main__", alter_sys=True)
