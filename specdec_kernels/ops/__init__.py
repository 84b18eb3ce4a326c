"""The public ops: one module each (the Python front, the ``torch.ops.specdec.<name>``
registration and its CPU / CUDA / fake kernels); Triton kernels in ``ops._triton``."""
