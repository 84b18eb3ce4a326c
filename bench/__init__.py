"""Source-checkout shims: the benchmarks live in ``specdec_kernels.bench`` (installed with the
package); ``python -m bench.<name>`` here runs ``python -m specdec_kernels.bench.<name>``.
This folder is not part of the wheel."""
