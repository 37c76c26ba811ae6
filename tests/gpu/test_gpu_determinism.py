"""Bitwise determinism on the GPU at the server's fixed batch shape: the same image at every slot
among different batch-mates (torch eager, torch CUDA graph, ONNX Runtime CUDA), the same bytes
from a second process, CUDA graph replay == eager, pinned == pageable, uint8 transfer == float32;
sticky CUDA errors are fatal, out-of-memory is not."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from loadtests.gpu_check import (
    BATCH, DIGITS, ROOT, digest_in_subprocess, midsize_inputs, ort_backend, ort_cuda_available, outputs_equal, run_fixed,
    second_process_digest, slot_invariance, torch_backend, uint8_equals_float32,
)

from gpu_fixtures import cache_dir, cpu_reference, heldout_set, midsize  # noqa: F401 - fixtures

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graph"])
def test_slot_invariance_torch_digits(graphs, heldout_set):
    backend = torch_backend(DIGITS, cuda_graphs=graphs)
    backend.warmup([BATCH])
    x = heldout_set[0]
    result = slot_invariance(backend, x[0], x[1:])
    assert result["bitwise"], result


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graph"])
def test_slot_invariance_torch_softmoe_s16(graphs, midsize):
    backend = torch_backend(midsize, cuda_graphs=graphs)
    backend.warmup([BATCH])
    x = midsize_inputs(24)
    result = slot_invariance(backend, x[0], x[1:])
    assert result["bitwise"], result


@pytest.mark.parametrize("graph", [False, True], ids=["plain", "cuda_graph"])
def test_slot_invariance_onnxruntime_cuda(graph, heldout_set, cache_dir):
    if not ort_cuda_available():
        pytest.skip("onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
    backend = ort_backend("fp32", cache_dir, cuda_graph=graph)
    backend.warmup([BATCH])
    x = heldout_set[0]
    result = slot_invariance(backend, x[0], x[1:])
    assert result["bitwise"], result


def test_cuda_graph_equals_eager(midsize):
    x = midsize_inputs(20)  # three calls, the last one padded
    graph = torch_backend(midsize)
    graph.warmup([BATCH])
    eager = torch_backend(midsize, cuda_graphs=False)
    assert outputs_equal(run_fixed(graph, x), run_fixed(eager, x))
    assert graph._cuda.captured_sizes("classify") == [BATCH]


def test_one_graph_per_warmed_shape_and_smaller_batches_padded(midsize):
    backend = torch_backend(midsize)
    backend.warmup([1, BATCH])
    assert backend._cuda.captured_sizes("classify") == [1, BATCH]
    x = midsize_inputs(3)
    three = backend.run("classify", {"pixel_values": x})
    padded = np.zeros((BATCH, *x.shape[1:]), np.float32)
    padded[:3] = x
    full = backend.run("classify", {"pixel_values": padded})
    assert backend._cuda.captured_sizes("classify") == [1, BATCH]  # nothing captured on the request path
    assert all(three[k].tobytes() == full[k][:3].tobytes() for k in full)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graph"])
def test_uint8_transfer_equals_float32(graphs, midsize):
    images = np.random.default_rng(4).integers(0, 256, (12, 224, 224, 3)).astype(np.uint8)
    assert uint8_equals_float32(midsize, images, cuda_graphs=graphs)["bitwise"]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graph"])
def test_pinned_equals_pageable(graphs, midsize):
    x = midsize_inputs(12)
    pinned = torch_backend(midsize, cuda_graphs=graphs, pinned_staging=True)
    pageable = torch_backend(midsize, cuda_graphs=graphs, pinned_staging=False)
    for b in (pinned, pageable):
        b.warmup([BATCH])
    assert outputs_equal(run_fixed(pinned, x), run_fixed(pageable, x))


def test_second_process_gives_the_same_bytes():
    assert second_process_digest() == digest_in_subprocess()


STICKY = """
import dataclasses, numpy as np, torch
from loadtests.gpu_check import DIGITS, torch_backend
from server.batching.batcher import FatalBackendError
backend = torch_backend(DIGITS, cuda_graphs=False)
def out_of_bounds(x):
    v = x.flatten()[torch.full((1,), 10**9, device=x.device, dtype=torch.long)]
    return v, v
backend._modules["classify"] = dataclasses.replace(backend._modules["classify"], module=out_of_bounds)
try:
    backend.run("classify", {"pixel_values": np.zeros((8, 3, 8, 8), np.float32)})
except FatalBackendError as e:
    print("FATAL", e)
"""


def test_device_side_assert_is_fatal():
    # A device-side assert poisons the CUDA context for the rest of the process: own process.
    r = subprocess.run([sys.executable, "-c", STICKY], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "FATAL CUDA context unusable" in r.stdout, (r.stdout, r.stderr[-2000:])


def test_out_of_memory_is_not_fatal_and_the_device_stays_usable():
    backend = torch_backend(DIGITS, cuda_graphs=False)
    graph = backend._modules["classify"]

    def huge(x):
        return torch.empty(1 << 50, device=x.device), x

    backend._modules["classify"] = dataclasses.replace(graph, module=huge)
    x = np.zeros((BATCH, 3, 8, 8), np.float32)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        backend.run("classify", {"pixel_values": x})
    backend._modules["classify"] = graph
    assert backend.run("classify", {"pixel_values": x})["logits"].shape == (BATCH, 10)
