"""ONNX Runtime sessions configured the same way for verification, benchmarks and serving."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import MissingExtraError


def ort_session(path: str | Path, threads: int | None = None, providers: list[str] | None = None):
    """An InferenceSession with full graph optimisation, pinned threads and no spinning.

    Args:
        path: the .onnx file (external data is found next to it).
        threads: intra-op threads (default: the CPUs this process may use).
        providers: execution providers (default: CPU).
    """
    try:
        import onnxruntime as ort
    except ImportError:
        raise MissingExtraError(
            "onnxruntime is not installed: pip install 'softmoe-serve[cpu]' (or '[gpu]' for onnxruntime-gpu)"
        ) from None
    opts = session_options(threads)
    return ort.InferenceSession(str(path), sess_options=opts, providers=providers or ["CPUExecutionProvider"])


def session_options(threads: int | None = None):
    """The SessionOptions every session here uses: full graph optimisation, a fixed intra-op
    thread count (the CPUs this process may use by default), one inter-op thread, sequential
    execution, no spinning, warnings off."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads or max(1, len(os.sched_getaffinity(0)))
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return opts
