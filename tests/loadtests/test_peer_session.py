"""The peers' ONNX Runtime session (loadtests/peers/common.py): ONNX Runtime's defaults with only
the thread count set, as their users write it, or the session `softmoe serve` builds."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from loadtests.peers.common import _session


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 12])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])], [w])
    path = tmp_path_factory.mktemp("peer") / "g.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    return path


def test_ort_defaults_sets_only_the_threads(graph):
    opts = _session(graph, 2, "ort-defaults").get_session_options()
    assert opts.intra_op_num_threads == 2
    # nothing of ours: the spin entries are unset, so ONNX Runtime's own defaults hold
    for key in ("session.intra_op.allow_spinning", "session.force_spinning_stop"):
        with pytest.raises(RuntimeError, match="does not have configuration"):
            opts.get_session_config_entry(key)


def test_softmoe_session_is_the_servers(graph):
    opts = _session(graph, 2, "softmoe").get_session_options()
    assert opts.intra_op_num_threads == 2
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert opts.get_session_config_entry("session.force_spinning_stop") == "1"


def test_unknown_session_is_refused(graph):
    with pytest.raises(ValueError, match="unknown session 'fast'"):
        _session(graph, 2, "fast")
