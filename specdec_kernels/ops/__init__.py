"""The public ops, one module each: the Python front (argument checks, public types, the
docstring), the ``torch.ops.specdec.<name>`` registration and its kernels by device.  Backends:
Triton launchers and kernels in ``ops._triton``, PyTorch compositions in ``ops._torch``, C++/CUDA
kernels in ``csrc/`` (``torch.ops.specdec_native.<name>``), references in ``specdec_kernels.reference``.

Each module is one slice, with one check pass and one dispatch layer per call: its front checks
the arguments once (values too, when ``validate`` allows), then on the eager path
(``_eager.direct_call``) runs the backend chosen once per process and device type itself
(``_run``: launcher, native op or reference); traced, compiled, fake or grad-requiring calls go
through the registered op instead, whose kernel ``_impl`` checks shapes and runs the same
``_run``: front -> ``_run``, or front -> ``torch.ops.specdec.<name>`` -> ``_impl`` -> ``_run``.
"""
