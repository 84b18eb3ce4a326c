"""The public ops, one module each: the Python front (argument checks, public types, the
docstring), the ``torch.ops.specdec.<name>`` registration and its kernels by device.  Backends:
Triton launchers and kernels in ``ops._triton``, PyTorch compositions in ``ops._torch``, C++/CUDA
kernels in ``csrc/`` (``torch.ops.specdec.<name>_native``), references in ``specdec_kernels.reference``."""
