"""Triton kernels and their launchers, one module per op; imported on first use only (they
import triton, about a second).  Each module lists its kernels' ahead-of-time compilation
specs in ``AOT_SPECS`` (tests/aot_compile.py)."""
