"""Failure classes: every exception a backend raises is one of three kinds.

- ``transient``: the same input may succeed later (out of device or host memory, a timeout).
  The batch's requests get 503 with Retry-After; nothing is retried in the server (an OOM at the
  padded shape would only OOM again per item).
- ``deterministic``: this input (or this batch) fails every time (a shape or type error, an
  invalid argument, a numerical check). The batch is bisected at the same shape to find the
  failing item(s); only those get 500, their batch-mates are answered normally.
- ``fatal``: the device is unusable (a sticky CUDA error poisons the context until the process
  exits; the device fell off the bus). The worker stops, every waiting item gets 503, and
  liveness and readiness fail so the orchestrator replaces the pod.

Backends raise their real exception types; this table maps them by type first and by the
messages CUDA, cuBLAS/cuDNN and ONNX Runtime print second (ORT raises the same pybind types,
``Fail`` / ``RuntimeException``, for a bad input and for a dead device).
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["transient", "deterministic", "fatal"]


class FatalBackendError(RuntimeError):
    """The device is unusable (the process must be restarted)."""

# Messages of errors that leave the CUDA context unusable (CUDA runtime error names and texts).
FATAL_MARKERS = (
    "illegal memory access", "illegal instruction", "misaligned address", "device-side assert",
    "unspecified launch failure", "launch timed out", "uncorrectable ecc", "ecc error",
    "device has fallen off the bus", "gpu is lost", "cuda_error_illegal_address", "cudaerrorillegaladdress",
    "cuda_error_launch_failed", "cudaerrorlaunchfailure", "hardware stack error", "nvlink uncorrectable",
    "cuda driver version is insufficient", "cuda error: unknown error", "cudnn_status_execution_failed",
    "cublas_status_execution_failed", "cuda failure 700", "cuda failure 719", "cuda error 700", "cuda error 719",
)
# Messages of resource exhaustion: the same input may well succeed later.
TRANSIENT_MARKERS = (
    "out of memory", "failed to allocate memory", "bad_alloc", "cudnn_status_alloc_failed",
    "cublas_status_alloc_failed", "cuda_error_out_of_memory", "resource exhausted", "timed out waiting",
)


def classify(exc: BaseException) -> Kind:
    """The failure class of an exception raised while running a batch."""
    if isinstance(exc, FatalBackendError):
        return "fatal"
    if isinstance(exc, (MemoryError, TimeoutError)):
        return "transient"
    name = type(exc).__name__
    if name in ("OutOfMemoryError",):  # torch.cuda.OutOfMemoryError (also importable on CPU builds)
        return "transient"
    text = f"{name}: {exc}".lower()
    if any(m in text for m in FATAL_MARKERS):
        return "fatal"
    if any(m in text for m in TRANSIENT_MARKERS):
        return "transient"
    return "deterministic"
