"""Sparse V-MoE packages on the TensorRT path, up to the `tensorrt` module boundary (as
tests/export/test_tensorrt.py does for Soft MoE: TensorRT cannot be installed here).

* ``export.op_support``'s rewrites, on small hand-written graphs: each form TensorRT 10's ONNX
  parser refuses or mistreats (ScatterND with add, CumSum / Clip on integers, ScatterElements on
  booleans, TopK on integers with ties) becomes one it takes, bitwise the same in ONNX Runtime, and
  the integer TopK keeps ONNX's lower-index-first order whatever order TensorRT gives ties.
* ``export_tensorrt`` on a Tokens Choice and an Experts Choice package with the recording stand-in
  of the API: a classifier and a routing engine, each from an opset-20 fp16 graph with batched
  experts that ``tensorrt_problems`` finds nothing in (Experts Choice needs the standard
  ScatterElements plugin, registered before the parser runs), each verified at the profile's
  batch sizes against fp32 PyTorch; ONNX Runtime on the very graph TensorRT would parse stands in
  for the engine's numerics. Without the rewrites the build stops before TensorRT is called.
"""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sparse_export import sparse_package  # noqa: E402
from test_tensorrt import fake_trt  # noqa: E402

from export.errors import ExportError  # noqa: E402
from export.op_support import sparse_ops_for_tensorrt, tensorrt_plugins, tensorrt_problems  # noqa: E402


# ------------------------------------------------------------------ the rewrites, one by one


def _graph(tmp_path: Path):
    """One graph holding every form the rewrites handle, on its inputs directly."""
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h

    k = h.make_tensor("k", T.INT64, [1], [12])
    axis = h.make_tensor("axis", T.INT64, [], [1])
    hi = h.make_tensor("hi", T.INT64, [], [2])
    nodes = [
        h.make_node("ScatterND", ["data", "rows", "updates"], ["added"], reduction="add"),
        h.make_node("CumSum", ["counts", "axis"], ["running"]),
        h.make_node("TopK", ["experts", "k"], ["sorted_experts", "order"], axis=1, largest=0, sorted=1),
        h.make_node("TopK", ["experts", "k"], ["sorted_desc", "order_desc"], axis=1, largest=1, sorted=1),
        h.make_node("Clip", ["experts", "", "hi"], ["clipped"]),
        h.make_node("ScatterElements", ["flags", "cols", "marks"], ["marked"], axis=1),
    ]
    inputs = [h.make_tensor_value_info(n, t, s) for n, t, s in (
        ("data", T.FLOAT, [6, 4]), ("rows", T.INT64, [9, 1]), ("updates", T.FLOAT, [9, 4]), ("counts", T.INT64, [2, 12]),
        ("experts", T.INT64, [2, 12]), ("flags", T.BOOL, [2, 5]), ("cols", T.INT64, [2, 3]), ("marks", T.BOOL, [2, 3]))]
    outputs = [h.make_tensor_value_info(n, t, None) for n, t in (
        ("added", T.FLOAT), ("running", T.INT64), ("sorted_experts", T.INT64), ("order", T.INT64),
        ("sorted_desc", T.INT64), ("order_desc", T.INT64), ("clipped", T.INT64), ("marked", T.BOOL))]
    model = h.make_model(h.make_graph(nodes, "forms", inputs, outputs, [k, axis, hi]),
                         opset_imports=[h.make_opsetid("", 20)], ir_version=10)
    path = tmp_path / "forms.onnx"
    onnx.save(model, path)
    return path


def _rewrite(src: Path, dst: Path) -> dict[str, int]:
    import onnx
    import onnx_ir as ir

    model = ir.serde.deserialize_model(onnx.load(src))
    counts = sparse_ops_for_tensorrt(model.graph)
    onnx.save(ir.serde.serialize_model(model), dst)
    return counts


