"""The C++ verification and sampling kernels round every multiply on its own, as the reference's
PyTorch ops do, even where the compiler targets a CPU with FMA (aarch64, x86 with -mfma or
-march=native): built for x86 with FMA, csrc/verify_sample_cpu.cpp has no fused multiply-add.
Without its fp-contract pragma GCC contracts `r * inv - q` there (84 FMAs with GCC 12)."""

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from tests.utils import ROOT

CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")

# compiles a C++ file: run apart from the parallel test workers (scripts/run_tests.sh)
pytestmark = [
    pytest.mark.serial,
    pytest.mark.skipif(
        CXX is None or os.uname().machine != "x86_64",
        reason="needs a C++ compiler for x86-64 (the check reads x86 FMA mnemonics)",
    ),
]

FMA = re.compile(r"^\s*v?f(n)?m(add|sub)\w*\s", re.MULTILINE)  # vfmadd231sd, vfnmsub..., vfmsubpd


def _assembly(tmp_path, source: Path, drop_pragma: bool) -> str:
    from torch.utils.cpp_extension import include_paths

    text = source.read_text()
    if drop_pragma:
        text = re.sub(r"^#pragma (GCC optimize|clang fp contract).*$", "", text, flags=re.MULTILINE)
    src = tmp_path / source.name
    src.write_text(text)
    out = tmp_path / (source.stem + ".s")
    cmd = [
        CXX,
        "-O3",
        "-std=c++17",
        "-fopenmp",
        "-mavx2",
        "-mfma",
        "-S",
        str(src),
        "-o",
        str(out),
        f"-I{ROOT / 'csrc'}",
        f"-I{sysconfig.get_paths()['include']}",
        "-DTORCH_EXTENSION_NAME=_C",
        *[f"-I{p}" for p in include_paths()],
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out.read_text()


def test_verify_sample_cpu_has_no_fused_multiply_add_when_built_with_fma(tmp_path):
    asm = _assembly(tmp_path, ROOT / "csrc" / "verify_sample_cpu.cpp", drop_pragma=False)
    found = FMA.findall(asm)
    assert not found, f"{len(found)} fused multiply-adds in verify_sample_cpu.cpp built with -mfma"
    # the same file without its pragma: the compiler does contract, and the check sees it
    (tmp_path / "bare").mkdir()
    assert FMA.findall(_assembly(tmp_path / "bare", ROOT / "csrc" / "verify_sample_cpu.cpp", drop_pragma=True))
