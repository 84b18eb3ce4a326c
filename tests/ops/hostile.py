"""Helpers of the hostile-input tests (``tests/ops/<op>/test_hostile_inputs.py``).

Hostile inputs with value checks off (validate=False, the CUDA default): every count and
index at and beyond its range, every tensor a view inside a guard buffer full of sentinels or
NaN.  Each backend must give the reference's answer for the clamped input and never read the
guards (a read would change the answer: the sentinels are chosen to do so).
"""

import torch


def in_guard(t: torch.Tensor, fill, pad: int = 64) -> torch.Tensor:
    """A copy of ``t`` as a view in the middle of a larger buffer filled with ``fill``."""
    flat = torch.full((t.numel() + 2 * pad,), fill, dtype=t.dtype)
    flat[pad : pad + t.numel()] = t.reshape(-1)
    return flat[pad : pad + t.numel()].view(t.shape)


COUNTS = [-5, -1, 0, 1, 3, 4, 5, 9, 2**31 - 1]

TREE = [-1, 0, 0, 1, 2, 3]
HOSTILE_PARENTS = [
    TREE,
    [-1, 0, 5, 1, 2, 3],  # a parent after its child
    [-1, -7, 0, 2**40, 1, 3],  # negative and huge parents
    [3, 0, 0, 1, 2, 3],  # the root with a parent
]
