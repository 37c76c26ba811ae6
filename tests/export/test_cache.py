"""Caches shared by replicas on one volume: keys over every input, hash-checked lookups, one build
across processes, nothing half-written or left behind; the ONNX Runtime export cache on top, and
the .onnx loader's tokenizer without a temp dir."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import GOLDEN
from export import cache
from export.errors import ExportError

QUIET = dict(log=lambda *_: None)


def _writer(files: dict[str, bytes], calls: list | None = None):
    """A builder writing ``files`` (and counting its calls)."""

    def build(tmp: Path) -> list[str]:
        if calls is not None:
            calls.append(tmp)
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
        return list(files)

    return build


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".bad-")))


# ------------------------------------------------------------------ the generic API


def test_key_is_canonical_and_changes_with_every_input():
    base = {"package": {"config.json": "c" * 64, "model.safetensors": "w" * 64}, "precision": "fp32", "opset": 20,
            "runtime": {"name": "onnxruntime", "version": "1.22.0"}, "device": "cpu-x86_64", "batches": [1, 4]}
    reordered = dict(reversed(list(base.items())))
    assert cache.cache_key(base) == cache.cache_key(reordered)  # canonical JSON: key order does not matter
    assert len(cache.cache_key(base)) == 64
    changes = [
        {"package": {"config.json": "d" * 64, "model.safetensors": "w" * 64}},  # config.json only
        {"precision": "fp16"}, {"opset": 21}, {"runtime": {"name": "onnxruntime", "version": "1.22.1"}},
        {"device": "cpu-aarch64"}, {"batches": [1, 8]},
    ]
    for change in changes:
        assert cache.cache_key({**base, **change}) != cache.cache_key(base), change


def test_build_publishes_a_checked_entry_and_lookup_reuses_it(tmp_path):
    calls: list = []
    files = {"model.onnx": b"graph" * 100, "sub/model.onnx.data": os.urandom(4096)}
    entry = cache.build(tmp_path, "k1", _writer(files, calls), inputs={"x": 1}, **QUIET)
    assert entry.built and entry.path == tmp_path / "k1" and entry.meta == ["model.onnx", "sub/model.onnx.data"]
    assert {n: p.read_bytes() for n, p in entry.files.items()} == files
    manifest = json.loads((entry.path / cache.MANIFEST).read_text())
    assert manifest["key"] == "k1" and manifest["inputs"] == {"x": 1}
    assert manifest["files"]["model.onnx"] == {"size": 500, "blake3": cache.file_digest(entry.files["model.onnx"])}
    again = cache.build(tmp_path, "k1", _writer(files, calls), **QUIET)
    assert not again.built and again.files == entry.files and again.meta == entry.meta
    assert len(calls) == 1 and cache.lookup(tmp_path, "k1", **QUIET) == again
    assert cache.lookup(tmp_path, "other", **QUIET) is None
    assert _leftovers(tmp_path) == []


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _drop_manifest(path: Path) -> None:
    (path.parent / cache.MANIFEST).unlink()


def _same_size_edit_of_manifest(path: Path) -> None:
    m = path.parent / cache.MANIFEST
    manifest = json.loads(m.read_text())
    manifest["meta"] = ["model.onnx", "model.onnx"]  # a tampered manifest whose file hashes still match
    m.write_text(json.dumps(manifest))


CORRUPTIONS = {"flip": _flip, "truncate": _truncate, "no-manifest": _drop_manifest,
               "manifest-edited": _same_size_edit_of_manifest, "deleted": lambda p: p.unlink()}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS))
def test_corrupt_or_partial_entry_is_detected_and_rebuilt(tmp_path, corrupt):
    calls: list = []
    files = {"model.onnx": os.urandom(10_000)}
    entry = cache.build(tmp_path, "k", _writer(files, calls), **QUIET)
    CORRUPTIONS[corrupt](entry.files["model.onnx"])
    lines: list[str] = []
    assert cache.lookup(tmp_path, "k", log=lines.append) is None
    assert lines and "not usable" in lines[0]
    rebuilt = cache.build(tmp_path, "k", _writer(files, calls), log=lines.append)
    assert rebuilt.built and len(calls) == 2
    assert rebuilt.files["model.onnx"].read_bytes() == files["model.onnx"]
    assert any("rebuilding" in line for line in lines)
    assert _leftovers(tmp_path) == []  # the bad entry was moved aside and deleted


@pytest.mark.parametrize("failure", ["raises", "verification"])
def test_failed_build_leaves_no_temp_dir_and_no_entry(tmp_path, failure):
    seen: list[Path] = []

    def build(tmp: Path):
        seen.append(tmp)
        (tmp / "model.onnx").write_bytes(b"half")
        if failure == "raises":
            raise RuntimeError("exporter crashed")
        raise ExportError("verification failed: max abs err 1e-1 > 1e-4")

    with pytest.raises((RuntimeError, ExportError)):
        cache.build(tmp_path, "k", build, **QUIET)
    assert seen and seen[0].parent == tmp_path and seen[0].name.startswith(".tmp-k-")
    assert not seen[0].exists() and not (tmp_path / "k").exists() and _leftovers(tmp_path) == []
    assert cache.lookup(tmp_path, "k", **QUIET) is None


def test_builder_may_not_write_the_manifest_or_nothing(tmp_path):
    with pytest.raises(cache.CacheError, match="keeps for itself"):
        cache.build(tmp_path, "k", _writer({cache.MANIFEST: b"{}"}), **QUIET)
    with pytest.raises(cache.CacheError, match="no files"):
        cache.build(tmp_path, "k", lambda tmp: [], **QUIET)
    assert not (tmp_path / "k").exists() and _leftovers(tmp_path) == []


def test_stale_temp_dirs_are_removed_but_not_a_live_build(tmp_path):
    import fcntl

    for name in (".tmp-k-dead1", ".tmp-other-dead2", ".tmp-busy-live", ".bad-k-half"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx").write_bytes(b"x")
    fd = os.open(tmp_path / "busy.lock", os.O_RDWR | os.O_CREAT)  # a process building "busy" right now
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        lines: list[str] = []
        cache.build(tmp_path, "k", _writer({"a": b"a"}), log=lines.append)
    finally:
        os.close(fd)
    assert _leftovers(tmp_path) == [".tmp-busy-live"]
    assert sum("did not finish" in line for line in lines) == 2


def _build_in_process(root: str, marker: str, barrier, out) -> None:
    def build(tmp: Path) -> list[str]:
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough for the other process to reach the lock
        (tmp / "model.onnx").write_bytes(b"built once" * 1000)
        return ["model.onnx"]

    barrier.wait()
    entry = cache.build(root, "shared", build, log=lambda *_: None)
    out.put((os.getpid(), entry.built, str(entry.files["model.onnx"]), entry.files["model.onnx"].read_bytes()))


def test_two_processes_build_one_entry_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    marker = tmp_path / "builds.txt"
    procs = [ctx.Process(target=_build_in_process, args=(str(tmp_path / "cache"), str(marker), barrier, out))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(marker.read_text().splitlines()) == 1  # built exactly once
    assert sorted(r[1] for r in results) == [False, True]  # one built it, the other waited and found it
    assert {r[2] for r in results} == {str(tmp_path / "cache" / "shared" / "model.onnx")}
    assert all(r[3] == b"built once" * 1000 for r in results)
    assert _leftovers(tmp_path / "cache") == []


def test_default_root_is_never_inside_the_package(monkeypatch, tmp_path):
    monkeypatch.delenv("SOFTMOE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.default_root() == tmp_path / "xdg" / "softmoe-serve"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.default_root() == tmp_path / "home" / ".cache" / "softmoe-serve"
    monkeypatch.setenv("SOFTMOE_CACHE_DIR", str(tmp_path / "vol"))
    assert cache.default_root() == tmp_path / "vol"
    assert cache.default_root(str(tmp_path / "flag")) == tmp_path / "flag"


# ------------------------------------------------------------------ the ONNX Runtime export cache


@pytest.fixture(scope="module")
def pkg(tmp_path_factory, golden_dir):
    from softmoe_models.convert import convert_checkpoint

    path, _ = convert_checkpoint(GOLDEN / "softmoe_e4p2.npz", tmp_path_factory.mktemp("cache") / "pkg")
    return path


@pytest.fixture(scope="module")
def fresh_output(pkg, tmp_path_factory):
    """Logits of a fresh export, never cached, on fixed inputs."""
    from export.onnx import export_onnx

    out = tmp_path_factory.mktemp("fresh") / "model.onnx"
    export_onnx(pkg, out, towers="split", **QUIET)
    return _logits([out], pkg)


def _logits(files: list[Path], package: Path) -> np.ndarray:
    from server.backends.onnxruntime_backend import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(files, threads=1, weights=package / "model.safetensors")
    x = np.random.default_rng(0).uniform(-1, 1, (3, 3, 32, 32)).astype(np.float32)
    return backend.run("classify", {"pixel_values": x})["logits"]


def _captured_keys(monkeypatch, pkg: Path, **calls) -> dict[str, str]:
    """The cache key ``exported_files`` asks for under each named variation (no export runs)."""
    from server.backends import onnxruntime_backend

    keys: dict[str, str] = {}

    class Captured(Exception):
        pass

    def capture(root, key, builder, **kw):
        raise Captured(key)

    monkeypatch.setattr(cache, "build", capture)
    for name, (package, precision, setup) in calls.items():
        with monkeypatch.context() as m:
            setup(m)
            with pytest.raises(Captured) as e:
                onnxruntime_backend.exported_files(package, "", precision, **QUIET)
        keys[name] = e.value.args[0]
    return keys


def test_onnx_cache_key_covers_config_precision_opset_runtime(monkeypatch, pkg, tmp_path):
    import onnxruntime

    import export.onnx

    other_config = tmp_path / "pkg"
    shutil.copytree(pkg, other_config)
    config = json.loads((other_config / "config.json").read_text())
    config["preprocess"]["crop"] = not config["preprocess"].get("crop", False)  # same weights, new contract
    (other_config / "config.json").write_text(json.dumps(config, indent=2))
    nothing = lambda m: None  # noqa: E731
    keys = _captured_keys(
        monkeypatch, pkg,
        base=(pkg, "fp32", nothing),
        same=(pkg, "fp32", nothing),
        config=(other_config, "fp32", nothing),
        precision=(pkg, "fp16", nothing),
        opset=(pkg, "fp32", lambda m: m.setattr(export.onnx, "DEFAULT_OPSET", 21)),
        runtime=(pkg, "fp32", lambda m: m.setattr(onnxruntime, "__version__", "0.0.1")),
        exporter=(pkg, "fp32", lambda m: m.setattr(cache, "versions", lambda *d: {n: "9.9" for n in d})),
    )
    assert keys["same"] == keys["base"]
    for name in ("config", "precision", "opset", "runtime", "exporter"):
        assert keys[name] != keys["base"], name


@pytest.mark.parametrize("corrupt", ["flip", "truncate", "no-manifest"])
def test_corrupt_cached_onnx_is_rebuilt_never_served(monkeypatch, pkg, fresh_output, tmp_path, corrupt):
    import export.onnx
    import server.backends.onnxruntime_backend as ob
    from server.backends.onnxruntime_backend import exported_files

    monkeypatch.setattr(ob, "EXPORT_IN_CHILD_BYTES", 1 << 62)  # in this process, where the exports are counted
    exports: list[Path] = []
    real = export.onnx.export_onnx

    def counting(package, out, **kw):
        exports.append(Path(out))
        return real(package, out, **kw)

    binds: list[Path] = []
    real_bind = export.onnx.bind_onnx

    def counting_binds(package, structure, out, **kw):
        binds.append(Path(out))
        return real_bind(package, structure, out, **kw)

    monkeypatch.setattr(export.onnx, "export_onnx", counting)
    monkeypatch.setattr(export.onnx, "bind_onnx", counting_binds)
    files = exported_files(pkg, str(tmp_path / "cache"), "fp32", **QUIET)
    assert [f.name for f in files] == ["model.onnx"] and len(exports) == 1
    assert exports[0].parent.parent.name.startswith(".tmp-")  # written in a temp dir, published by rename
    assert np.array_equal(_logits(files, pkg), fresh_output)
    assert exported_files(pkg, str(tmp_path / "cache"), "fp32", **QUIET) == files and len(exports) == 1

    {"flip": _flip, "truncate": _truncate, "no-manifest": _drop_manifest}[corrupt](files[0])
    lines: list[str] = []
    again = exported_files(pkg, str(tmp_path / "cache"), "fp32", log=lines.append)
    # rebuilt from the structure exported once: the weights bound again and verified
    assert len(exports) == 1 and len(binds) == 1 and any("not usable" in line for line in lines)
    assert again == files
    assert np.array_equal(_logits(again, pkg), fresh_output)  # what is served is a fresh, verified export
    assert _leftovers(tmp_path / "cache" / "onnx") == []


def test_cache_dir_setting_and_config_change_give_separate_entries(pkg, tmp_path):
    from server.backends.onnxruntime_backend import exported_files

    other = tmp_path / "pkg"
    shutil.copytree(pkg, other)
    config = json.loads((other / "config.json").read_text())
    config["provenance"]["note"] = "edited"
    (other / "config.json").write_text(json.dumps(config, indent=2))
    a = exported_files(pkg, str(tmp_path / "cache"), "fp32", **QUIET)
    b = exported_files(other, str(tmp_path / "cache"), "fp32", **QUIET)
    assert a[0].parent != b[0].parent and a[0].parent.parent == tmp_path / "cache" / "onnx"
    assert sorted(p.name for p in other.iterdir()) == sorted(p.name for p in pkg.iterdir())  # nothing written there


# ------------------------------------------------------------------ serving an .onnx file


def test_onnx_file_loader_leaks_no_temp_dir(monkeypatch, tmp_path, tokenizer_file, golden_dir):
    from export.onnx import export_onnx
    from server.engine.models import _from_onnx
    from server.settings import Settings
    from softmoe_models.convert import convert_checkpoint
    from softmoe_models.tokenizer import Tokenizer

    pkg_dir, _ = convert_checkpoint(GOLDEN / "twotower.npz", tmp_path / "tt", tokenizer=tokenizer_file, text_pool="last")
    export_onnx(pkg_dir, tmp_path / "out" / "tt.onnx", towers="split", **QUIET)

    def no_temp(*args, **kw):
        raise AssertionError("the .onnx loader made a temp dir")

    private = tmp_path / "tmpdir"  # others share /tmp: count entries of a temp dir of our own
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    before = sorted(os.listdir(tempfile.gettempdir()))
    monkeypatch.setattr(tempfile, "mkdtemp", no_temp)
    monkeypatch.setattr(tempfile, "mkstemp", no_temp)
    model = _from_onnx("tt", tmp_path / "out" / "tt.text.onnx", Settings(backend="onnxruntime", threads=1))
    assert sorted(os.listdir(tempfile.gettempdir())) == before
    want = Tokenizer.from_contract(tokenizer_file, model.text_contract)
    texts = ["a photo of a cat", "ONE boat", "the apple tree house bird dog car"]
    assert np.array_equal(model.tokenizer(texts), want(texts))


def test_hashing_runs_on_a_low_priority_thread_and_raises_in_the_caller(tmp_path):
    """Weights and cached graphs are hashed on a thread of their own at nice 19 (Linux), so a
    server that loads a model while it serves hashes with the CPU its batches leave; the digest
    is sha256's and an error comes back to the caller."""
    import hashlib
    import os
    import sys
    import threading

    import pytest

    from export import cache

    data = os.urandom(3 * cache.CHUNK + 5)
    (tmp_path / "w").write_bytes(data)
    seen = {}

    def probe(path, fsync):
        seen["thread"] = threading.current_thread() is not threading.main_thread()
        if sys.platform == "linux":
            seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return cache._sha256(path, fsync)

    assert cache.at_low_priority(probe, tmp_path / "w", False) == hashlib.sha256(data).hexdigest()
    assert seen["thread"] and seen.get("nice", 19) == 19
    assert cache.file_sha256(tmp_path / "w") == hashlib.sha256(data).hexdigest()
    with pytest.raises(FileNotFoundError):
        cache.file_sha256(tmp_path / "missing")


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values and CPUs are Linux's")
def test_a_digest_as_load_work_is_the_same_and_hashed_on_one_lowered_thread(tmp_path, monkeypatch):
    from export import cache, runtime

    data = os.urandom(3 * cache.CHUNK + 5)
    (tmp_path / "w").write_bytes(data)
    whole = cache.file_digest(tmp_path / "w")
    seen = {}
    real = cache._blake3

    def probe(path, fsync, threads=0):
        tid = threading.get_native_id()
        seen.update(nice=os.getpriority(os.PRIO_PROCESS, tid), cpus=os.sched_getaffinity(tid), threads=threads)
        return real(path, fsync, threads)

    monkeypatch.setattr(cache, "_blake3", probe)
    assert cache.file_digest(tmp_path / "w", load=True) == whole
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == {"nice": max(runtime.LOAD_NICE, mine), "cpus": {max(os.sched_getaffinity(0))}, "threads": 1}
