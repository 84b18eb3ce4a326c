"""``python -m specdec_kernels.bench.kernels --static``: every launcher configuration compiles for sm_80 and
sm_90 with no register spills (no GPU needed), and the occupancy arithmetic is right."""

import json
import os
import subprocess
import sys

import pytest

from specdec_kernels.bench import static
from tests.utils import ROOT

# compiles every kernel configuration in worker processes: run apart from the parallel test workers (scripts/run_tests.sh)
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("static")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_kernels.bench.kernels", "--static", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "static.jsonl")]
    return rows, proc.stdout


def test_every_configuration_compiles_for_both_architectures(report):
    rows, _ = report
    assert rows and not [r for r in rows if "error" in r]
    by_kernel = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], set()).add(r["arch"])
    assert all(a == {80, 90} for a in by_kernel.values())
    # every Triton kernel function of the package appears in some launcher configuration
    functions = {r["function"] for r in rows}
    assert functions >= {
        "_argmax_partials_kernel",
        "_verify_greedy_accept_kernel",
        "_verify_tree_greedy_walk_kernel",
        "_rejection_partials_kernel",
        "_rejection_sample_kernel",
        "_sampling_search_kernel",
        "_sampling_write_kernel",
        "_tree_mass_kernel",
        "_tree_sample_kernel",
        "_tree_attention_fwd_kernel",
        "_tree_attention_combine_kernel",
    }


def test_no_default_configuration_spills_registers(report):
    rows, _ = report
    spills = [
        f"{r['kernel']} sm_{r['arch']}: {r['registers']} registers, {r['spill_stores']} B spill stores, "
        f"{r['spill_loads']} B spill loads"
        for r in rows
        if r["spill_stores"] or r["spill_loads"]
    ]
    assert not spills, "\n".join(spills)


def test_verification_and_sampling_kernels_have_no_fused_multiply_add(report):
    """Their float64 arithmetic must round as the reference's separate PyTorch ops do; only
    tree attention (compared within a tolerance) may fuse."""
    rows, _ = report
    fused = [
        f"{r['kernel']} sm_{r['arch']}: {r['fp_contractions']}"
        for r in rows
        if r["fp_contractions"] and not r["function"].startswith("_tree_attention")
    ]
    assert not fused, "\n".join(fused)
    # the detector sees the contractions that tree attention's dots and rescaling do have
    assert any(r["fp_contractions"] for r in rows if r["function"].startswith("_tree_attention"))


def test_fp_contractions_golden_ptx():
    ptx = """
    mul.f64 %fd3, %fd1, %fd2;
    sub.f64 %fd4, %fd3, %fd5;
    mul.rn.f64 %fd6, %fd1, %fd2;
    sub.f64 %fd7, %fd6, %fd5;
    mul.f32 %f3, %f1, %f2;
    setp.lt.f32 %p1, %f3, %f4;
    @%p1 fma.rn.f32 %f5, %f1, %f2, %f4;
    mul.f64 %fd8, %fd1, %fd2;
    add.f32 %f9, %f1, %f2;
    add.rn.f64 %fd9, %fd5, %fd8;
    mul.ftz.f32 %f10, %f1, %f2;
    add.ftz.f32 %f11, %f10, %f4;
    """
    # the unrounded mul feeding a sub (1), the predicated fma (1), the mul feeding add.rn (1,
    # counted to be safe), the ftz pair (1); not: mul.rn, a mul feeding a compare, an f32 add
    # of other registers
    assert static.fp_contractions(ptx) == 4
    assert static.fp_contractions("mul.rn.f64 %fd1, %fd2, %fd3;\nsub.f64 %fd4, %fd1, %fd5;") == 0


def test_report_fields_are_consistent(report):
    rows, stdout = report
    for r in rows:
        assert 1 <= r["registers"] <= 255 and r["warps"] in (1, 2, 4, 8, 16)
        assert 1 <= r["blocks_per_sm"] <= 32 and r["warps_per_sm"] == r["blocks_per_sm"] * r["warps"]
        assert 0 < r["occupancy"] <= 1 and r["limiter"] in ("warps", "blocks", "registers", "shared memory")
    assert "occupancy" in stdout and "spill" in stdout  # the table's header


def test_occupancy_golden_cases():
    sm90, sm80 = static.ARCHS[90], static.ARCHS[80]
    # 128 registers x 32 threads = 4096 per warp: 16 warps fit, 4 blocks of 4 warps: 25%
    assert static.occupancy(128, 4, 0, sm90) == {
        "blocks_per_sm": 4,
        "warps_per_sm": 16,
        "occupancy": 0.25,
        "limiter": "registers",
    }
    # 32 registers: 64 warps by registers; 4-warp blocks hit the warp limit (16 blocks, 100%)
    assert static.occupancy(32, 4, 0, sm90)["occupancy"] == 1.0
    # 1-warp blocks: the 32-block limit caps at half the warps
    r = static.occupancy(16, 1, 0, sm90)
    assert r["blocks_per_sm"] == 32 and r["occupancy"] == 0.5 and r["limiter"] == "blocks"
    # 100 KiB of shared memory (+1 KiB reserved): 2 blocks on sm_90 (228 KiB), 1 on sm_80 (164 KiB)
    assert static.occupancy(32, 4, 100 * 1024, sm90)["blocks_per_sm"] == 2
    r = static.occupancy(32, 4, 100 * 1024, sm80)
    assert r["blocks_per_sm"] == 1 and r["limiter"] == "shared memory"
    # registers round up to 256 per warp: 33 registers take 1280 per warp, 51 warps, 12 blocks of 4
    assert static.occupancy(33, 4, 0, sm90)["blocks_per_sm"] == 12


def test_as_launched_specializes_like_the_jit():
    """Unit head-dim strides become constants and pointers carry divisibility 16, as Triton's
    JIT specializes a real launch."""
    from specdec_kernels.bench import aot_specs
    from specdec_kernels.ops._triton import tree_attention as ta

    spec = static.as_launched(
        aot_specs.tree_attention_fwd_spec("bf16", 64, ta.MASK_BOOL, aot_specs.tree_attention_config("bf16", 64))
    )
    assert spec["signature"]["stride_kd"] == "constexpr" and spec["constexprs"]["stride_kd"] == 1
    q_index = spec["kernel"].arg_names.index("Q")
    assert spec["attrs"][(q_index,)] == [["tt.divisibility", 16]]


def test_launcher_specs_are_the_launchers_configurations():
    """The report compiles what each launcher's ``launch_config`` chooses for the GPU it is
    given: here the chain sampler's tiles and chunk lanes, for two SM counts."""
    from specdec_kernels.ops._triton import rejection_sample as rs

    by_sms = {sms: {s["name"] for s in static.launcher_specs(sms)} for sms in (132, 16)}
    assert by_sms[132] == {s["name"] for s in static.launcher_specs()}  # the default target
    assert by_sms[16] != by_sms[132]
    for sms, names in by_sms.items():
        for V in static.VOCABS.values():
            for B in static.BATCHES:
                cfg = rs.launch_config(B, 15, V, sms)
                tiles, lanes = (
                    f"BLOCK_B={cfg.vocab.block_b} BLOCK_V={cfg.vocab.block_v}",
                    f"BLOCK_S={cfg.vocab.block_s}",
                )
                assert any(n.startswith("rejection_sample ") and tiles in n and n.endswith(lanes) for n in names), (
                    sms,
                    V,
                    B,
                )
