"""Triton kernels and their launchers, one module per op; imported on first use only (they
import triton, about a second).  Each launcher module has a ``launch_config`` function: the
grid, tile sizes, warps and splits it launches with, which ``specdec_kernels/bench/static.py`` asks for the
configurations of a GPU that is not here (its ahead-of-time specs: ``specdec_kernels/bench/aot_specs.py``)."""
