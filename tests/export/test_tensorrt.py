"""TensorRT path up to the `tensorrt` module boundary (TensorRT cannot be installed here).

A small recording stand-in of the TensorRT 10 Python API checks the sequence of builder calls:
the optimization profile shapes, precision flags, fp32 layers in reduced precision, the timing
cache round trip (hash-checked, replaced atomically). Through ``export_tensorrt`` with that
stand-in: engines verified in a temp dir before they are published, never published when the
check fails, rebuilt when the cached copy does not match its hash, cached outside the package.
The real library is never imitated beyond the calls we make.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from export.errors import ExportError, MissingExtraError
from export.tensorrt import (
    BatchProfile, EngineKey, build_engine, engine_inputs, import_tensorrt, read_timing_cache, write_timing_cache,
)


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
    base = dict(weights_digest="a" * 64, graph="classifier", tensorrt_version="10.13.0", gpu_name="NVIDIA H200",
                compute_capability="9.0", precision="fp16", profile=(1, 8, 32), workspace_bytes=4 << 30)
    base.update(kw)
    return EngineKey(**base)


def test_engine_key_is_stable_and_sensitive():
    assert _key().digest() == _key().digest()
    assert len(_key().digest()) == 32 and _key().file_name().startswith("classifier-fp16-")
    for change in (dict(weights_digest="b" * 64), dict(tensorrt_version="10.14.1"), dict(gpu_name="NVIDIA A100"),
                   dict(compute_capability="8.0"), dict(precision="bf16"), dict(profile=(1, 16, 32)), dict(graph="image"),
                   dict(config_digest="c" * 64)):
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
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=5)
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
    write_timing_cache(cache_file, b"timing-v1")
    engine = build_engine(trt, tmp_path / "m.onnx", {"pixel_values": ("batch", 3, 32, 32)}, "fp16",
                          BatchProfile(1, 4, 16), 1 << 30, cache_file)
    assert engine == b"ENGINE"
    calls = [(who, what) for who, what, _ in log]
    assert ("config", "add_optimization_profile") in calls
    assert ("profile", "set_shape", ("pixel_values", (1, 3, 32, 32), (4, 3, 32, 32), (16, 3, 32, 32))) in log
    assert ("config", "set_memory_pool_limit", ("WORKSPACE", 1 << 30)) in log
    assert ("config", "create_timing_cache", (b"timing-v1",)) in log
    assert read_timing_cache(cache_file) == b"timing-v2"
    # Strongly typed: the fp16 graph's own types decide; no weak-typing flags, no per-layer pins.
    assert ("builder", "create_network", (1 << 5,)) in log
    assert not [a for w, what, a in log if what == "set_flag"]
    assert ("config", "clear_flag", ("TF32",)) in log
    assert all(l.precision is None for l in trt._layers)


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


# ------------------------------------------------------------------ timing cache and engine cache


def test_timing_cache_is_written_atomically(tmp_path, monkeypatch):
    import os

    cache_file = tmp_path / "timing.cache"
    write_timing_cache(cache_file, b"old timings")
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (replaced.append((src, dst)), real_replace(src, dst)))
    build_engine(fake_trt([]), tmp_path / "m.onnx", {"x": ("batch",)}, "fp16", BatchProfile(), 1, cache_file)
    (src, dst), = replaced  # one temp file in the same directory, renamed over the cache
    assert Path(dst) == cache_file and Path(src).parent == tmp_path and Path(src).name.endswith(".tmp")
    assert read_timing_cache(cache_file) == b"timing-v2"

    def crash(fd):  # the process dies between writing and publishing: the old cache stays whole
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        write_timing_cache(cache_file, b"new timings")
    assert read_timing_cache(cache_file) == b"timing-v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timing.cache"]  # no temp file left


def test_corrupt_timing_cache_is_not_used(tmp_path):
    cache_file = tmp_path / "timing.cache"
    write_timing_cache(cache_file, b"timings " * 100)
    data = bytearray(cache_file.read_bytes())
    data[-10] ^= 0x20
    cache_file.write_bytes(bytes(data))
    lines, log = [], []
    assert read_timing_cache(cache_file, lines.append) == b"" and "does not match its sha256" in lines[0]
    cache_file.write_bytes(b"raw bytes of another writer")
    build_engine(fake_trt(log), tmp_path / "m.onnx", {"x": ("batch",)}, "fp16", BatchProfile(), 1, cache_file, log=lines.append)
    assert ("config", "create_timing_cache", (b"",)) in log  # a fresh cache, then rewritten whole
    assert read_timing_cache(cache_file) == b"timing-v2"


@pytest.fixture(scope="module")
def tiny_package(tmp_path_factory, golden_dir):
    from conftest import GOLDEN
    from softmoe_models.convert import convert_checkpoint

    pkg, _ = convert_checkpoint(GOLDEN / "softmoe_e4p2.npz", tmp_path_factory.mktemp("trt") / "pkg")
    return pkg


@pytest.fixture
def stand_in(monkeypatch):
    """The recording ``tensorrt`` stand-in, a pretend GPU, and an engine check that runs no CUDA."""
    import sys

    import export.tensorrt as trt_export

    calls: dict[str, list] = {"build": [], "verify": []}
    trt = fake_trt([])
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(trt_export, "gpu_identity", lambda: ("NVIDIA H100 80GB HBM3", "9.0"))
    real_build = trt_export.build_engine

    def build(*args, **kw):
        calls["build"].append(args[1])
        return real_build(*args, **kw)

    def verify(trt, engine, reference, feeds, precision, tol_fn, log):
        calls["verify"].append(engine)
        calls.setdefault("feeds", []).append(feeds)
        assert engine.read_bytes() == b"ENGINE" and callable(reference) and feeds
        if calls.get("fail"):
            raise ExportError(f"{engine}: engine output logits differs from ONNX Runtime by 1e-1 > 1e-2")

    monkeypatch.setattr(trt_export, "build_engine", build)
    monkeypatch.setattr(trt_export, "_verify_engine", verify)
    return calls


def _entries(root):
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_engines_are_verified_in_a_temp_dir_then_published_and_reused(tiny_package, stand_in, tmp_path):
    from export import cache
    from export.tensorrt import export_tensorrt

    before = sorted(p.name for p in tiny_package.iterdir())
    lines: list[str] = []
    engines = export_tensorrt(tiny_package, tmp_path / "engines", log=lines.append)
    engine, routing_engine = engines  # a Soft MoE package also gets the /v1/routing graph's engine
    assert engine.name.startswith("classifier-fp16-") and engine.read_bytes() == b"ENGINE"
    assert routing_engine.name.startswith("routing-fp16-")
    assert json.loads(engine.with_suffix(".json").read_text())["config_digest"] == cache.file_digest(tiny_package / "config.json")
    verified = stand_in["verify"]
    assert [v.name for v in verified] == [e.name for e in engines]
    assert all(v.parent.name.startswith(".tmp-") for v in verified)  # checked before publishing
    assert sorted(p.name for p in engine.parent.iterdir()) == sorted(
        [n for e in engines for n in (e.name, e.with_suffix(".json").name)] + [cache.MANIFEST])
    assert cache.lookup(engine.parent.parent, engine.parent.name) is not None
    assert export_tensorrt(tiny_package, tmp_path / "engines", log=lines.append) == engines
    assert len(stand_in["build"]) == 2 and any("reusing cached engine" in line for line in lines)
    assert sorted(p.name for p in tiny_package.iterdir()) == before  # nothing written into the package
    assert read_timing_cache(tmp_path / "engines" / "timing-10.13.0-9.0.cache") == b"timing-v2"


def test_engine_failing_verification_is_never_published(tiny_package, stand_in, tmp_path):
    from export.tensorrt import export_tensorrt

    stand_in["fail"] = True
    with pytest.raises(ExportError, match="differs from ONNX Runtime"):
        export_tensorrt(tiny_package, tmp_path / "engines", log=lambda *_: None)
    assert stand_in["verify"] and not stand_in["verify"][0].exists()
    assert _entries(tmp_path / "engines") == []  # no entry, no temp dir
    stand_in["fail"] = False
    engine, _ = export_tensorrt(tiny_package, tmp_path / "engines", log=lambda *_: None)
    assert len(stand_in["build"]) == 3 and engine.read_bytes() == b"ENGINE"  # 1 failed + classifier + routing


@pytest.mark.parametrize("corrupt", ["flip", "truncate", "no-manifest"])
def test_corrupt_cached_engine_is_rebuilt(tiny_package, stand_in, tmp_path, corrupt):
    from export import cache
    from export.tensorrt import export_tensorrt

    engine, _ = export_tensorrt(tiny_package, tmp_path / "engines", log=lambda *_: None)
    if corrupt == "flip":
        engine.write_bytes(b"ENGINF")
    elif corrupt == "truncate":
        engine.write_bytes(b"ENG")
    else:
        (engine.parent / cache.MANIFEST).unlink()
    lines: list[str] = []
    again, _ = export_tensorrt(tiny_package, tmp_path / "engines", log=lines.append)
    assert again == engine and again.read_bytes() == b"ENGINE"
    assert len(stand_in["build"]) == 4 and len(stand_in["verify"]) == 4
    assert any("rebuilding" in line for line in lines)
    assert _entries(tmp_path / "engines") == [engine.parent.name]


def test_default_engine_cache_is_outside_the_package(tiny_package, stand_in, tmp_path, monkeypatch):
    from export.tensorrt import export_tensorrt

    monkeypatch.setenv("SOFTMOE_CACHE_DIR", str(tmp_path / "volume"))
    engine, _ = export_tensorrt(tiny_package, log=lambda *_: None)
    assert engine.parent.parent == tmp_path / "volume" / "engines"
    assert not (tiny_package / "engines").exists()


def test_text_engines_are_verified_on_real_tokenised_prompts(packages):
    """Text engines see the package tokenizer's ids of real prompts at every profile batch, not {0, 1}."""
    from export.tensorrt import BatchProfile, verification_inputs

    feeds = verification_inputs(packages["tt-tok"], "text", {"input_ids": ("batch", 16)}, BatchProfile(1, 4, 8))
    assert [f["input_ids"].shape[0] for f in feeds] == [1, 4, 8]
    ids = feeds[-1]["input_ids"]
    assert int(ids.max()) > 1 and len({tuple(r.tolist()) for r in ids}) > 1  # real, varied token ids
    assert (ids[:, -1] == 1).any()  # a long prompt reaches the sticky EOS (id 1) at the last position
    images = verification_inputs(packages["golden"], "classifier", {"pixel_values": ("batch", 3, 32, 32)},
                                 BatchProfile(2, 2, 2))
    x = images[0]["pixel_values"]
    assert x.shape == (2, 3, 32, 32) and float(x.min()) >= -1 and float(x.max()) <= 1


def test_fp32_reference_matches_the_package_model(packages):
    import torch

    from export.tensorrt import BatchProfile, _fp32_reference, verification_inputs
    from softmoe_models.package import load_model

    ref = _fp32_reference(packages["tt-tok"])
    feed = verification_inputs(packages["tt-tok"], "text", {"input_ids": ("batch", 16)}, BatchProfile(3, 3, 3))[0]
    got = ref["text"](feed)
    want = load_model(packages["tt-tok"]).encode_text(feed["input_ids"])
    torch.testing.assert_close(next(iter(got.values())), want, rtol=0, atol=1e-6)
