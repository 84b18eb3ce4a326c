"""What the tests of the draft heads (EAGLE, Medusa) and of the drafters built on them (ensemble,
lookahead) share: the tiny model as our Transformer alone, its hidden size, the prompts they
decode and the prompts the heads are trained on."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.decoding import Transformer
from tests.engine.tiny import V, tiny_llama

HIDDEN = 64
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [64], [12, 99, 8, 12, 99, 8, 12, 99, 101, 4, 12], [3, 1]]


@pytest.fixture(scope="module")
def tiny():
    """Our Transformer of ``tiny_llama()`` (3 layers, hidden 64, H=4, Hkv=2, D=16, vocab 111)."""
    return Transformer.from_hf_model(tiny_llama())


def train_prompts():
    g = torch.Generator().manual_seed(3)
    return PROMPTS + [torch.randint(0, V, (6,), generator=g).tolist() for _ in range(12)]
