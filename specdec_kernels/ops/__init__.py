"""The public ops, one module each: the Python front (argument checks, public types, the
docstring), the ``torch.ops.specdec.<name>`` registration and its kernels by device.  Backends:
Triton launchers and kernels in ``ops._triton``, PyTorch compositions in ``ops._torch``, C++/CUDA
kernels in ``csrc/`` (``torch.ops.specdec.<name>_native``), references in ``specdec_kernels.reference``.

Each module is one slice: its front checks the arguments (values once, when ``validate``
allows) and calls the registered op; the op's kernel ``_impl`` checks shapes only and runs the
backend chosen once per process and device type: front -> ``_impl`` -> launcher or reference.
"""
