"""Settings and cases shared by the tests of the samplers (rejection_sample,
tree_rejection_sample, their flattened layout)."""

import torch


def random_probs(shape, g, zero_frac=0.3):
    """Rows of random probabilities with some exact zeros, normalised (float32); every row keeps
    some mass at token 0."""
    x = torch.rand(shape, generator=g)
    x = torch.where(torch.rand(shape, generator=g) < zero_frac, torch.zeros_like(x), x)
    x[..., 0] += 1e-3
    return x / x.sum(-1, keepdim=True)


# vocabulary chunks (the batch-1 split): (BLOCK_B, BLOCK_V, chunks per row); chunk counts above
# the tile count are clamped, several tiles per chunk and an uneven last chunk occur
TILINGS = [(1, 16, 2), (2, 16, 3), (4, 32, 5), (1, 16, 64), (8, 16, 7)]

# the target distributions of the distribution tests (sampling_probs settings)
TARGETS = {
    "t1.0": dict(temperature=1.0),
    "t0.6": dict(temperature=0.6),
    "t1.0_topk8": dict(temperature=1.0, top_k=8),
    "t0.6_topp0.8": dict(temperature=0.6, top_p=0.8),
}
