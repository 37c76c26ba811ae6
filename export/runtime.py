"""ONNX Runtime sessions configured the same way for verification, benchmarks and serving, and
the lower CPU priority of the work a serving process does beside its batches."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import MissingExtraError
from .weights_file import PackageWeights


SPIN_POLICIES = ("off", "run")


def ort_session(path: str | Path, threads: int | None = None, providers: list[str] | None = None,
                spin: str = "off", background: bool = False, weights: str | Path | None = None,
                checking: bool = False):
    """An InferenceSession with full graph optimisation, pinned threads and the given spin policy.

    Args:
        path: the .onnx file (external data is found next to it).
        threads: intra-op threads (default: the CPUs this process may use).
        providers: execution providers (default: CPU).
        spin: ``off`` (default), or ``run``: see ``session_options``.
        background: set the session up at the lowest CPU priority (``BackgroundBuiltSession``),
            for a process that loads a model while it serves others' batches.
        weights: the package's ``model.safetensors``, for a bound graph that reads its
            initializers from there (``export.weights_file``); its caller has checked its hash.
        checking: a session for a few runs that check a graph's numbers against PyTorch
            (``export.onnx.verify``), never for serving or start-up proofs: basic graph
            optimisation and no prepacked weights: set up in a fraction of a serving session's
            time, its outputs within float32 noise of it (docs/benchmarks.md, coldstart). The
            served session is proven and warmed on its own.
    """
    try:  # onnxruntime: an optional extra, imported only when a session is made
        import onnxruntime as ort
    except ImportError:
        raise MissingExtraError(
            "onnxruntime is not installed: pip install 'softmoe-serve[cpu]' (or '[gpu]' for onnxruntime-gpu)"
        ) from None
    opts = session_options(threads, spin=spin, parallel_prepack=not background)
    if checking:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.add_session_config_entry("session.disable_prepacking", "1")
    package = with_package_weights(opts, path, weights)
    if background:
        session = BackgroundBuiltSession(path, opts, providers or ["CPUExecutionProvider"])
    else:
        session = ort.InferenceSession(str(path), sess_options=opts, providers=providers or ["CPUExecutionProvider"])
    session.package_weights = package  # the memory the session reads its initializers from lives as long as it
    give_back_freed_memory()
    return session


def give_back_freed_memory() -> None:
    """Return the heap freed so far to the kernel. glibc keeps freed chunks below its mmap threshold
    in its arenas: ONNX Runtime copies the initializers it is handed and frees each copy it has
    prepacked, which left soft-s16-e128's serving session with its weights' size twice in anonymous
    memory until this call (docs/benchmarks.md, coldstart); an unloaded model's memory likewise."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def with_package_weights(options, path: str | Path, weights: str | Path | None) -> PackageWeights | None:
    """Give ``options`` the initializers the graph at ``path`` reads from its package's weights
    file ``weights`` (``export.weights_file``); what the session must keep, or None when the graph
    holds all its data."""
    package = PackageWeights.of(path, weights)
    if package is not None:
        package.give(options)
    return package


