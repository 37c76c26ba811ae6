"""Fixtures of the GPU tests (imported by each module: a conftest.py here would shadow the root
``conftest`` that other test modules import by name). Built on first use only, so nothing here
touches CUDA on a CPU machine, where every GPU test module is skipped."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """Where ONNX exports go: gpu-check's own cache when it runs these tests, else a temp dir."""
    from loadtests.gpu_check import CACHE_ENV

    return os.environ.get(CACHE_ENV) or str(tmp_path_factory.mktemp("gpu-cache"))


@pytest.fixture(scope="session")
def heldout_set():
    from loadtests.gpu_check import heldout

    return heldout()


@pytest.fixture(scope="session")
def cpu_reference(heldout_set):
    """fp32 PyTorch on the CPU: the reference every GPU backend and precision is compared with."""
    from loadtests.gpu_check import DIGITS, run_fixed, torch_backend

    return run_fixed(torch_backend(DIGITS, precision="fp32", device="cpu"), heldout_set[0])


@pytest.fixture(scope="session")
def midsize():
    """A random 224x224 Soft MoE S/16 (128 experts) on the GPU in the auto precision."""
    from loadtests.gpu_check import midsize_model

    return midsize_model()
