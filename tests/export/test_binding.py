"""A structure exported once, other packages' weights bound into it (export.binding,
export.onnx.bind_onnx, the ONNX cache of server.backends.onnxruntime_backend)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import export.onnx
import server.backends.onnxruntime_backend as ob
from export import binding, cache
from export.onnx import read_metadata
from server.backends.onnxruntime_backend import OnnxRuntimeBackend, exported_files
from server.backends.torch_backend import TorchBackend


def _other_weights(src: Path, dst: Path, seed: int = 1) -> Path:
    """``src`` with every float tensor moved by noise: the same structure, other weights."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
             for k, v in tensors.items()}
    save_file(moved, dst / "model.safetensors")
    return dst


def _counting(monkeypatch) -> dict[str, list]:
    calls: dict[str, list] = {"export": [], "bind": []}
    real_export, real_bind = export.onnx.export_onnx, export.onnx.bind_onnx

    def exporting(package, out, **kw):
        calls["export"].append(Path(package))
        return real_export(package, out, **kw)

    def binding_(package, structure, out, **kw):
        calls["bind"].append(Path(package))
        return real_bind(package, structure, out, **kw)

    monkeypatch.setattr(export.onnx, "export_onnx", exporting)
    monkeypatch.setattr(export.onnx, "bind_onnx", binding_)
    monkeypatch.setattr(ob, "EXPORT_IN_CHILD_BYTES", 1 << 62)  # in this process, where calls are counted
    return calls


def _run(files, fn: str, rows: dict, package: Path | None = None) -> dict:
    backend = OnnxRuntimeBackend(files, routing=True, weights=package / "model.safetensors" if package else None)
    try:
        return backend.run(fn, rows)
    finally:
        backend.close()


def test_a_package_of_the_same_structure_is_bound_not_exported(monkeypatch, packages, tmp_path):
    calls = _counting(monkeypatch)
    a = packages["golden"]
    b = _other_weights(a, tmp_path / "b")
    cache_dir = str(tmp_path / "cache")
    first = exported_files(a, cache_dir, "fp32", log=lambda *_: None)
    lines: list[str] = []
    bound = exported_files(b, cache_dir, "fp32", log=lines.append)
    assert calls == {"export": [a], "bind": [b]}, calls
    assert any("binding" in line for line in lines) and any("bound and verified" in line for line in lines), lines
    assert bound[0].parent != first[0].parent  # its own entry, hash-checked like every entry

    # the bound graph answers with b's weights: as the torch backend on b, and as b's own export
    size = read_metadata(bound[0])["package_config"]["model"]["image_size"]
    x = np.random.default_rng(0).uniform(-1, 1, (3, 3, size, size)).astype(np.float32)
    got = _run(bound, "classify", {"pixel_values": x}, b)
    torch_b = TorchBackend(b, device="cpu", precision="fp32", max_batch_size=8).run("classify", {"pixel_values": x})
    assert float(np.abs(got["logits"] - torch_b["logits"]).max()) < 1e-4
    assert float(np.abs(got["logits"] - _run(first, "classify", {"pixel_values": x}, a)["logits"]).max()) > 1e-3
    own = export.onnx.export_onnx(b, tmp_path / "own" / "model.onnx", routing=True, towers="split",
                                  log=lambda *_: None)
    mine = _run([own[0].path], "classify", {"pixel_values": x})
    assert all(np.array_equal(got[k], mine[k]) for k in mine)  # bitwise: the same graph, the same weights
    # its metadata is b's (its weights' digest, the one its cache key holds), not the structure's first package's
    assert read_metadata(bound[0])["weights_blake3"] == cache.file_digest(b / "model.safetensors")
    assert read_metadata(first[0])["weights_blake3"] == cache.file_digest(a / "model.safetensors")
    assert read_metadata(own[0].path)["weights_blake3"] == cache.file_digest(b / "model.safetensors")  # computed there


def test_the_structure_keeps_no_weights(monkeypatch, packages, tmp_path):
    _counting(monkeypatch)
    exported_files(packages["golden"], str(tmp_path / "cache"), "fp32", log=lambda *_: None)
    [structure] = [p for p in (tmp_path / "cache" / "onnx-structure").iterdir() if p.is_dir()]
    recipe = json.loads((structure / binding.RECIPE).read_text())
    graph = structure / "model.onnx"
    steps = recipe["model.onnx"]["steps"]
    assert steps and all(s["op"] in binding.OPS for s in steps)
    import onnx

    model = onnx.load(str(graph))
    filled = {s["name"] for s in steps}
    emptied = [i for i in model.graph.initializer if i.name in filled]
    assert emptied and all(not i.raw_data and not i.float_data for i in emptied)
    weights = (packages["golden"] / "model.safetensors").stat().st_size
    assert sum(i.ByteSize() for i in emptied) < weights / 100


def _a_exported(monkeypatch, a, tmp_path):
    """(export/bind calls, a package of ``a``'s structure with other weights, the cache) once ``a``
    is exported into that cache."""
    calls = _counting(monkeypatch)
    b = _other_weights(a, tmp_path / "b")
    cache_dir = str(tmp_path / "cache")
    exported_files(a, cache_dir, "fp32", log=lambda *_: None)
    return calls, b, cache_dir


