"""ONNX Runtime sessions configured the same way for verification, benchmarks and serving."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import MissingExtraError


SPIN_POLICIES = ("off", "run")


def ort_session(path: str | Path, threads: int | None = None, providers: list[str] | None = None,
                spin: str = "off"):
    """An InferenceSession with full graph optimisation, pinned threads and the given spin policy.

    Args:
        path: the .onnx file (external data is found next to it).
        threads: intra-op threads (default: the CPUs this process may use).
        providers: execution providers (default: CPU).
        spin: ``off`` (default), or ``run``: see ``session_options``.
    """
    try:
        import onnxruntime as ort
    except ImportError:
        raise MissingExtraError(
            "onnxruntime is not installed: pip install 'softmoe-serve[cpu]' (or '[gpu]' for onnxruntime-gpu)"
        ) from None
    opts = session_options(threads, spin=spin)
    return ort.InferenceSession(str(path), sess_options=opts, providers=providers or ["CPUExecutionProvider"])


def session_options(threads: int | None = None, spin: str = "off"):
    """The SessionOptions every session here uses: full graph optimisation, a fixed intra-op
    thread count (the CPUs this process may use by default), one inter-op thread, sequential
    execution, warnings off, and one of two spin policies for the intra-op threads:

    - ``off``: a worker with nothing to do sleeps at once. Verification and the benchmarks of
      forms use it, so that sessions side by side do not take each other's cores.
    - ``run``: workers spin between the parallel steps of one ``run`` and stop spinning when it
      returns (``session.force_spinning_stop``), so an idle server still sleeps. A Soft MoE layer
      is hundreds of small per-expert MatMuls, each a parallel step whose worker would otherwise
      be woken from sleep, so a call runs faster at every batch size (loadtests/spin_bench.py
      measures it; docs/benchmarks.md has the figures). Outputs are bitwise those of ``off``: the
      work is split the same.
    """
    import onnxruntime as ort

    if spin not in SPIN_POLICIES:
        raise ValueError(f"unknown spin policy {spin!r}: use one of {', '.join(SPIN_POLICIES)}")

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads or max(1, len(os.sched_getaffinity(0)))
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin == "run" else "0")
    if spin == "run":
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    opts.log_severity_level = 3
    return opts
