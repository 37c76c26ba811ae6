"""The exported towers pool tokens with a MatMul, not ReduceMean, so ONNX Runtime gives a lone
image the same bits as the same image among batch-mates, and strict determinism can run a lone
request at batch shape 1 (export/graph_passes.py, token_means_as_matmuls)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from export.onnx import export_onnx, op_inventory
from server.engine.defaults import SHIPPED


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx")
    export_onnx(SHIPPED / "digits", out / "digits.onnx", log=lambda *a, **k: None)
    export_onnx(SHIPPED / "digits-lit", out / "lit.onnx", log=lambda *a, **k: None)
    return out


def _session(path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", ["digits.onnx", "lit.image.onnx"])
def test_no_token_reduce_mean_is_left(exported, name):
    ops = op_inventory(exported / name)
    assert "ReduceMean" not in ops and ops.get("MatMul", 0) > 0, ops


@pytest.mark.parametrize("name", ["digits.onnx", "lit.image.onnx"])
def test_batch_one_gives_the_bits_of_batch_eight(exported, name):
    s = _session(exported / name)
    inp = s.get_inputs()[0]
    x = np.random.default_rng(0).uniform(-1, 1, (8, *inp.shape[1:])).astype(np.float32)
    ref = s.run(None, {inp.name: x})
    for i in range(8):
        one = s.run(None, {inp.name: x[i:i + 1]})
        for a, r, out in zip(one, ref, s.get_outputs()):
            assert np.array_equal(a[0], r[i]), (out.name, i, float(np.abs(a[0] - r[i]).max()))


def test_a_plain_reduce_mean_is_not_batch_invariant():
    """Why the rewrite exists: a bare ReduceMean with the digits tower's shapes gives a lone row
    other bits than the same row in a batch of 8 (onnxruntime 1.31 on x86-64). Should a future
    onnxruntime make it batch-invariant, this fails, and the rewrite can go."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 64])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    graph = helper.make_graph([helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=0)], "g", [x], [y], [axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    data = np.random.default_rng(0).uniform(-1, 1, (8, 16, 64)).astype(np.float32)
    ref = s.run(None, {"x": data})[0]
    assert any(not np.array_equal(s.run(None, {"x": data[i:i + 1]})[0][0], ref[i]) for i in range(8))
