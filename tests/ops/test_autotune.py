"""specdec_kernels.autotune.RuntimeChoice: the faster candidate per shape class, measured
on real calls; forced by its environment variable; the default under tracing."""

from __future__ import annotations

import time

import pytest
import torch

from specdec_kernels.autotune import RuntimeChoice


def runner(delays, calls):
    def run(name):
        calls.append(name)
        time.sleep(delays[name])
        return name.upper()

    return run


def test_measures_alternately_then_keeps_the_faster():
    calls = []
    choice = RuntimeChoice("t", ("slow", "fast"), trials=3)
    run = runner({"slow": 0.02, "fast": 0.0}, calls)
    results = [choice("k", run) for _ in range(10)]
    assert results == [c.upper() for c in calls]  # every call does the real work
    assert calls[:6] == ["slow", "fast"] * 3  # alternating while measuring
    assert calls[6:] == ["fast"] * 4
    (row,) = choice.choices()
    assert row["choice"] == "fast" and row["slow_ms"] > row["fast_ms"]


def test_shape_classes_are_separate():
    calls = []
    choice = RuntimeChoice("t", ("a", "b"), trials=1)
    choice("small", runner({"a": 0.0, "b": 0.02}, calls))
    choice("small", runner({"a": 0.0, "b": 0.02}, calls))
    choice("big", runner({"a": 0.02, "b": 0.0}, calls))
    choice("big", runner({"a": 0.02, "b": 0.0}, calls))
    assert {r["key"]: r["choice"] for r in choice.choices()} == {"'small'": "a", "'big'": "b"}


def test_environment_forces_and_is_checked(monkeypatch):
    calls = []
    choice = RuntimeChoice("t", ("a", "b"), env="SPECDEC_TEST_CHOICE")
    monkeypatch.setenv("SPECDEC_TEST_CHOICE", "b")
    choice.read_environment()  # read at construction and on reset_backends()
    for _ in range(4):
        choice("k", runner({"a": 0.0, "b": 0.0}, calls))
    assert calls == ["b"] * 4 and choice.choices() == []
    monkeypatch.setenv("SPECDEC_TEST_CHOICE", "c")
    choice.read_environment()
    with pytest.raises(ValueError, match="SPECDEC_TEST_CHOICE"):
        choice("k", runner({"a": 0.0, "b": 0.0}, calls))


def test_default_under_a_dispatch_mode_and_available_subset():
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = []
    choice = RuntimeChoice("t", ("a", "b"), trials=1)
    with FakeTensorMode():
        choice("k", runner({"a": 0.0, "b": 0.0}, calls))
    assert calls == ["a"] and choice.choices() == []
    choice("k", runner({"a": 0.0, "b": 0.0}, calls), available=("b",))
    assert calls == ["a", "b"]


def test_paged_attention_cpu_path_is_fixed_and_matches_the_reference():
    """The automatic CPU backend of the paged op gives the reference's result, through the C++
    kernel on every call: its RuntimeChoice serves only its environment variable, nothing is
    measured."""
    import specdec_kernels as sk
    from specdec_kernels import _native, reference
    from specdec_kernels.ops.tree_attention import PAGED_CPU_CHOICE

    if not _native.has_kernel("paged_tree_attention", "cpu"):
        pytest.skip("the extension has no CPU paged attention kernel")
    g = torch.Generator().manual_seed(3)
    k = torch.randn(9, 4, 2, 16, generator=g)
    v = torch.randn(9, 4, 2, 16, generator=g)
    table = torch.tensor([[3, 1, 8], [0, 5, 2]], dtype=torch.int32)
    lens = torch.tensor([6, 2], dtype=torch.int32)
    q = torch.randn(2, 3, 4, 16, generator=g)
    want = reference.tree_attention(q, k, v, lens, block_table=table)
    by_native = sk.tree_attention(q, k, v, lens, block_table=table, backend="native")
    torch.testing.assert_close(by_native, want, atol=1e-5, rtol=1e-5)
    PAGED_CPU_CHOICE.reset()
    for _ in range(2 * PAGED_CPU_CHOICE.trials + 2):
        assert torch.equal(sk.tree_attention(q, k, v, lens, block_table=table), by_native)
    assert PAGED_CPU_CHOICE.choices() == []
