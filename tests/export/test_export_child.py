"""Large packages are exported in a child process (server/backends/onnxruntime_backend.py), so the
server does not keep the exporter's memory: the same verified, hash-checked cache entry as an
in-process export; the child's error, or its death, is one ExportError line, never a hang."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import GOLDEN
from export.errors import ExportError
from server.backends import onnxruntime_backend as ob

QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory, golden_dir):
    from softmoe_models.convert import convert_checkpoint

    path, _ = convert_checkpoint(GOLDEN / "softmoe_e8p1.npz", tmp_path_factory.mktemp("child") / "pkg")
    return path


def _logits(files: list[Path], package: Path) -> np.ndarray:
    backend = ob.OnnxRuntimeBackend(files, threads=1, weights=package / "model.safetensors")
    x = np.random.default_rng(0).uniform(-1, 1, (3, 3, 32, 32)).astype(np.float32)
    return backend.run("classify", {"pixel_values": x})["logits"]


def test_child_export_is_the_in_process_export(monkeypatch, pkg, tmp_path):
    lines: list[str] = []
    child = ob.exported_files(pkg, str(tmp_path / "b"), "fp32", log=lines.append)  # every export: in a child
    monkeypatch.setattr(ob, "EXPORT_IN_CHILD_BYTES", 1 << 62)
    inproc = ob.exported_files(pkg, str(tmp_path / "a"), "fp32", **QUIET)
    assert any("in a child process" in line for line in lines), lines
    assert [f.name for f in child] == [f.name for f in inproc]
    assert (child[0].parent / "model.routing.onnx").is_file()  # the routing graph too
    assert np.array_equal(_logits(child, pkg), _logits(inproc, pkg))
    # The entry is the cache's usual one: reused (hash-checked) on the next start, no export.
    again: list[str] = []
    assert ob.exported_files(pkg, str(tmp_path / "b"), "fp32", log=again.append) == child
    assert not any("exporting" in line for line in again), again


def test_child_errors_come_back_as_they_are(pkg, tmp_path):
    with pytest.raises(ExportError, match="unsupported opset 3"):
        ob._in_child("export", pkg, tmp_path / "model.onnx", {"opset": 3}, tmp_path / "s")


def test_a_child_that_dies_is_an_export_error(monkeypatch, pkg, tmp_path):
    # The kernel's OOM killer sends SIGKILL: the same death, without using up the memory.
    monkeypatch.setattr(ob, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(ExportError, match=r"the export process died \(exit status -9"):
        ob._in_child("export", pkg, tmp_path / "model.onnx", {}, tmp_path / "s")


def test_a_large_package_exports_at_the_lowest_priority_and_a_small_one_at_the_servers(monkeypatch, pkg, tmp_path):
    import os

    # the child's own preamble (its arguments, its nice value), then its niceness instead of an export
    preamble = ob._CHILD.split("try:")[0]
    monkeypatch.setattr(ob, "_CHILD", preamble + "print(json.dumps([os.nice(0)]))")
    mine = os.nice(0)
    monkeypatch.setattr(ob, "LOW_PRIORITY_EXPORT_BYTES", 1)
    assert ob._in_child("export", pkg, tmp_path / "model.onnx", {}, tmp_path / "s") == [19]
    monkeypatch.setattr(ob, "LOW_PRIORITY_EXPORT_BYTES", 1 << 62)
    assert ob._in_child("export", pkg, tmp_path / "model.onnx", {}, tmp_path / "s") == [mine]
    assert ob._in_child("export", pkg, tmp_path / "model.onnx", {}, tmp_path / "s", beside_batches=True) == [mine]


def test_a_large_package_beside_served_batches_binds_as_load_work_on_one_cpu(monkeypatch, pkg, tmp_path):
    import os

    from export.runtime import LOAD_NICE

    preamble = ob._CHILD.split("try:")[0]
    monkeypatch.setattr(ob, "_CHILD", preamble + "print(json.dumps([os.nice(0), sorted(os.sched_getaffinity(0))]))")
    monkeypatch.setattr(ob, "LOW_PRIORITY_EXPORT_BYTES", 1)
    nice, cpus = ob._in_child("bind", pkg, tmp_path / "model.onnx", {}, tmp_path / "s", beside_batches=True)
    assert nice == max(LOAD_NICE, os.nice(0)) and cpus == [max(os.sched_getaffinity(0))]


def test_export_memory_bench_runs(tmp_path):
    """`python -m loadtests.export_memory` (its figures: docs/benchmarks.md) on the shipped digits:
    both ways run and report; no figure is asserted."""
    from loadtests.export_memory import run
    from server.engine.defaults import SHIPPED

    out = run(SHIPPED / "digits", tmp_path, log=lambda m: None)
    for key in ("export_child_rss_mb", "export_inprocess_rss_mb", "export_child_s", "export_inprocess_s"):
        assert out[key] > 0, (key, out)
    assert list(tmp_path.iterdir()) == []  # the temporary caches are gone
