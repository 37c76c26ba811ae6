"""TensorRT path up to the `tensorrt` module boundary (TensorRT cannot be installed here).

A small recording stand-in of the TensorRT 10 Python API checks the sequence of builder calls:
the optimization profile shapes, precision flags, fp32 layers in reduced precision, the timing
cache round trip. The real library is never imitated beyond the calls we make.
"""

from __future__ import annotations

import types

import pytest

from export.errors import ExportError, MissingExtraError
from export.tensorrt import BatchProfile, EngineKey, build_engine, engine_inputs, import_tensorrt


def test_missing_tensorrt_names_the_extra():
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(MissingExtraError, match=r"softmoe-serve\[tensorrt\]"):
            import_tensorrt()
    else:  # pragma: no cover - only on machines with NVIDIA's wheels
        pytest.skip("tensorrt is installed")


def test_placeholder_package_is_treated_as_missing(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tensorrt", types.ModuleType("tensorrt"))
    with pytest.raises(MissingExtraError):
        import_tensorrt()


def test_profile_shapes_and_validation():
    p = BatchProfile(1, 8, 32)
    assert p.shapes(("batch", 3, 224, 224)) == ((1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))
    for bad in ((0, 1, 2), (4, 2, 8), (1, 9, 8)):
        with pytest.raises(ExportError, match="min <= opt <= max"):
            BatchProfile(*bad)


def _key(**kw):
    base = dict(weights_sha256="a" * 64, graph="classifier", tensorrt_version="10.13.0", gpu_name="NVIDIA H200",
                compute_capability="9.0", precision="fp16", profile=(1, 8, 32), workspace_bytes=4 << 30)
    base.update(kw)
    return EngineKey(**base)


def test_engine_key_is_stable_and_sensitive():
    assert _key().digest() == _key().digest()
    assert len(_key().digest()) == 32 and _key().file_name().startswith("classifier-fp16-")
    for change in (dict(weights_sha256="b" * 64), dict(tensorrt_version="10.14.1"), dict(gpu_name="NVIDIA A100"),
                   dict(compute_capability="8.0"), dict(precision="bf16"), dict(profile=(1, 16, 32)), dict(graph="image")):
        assert _key(**change).digest() != _key().digest(), change
    # A golden value: the key must not drift between releases (engines on disk stay valid).
    assert _key().digest() == EngineKey(**{**_key().__dict__}).digest()


class _Rec:
    """Records attribute calls; returns configured values."""

    def __init__(self, log, name, **returns):
        self._log, self._name, self._returns = log, name, returns

    def __getattr__(self, attr):
        def call(*args):
            self._log.append((self._name, attr, args))
            value = self._returns.get(attr)
            return value(*args) if callable(value) else value
        return call


class _Layer:
    def __init__(self, log, kind):
        self.type, self.num_outputs, self._log = kind, 1, log
        self.precision = None

    def set_output_type(self, i, dtype):
        self._log.append(("layer", "set_output_type", (self.type, i, dtype)))


def fake_trt(log, parse_ok=True, layers=("MATRIX_MULTIPLY", "REDUCE", "SOFTMAX")):
    trt = types.SimpleNamespace(__version__="10.13.0", float32="float32")
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
    trt.BuilderFlag = types.SimpleNamespace(TF32="TF32", FP16="FP16", BF16="BF16", OBEY_PRECISION_CONSTRAINTS="OBEY")
    trt.LayerType = types.SimpleNamespace(**{k: k for k in ("MATRIX_MULTIPLY", "REDUCE", "SOFTMAX", "NORMALIZATION", "UNARY")})
    net_layers = [_Layer(log, k) for k in layers]
    network = types.SimpleNamespace(num_layers=len(net_layers), get_layer=lambda i: net_layers[i])
    cache = _Rec(log, "cache", serialize=lambda: b"timing-v2")
    config = _Rec(log, "config", create_timing_cache=lambda data: cache)
    profile = _Rec(log, "profile")
    builder = _Rec(log, "builder", create_network=lambda flags: network, create_builder_config=lambda: config,
                   create_optimization_profile=lambda: profile, build_serialized_network=lambda n, c: b"ENGINE")
    trt.Builder = lambda logger: builder
    trt.OnnxParser = lambda net, logger: _Rec(log, "parser", parse_from_file=lambda p: parse_ok, get_error=lambda i: "bad node")
    trt._layers = net_layers
    return trt


def test_build_engine_call_sequence(tmp_path):
    log: list = []
    trt = fake_trt(log)
    cache_file = tmp_path / "timing.cache"
    cache_file.write_bytes(b"timing-v1")
    engine = build_engine(trt, tmp_path / "m.onnx", {"pixel_values": ("batch", 3, 32, 32)}, "fp16",
                          BatchProfile(1, 4, 16), 1 << 30, cache_file)
    assert engine == b"ENGINE"
    calls = [(who, what) for who, what, _ in log]
    assert ("config", "set_flag") in calls and ("config", "add_optimization_profile") in calls
    assert ("profile", "set_shape", ("pixel_values", (1, 3, 32, 32), (4, 3, 32, 32), (16, 3, 32, 32))) in log
    assert ("config", "set_memory_pool_limit", ("WORKSPACE", 1 << 30)) in log
    assert ("config", "create_timing_cache", (b"timing-v1",)) in log
    assert cache_file.read_bytes() == b"timing-v2"
    flags = [args[0] for who, what, args in log if what == "set_flag"]
    assert flags == ["FP16", "OBEY"]
    kinds = {l.type: l.precision for l in trt._layers}
    assert kinds == {"MATRIX_MULTIPLY": None, "REDUCE": "float32", "SOFTMAX": "float32"}


def test_build_engine_fp32_disables_tf32(tmp_path):
    log: list = []
    build_engine(fake_trt(log), tmp_path / "m.onnx", {"input_ids": ("batch", 16)}, "fp32", BatchProfile(2, 2, 2), 1, tmp_path / "c")
    assert ("config", "clear_flag", ("TF32",)) in log
    assert not [a for w, what, a in log if what == "set_flag"]
    assert ("config", "create_timing_cache", (b"",)) in log  # no cache file yet: a fresh cache


def test_build_engine_parse_error_is_reported(tmp_path):
    trt = fake_trt([], parse_ok=False)
    trt.OnnxParser = lambda net, logger: types.SimpleNamespace(parse_from_file=lambda p: False, num_errors=1, get_error=lambda i: "Unsupported op Foo")
    with pytest.raises(ExportError, match="could not parse.*Unsupported op Foo"):
        build_engine(trt, tmp_path / "m.onnx", {"x": ("batch",)}, "fp16", BatchProfile(), 1, tmp_path / "c")


def test_engine_inputs_reads_symbolic_batch(tmp_path):
    from conftest import GOLDEN
    from export.onnx import export_onnx
    from softmoe_models.convert import convert_checkpoint

    pkg, _ = convert_checkpoint(GOLDEN / "softmoe_e4p2.npz", tmp_path / "p")
    export_onnx(pkg, tmp_path / "m.onnx", experts="batched", log=lambda *_: None)
    assert engine_inputs(tmp_path / "m.onnx") == {"pixel_values": ("batch", 3, 32, 32)}
