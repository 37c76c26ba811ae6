"""ONNX export: op inventory, parity with the golden data at several batch sizes, precisions,
external data, metadata, and clear failures."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

from conftest import GOLDEN, golden_npz
from export.errors import ExportError
from export.onnx import export_onnx, op_inventory, read_metadata
from export.runtime import ort_session
from helpers import vmoe_numpy as ref
from softmoe_models.convert import convert_checkpoint

QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def pkgs(tmp_path_factory, golden_dir):
    root = tmp_path_factory.mktemp("export")
    out = {}
    for name in ("softmoe_e8p1", "softmoe_e4p2", "twotower"):
        pool = {"text_pool": "last"} if name == "twotower" else {}  # twotower.json: text_pool_type "last"
        out[name], _ = convert_checkpoint(GOLDEN / f"{name}.npz", root / name, **pool)
    out["legacy"], _ = convert_checkpoint(GOLDEN / "checkpoint/partitioned/softmoe_e4p2", root / "legacy")
    out["orbax"], _ = convert_checkpoint(GOLDEN / "checkpoint/orbax/ckpt/0", root / "orbax")
    return out


def _nchw(images):
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2))


@pytest.mark.parametrize("name,golden", [
    ("softmoe_e8p1", "softmoe_e8p1"), ("softmoe_e4p2", "softmoe_e4p2"),
    ("legacy", "softmoe_e4p2"), ("orbax", "softmoe_e4p2"),
])
@pytest.mark.parametrize("experts", ["per-expert", "batched"])
def test_classifier_export_matches_golden(pkgs, tmp_path, name, golden, experts):
    files = export_onnx(pkgs[name], tmp_path / "m.onnx", experts=experts, **QUIET)
    assert [f.role for f in files] == ["classifier"]
    ops = op_inventory(tmp_path / "m.onnx")
    assert "Einsum" not in ops and ops["Softmax"] >= 2
    data = golden_npz(golden)
    session = ort_session(tmp_path / "m.onnx")
    assert [i.name for i in session.get_inputs()] == ["pixel_values"]
    assert [o.name for o in session.get_outputs()] == ["logits", "pre_logits"]
    images = _nchw(data["inputs/images"])
    for batch in (1, 4):
        logits, pre = session.run(["logits", "pre_logits"], {"pixel_values": images[:batch]})
        assert np.abs(logits - data["outputs_fp32dispatch/logits"][:batch]).max() <= 1e-4
        assert np.abs(pre - data["outputs_fp32dispatch/pre_logits"][:batch]).max() <= 1e-4


def test_two_tower_export_matches_golden(pkgs, tmp_path):
    files = export_onnx(pkgs["twotower"], tmp_path / "tt.onnx", **QUIET)
    assert {f.role: f.path.name for f in files} == {"two-tower": "tt.onnx", "image": "tt.image.onnx", "text": "tt.text.onnx"}
    data = golden_npz("twotower")
    images, texts = _nchw(data["inputs/images"]), data["inputs/texts"].astype(np.int64)
    combined = ort_session(tmp_path / "tt.onnx")
    assert [i.name for i in combined.get_inputs()] == ["pixel_values", "input_ids"]
    for batch in (1, 4):
        zimg, ztxt = combined.run(["image_embeds", "text_embeds"], {"pixel_values": images[:batch], "input_ids": texts[:batch]})
        assert np.abs(zimg - data["outputs_fp32dispatch/zimg"][:batch]).max() <= 1e-4
        assert np.abs(ztxt - data["outputs_fp32dispatch/ztxt"][:batch]).max() <= 1e-4
    (zimg,) = ort_session(tmp_path / "tt.image.onnx").run(None, {"pixel_values": images})
    (ztxt,) = ort_session(tmp_path / "tt.text.onnx").run(None, {"input_ids": texts.astype(np.int32).astype(np.int64)})
    assert np.abs(zimg - data["outputs_fp32dispatch/zimg"]).max() <= 1e-4
    assert np.abs(ztxt - data["outputs_fp32dispatch/ztxt"]).max() <= 1e-4
    for f in files:
        assert "Einsum" not in f.ops


def test_metadata_lets_a_server_load_the_file_alone(pkgs, tmp_path):
    export_onnx(pkgs["softmoe_e8p1"], tmp_path / "m.onnx", **QUIET)
    meta = read_metadata(tmp_path / "m.onnx")
    assert meta["kind"] == "classifier" and meta["graph"] == "classifier"
    tt = export_onnx(pkgs["twotower"], tmp_path / "tt.onnx", towers="split", **QUIET)
    tmeta = read_metadata(tt[1].path)
    data = golden_npz("twotower")
    assert float(tmeta["logit_scale"]) == pytest.approx(float(np.exp(data["params/s"])), rel=1e-6)
    assert float(tmeta["logit_bias"]) == pytest.approx(float(data["params/b"]))
    assert meta["preprocess"]["image_size"] == 32
    assert meta["package_config"]["model"]["encoder"]["moe"]["num_experts"] == 8
    assert meta["outputs"] == ["logits", "pre_logits"] and len(meta["weights_blake3"]) == 64
    onnx.checker.check_model(str(tmp_path / "m.onnx"))


def test_other_config_and_batch_sizes(tmp_path):
    params = ref.random_vit_params(seed=5, d=48, heads=3, mlp_dim=64, layers=2, moe_layers=(0, 1), n=6, p=2,
                                   patch=4, image_size=20, num_classes=9)
    np.savez(tmp_path / "c.npz", **{f"params/{k}": v for k, v in params.items()})
    pkg, _ = convert_checkpoint(tmp_path / "c.npz", tmp_path / "pkg")
    export_onnx(pkg, tmp_path / "c.onnx", verify_batches=(1, 3), **QUIET)
    session = ort_session(tmp_path / "c.onnx")
    images = np.random.default_rng(0).uniform(-1, 1, (7, 20, 20, 3)).astype(np.float32)
    expected = ref.vit(params, images.astype(np.float64))
    for batch in (1, 2, 7):
        logits, _ = session.run(None, {"pixel_values": _nchw(images[:batch])})
        assert np.abs(logits - expected[:batch]).max() <= 1e-4


def test_fp16_export_within_tolerance(pkgs, tmp_path):
    files = export_onnx(pkgs["softmoe_e8p1"], tmp_path / "h.onnx", precision="fp16", **QUIET)
    assert all(v.ok for v in files[0].verification)
    data = golden_npz("softmoe_e8p1")
    logits, _ = ort_session(tmp_path / "h.onnx").run(None, {"pixel_values": _nchw(data["inputs/images"])})
    assert logits.dtype == np.float32
    ref_logits = data["outputs_fp32dispatch/logits"]
    assert np.abs(logits - ref_logits).max() <= 1e-2 * max(1.0, np.abs(ref_logits).max())
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).all()
    # The Soft MoE normalisation is computed in float32 inside the fp16 graph.
    model = onnx.load(str(tmp_path / "h.onnx"))
    pow_inputs = {n.input[0] for n in model.graph.node if n.op_type == "Pow"}
    cast_to_fp32 = {n.output[0] for n in model.graph.node if n.op_type == "Cast"
                    and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT for a in n.attribute)}
    assert pow_inputs and pow_inputs <= cast_to_fp32
    # ... and so are the routing softmaxes: 2 per Soft MoE layer (2 layers) take float32 logits.
    producers = {o: n for n in model.graph.node for o in n.output}
    fp32_softmax = [n for n in model.graph.node if n.op_type == "Softmax" and n.input[0] in cast_to_fp32
                    or n.op_type == "Softmax" and producers.get(n.input[0]) is not None
                    and producers[n.input[0]].input and producers[n.input[0]].input[0] in cast_to_fp32]
    assert len(fp32_softmax) >= 4


def test_bf16_on_cpu_is_refused_clearly(pkgs, tmp_path):
    with pytest.raises(ExportError, match="no bf16 kernels"):
        export_onnx(pkgs["softmoe_e4p2"], tmp_path / "b.onnx", precision="bf16", **QUIET)
    assert not (tmp_path / "b.onnx").exists()


def test_external_data_has_a_per_model_name(pkgs, tmp_path):
    for name in ("a", "b"):
        files = export_onnx(pkgs["softmoe_e4p2"], tmp_path / f"{name}.onnx", external_data=True, **QUIET)
        assert files[0].external_data == tmp_path / f"{name}.onnx.data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx", "a.onnx.data", "b.onnx", "b.onnx.data"]
    model = onnx.load(str(tmp_path / "a.onnx"), load_external_data=False)
    locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"a.onnx.data"}
    assert (tmp_path / "a.onnx").stat().st_size < (tmp_path / "a.onnx.data").stat().st_size
    data = golden_npz("softmoe_e4p2")
    logits, _ = ort_session(tmp_path / "a.onnx").run(None, {"pixel_values": _nchw(data["inputs/images"])})
    assert np.abs(logits - data["outputs_fp32dispatch/logits"]).max() <= 1e-4


def test_static_batch(pkgs, tmp_path):
    export_onnx(pkgs["softmoe_e4p2"], tmp_path / "s.onnx", dynamic_batch=False, **QUIET)
    shape = onnx.load(str(tmp_path / "s.onnx")).graph.input[0].type.tensor_type.shape
    assert [d.dim_value for d in shape.dim] == [2, 3, 32, 32]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "server", "export", *args], capture_output=True, text=True)


@pytest.mark.parametrize("args,message", [
    (["onnx", "/nonexistent/pkg"], "model package not found"),
    (["onnx", "{pkg}", "--opset", "11"], "unsupported opset 11"),
    (["tensorrt", "{pkg}"], "TensorRT is not installed: pip install 'softmoe-serve[tensorrt]'"),
])
def test_cli_failures_are_one_line(pkgs, args, message):
    r = _cli(*[a.format(pkg=pkgs["softmoe_e4p2"]) for a in args])
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and message in r.stderr, r.stderr


def test_cli_not_a_package(tmp_path):
    r = _cli("onnx", str(tmp_path))
    assert r.returncode == 2 and "not a model package" in r.stderr


def test_spin_policies_set_onnxruntime_config_and_refuse_unknown():
    from export.runtime import session_options

    run, off = session_options(2, spin="run"), session_options(2, spin="off")
    assert run.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert run.get_session_config_entry("session.force_spinning_stop") == "1"  # an idle server sleeps
    assert off.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert run.intra_op_num_threads == off.intra_op_num_threads == 2
    with pytest.raises(ValueError, match="unknown spin policy 'always'"):
        session_options(2, spin="always")


def test_spinning_within_a_run_gives_bitwise_the_outputs_of_never_spinning(pkgs, tmp_path):
    """The spin policy changes how idle workers wait, never how the work is split: the per-expert
    export on 2 threads gives the same bits either way, at every batch the server runs."""
    export_onnx(pkgs["softmoe_e8p1"], tmp_path / "m.onnx", experts="per-expert", **QUIET)
    sessions = {spin: ort_session(tmp_path / "m.onnx", threads=2, spin=spin) for spin in ("off", "run")}
    rng = np.random.default_rng(5)
    for batch in (1, 2, 8):
        x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
        outs = {spin: s.run(None, {"pixel_values": x}) for spin, s in sessions.items()}
        for a, b in zip(outs["off"], outs["run"]):
            assert a.tobytes() == b.tobytes()
