"""compact_kv_cache: hostile inputs with value checks off (validate=False, the CUDA default); the
guard buffers and the rule they check are described in tests/ops/hostile.py."""

import pytest
import torch

import specdec_kernels as sk
from tests.utils import runnable_backends


def test_compact_kv_cache_refuses_partly_overlapping_caches():
    base = torch.randn(1, 1, 24, 4)
    a, b = base[:, :, 0:16], base[:, :, 4:20]  # distinct starts, shared elements
    for backend in runnable_backends("compact_kv_cache", "cpu"):
        with pytest.raises(ValueError, match="aliases"):
            sk.compact_kv_cache([a, b], torch.tensor([0]), torch.tensor([[1]]), torch.tensor([1]), backend=backend)
    # disjoint views of one buffer are fine
    sk.compact_kv_cache(
        [base[:, :, 0:12], base[:, :, 12:24]], torch.tensor([0]), torch.tensor([[1]]), torch.tensor([1])
    )


def test_compact_kv_cache_refuses_a_cache_whose_rows_overlap():
    base = torch.randn(64)
    rows_overlap = torch.as_strided(base, (1, 1, 8, 4), (32, 32, 2, 1))  # row stride 2 < D = 4
    with pytest.raises(ValueError, match="overlaps itself"):
        sk.compact_kv_cache([rows_overlap], torch.tensor([0]), torch.tensor([[1]]), torch.tensor([1]))


def test_compact_kv_cache_reference_clamps_and_skips_like_native():
    """Negative lengths, counts past M and slots past S (validate=False): the reference skips
    what the native kernels skip (it used to write slots counted from the end)."""
    from tests.utils import runnable_backends as rb

    for lens, idx, n in (([-3], [[3, 4]], [2]), ([0], [[1, 2]], [5]), ([8], [[0, 1]], [2]), ([6], [[1, 5]], [2])):
        results = []
        for backend in rb("compact_kv_cache", "cpu"):
            cache = torch.arange(8.0).view(1, 1, 1, 8, 1).expand(1, 2, 1, 8, 1).reshape(1, 2, 1, 1, 8, 1).clone()
            sk.compact_kv_cache(
                cache, torch.tensor(lens), torch.tensor(idx), torch.tensor(n), backend=backend, validate=False
            )
            results.append(cache[0, 0, 0, 0, :, 0].tolist())
        assert all(r == results[0] for r in results), (lens, idx, n, results)
        if lens == [-3]:
            assert results[0] == list(range(8))  # nothing valid to move