def _run(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def test_each_form_tensorrt_refuses_becomes_one_it_takes_with_the_same_results(tmp_path):
    rng = np.random.default_rng(0)
    feeds = {"data": rng.normal(size=(6, 4)).astype(np.float32), "rows": rng.integers(0, 6, (9, 1)),
             "updates": rng.normal(size=(9, 4)).astype(np.float32), "counts": rng.integers(0, 2, (2, 12)),
             "experts": rng.integers(0, 3, (2, 12)), "flags": np.zeros((2, 5), bool),
             "cols": np.array([[0, 2, 4], [1, 3, 0]]), "marks": np.array([[True, False, True], [True, True, False]])}
    before = _graph(tmp_path)
    problems = tensorrt_problems(before)
    for what in ("ScatterND with reduction", "CumSum on INT64", "Clip on INT64", "ScatterElements on BOOL"):
        assert any(what in p for p in problems), (what, problems)
    after = tmp_path / "after.onnx"
    assert _rewrite(before, after) == {"scatter_nd": 1, "int_cumsum": 1, "int_topk": 2, "int_clip": 1,
                                       "bool_scatter": 1}
    assert tensorrt_problems(after) == []
    assert tensorrt_plugins(after) == ["ScatterElements"]  # the add: TensorRT's standard plugin
    want, got = _run(before, feeds), _run(after, feeds)
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    # ONNX's tie rule, which TensorRT does not document: equal experts in index order
    assert np.array_equal(got["order"], np.argsort(feeds["experts"], axis=1, kind="stable"))
    assert np.array_equal(got["order_desc"], np.argsort(-feeds["experts"], axis=1, kind="stable"))


def test_tie_free_keys_reach_the_topk(tmp_path):
    """What the rewritten integer TopK sorts has no two equal values along its axis."""
    import onnx

    after = tmp_path / "after.onnx"
    _rewrite(_graph(tmp_path), after)
    model = onnx.load(after)
    keys = [n.input[0] for n in model.graph.node if n.op_type == "TopK"]
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(k) for k in keys)
    onnx.save(model, after)
    experts = np.random.default_rng(1).integers(0, 3, (2, 12))
    out = _run(after, {"data": np.zeros((6, 4), np.float32), "rows": np.zeros((9, 1), np.int64),
                       "updates": np.zeros((9, 4), np.float32), "counts": np.zeros((2, 12), np.int64),
                       "experts": experts, "flags": np.zeros((2, 5), bool), "cols": np.zeros((2, 3), np.int64),
                       "marks": np.zeros((2, 3), bool)})
    for k in keys:
        assert all(len(set(row)) == len(row) for row in out[k].tolist()), k


# ------------------------------------------------------------------ export_tensorrt, with the stand-in


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sparse-trt")
    return {name: sparse_package(root, name, "1.05")[0] for name in ("vmoe_tc_e8k2", "vmoe_ec_e4")}


@pytest.fixture
def stand_in(monkeypatch):
    """The recording stand-in of ``tensorrt`` (with its plugin registration), a pretend GPU, and an
    engine check that runs ONNX Runtime on the graph the engine was built from."""
    import export.tensorrt as trt_export

    log: list = []
    trt = fake_trt(log)
    trt.init_libnvinfer_plugins = lambda logger, namespace: log.append(("trt", "init_libnvinfer_plugins", (namespace,)))
    trt.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)  # torch's exporter looks modules up by spec
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(trt_export, "gpu_identity", lambda: ("NVIDIA H100 80GB HBM3", "9.0"))
    seen: dict = {"log": log, "builds": [], "checked": []}
    real_build = trt_export.build_engine

    def build(trt_module, onnx_path, inputs, precision, *args, **kw):
        import onnx

        from export.onnx import op_inventory, read_metadata

        model = onnx.load(str(onnx_path), load_external_data=False)
        seen["builds"].append({
            "onnx": onnx_path, "inputs": inputs, "precision": precision, "meta": read_metadata(onnx_path),
            "opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
            "ops": op_inventory(onnx_path), "problems": tensorrt_problems(onnx_path),
            "plugins": tensorrt_plugins(onnx_path)})
        return real_build(trt_module, onnx_path, inputs, precision, *args, **kw)

    def verify(trt_module, engine, reference, feeds, precision, tol_fn, log_fn):
        from export.runtime import ort_session

        onnx_path = seen["builds"][-1]["onnx"]  # the graph this engine was just built from
        session = ort_session(onnx_path)
        names = [o.name for o in session.get_outputs()]
        for feed in feeds:
            want = reference(feed)
            got = dict(zip(names, session.run(names, {k: v.numpy() for k, v in feed.items()})))
            for name in names:
                ref = want[name].double().numpy()
                err = float(np.abs(got[name].astype(np.float64) - ref).max())
                seen["checked"].append((engine.name, name, feed["pixel_values"].shape[0], err))
                assert err <= tol_fn(precision, float(np.abs(ref).max())), (engine.name, name, err)

    monkeypatch.setattr(trt_export, "build_engine", build)
    monkeypatch.setattr(trt_export, "_verify_engine", verify)
    return seen


