"""The GPU check's and GPU bench's own code, run on the CPU with a tiny model, so it cannot rot
between the rare days a GPU is lent: the CUDA-only parts (graphs, pinned buffers, the stream) are
not reached here, everything around them is. No timing is asserted."""

from __future__ import annotations

import math

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
