"""Benchmarks: `python -m bench.kernels` (per op and backend) and `python -m bench.e2e`."""
