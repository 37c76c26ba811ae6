"""The GPU check's and GPU bench's own code, run on the CPU with a tiny model, so it cannot rot
between the rare days a GPU is lent: the CUDA-only parts (graphs, pinned buffers, the stream) are
not reached here, everything around them is. No timing is asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from loadtests import gpu_bench
from loadtests.gpu_check import uint8_equals_float32
from softmoe_models.package import load_model


def test_uint8_check_on_cpu(packages):
    images = np.random.default_rng(0).integers(0, 256, (11, 32, 32, 3)).astype(np.uint8)
    result = uint8_equals_float32(packages["golden"], images, device="cpu", precision="fp32")
    assert result == {"bitwise": True, "images": 11}


def test_compare_on_cpu_reports_every_ratio(packages):
    model = load_model(packages["golden"])
    lines = []
    out = gpu_bench.compare({"softmoe": model, "vit": model}, "fp32", 2, window=0.01, rounds=1, log=lines.append,
                            device="cpu", size=32)
    for key in ("gpu_softmoe_vs_vit", "gpu_graph_speedup_softmoe", "gpu_pinned_speedup_softmoe",
                "gpu_uint8_speedup_softmoe"):
        v = out[f"{key}_b2"]
        assert isinstance(v, float) and math.isfinite(v) and v > 0, (key, v)
    assert out["gpu_img_per_s_softmoe_graph_uint8_b2"] > 0
    assert len(lines) == 1 and "softmoe_graph_uint8" in lines[0]


def test_gpu_check_dry_run_on_cpu():
    """`make gpu-check`'s own code end to end on the CPU (SOFTMOE_GPU_CHECK_DEVICE=cpu): every
    section but the timings (smoked above) runs, the JSON line comes out, every check that ran
    passed. The CUDA-only paths inside the backends are not reached; the JSON says it is a dry run."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "SOFTMOE_GPU_CHECK_DEVICE": "cpu"}
    r = subprocess.run([sys.executable, "-m", "loadtests.gpu_check", "--skip", "timings"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["gpu_check"] == "passed" and result["failed"] == [] and "dry_run" in result
    torch_rows = [row for row in result["parity"] if row["backend"] == "torch"]
    assert [row["precision"] for row in torch_rows] == ["fp32", "fp16", "bf16"]
    assert all(row["ok"] and row["top1_agreement"] >= 0.999 for row in torch_rows), torch_rows
    for key in ("slot_invariance_softmoe_s16_torch_cuda_graph", "cuda_graph_equals_eager", "pinned_equals_pageable",
                "uint8_transfer_equals_float32", "second_process_identical"):
        assert result["determinism"][key]["bitwise"] is True, key
    assert result["tests"]["rc"] == 0  # tests/gpu: collected and skipped without CUDA
    assert result["command"].startswith("SOFTMOE_GPU_CHECK_DEVICE=cpu python -m loadtests.gpu_check")
