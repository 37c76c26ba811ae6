"""Every GPU backend and precision against fp32 PyTorch on the CPU, on the digits model's held-out
images: top-1 agreement >= 99.9% and max error within the export tolerances; the device really
used; weights loaded straight onto it; LayerNorm and softmax in fp32 under fp16/bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loadtests.gpu_check import (
    BATCH, DIGITS, PRECISIONS, ort_backend, ort_cuda_available, parity, run_fixed, torch_backend,
)

from gpu_fixtures import cache_dir, cpu_reference, heldout_set, midsize  # noqa: F401 - fixtures
from helpers.dtypes import Dtypes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_torch_cuda_parity(precision, heldout_set, cpu_reference):
    backend = torch_backend(DIGITS, precision=precision)
    backend.warmup([BATCH])
    d = backend.describe()
    assert d["device"].startswith("cuda") and d["precision"] == precision, d
    assert all(p.is_cuda for p in backend.model.parameters())
    result = parity(run_fixed(backend, heldout_set[0]), cpu_reference, precision)
    assert result["ok"], result


@pytest.mark.parametrize("precision", PRECISIONS)
def test_onnxruntime_cuda_parity(precision, heldout_set, cpu_reference, cache_dir):
    if not ort_cuda_available():
        pytest.skip("onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
    try:
        backend = ort_backend(precision, cache_dir)
    except Exception as e:
        if precision == "bf16":  # partial bf16 kernel coverage in the CUDA EP; auto uses fp16 for ORT
            pytest.skip(f"onnxruntime CUDA cannot run the bf16 graph: {e}")
        raise
    backend.warmup([BATCH])
    d = backend.describe()
    assert d["device"] == "cuda:0" and d["precision"] == precision, d
    assert all(p[0] == "CUDAExecutionProvider" for p in d["providers"].values()), d
    result = parity(run_fixed(backend, heldout_set[0]), cpu_reference, precision)
    assert result["ok"], result



def test_auto_precision_and_fp32_norms_on_cuda():
    backend = torch_backend(DIGITS, cuda_graphs=False)  # eager: a replayed graph calls no Python
    assert backend.precision == ("bf16" if torch.cuda.get_device_capability()[0] >= 8 else "fp16")
    with Dtypes() as mode:
        backend.run("classify", {"pixel_values": np.zeros((BATCH, 3, 8, 8), np.float32)})
    assert {n for n, _ in mode.seen} >= {"layer_norm", "softmax", "rsqrt"}
    assert all(dt == torch.float32 for _, dt in mode.seen), mode.seen


def test_weights_go_straight_to_the_device():
    from softmoe_models.package import load_model

    on_gpu = load_model(DIGITS, device="cuda", dtype=torch.bfloat16).state_dict()
    host = load_model(DIGITS, dtype=torch.bfloat16).state_dict()
    assert on_gpu.keys() == host.keys()
    for k, v in on_gpu.items():
        assert v.is_cuda and v.dtype == host[k].dtype and torch.equal(v.cpu(), host[k]), k
