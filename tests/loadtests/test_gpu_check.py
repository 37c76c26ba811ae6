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
