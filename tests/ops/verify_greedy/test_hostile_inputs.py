"""verify_greedy: hostile inputs with value checks off (validate=False, the CUDA default); the
guard buffers and the rule they check are described in tests/ops/hostile.py."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import reference
from tests.ops.hostile import COUNTS, in_guard
from tests.utils import gen, runnable_backends


@pytest.mark.parametrize("backend", runnable_backends("verify_greedy", "cpu"))
def test_verify_greedy_hostile_counts(backend):
    B, K, V = 3, 4, 10
    logits = torch.randn(B, K + 1, V, generator=gen(2))
    drafts = logits[:, :K].argmax(-1)
    for count in COUNTS:
        n = torch.tensor([count, 1, K])
        want = reference.verify_greedy(logits, drafts, n.clamp(0, K))
        got = sk.verify_greedy(
            in_guard(logits, float("nan")), in_guard(drafts, 3), in_guard(n, 2**40), backend=backend, validate=False
        )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), count


def test_fake_kernels_raise_the_eager_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    logits, drafts = torch.randn(2, 3, 5), torch.zeros(2, 2, dtype=torch.long)
    with FakeTensorMode() as mode:
        fl, fd = mode.from_tensor(logits), mode.from_tensor(drafts)
        with pytest.raises(TypeError, match="draft_tokens"):
            torch.ops.specdec.verify_greedy(fl, fd.float())
        with pytest.raises(ValueError, match="backend"):
            torch.ops.specdec.verify_greedy(fl, fd, None, "bogus")
        with pytest.raises(ValueError, match="draft_tokens"):
            torch.ops.specdec.verify_greedy(fl, fd[:, :1])