def structure_digest(path: str | Path) -> str:
    """sha256 (hex) of what an ONNX graph asks a runtime to compute, its weights' values left out:
    every node and attribute, the inputs and outputs, each initializer's name, type and shape, and
    the values of the one-element initializers (the scalars a graph optimiser matches, such as an
    epsilon or a power); not the data of larger initializers (weights, biases), nor the model's
    metadata. Two graphs with the same digest run the same kernels on the same shapes, so what
    start-up proved and measured of one on a machine holds for the other (``server.engine.proofs``)."""
    # onnx: heavy, out of this module's import (the server imports it)
    import onnx
    # onnx as well: heavy, out of this module's import
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        if len(tensor.dims) and _elements(tensor.dims) > 1:
            name, dims, dtype = tensor.name, list(tensor.dims), tensor.data_type
            tensor.Clear()
            tensor.name, tensor.data_type = name, dtype
            tensor.dims.extend(dims)
        elif uses_external_data(tensor):  # a scalar kept outside the file: its value, not its place
            load_external_data_for_tensor(tensor, str(path.parent))
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
    del model.metadata_props[:]
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def _elements(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


class BackgroundBuiltSession:
    """An ONNX Runtime session set up at the lowest CPU priority, its intra-op threads at the
    caller's: what a server uses for a model it loads while it serves.

    Setting a session up (the graph read and optimised, gigabytes of weights read and prepacked)
    takes seconds of one core for a large model, and at normal priority those seconds come out of
    the served batches. A thread takes its nice value from the thread that starts it, and an
    unprivileged thread cannot lower its nice value again; ONNX Runtime starts a session's intra-op
    threads when the session object is constructed, then sets it up. ``onnxruntime.InferenceSession``
    takes both steps in one call, so they are taken here, one by one, on the binding it wraps
    (``onnxruntime.capi._pybind_state.InferenceSession``): the construction on the calling thread,
    so the intra-op threads that serve later keep its priority, then the set-up
    (``initialize_session``, which releases the GIL) on a thread lowered for load work
    (``at_low_priority(..., load=True)``: nice ``LOAD_NICE`` on one CPU).
    It answers the calls the backends make on a session; its outputs are those of an
    ``InferenceSession`` of the same file and options (tests/export/test_runtime.py)."""

    def __init__(self, path: str | Path, options, providers: list[str]) -> None:
        # onnxruntime: an optional extra, out of this module's import
        from onnxruntime.capi import _pybind_state as binding

        self._sess = binding.InferenceSession(options, str(path), True, False)
        at_low_priority(self._sess.initialize_session, list(providers), [{} for _ in providers], set(), load=True)
        self._inputs = self._sess.inputs_meta
        self._outputs = self._sess.outputs_meta

    def run(self, output_names: list[str] | None, input_feed: dict[str, Any], run_options=None) -> list:
        names = list(output_names) if output_names else [o.name for o in self._outputs]
        return self._sess.run(names, input_feed, run_options)

    def get_inputs(self) -> list:
        return self._inputs

    def get_outputs(self) -> list:
        return self._outputs

    def get_providers(self) -> list[str]:
        return self._sess.get_providers()

    def get_provider_options(self) -> dict:
        return self._sess.get_provider_options()

    def get_modelmeta(self):
        return self._sess.model_meta


# The nice value of the work a serving process does to load a model beside the batches it serves
# (the binding or export child, the sessions' set-up), which also runs on one CPU only
# (``lower_for_load``). On one CPU it slows at most one intra-op thread of a batch, whatever the
# core count; nice 5 gives it about a quarter of that CPU against a batch thread. soft-s16-e128's
# new weights at 70% of saturation on 2 cores (docs/benchmarks.md, coldstart): nice 19 on any CPU
# waited for CPU the batches never left (1,356.8 s, p99 during the load 1.27x the steady one);
# nice 5 on one CPU 87.9-90.1 s at 1.28-1.42x; nice 3 58.1 s at 3.01x and nice 0 48.6 s at 3.35x,
# where the served capacity fell to the offered load and the queue grew.
LOAD_NICE = 5


def lower_for_load() -> None:
    """Lower the calling thread to load work's priority: nice ``LOAD_NICE`` (raised, never
    lowered) on the last CPU this process may use. Threads it starts later inherit both; called
    first thing in a child process, it holds for the whole child."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, max(LOAD_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
    with contextlib.suppress(OSError):
        os.sched_setaffinity(tid, {max(os.sched_getaffinity(0))})


def at_low_priority(fn: Callable[..., Any], *args: Any, load: bool = False) -> Any:
    """``fn(*args)`` on a thread of its own, waited for; what it raises is raised here. The thread
    runs at the lowest CPU priority (Linux: nice 19), or, with ``load``, as load work beside
    served batches (``lower_for_load``). A server that loads a model while it serves hashes
    gigabytes of weights and cached graphs: at nice 19 that work takes only the CPU time the
    served batches leave; a session's set-up is several CPU-seconds that would wait for minutes
    there. The thread is new each time because an unprivileged thread cannot lower its nice
    value again, and no other thread should keep it."""
    out: list[Any] = []
    failed: list[BaseException] = []

    def low() -> None:
        if load:
            lower_for_load()
        elif sys.platform == "linux":
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            out.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            failed.append(e)

    thread = threading.Thread(target=low, name="softmoe-low-priority", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return out[0]


def session_options(threads: int | None = None, spin: str = "off", parallel_prepack: bool = True):
    """The SessionOptions every session here uses: full graph optimisation, a fixed intra-op
    thread count (the CPUs this process may use by default), one inter-op thread, sequential
    execution, warnings off, weights prepacked on the intra-op threads (``parallel_prepack``; off
    for a ``BackgroundBuiltSession``, whose intra-op threads run at the server's priority: its
    set-up must stay on its one low-priority thread), and one of two spin policies for the
    intra-op threads:

    - ``off``: a worker with nothing to do sleeps at once. Verification and the benchmarks of
      forms use it, so that sessions side by side do not take each other's cores.
    - ``run``: workers spin between the parallel steps of one ``run`` and stop spinning when it
      returns (``session.force_spinning_stop``), so an idle server still sleeps. A Soft MoE layer
      is hundreds of small per-expert MatMuls, each a parallel step whose worker would otherwise
      be woken from sleep, so a call runs faster at every batch size (loadtests/spin_bench.py
      measures it; docs/benchmarks.md has the figures). Outputs are bitwise those of ``off``: the
      work is split the same.
    """
    # onnxruntime: an optional extra, out of this module's import
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
    # Prepacking (each constant MatMul weight laid out for MLAS) is most of a large graph's set-up;
    # split over the intra-op threads it packs the same bytes (docs/benchmarks.md, coldstart).
    opts.add_session_config_entry("session.prepack.enable_parallel", "1" if parallel_prepack else "0")
    opts.log_severity_level = 3
    return opts
