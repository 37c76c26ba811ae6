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


def test_make_gpu_check_without_cuda_exits_77_with_one_line(tmp_path):
    """The command users run: GNU make's own status would be 2; the loaded exit_status plugin gives 77."""
    import shutil

    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.skip("needs GNU make and a C compiler (without one, make exits 2 reporting Error 77)")
    r = subprocess.run(["make", "--no-print-directory", "gpu-check", f"GPU_PY={sys.executable}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 77, (r.returncode, lines)
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device"), lines
