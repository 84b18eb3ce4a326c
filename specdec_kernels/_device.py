"""Device facts the Triton launchers choose their launch configuration from (no triton import).

One device rule for every launcher: a CUDA device gets the GPU choices, sized by its SM count
(``sm_count`` returns it); any other device gets ``None`` and the Triton interpreter's choices
(CPU tensors only run under ``TRITON_INTERPRET=1``: larger tiles, no split of the vocabulary
or of the prefix, since its programs run one after another).  CUDA tensors under the
interpreter keep the GPU choices.  The ``launch_config`` functions of the launchers take that
SM count (or ``None``) as an argument, so a report can ask for the configuration of a GPU
that is not here (``specdec_kernels/bench/static.py``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-int(a) // int(b))


# Launch configurations are pure functions of shapes and the SM count: each launcher's
# ``launch_config`` is cached per shape class (its arguments), so a decode loop computes its
# grids, tiles and splits once, not per call.  Bounded: a serving batch size varies.
cached_launch_config = functools.lru_cache(maxsize=4096)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> Optional[int]:
    """Streaming multiprocessors of a CUDA device (read once per device; a device without an
    index is the current one), or ``None`` for any other device: the launchers then take the
    interpreter's configuration."""
    if device.type != "cuda":
        return None
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
