"""Small builders for driving a drafter by hand in tests (the ``propose(request)`` /
``observe(result)`` contract of ``specdec_kernels.decoding.draft``)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specdec_kernels.decoding.draft import DraftRequest, DraftRun, SamplingParams, StepResult, TargetFeatures


def run_for(
    histories, sampling: Optional[SamplingParams] = None, generators=None, capacity: int = 256, **kw
) -> DraftRun:
    """A ``DraftRun`` for ``histories`` (greedy by default); ``kw`` sets the other fields
    (coupling, cache_layout, target, target_kv_cache, stats)."""
    return DraftRun(capacity=capacity, sampling=sampling or SamplingParams(), generators=generators, **kw)


def start(
    d,
    histories,
    sampling: Optional[SamplingParams] = None,
    generators=None,
    capacity: int = 256,
    features: Optional[TargetFeatures] = None,
    run: Optional[DraftRun] = None,
    **kw,
) -> DraftRun:
    """Begin a run of drafter ``d`` (its started ``observe``) and return the run."""
    if run is None:
        run = run_for(histories, sampling, generators, capacity, **kw)
    d.observe(StepResult([list(h) for h in histories], [True] * len(histories), run, features=features))
    return run


def request(histories, ks, run: DraftRun, active: Optional[Sequence[bool]] = None) -> DraftRequest:
    """A ``DraftRequest``; ``ks`` is one int per sequence or a single int for all."""
    B = len(histories)
    if isinstance(ks, int):
        ks = [ks] * B
    return DraftRequest(histories, list(ks), list(active) if active is not None else [True] * B, run)


def step(
    histories,
    run: DraftRun,
    accepted_nodes=None,
    num_accepted=None,
    active=None,
    num_nodes=None,
    target_argmax=None,
    features: Optional[TargetFeatures] = None,
) -> StepResult:
    """A step's ``StepResult``; accepted_nodes (B, N), num_accepted (B,), num_nodes (B,) and
    target_argmax (B, N) may be given as lists (int64 tensors are made of them).  Without
    accepted_nodes, each sequence accepted the root alone; without num_accepted, it is counted
    from accepted_nodes."""
    B = len(histories)

    def tensor(x):
        return x if x is None or isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.int64)

    accepted_nodes, num_accepted, num_nodes, target_argmax = map(
        tensor, (accepted_nodes, num_accepted, num_nodes, target_argmax)
    )
    if accepted_nodes is None:
        accepted_nodes = torch.zeros(B, 1, dtype=torch.int64)
    if num_accepted is None:
        num_accepted = (accepted_nodes >= 0).sum(dim=1) - 1
    return StepResult(
        histories,
        list(active) if active is not None else [True] * B,
        run,
        accepted_nodes,
        num_accepted,
        num_nodes,
        target_argmax,
        features,
    )


def features(last: torch.Tensor, valid=None, context=None, context_positions=None) -> TargetFeatures:
    """``TargetFeatures`` with every row valid unless ``valid`` says otherwise."""
    return TargetFeatures(
        last, list(valid) if valid is not None else [True] * last.shape[0], context, context_positions
    )
