"""Cases shared by the tests of the greedy verifiers (verify_greedy, verify_tree_greedy)."""

import torch


def logits_with_argmax(argmax, vocab: int) -> torch.Tensor:
    """Logits [..., vocab] whose argmax is the given ids (a clear margin, no ties)."""
    ids = torch.tensor(argmax)
    logits = torch.randn(*ids.shape, vocab, generator=torch.Generator().manual_seed(0))
    return logits.scatter(-1, ids[..., None], 10.0)


def drafts_near_argmax(B: int, K: int, V: int, *, seed: int, wrong: float, shift: int):
    """Random logits [B, K + 1, V] and drafts [B, K] equal to the argmax of their row but for
    a fraction ``wrong`` moved by ``shift`` (mod V); and the generator, for further draws."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = logits.argmax(-1)[:, :K].clone()
    moved = torch.rand(B, K, generator=g) < wrong
    drafts[moved] = (drafts[moved] + shift) % V
    return logits, drafts, g