@pytest.mark.parametrize("name", ["vmoe_tc_e8k2", "vmoe_ec_e4"])
def test_sparse_package_builds_verified_classifier_and_routing_engines(packages, stand_in, tmp_path, name):
    from export.tensorrt import BatchProfile, export_tensorrt
    from softmoe_models.sparse_routing import OUTPUTS

    lines: list[str] = []
    engines = export_tensorrt(packages[name], tmp_path / "engines", profile=BatchProfile(1, 2, 4), log=lines.append)
    assert [e.name.split("-")[0] for e in engines] == ["classifier", "routing"]
    builds = stand_in["builds"]
    assert [b["meta"]["graph"] for b in builds] == ["classifier", "routing"]
    for b in builds:
        assert b["opset"] == 20 and b["precision"] == "fp16" and b["meta"]["precision"] == "fp16"
        assert b["meta"]["experts_form"] == "batched" and b["meta"]["sparse_dispatch"] == "fused"
        assert b["inputs"] == {"pixel_values": ("batch", 3, 32, 32)}
        assert b["problems"] == [] and "Einsum" not in b["ops"] and "ScatterND" not in b["ops"]
        assert {"TopK", "GatherElements"} <= set(b["ops"])
        assert b["plugins"] == (["ScatterElements"] if name == "vmoe_ec_e4" else [])
    routing_outputs = {n for e, n, _, _ in stand_in["checked"] if e.startswith("routing-")}
    assert routing_outputs == {"logits", "pre_logits", *OUTPUTS}
    assert {b for e, _, b, _ in stand_in["checked"]} == {1, 2, 4}  # the profile's min, opt and max
    calls = [(who, what) for who, what, _ in stand_in["log"]]
    first_parse = calls.index(("parser", "parse_from_file"))
    assert ("trt", "init_libnvinfer_plugins") in calls[:first_parse]  # the plugin is registered first
    if name == "vmoe_ec_e4":
        assert any("standard plugin(s) ScatterElements" in line for line in lines)


def test_without_the_rewrites_the_build_stops_before_tensorrt(packages, stand_in, tmp_path, monkeypatch):
    """Tokens Choice as the exporter writes it (integer CumSum and Clip): refused before a build.
    (Experts Choice's fp16 graph without them does not even pass ONNX Runtime's verification: its
    CPU ScatterND has no fp16 add.)"""
    import export.onnx as onnx_export
    from export.tensorrt import BatchProfile, export_tensorrt

    monkeypatch.setattr(onnx_export, "sparse_ops_for_tensorrt", lambda graph: {})
    with pytest.raises(ExportError, match="does not take: .*CumSum on INT64"):
        export_tensorrt(packages["vmoe_tc_e8k2"], tmp_path / "engines", profile=BatchProfile(1, 1, 2),
                        log=lambda *a: None)
    assert stand_in["builds"] == [] and not [p for p in (tmp_path / "engines").iterdir() if p.is_dir()]