def test_a_binding_that_fails_verification_is_exported_instead(monkeypatch, packages, tmp_path):
    a = packages["golden"]
    calls, b, cache_dir = _a_exported(monkeypatch, a, tmp_path)
    real = binding.derive
    monkeypatch.setattr(binding, "derive", lambda tensors, step: real(tensors, step) * 1.01)  # a wrong recipe
    lines: list[str] = []
    files = exported_files(b, cache_dir, "fp32", log=lines.append)
    assert calls == {"export": [a, b], "bind": [b]}, calls
    assert any("binding failed" in line and "failed verification" in line for line in lines), lines
    monkeypatch.setattr(binding, "derive", real)
    size = read_metadata(files[0])["package_config"]["model"]["image_size"]
    x = np.random.default_rng(1).uniform(-1, 1, (2, 3, size, size)).astype(np.float32)
    torch_b = TorchBackend(b, device="cpu", precision="fp32", max_batch_size=8).run("classify", {"pixel_values": x})
    assert float(np.abs(_run(files, "classify", {"pixel_values": x}, b)["logits"] - torch_b["logits"]).max()) < 1e-4


def test_the_routing_graph_vouches_for_its_plain_graph(monkeypatch, packages, tmp_path):
    """A binding builds no session of the plain graph: the verified routing graph reads the same
    bytes for every initializer. The plain graph, run on its own, still answers with b's weights."""
    a = packages["golden"]
    calls, b, cache_dir = _a_exported(monkeypatch, a, tmp_path)
    verified: list[str] = []
    real_verify = export.onnx.verify
    monkeypatch.setattr(export.onnx, "verify", lambda path, *a, **k: verified.append(Path(path).name)
                        or real_verify(path, *a, **k))
    [plain] = exported_files(b, cache_dir, "fp32", log=lambda *_: None)
    assert calls["bind"] == [b] and verified == ["model.routing.onnx"], verified
    size = read_metadata(plain)["package_config"]["model"]["image_size"]
    x = np.random.default_rng(2).uniform(-1, 1, (3, 3, size, size)).astype(np.float32)
    alone = OnnxRuntimeBackend([plain], routing=False, weights=b / "model.safetensors")
    try:
        got = alone.run("classify", {"pixel_values": x})
    finally:
        alone.close()
    torch_b = TorchBackend(b, device="cpu", precision="fp32", max_batch_size=8).run("classify", {"pixel_values": x})
    assert float(np.abs(got["logits"] - torch_b["logits"]).max()) < 1e-4


def test_a_plain_graph_not_bound_as_its_routing_graph_is_verified_itself(monkeypatch, packages, tmp_path):
    """One initializer of the plain graph read from elsewhere than the routing graph's: the routing
    graph cannot vouch for it, and the plain graph is verified against PyTorch on its own."""
    a = packages["golden"]
    calls, b, cache_dir = _a_exported(monkeypatch, a, tmp_path)
    real_bind = binding.Binder.bind

    def bind(self, structure_file, recipe, tensors, out, metadata, found=False):
        real_bind(self, structure_file, recipe, tensors, out, metadata, found)
        if out.name == "model.onnx":  # the plain graph: one tensor moved to a copy of its bytes
            model = self.bound[out]
            t = next(t for t in model.graph.initializer if t.external_data)
            info = {e.key: e.value for e in t.external_data}
            source = self.weights if info["location"] == "model.safetensors" else self.derived
            with open(source, "rb") as f:
                f.seek(int(info["offset"]))
                data = f.read(int(info["length"]))
            at = self._out.seek(0, 2)
            self._out.write(data)
            self._written[("copy",)] = (at, len(data))
            for e in t.external_data:
                e.value = {"location": self.derived.name, "offset": str(at)}.get(e.key, e.value)
            out.write_bytes(model.SerializeToString())

    monkeypatch.setattr(binding.Binder, "bind", bind)
    verified: list[str] = []
    real_verify = export.onnx.verify
    monkeypatch.setattr(export.onnx, "verify", lambda path, *a, **k: verified.append(Path(path).name)
                        or real_verify(path, *a, **k))
    exported_files(b, cache_dir, "fp32", log=lambda *_: None)
    assert calls["bind"] == [b] and calls["export"] == [a] and verified == ["model.routing.onnx", "model.onnx"]


def test_tensors_of_one_value_are_told_apart_by_name():
    """Zero rows of experts' biases and a zero bias (as `softmoe init` writes them) share one value:
    the initializer's name, the parameter's path and row as the exporter writes them, settles which
    is which; a name that says nothing settles nothing."""
    options = [{"source": "encoder.blocks.0.norm1.bias", "op": "same", "index": None},
               *({"source": "encoder.blocks.6.mlp.b2", "op": "row", "index": i} for i in range(3)),
               {"source": "blocks.6.mlp.b2", "op": "row", "index": 2}]
    assert binding._named_after("model.encoder.blocks.6.mlp.b2__2", options) == options[3]  # the longest path
    assert binding._named_after("plain.model.encoder.blocks.6.mlp.b2__1", options) == options[2]
    assert binding._named_after("model.encoder.blocks.0.norm1.bias", options) == options[0]
    assert binding._named_after("model.encoder.blocks.6.mlp.b2__7", options) is None
    assert binding._named_after("val_12", options) is None


