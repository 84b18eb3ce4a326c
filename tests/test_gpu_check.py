"""scripts/gpu_check.sh before any device time is spent: its dry run (every step's command
exists, the limits add up to its budget under the 6-minute outer limit) and the compaction
driver that compute-sanitizer runs there, on the C++ CPU kernel."""

import os
import subprocess
import sys

from tests.utils import ROOT


def test_gpu_check_dry_run(tmp_path):
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.endswith(" ok") for line in lines if line.startswith("dry-run ")) == 7, proc.stdout
    assert "limits 320s of 360s, status 0" in lines[-1]


def test_sanitizer_driver_on_the_cpu_kernel():
    proc = subprocess.run(
        [sys.executable, "scripts/sanitizer_driver.py", "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("same bytes as the reference") == 8, proc.stdout
    assert "DIFFERS" not in proc.stdout
