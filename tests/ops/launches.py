"""Recording the Triton launches of a kernel module: which kernels a call launches, on which
grid, with which arguments (the launchers call ``launch(kernel)[grid](*args, **meta)``, with
``launch`` imported into each module of ``specdec_kernels.ops._triton``)."""

from contextlib import contextmanager
from typing import Iterator, List, NamedTuple
from unittest import mock


class Launch(NamedTuple):
    kernel: str  # the @triton.jit function's name
    grid: tuple
    args: tuple
    meta: dict


def kernel_name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", repr(fn))


@contextmanager
def recorded_launches(module) -> Iterator[List[Launch]]:
    """Within the block, every launch by ``module`` (a module of ``specdec_kernels.ops._triton``)
    runs as usual and is appended to the yielded list."""
    real = module.launch
    launches: List[Launch] = []

    def recording(kernel):
        launcher = real(kernel)

        class Grid:
            def __getitem__(self, grid):
                run = launcher[grid]

                def call(*args, **meta):
                    launches.append(Launch(kernel_name(kernel), tuple(grid), args, meta))
                    return run(*args, **meta)

                return call

        return Grid()

    with mock.patch.object(module, "launch", recording):
        yield launches
