"""What the tests of the draft heads (EAGLE, Medusa) and of the drafters built on them (ensemble,
lookahead) share: the tiny model as our Transformer alone, its hidden size, the prompts they
decode, the prompts the heads are trained on, and the target's hidden states they read."""

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


def final_hidden(model, ids, layers=()):
    """(T, hidden): the target's final hidden state (after its final norm) of every position of
    ``ids``, one teacher-forced prefill pass; with ``layers`` (T, (1 + k) hidden), those
    layers' outputs appended (EAGLE-3's features)."""
    T = len(ids)
    with torch.inference_mode():
        _, h = model(
            torch.tensor([ids]),
            torch.arange(T)[None],
            model.new_kv_cache(1, T),
            torch.zeros(1, dtype=torch.int32),
            return_hidden=True,
            hidden_layers=layers,
        )
    return h[0]


def committed(drafter, model, histories, layers=(), sampling=None):
    """Start a drafter with a context window on ``histories`` and hand it each sequence's
    committed features (teacher forcing: the last ``context_window`` positions before its root),
    as the engine does after a prefill (the started ``observe`` of a run with ``sampling``,
    greedy by default; ``drafter.run`` is then the run for its requests); returns each sequence's features of every position
    (``final_hidden`` with ``layers``)."""
    from tests.engine import drive

    feats = [final_hidden(model, h, layers) for h in histories]
    firsts = [max(0, len(h) - 1 - drafter.context_window) for h in histories]
    context = [f[first : len(h) - 1] for f, first, h in zip(feats, firsts, histories)]
    # the last hidden state (the root's predecessor; a one-token history has none: zeros)
    last = torch.stack([f[len(h) - 2] if len(h) >= 2 else torch.zeros_like(f[0]) for f, h in zip(feats, histories)])
    drive.start(drafter, histories, sampling, features=drive.features(last, [True] * len(histories), context, firsts))
    return feats
