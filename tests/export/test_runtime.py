"""export.runtime: a session set up at low priority while its intra-op threads keep the caller's,
and the structure digest that says when two graphs differ only in their weights' values."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from export import runtime


def _graph(path, weight: np.ndarray, eps: float = 1e-6, width: int = 16):
    """x @ W + eps, W an initializer (its data outside the file, as large graphs keep it)."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "eps"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, width])],
        initializer=[numpy_helper.from_array(weight.astype(np.float32), "W"),
                     numpy_helper.from_array(np.array(eps, np.float32), "eps")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    helper.set_model_props(model, {"softmoe.weights": str(float(weight.sum()))})
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    return path


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_a_background_session_is_set_up_as_load_work_and_serves_from_threads_at_the_callers(tmp_path, monkeypatch):
    """Set up at nice LOAD_NICE on one CPU (or lower, were the caller lower); its intra-op threads
    keep the caller's nice value and CPUs."""
    rng = np.random.default_rng(0)
    path = _graph(tmp_path / "m.onnx", rng.standard_normal((16, 16)))
    seen = {}
    real = runtime.at_low_priority

    def spy(fn, *args, **kw):
        def probe(*a):
            tid = threading.get_native_id()
            seen["setup_nice"], seen["setup_tid"] = _nice(tid), str(tid)
            seen["setup_cpus"] = os.sched_getaffinity(tid)
            return fn(*a)
        return real(probe, *args, **kw)

    monkeypatch.setattr(runtime, "at_low_priority", spy)
    before = set(os.listdir("/proc/self/task"))
    mine = _nice(threading.get_native_id())
    session = runtime.ort_session(path, threads=3, background=True)
    # the set-up thread has ended, but its task can outlive the join by a moment
    started = set(os.listdir("/proc/self/task")) - before - {seen["setup_tid"]}
    assert seen["setup_nice"] == max(runtime.LOAD_NICE, mine)
    assert seen["setup_cpus"] == {max(os.sched_getaffinity(0))}
    assert started, "three intra-op threads: two started by the session"
    assert {_nice(int(t)) for t in started} == {mine}  # the threads that serve keep the caller's priority
    assert all(os.sched_getaffinity(int(t)) == os.sched_getaffinity(0) for t in started)

    plain = runtime.ort_session(path, threads=3)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    assert [i.name for i in session.get_inputs()] == ["x"] and [o.name for o in session.get_outputs()] == ["y"]
    assert session.get_providers() == ["CPUExecutionProvider"]
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], plain.run(["y"], {"x": x})[0])
    np.testing.assert_array_equal(session.run(["y"], {"x": x})[0], plain.run(None, {"x": x})[0])


def test_a_background_session_that_cannot_be_set_up_raises_in_the_caller(tmp_path):
    path = _graph(tmp_path / "m.onnx", np.ones((16, 16)))
    (tmp_path / "m.onnx.data").write_bytes(b"short")  # the weights' file cut
    with pytest.raises(Exception) as failed:
        runtime.ort_session(path, background=True)
    assert not isinstance(failed.value, AssertionError)
    with pytest.raises(Exception):
        runtime.ort_session(path)  # the plain session refuses it the same way


def test_the_structure_digest_leaves_out_the_weights_values_and_nothing_else(tmp_path):
    rng = np.random.default_rng(1)
    base = runtime.structure_digest(_graph(tmp_path / "a.onnx", rng.standard_normal((16, 16))))
    # other weights (and the metadata that names them): the same structure
    assert runtime.structure_digest(_graph(tmp_path / "b.onnx", rng.standard_normal((16, 16)))) == base
    # a scalar a graph optimiser may match on, another shape: another structure
    assert runtime.structure_digest(_graph(tmp_path / "c.onnx", rng.standard_normal((16, 16)), eps=1e-5)) != base
    assert runtime.structure_digest(_graph(tmp_path / "d.onnx", rng.standard_normal((8, 8)), width=8)) != base


def test_weights_prepacked_on_the_intra_op_threads_give_the_same_bits_and_a_background_session_packs_alone(tmp_path):
    rng = np.random.default_rng(1)
    path = _graph(tmp_path / "m.onnx", rng.standard_normal((256, 256)), width=256)
    assert runtime.session_options(2).get_session_config_entry("session.prepack.enable_parallel") == "1"
    assert runtime.session_options(2, parallel_prepack=False).get_session_config_entry(
        "session.prepack.enable_parallel") == "0"
    x = rng.standard_normal((7, 256)).astype(np.float32)
    parallel = runtime.ort_session(path, threads=2).run(None, {"x": x})[0]
    background = runtime.ort_session(path, threads=2, background=True).run(None, {"x": x})[0]
    opts = runtime.session_options(2, parallel_prepack=False)
    alone = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(parallel, alone)
    np.testing.assert_array_equal(background, alone)

