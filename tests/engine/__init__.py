"""The decoding engine (``specdec_kernels.decoding``, ``specdec_kernels.generate``): model, loop,
drafters, training, paged cache, the CLI, on tiny random models and on the real SmolLM2."""
