"""How the sampling ops draw their random numbers.

Every random op takes its randomness as explicit uniforms so that the reference and a
kernel given the same numbers return the same tokens.  When the caller passes a
``torch.Generator`` instead, the numbers are drawn here, in this order:

1. the acceptance coins, ``uniform_samples`` of shape [B, C] (C = K for a chain, N - 1 for
   a tree: one coin per draft token / non-root node);
2. the uniform that draws each sequence's one sampled token (the residual sample at the
   first rejection or the bonus token), ``sample_uniforms`` of shape [B].

With one generator the batch is drawn at once (``torch.rand(B, C)`` then ``torch.rand(B)``);
with a list of one generator per sequence, sequence b draws ``torch.rand(C)`` then
``torch.rand(1)`` from its own generator, so its tokens do not depend on the rest of the
batch.  Numbers are drawn on the generator's device and moved to the inputs' device.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from specdec_kernels._checks import check_uniforms

GeneratorArg = Union[None, torch.Generator, Sequence[torch.Generator]]


def _rand(shape, generator: Optional[torch.Generator], device) -> torch.Tensor:
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device, dtype=torch.float32).to(device)


def draw_uniforms(
    batch: int,
    num_coins: int,
    device: torch.device,
    generator: GeneratorArg = None,
    uniform_samples: Optional[torch.Tensor] = None,
    sample_uniforms: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return (uniform_samples [B, C], sample_uniforms [B]) as float32 on ``device``.

    Explicit tensors are checked and used as they are; missing ones are drawn from
    ``generator`` in the documented order.

    Raises:
        TypeError: ``generator`` is neither a Generator nor a sequence of them.
        ValueError: a list of generators of the wrong length; explicit uniforms of the
            wrong shape or outside [0, 1).
    """
    if uniform_samples is not None:
        uniform_samples = check_uniforms("uniform_samples", uniform_samples, (batch, num_coins), device)
    if sample_uniforms is not None:
        sample_uniforms = check_uniforms("sample_uniforms", sample_uniforms, (batch,), device)
    if uniform_samples is not None and sample_uniforms is not None:
        return uniform_samples, sample_uniforms

    if generator is None or isinstance(generator, torch.Generator):
        coins = _rand((batch, num_coins), generator, device)
        final = _rand((batch,), generator, device)
    elif isinstance(generator, (list, tuple)):
        if len(generator) != batch:
            raise ValueError(f"generator must be one torch.Generator per sequence ({batch}), got {len(generator)}")
        for g in generator:
            if not isinstance(g, torch.Generator):
                raise TypeError(f"generator list must hold torch.Generator objects, got {type(g).__name__}")
        coins_rows, final_rows = [], []
        for g in generator:
            coins_rows.append(_rand((num_coins,), g, device))
            final_rows.append(_rand((1,), g, device))
        coins = torch.stack(coins_rows) if batch else torch.empty((0, num_coins), device=device)
        final = torch.cat(final_rows) if batch else torch.empty((0,), device=device)
    else:
        raise TypeError(f"generator must be a torch.Generator or a list of them, got {type(generator).__name__}")
    return (
        uniform_samples if uniform_samples is not None else coins,
        sample_uniforms if sample_uniforms is not None else final,
    )
