"""`make gpu-check` on a machine without CUDA: one line, exit status 77, nothing installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu-check would run for real")


@pytest.mark.parametrize("extra", [[], ["--wheels", "/nonexistent-wheel-dir"]])
def test_gpu_check_without_cuda_says_so_and_exits_77(extra):
    r = subprocess.run([sys.executable, "-m", "loadtests.gpu_check", *extra], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 77, (r.returncode, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith("gpu-check: no CUDA device") and lines[0].endswith("nothing to check")


def test_make_gpu_check_without_cuda_reports_the_checks_line():
    """The command users run: the check's one line, then make's own report of its status 77; the
    Makefile loads nothing into make (no plugin, no compiler)."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("needs GNU make")
    assert not any(line.split()[:1] in (["load"], ["-load"], ["sload"]) for line in (ROOT / "Makefile").read_text().splitlines())
    r = subprocess.run(["make", "--no-print-directory", "gpu-check", f"GPU_PY={sys.executable}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
    assert r.stdout.splitlines()[:1] and r.stdout.splitlines()[0].startswith("gpu-check: no CUDA device"), r.stdout
    assert r.returncode == 2 and "Error 77" in r.stderr, (r.returncode, r.stderr)
