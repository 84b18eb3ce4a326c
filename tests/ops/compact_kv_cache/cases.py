"""Cases that test_kernels.py and test_paged.py share: the hostile values of one sequence (the
kernels' bounds tests) and the smallest call that moves one slot."""

import torch


def spoil(bad: int, what: dict, seqlens: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor) -> None:
    """Write a hostile case's bad value into sequence ``bad``, in place: ``what`` holds an
    ``index`` (position, value), a whole ``row`` of indices, a ``seqlen`` or a ``count``."""
    if "index" in what:
        indices[bad, what["index"][0]] = what["index"][1]
    if "row" in what:
        indices[bad] = torch.tensor(what["row"])
    if "seqlen" in what:
        seqlens[bad] = what["seqlen"]
    if "count" in what:
        counts[bad] = what["count"]


def one_slot_move(device) -> tuple:
    """(cache_seqlens, accepted_indices, num_accepted) on ``device``: one sequence of length 0
    that keeps its slot 1."""
    return torch.tensor([0], device=device), torch.tensor([[1]], device=device), torch.tensor([1], device=device)
