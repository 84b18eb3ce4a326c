"""The benchmark commands (``bench``): kernels, static report, step cost, end to end, FlashInfer."""