def test_another_structure_is_exported(monkeypatch, packages, tmp_path):
    calls = _counting(monkeypatch)
    a = packages["golden"]
    c = tmp_path / "c"
    shutil.copytree(a, c)
    config = json.loads((c / "config.json").read_text())
    config["labels"] = None  # metadata only: the same structure
    (c / "config.json").write_text(json.dumps(config))
    d = tmp_path / "d"
    shutil.copytree(a, d)
    config = json.loads((d / "config.json").read_text())
    config["model"]["classifier"] = "token" if config["model"]["classifier"] != "token" else "gap"
    (d / "config.json").write_text(json.dumps(config))
    from export import cache

    assert cache.package_structure(c) == cache.package_structure(a)
    assert cache.package_structure(d) != cache.package_structure(a)
    cache_dir = str(tmp_path / "cache")
    exported_files(a, cache_dir, "fp32", log=lambda *_: None)
    exported_files(c, cache_dir, "fp32", log=lambda *_: None)
    assert calls == {"export": [a], "bind": [c]}, calls


def test_a_two_tower_package_binds_both_towers(monkeypatch, packages, tmp_path):
    a = packages["tt"]
    calls, b, cache_dir = _a_exported(monkeypatch, a, tmp_path)
    files = exported_files(b, cache_dir, "fp32", log=lambda *_: None)
    assert calls == {"export": [a], "bind": [b]}, calls
    assert sorted(f.name for f in files) == ["model.image.onnx", "model.text.onnx"]


@pytest.mark.parametrize("mode", ["export", "bind"])
def test_the_child_exports_and_binds(packages, tmp_path, mode):
    """The child process (large packages) writes the structure when it exports, binds from it."""
    a = packages["golden"]
    settings = dict(opset=export.onnx.DEFAULT_OPSET, precision="fp32", experts="per-expert", towers="split",
                    dynamic_batch=True, verify_batches=[1, 4], routing=True)
    names = ob._in_child("export", a, tmp_path / "a" / "model.onnx", settings, tmp_path / "s")
    assert names == ["model.onnx", "model.routing.onnx"] and (tmp_path / "s" / binding.RECIPE).is_file()
    if mode == "bind":
        b = _other_weights(a, tmp_path / "b")
        assert ob._in_child("bind", b, tmp_path / "bb" / "model.onnx", settings, tmp_path / "s") == names


def test_the_cache_holds_no_copy_of_the_weights(monkeypatch, packages, tmp_path):
    """Exported then bound: each entry's graphs read their weights from the package's own file,
    the entry keeps only what that file does not hold as the graphs take it."""
    a = packages["golden"]
    calls, b, cache_dir = _a_exported(monkeypatch, a, tmp_path)
    import onnx

    from export import weights_file

    for package in (a, b):
        files = exported_files(package, cache_dir, "fp32", log=lambda *_: None)
        entry = files[0].parent
        assert not list(entry.glob("*.onnx.data"))
        stored = weights_file.index(package / "model.safetensors")
        [structure] = [p for p in (tmp_path / "cache" / "onnx-structure").iterdir() if p.is_dir()]
        steps = json.loads((structure / binding.RECIPE).read_text())["model.routing.onnx"]["steps"]
        graph = onnx.load(str(entry / "model.routing.onnx"), load_external_data=False)
        length = {t.name: int(next(e.value for e in t.external_data if e.key == "length"))
                  for t in graph.graph.initializer if t.external_data}
        from_package = {t.name for t in weights_file.uses_package(graph)}
        # every parameter taken as it is or by row is read from the package, the rest (transposed,
        # derived) once from the entry's derived file
        assert from_package == {s["name"] for s in steps if s["op"] in ("same", "row") and s["source"] in stored}
        derived = sum(length[s["name"]] for s in steps if s["name"] not in from_package)
        assert derived <= (entry / "model.derived.data").stat().st_size < derived + 4096 * len(steps)
    assert calls == {"export": [a], "bind": [b]}, calls


def test_a_bound_graph_needs_its_package_weights(monkeypatch, packages, tmp_path):
    a = packages["golden"]
    _counting(monkeypatch)
    files = exported_files(a, str(tmp_path / "cache"), "fp32", log=lambda *_: None)
    from export.errors import ExportError

    with pytest.raises(ExportError, match="model.safetensors: give the session that file"):
        OnnxRuntimeBackend(files)
    other = _other_weights(a, tmp_path / "short")
    (other / "model.safetensors").write_bytes((a / "model.safetensors").read_bytes()[:4096])
    with pytest.raises(ExportError, match="are not in"):
        OnnxRuntimeBackend(files, weights=other / "model.safetensors")
