"""``softmoe cache list|prune`` on a real small cache: kinds, bytes, last use, what made each entry,
what a loaded model holds; prune everything unused, by age, or down to a size; a table for people
and --json for scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from export import cache, cache_space as space
from export.cli import parse_age
from server.main import main

QUIET = dict(log=lambda *_: None)
ROOT = Path(__file__).resolve().parents[2]


def _build(home: Path, kind: str, key: str, size: int, last_use: float, model: str = "digits") -> Path:
    def write(tmp: Path) -> list[str]:
        (tmp / "blob.bin").write_bytes(b"x" * size)
        return ["blob.bin"]

    with cache.made_by(model, home.parent / "packages" / model):
        entry = cache.build(home / kind, key, write, **QUIET).path
    os.utime(entry, (last_use, last_use))
    return entry


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A cache of four entries, one of each kind, the oldest first; the graph entry held as a loaded model holds it."""
    monkeypatch.setattr(space, "FLOOR", 0.0)
    home = tmp_path / "cache"
    _build(home, "onnx-structure", "s", 1_000, 1_000_000)
    _build(home, "engines", "e", 2_000, 2_000_000, model="siglip")
    _build(home, "proofs", "p", 3_000, 3_000_000)
    _build(home, "onnx", "g", 4_000, 4_000_000)
    return home


def _run(capsys, *argv: str) -> str:
    main(list(argv))
    return capsys.readouterr().out


def test_list_shows_kind_bytes_last_use_and_what_made_each_entry(home, capsys):
    held = cache.hold([home / "onnx" / "g" / "blob.bin"])
    os.utime(home / "onnx" / "g", (4_000_000, 4_000_000))
    listed = json.loads(_run(capsys, "cache", "list", "--cache-dir", str(home), "--json"))
    rows = listed["entries"]
    assert [(r["kind"], r["key"]) for r in rows] == [("structure", "s"), ("engine", "e"), ("proofs", "p"),
                                                   ("graph", "g")]  # least recently used first
    assert [r["in_use"] for r in rows] == [False, False, False, True]
    assert rows[1]["model"] == "siglip" and rows[1]["package"] == str(home.parent / "packages" / "siglip")
    assert rows[0]["last_use"] == "1970-01-12T13:46:40Z"
    assert all(r["bytes"] > size for r, size in zip(rows, (1_000, 2_000, 3_000, 4_000)))  # the files and the manifest
    assert listed["bytes"] == sum(r["bytes"] for r in rows) and listed["cap"] > 0
    table = _run(capsys, "cache", "list", "--cache-dir", str(home))
    lines = table.splitlines()
    assert lines[0].split() == ["KIND", "KEY", "BYTES", "LAST", "USE", "IN", "USE", "MODEL", "PACKAGE"]
    assert lines[4].split()[0] == "graph" and "yes" in lines[4].split()
    assert lines[-1].startswith(f"4 entries, {listed['bytes']:,} bytes in {home}")
    for h in held:
        h.release()


def test_prune_removes_every_unused_entry_and_keeps_those_in_use(home, capsys):
    held = cache.hold([home / "onnx" / "g" / "blob.bin"])
    out = json.loads(_run(capsys, "cache", "prune", "--cache-dir", str(home), "--json"))
    assert sorted(r["key"] for r in out["removed"]) == ["e", "p", "s"] and [r["key"] for r in out["in_use"]] == ["g"]
    assert out["freed"] == sum(r["bytes"] for r in out["removed"]) and out["bytes"] == out["in_use"][0]["bytes"]
    assert [i.key for i in space.items(home)] == ["g"]
    for h in held:
        h.release()
    text = _run(capsys, "cache", "prune", "--cache-dir", str(home))
    assert "removed 1 entries" in text and space.items(home) == []


def test_prune_by_age_removes_only_entries_last_used_before_it(home, capsys):
    age = int(time.time() - 3_500_000)  # the entries were last used 1e6, 2e6, 3e6 and 4e6 s after the epoch
    out = json.loads(_run(capsys, "cache", "prune", "--cache-dir", str(home), "--older-than", str(age), "--json"))
    assert sorted(r["key"] for r in out["removed"]) == ["e", "p", "s"]
    assert [i.key for i in space.items(home)] == ["g"]
    assert [parse_age(a) for a in ("30d", "12h", "90m", "45s", "2w", "7")] == [2_592_000, 43_200, 5_400, 45,
                                                                              1_209_600, 7]


def test_prune_down_to_a_size_removes_the_least_recently_used_first(home, capsys):
    sizes = {i.key: i.bytes for i in space.items(home)}
    target = sizes["p"] + sizes["g"]
    out = json.loads(_run(capsys, "cache", "prune", "--cache-dir", str(home), "--max-size", str(target), "--json"))
    assert [r["key"] for r in out["removed"]] == ["s", "e"] and out["bytes"] == target
    assert [i.key for i in space.items(home)] == ["p", "g"]


def test_bad_arguments_are_one_line_errors(home):
    r = subprocess.run([sys.executable, "-m", "server.main", "cache", "prune", "--cache-dir", str(home),
                        "--older-than", "soon"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: argument --older-than: 'soon'")
    r = subprocess.run([sys.executable, "-m", "server.main", "cache", "prune", "--max-size", "50%"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "a size such as 10G" in r.stderr


def test_a_reader_that_stops_early_gets_no_traceback(home):
    """`softmoe cache list --json | head`: the pipe's reader is gone before the listing is written;
    the command ends with status 1 and nothing on stderr, as a filter that lost its reader does."""
    proc = subprocess.Popen([sys.executable, "-m", "server", "cache", "list", "--json", "--cache-dir", str(home)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # no reader: the first write fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and err == "", err
