"""Host-side helpers of the Triton launchers (no kernels here): the outputs they allocate and
the inputs they make fit for the kernels."""

from __future__ import annotations

from typing import Tuple

import torch


def new_int64(like: torch.Tensor, *shapes: Tuple[int, ...]) -> Tuple[torch.Tensor, ...]:
    """Uninitialised int64 tensors of ``shapes`` on ``like``'s device: the token, node and
    count outputs of the ops (``like.new_empty``, so a fake ``like`` gives fake tensors)."""
    return tuple(like.new_empty(shape, dtype=torch.int64) for shape in shapes)


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if its last dimension is unit-stride (as the kernels read the vocabulary),
    else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def dummy(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor on ``like``'s device for an input the kernels never read (an empty
    tensor may have no storage)."""
    return torch.zeros(1, dtype=dtype, device=like.device)
