"""The export cache's bound (export.cache_space): least recently used entries nothing holds removed
to keep a cap and a floor, held entries kept whichever process holds them, last use recorded at a
load, an entry that cannot fit refused with the bytes it needed and the bytes free, nothing
half-written left; and the metrics that watch it. Real files, real flocks, real small caches."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import GOLDEN
from export import cache, cache_space as space

QUIET = dict(log=lambda *_: None)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_floor(monkeypatch):
    """The cap alone, whatever the free space of the disk the tests run on (the floor has its own test)."""
    monkeypatch.setattr(space, "FLOOR", 0.0)
    monkeypatch.setattr(space, "_setting", None)
    monkeypatch.delenv(space.ENV, raising=False)


def _writer(size: int, name: str = "blob.bin"):
    def build(tmp: Path) -> list[str]:
        (tmp / name).write_bytes(os.urandom(size))
        return [name]

    return build


def _entry(home: Path, key: str, size: int = 10_000, last_use: float | None = None, kind: str = "onnx") -> Path:
    entry = cache.build(home / kind, key, _writer(size), **QUIET).path
    if last_use is not None:
        os.utime(entry, (last_use, last_use))
    return entry


def _leftovers(home: Path) -> list[str]:
    return sorted(p.name for r in space.roots(home) if r.is_dir() for p in r.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------ the bound


def test_sizes_and_shares_parse_and_the_default_bound_is_a_share_of_the_volume(tmp_path):
    assert space.parse_size("20G") == (20 * 10**9, None)
    assert space.parse_size("512Mi") == (512 * 2**20, None)
    assert space.parse_size("1000") == (1000, None)
    assert space.parse_size("50%") == (None, 0.5)
    assert space.parse_size("") == (None, None)
    for bad in ("abc", "0%", "120%", "-5G"):
        with pytest.raises(ValueError, match="cache size"):
            space.parse_size(bad)
    volume = os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize
    default = space.limit(tmp_path)
    assert default.cap == int(volume * space.DEFAULT_CAP) and default.volume == volume
    assert space.limit(tmp_path, "100%").floor == 0  # all of the volume: nothing left for a floor
    assert space.limit(tmp_path, "1M").cap == 10**6


def test_a_full_cap_removes_the_least_recently_used_unused_entry_not_the_used_one(tmp_path):
    home = tmp_path / "cache"
    used = _entry(home, "a", last_use=1_000)  # the oldest, but a loaded model holds it
    b = _entry(home, "b", last_use=2_000)  # the least recently used of those nothing holds
    c = _entry(home, "c", last_use=3_000)
    held = cache.hold([used / "blob.bin"])
    os.utime(used, (1_000, 1_000))  # still the least recently used (holding it was a use)
    space.set_limit(str(35_000))  # three entries and their manifests fit; a fourth does not
    lines: list[str] = []
    d = cache.build(home / "onnx", "d", _writer(10_000), log=lines.append).path
    assert used.is_dir() and c.is_dir() and d.is_dir()
    assert not b.exists() and not (home / "onnx" / "b.lock").exists()
    assert any("removed" in line and str(b) in line for line in lines)
    assert space.usage(home).total <= 35_000
    assert _leftovers(home) == []
    for h in held:
        h.release()
    os.utime(used, (1_000, 1_000))  # (holding it was a use)
    e = cache.build(home / "onnx", "e", _writer(10_000), **QUIET).path
    assert not used.exists() and c.is_dir() and e.is_dir()  # released: now the least recently used goes


def _hold_in_child(entry: Path) -> subprocess.Popen:
    code = ("import sys; from pathlib import Path; from export import cache; "
            "held = cache.hold([Path(sys.argv[1]) / 'blob.bin']); print('held', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code, str(entry)], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_another_process_holding_an_entry_keeps_it_from_removal(tmp_path):
    home = tmp_path / "cache"
    entry = _entry(home, "a", last_use=1_000)
    child = _hold_in_child(entry)
    try:
        assert space.evict(entry.parent, "a") is None
        assert [i.in_use for i in space.items(home, in_use=True)] == [True]
        removed, held = space.prune(home)
        assert removed == [] and [i.key for i in held] == ["a"]
        space.set_limit("1")  # a cap nothing fits under
        with pytest.raises(cache.CacheFull):
            cache.build(home / "onnx", "b", _writer(100), **QUIET)
        assert entry.is_dir() and cache.lookup(home / "onnx", "a", **QUIET) is not None
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert space.evict(entry.parent, "a") > 0 and not entry.exists()


def test_an_entry_being_built_is_not_removed(tmp_path):
    home = tmp_path / "cache"
    entry = _entry(home, "a")
    lock = space.lock_exclusive(home / "onnx" / "a.lock")  # as a build or replacement holds it
    try:
        assert space.evict(home / "onnx", "a") is None and entry.is_dir()
    finally:
        os.close(lock)


def test_a_removed_key_builds_again_under_a_new_lock_file(tmp_path):
    home = tmp_path / "cache"
    _entry(home, "a")
    waiting = os.open(home / "onnx" / "a.lock", os.O_RDWR)  # a builder that opened the lock file before
    assert space.evict(home / "onnx", "a") > 0 and not (home / "onnx" / "a.lock").exists()
    again = cache.build(home / "onnx", "a", _writer(10), **QUIET)
    assert again.built and (home / "onnx" / "a.lock").is_file()
    assert not space._same_file(waiting, home / "onnx" / "a.lock")  # its lock is not the one a build takes now
    os.close(waiting)


def test_no_room_under_the_cap_fails_naming_the_bytes_needed_and_free_and_leaves_nothing(tmp_path):
    home = tmp_path / "cache"
    kept = _entry(home, "a", size=5_000)
    held = cache.hold([kept / "blob.bin"])
    space.set_limit("8000")
    with pytest.raises(cache.CacheFull) as e:
        cache.build(home / "onnx", "b", _writer(6_000), **QUIET)
    message = str(e.value)
    assert "needs 6,000 bytes" in message and "free under the cache's cap of 8,000" in message
    assert "free on the volume" in message and "--cache-max-size" in message
    assert not (home / "onnx" / "b").exists() and _leftovers(home) == [] and kept.is_dir()
    for h in held:
        h.release()


def test_a_builder_out_of_space_runs_again_after_unused_entries_go(tmp_path):
    home = tmp_path / "cache"
    old = _entry(home, "a")
    calls: list[Path] = []

    def build(tmp: Path) -> list[str]:
        calls.append(tmp)
        (tmp / "blob.bin").write_bytes(b"x" * 100)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return ["blob.bin"]

    entry = cache.build(home / "onnx", "b", build, **QUIET)
    assert entry.built and len(calls) == 2 and not old.exists()

    def always_full(tmp: Path) -> list[str]:
        (tmp / "blob.bin").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    held = cache.hold([entry.path / "blob.bin"])
    with pytest.raises(cache.CacheFull, match="at least 100 bytes"):
        cache.build(home / "onnx", "c", always_full, **QUIET)
    assert _leftovers(home) == [] and entry.path.is_dir()
    for h in held:
        h.release()


def test_the_floor_removes_unused_entries_but_an_entry_the_volume_holds_is_still_written(tmp_path, monkeypatch):
    home = tmp_path / "cache"
    a = _entry(home, "a", last_use=1_000)
    b = _entry(home, "b", last_use=2_000)
    monkeypatch.setattr(space, "FLOOR", 0.10)
    def small_volume(path):  # a volume of 1 MB with less than its floor free, whatever the disk has
        return 10**6, 50_000 + sum(not p.exists() for p in (a, b)) * 20_000

    monkeypatch.setattr(space, "_statvfs", small_volume)
    entry = cache.build(home / "onnx", "c", _writer(1_000), **QUIET)
    assert entry.built and not a.exists() and not b.exists()  # both went towards the floor (100,000 free)


# ------------------------------------------------------------------ use and last use


def test_last_use_is_recorded_by_a_lookup_or_a_build_that_returns_the_entry(tmp_path):
    home = tmp_path / "cache"
    entry = _entry(home, "a", last_use=1_000)
    (entry / "blob.bin").read_bytes()  # reading the files is not a use the cache records
    assert entry.stat().st_mtime == 1_000
    assert cache.lookup(home / "onnx", "a", **QUIET) is not None
    assert entry.stat().st_mtime > 1_000
    os.utime(entry, (1_000, 1_000))
    assert not cache.build(home / "onnx", "a", _writer(1), **QUIET).built
    assert entry.stat().st_mtime > 1_000


def test_a_read_only_cache_is_never_written(tmp_path, monkeypatch):
    home = tmp_path / "cache"
    entry = _entry(home, "a", last_use=1_000)
    monkeypatch.setattr(space.os, "access", lambda path, mode: mode != os.W_OK)  # as a read-only mount answers
    assert cache.lookup(home / "onnx", "a", **QUIET) is not None
    assert entry.stat().st_mtime == 1_000


def test_an_entry_records_the_model_and_package_it_was_made_for(tmp_path):
    home = tmp_path / "cache"
    with cache.made_by("digits", tmp_path / "pkg"):
        cache.build(home / "onnx", "a", _writer(10), **QUIET)

    def findings(tmp: Path) -> dict:
        (tmp / "findings.json").write_text("{}")
        return {"model": "m"}  # as server.engine.proof_cache keeps it

    cache.build(home / "proofs", "p", findings, **QUIET)
    listed = {i.key: i for i in space.items(home)}
    assert (listed["a"].kind, listed["a"].model, listed["a"].package) == ("graph", "digits", str(tmp_path / "pkg"))
    assert (listed["p"].kind, listed["p"].model) == ("proofs", "m")


# ------------------------------------------------------------------ the metrics


def test_the_metrics_show_the_bytes_the_bound_and_the_removals(tmp_path):
    from server.metrics import Metrics

    metrics = Metrics()
    home = tmp_path / "cache"
    _entry(home, "a", last_use=1_000)
    space.set_limit("25000")
    _entry(home, "b")
    _entry(home, "c")  # a goes
    value = metrics.registry.get_sample_value
    assert value("softmoe_cache_bytes", {"kind": "graph"}) == space.usage(home).bytes["graph"] > 0
    assert value("softmoe_cache_evictions_total", {"kind": "graph"}) == 1
    assert value("softmoe_cache_max_bytes") == 25_000
    assert value("softmoe_cache_free_bytes") > 0


# ------------------------------------------------------------------ a served model holds its graphs


def test_a_loaded_onnx_model_holds_its_entry_until_it_is_closed(tmp_path_factory, tmp_path):
    from softmoe_models.convert import convert_checkpoint

    from server.backends.onnxruntime_backend import OnnxRuntimeBackend, exported_files

    pkg, _ = convert_checkpoint(GOLDEN / "softmoe_e4p2.npz", tmp_path_factory.mktemp("space") / "pkg")
    files = exported_files(pkg, str(tmp_path / "cache"), "fp32", **QUIET)
    backend = OnnxRuntimeBackend(files, threads=1, weights=pkg / "model.safetensors")
    x = np.random.default_rng(0).uniform(-1, 1, (2, 3, 32, 32)).astype(np.float32)
    assert backend.run("classify", {"pixel_values": x})["logits"].shape[0] == 2
    graphs = files[0].parent
    removed, held = space.prune(tmp_path / "cache")
    assert graphs.is_dir() and [i.path for i in held] == [graphs]
    assert {i.kind for i in removed} == {"structure"}  # read at the export, held by nobody since
    backend.close()
    removed, held = space.prune(tmp_path / "cache")
    assert [i.path for i in removed] == [graphs] and held == [] and not graphs.exists()
