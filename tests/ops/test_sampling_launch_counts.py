"""Triton launches per call of the sampling ops (issue 54: "sampling in at most 2 launches"):
``sampling_probs`` with temperature, top-k and top-p, and ``tree_rejection_sample``, counted by
recording each kernel module's launches (``tests/ops/launches.py``), on vocabularies cut into
several tiles and chunks, so that no count grows with the passes, tiles or chunks; the
results are checked against the references, so the counted calls did the whole work."""

from functools import partial
from unittest import mock

import pytest
import torch

from specdec_kernels.ops import sampling_probs as sampling_op
from specdec_kernels.ops import tree_rejection_sample as tree_op
from specdec_kernels.reference.sampling_probs import sampling_probs as reference_sampling_probs
from specdec_kernels.reference.tree_rejection_sample import tree_rejection_sample as reference_tree
from tests.ops.launches import recorded_launches
from tests.ops.sampling import random_probs
from tests.utils import TOLERANCES, assert_same, gen, requires_triton

pytestmark = requires_triton("sampling_probs")

MAX_SAMPLING_PROBS_LAUNCHES = 2
MAX_TREE_REJECTION_SAMPLE_LAUNCHES = 2


@pytest.mark.parametrize("tiling", [None, (2, 16, 5)], ids=["default", "BB2-BV16-S5"])
@pytest.mark.parametrize(
    "setting",
    [dict(temperature=0.7, top_k=9, top_p=0.8), dict(temperature=1.3, top_k=40, top_p=0.95), dict(temperature=0.6)],
    ids=["topk9-topp0.8", "topk40-topp0.95", "temperature"],
)
def test_sampling_probs_launches(device, setting, tiling):
    from specdec_kernels.ops._triton import sampling_probs as kernels

    config = kernels.launch_config
    if tiling is not None:
        block_b, block_v, splits = tiling
        config = partial(kernels.launch_config, tile=(block_b, block_v), num_splits=splits)
    logits = torch.randn(3, 2, 111, generator=gen(4)) * 3
    with mock.patch.object(kernels, "launch_config", config), recorded_launches(kernels) as launches:
        got = sampling_op.sampling_probs(logits.to(device), backend="triton", **setting).cpu()
    want = reference_sampling_probs(logits, **setting)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])
    assert 1 <= len(launches) <= MAX_SAMPLING_PROBS_LAUNCHES, [x.kernel for x in launches]
    if tiling is not None:  # the write is cut into the chunks; the search reads whole rows
        assert max(x.grid[-1] for x in launches) > 1


def tree_case(B, N, V, sampled, seed):
    g = gen(seed)
    target = random_probs((B, N, V), g)
    parents = torch.tensor([-1] + [0] * (N // 2) + list(range(1, N - N // 2)))  # a bushy root, then a chain
    draft = random_probs((B, N, V), g) if sampled else None
    tokens = torch.randint(0, V, (B, N), generator=g)
    return dict(
        target_probs=target,
        tree_tokens=tokens,
        tree_parents=parents,
        draft_probs=draft,
        num_nodes=torch.full((B,), N),
        uniform_samples=torch.rand(B, N - 1, generator=g) ** 0.2,  # high coins: many rejections
        sample_uniforms=torch.rand(B, generator=g),
    )


@pytest.mark.parametrize("tiling", [None, (2, 16, 3)], ids=["default", "BB2-BV16-S3"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_children", "deterministic_children"])
def test_tree_rejection_sample_launches(device, sampled, tiling):
    from specdec_kernels.ops._triton import tree_rejection_sample as kernels

    config = kernels.launch_config
    if tiling is not None:
        block_b, block_v, splits = tiling
        config = partial(kernels.launch_config, tile=(block_b, block_v), num_splits=splits)
    case = tree_case(4, 9, 61, sampled, seed=5)
    on = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    randoms = ("uniform_samples", "sample_uniforms")
    args = [on[k] for k in ("target_probs", "tree_tokens", "tree_parents", "draft_probs", "num_nodes")]
    with mock.patch.object(kernels, "launch_config", config), recorded_launches(kernels) as launches:
        got = tree_op.tree_rejection_sample(*args, backend="triton", **{r: on[r] for r in randoms})
    want = reference_tree(
        *[case[k] for k in ("target_probs", "tree_tokens", "tree_parents", "draft_probs", "num_nodes")],
        **{r: case[r] for r in randoms},
    )
    assert_same(tuple(t.cpu() for t in got), want)
    assert (want[1][:, 1] != 1).any()  # some sequence rejected the root's first child (a residual update)
    assert 1 <= len(launches) <= MAX_TREE_REJECTION_SAMPLE_LAUNCHES, [x.kernel for x in launches]


def test_a_tree_of_the_root_alone_is_one_launch(device):
    from specdec_kernels.ops._triton import tree_rejection_sample as kernels

    case = tree_case(2, 1, 30, True, seed=6)
    with recorded_launches(kernels) as launches:
        tree_op.tree_rejection_sample(
            case["target_probs"].to(device),
            case["tree_tokens"].to(device),
            torch.tensor([-1], device=device),
            uniform_samples=torch.zeros(2, 0, device=device),
            sample_uniforms=case["sample_uniforms"].to(device),
            backend="triton",
        )
    assert [x.kernel for x in launches] == ["_tree_sample_kernel"]
