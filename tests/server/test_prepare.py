"""Ahead of time (``softmoe prepare``): a prepared cache starts a server that exports nothing and
proves nothing, from a read-only volume; proofs are kept per kind of machine, and a bad or foreign
entry is refused with a line and rebuilt, never read. A load says where its time went: its phases
in the start-up line, in a metric and in the repository index while it runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from export import cache
from export.phases import Phases, phase, recording
from server.engine import proof_cache, proofs
from server.engine.core import LOADING, Engine, ModelStatus
from server.engine.startup import load_models
from server.metrics import Metrics
from server.settings import Settings

from helpers.images import golden_pngs
from helpers.live import free_port, stop_process, wait_until
from helpers.volumes import read_only, read_only_ok

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "server" / "default_models" / "digits"
SOFTMOE = [sys.executable, "-m", "server"]


def other_weights(dst: Path) -> Path:
    """digits with other head biases: the same structure, other weights, another cache key."""
    shutil.copytree(DIGITS, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights["head.bias"] = (weights["head.bias"] + np.arange(10, dtype=np.float32)).astype(np.float32)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "softmoe-package"})
    return dst


@pytest.mark.skipif(not read_only_ok(), reason="needs `unshare --mount --map-root-user` to mount a read-only volume")
def test_a_prepared_cache_serves_from_a_read_only_volume(tmp_path):
    package, cache_dir = tmp_path / "digits", tmp_path / "cache"
    shutil.copytree(DIGITS, package)
    flags = ["--model", f"d={package}", "--cache-dir", str(cache_dir), "--threads", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    prepared = subprocess.run([*SOFTMOE, "prepare", *flags], capture_output=True, text=True, env=env, timeout=600)
    assert prepared.returncode == 0, prepared.stderr + prepared.stdout
    assert "ready after" in prepared.stdout and "(exported, proven:" in prepared.stdout, prepared.stdout
    assert f"--cache-dir {cache_dir}" in prepared.stdout.splitlines()[-1]

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(read_only(cache_dir, [*SOFTMOE, "serve", *flags, "--port", str(port)]),
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until(f"http://127.0.0.1:{port}/v2/health/ready", 120, lambda: proc.poll() is None)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/classify", files=[("images", ("0.png", golden_pngs()[0], "image/png"))],
                       data={"model": "d"}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        stop_process(proc)
    text = log.read_text()
    line = next(x for x in text.splitlines() if "d: onnxruntime on cpu" in x)
    assert "(graphs from the cache, proofs from the cache:" in line and "start-up findings read from" in line, line
    assert "exporting" not in text and "proofs not kept" not in text, text

    # A package of the same structure that was not prepared: a load request gets a 400 naming what
    # to run, and the serving version stays ...
    repo = tmp_path / "repository"
    shutil.copytree(package, repo / "d")
    other = other_weights(repo / "other")
    port = free_port()
    with open(tmp_path / "repository.log", "w") as out:
        proc = subprocess.Popen(read_only(cache_dir, [*SOFTMOE, "serve", "--model-repository", str(repo),
                                                      "--model-control-mode", "explicit", "--load-model", "d",
                                                      "--cache-dir", str(cache_dir), "--threads", "2",
                                                      "--port", str(port)]),
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(f"{url}/v2/health/ready", 120, lambda: proc.poll() is None)
        r = httpx.post(f"{url}/v2/repository/models/other/load", timeout=120)
        assert r.status_code == 400, r.text
        message = r.json()["error"]  # the Open Inference Protocol's error body
        assert "cannot be written (Read-only file system)" in message, message
        assert f"softmoe prepare --model {other} --cache-dir {cache_dir}" in message, message
        r = httpx.post(f"{url}/v1/classify", files=[("images", ("0.png", golden_pngs()[0], "image/png"))],
                       data={"model": "d"}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        stop_process(proc)

    # ... and at start the server says what to run and exits 2.
    refused = subprocess.run(read_only(cache_dir, [*SOFTMOE, "serve", "--model", f"d={other}", "--cache-dir",
                                                   str(cache_dir), "--port", str(free_port())]),
                             capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode == 2, refused.stderr
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "cannot be written (Read-only file system)" in error, error
    assert f"softmoe prepare --model {other} --cache-dir {cache_dir}" in error, error


def _start(settings: Settings, lines: list[str]):
    engine = Engine(settings, Metrics(), say=lines.append)
    [model] = load_models(settings)
    engine.adopt([model])
    engine.warm(model)
    return engine, model


def test_proofs_are_kept_per_kind_of_machine_and_never_read_blind(tmp_path, monkeypatch):
    shutil.copytree(DIGITS, tmp_path / "d")
    settings = Settings(models=[f"d={tmp_path / 'd'}"], backend="onnxruntime", cache_dir=str(tmp_path / "cache"),
                        threads=2)
    proved = []
    real = proofs.prove
    monkeypatch.setattr(proofs, "prove", lambda *a, **k: proved.append(1) or real(*a, **k))

    def start():
        lines: list[str] = []
        engine, model = _start(settings, lines)
        shapes = {fn: tuple(q.shapes) for fn, q in model.queues.items()}
        value = engine.metrics.registry.get_sample_value(
            "softmoe_model_load_phase_duration_seconds_count", {"model": "d", "phase": "session"})
        engine.close()
        assert value == 1
        return lines, model, shapes

    lines, first, shapes = start()
    assert proved == [1] and not first.proofs_from
    [entry] = [p for p in (tmp_path / "cache" / "proofs").iterdir() if p.is_dir()]
    kept = json.loads((entry / proof_cache.FILE).read_text())
    assert {fn: tuple(s) for fn, s in kept["shapes"].items()} == shapes

    lines, second, again = start()
    assert proved == [1] and second.proofs_from == str(entry) and again == shapes
    assert "start-up findings read from" in lines[-1] and "proofs from the cache:" in lines[-1], lines

    # Another kind of machine: its own key, proven there, and the line says why.
    mine = cache.machine_identity()
    monkeypatch.setattr(cache, "machine_identity", lambda: {**mine, "cpu": "Another CPU", "flags": "0" * 16})
    lines, third, _ = start()
    assert proved == [1, 1] and not third.proofs_from
    assert any("were made on another kind of machine (" + mine["cpu"] in line and "Another CPU" in line
               for line in lines), lines

    # A corrupt entry is refused with its reason and rebuilt, never read.
    monkeypatch.setattr(cache, "machine_identity", lambda: mine)
    (entry / proof_cache.FILE).write_text(json.dumps({**kept, "shapes": {fn: [8] for fn in kept["shapes"]}}))
    lines, fourth, after = start()
    assert proved == [1, 1, 1] and not fourth.proofs_from and after == shapes
    assert any(f"cache entry {entry} is not usable (findings.json " in line
               for line in lines), lines
    _, fifth, _ = start()
    assert proved == [1, 1, 1] and fifth.proofs_from == str(entry)


def test_the_index_shows_where_a_load_is():
    status = ModelStatus("a", state=LOADING, loading=Phases())
    assert status.entry()["reason"] == ""
    with recording(status.loading), phase("export"):
        assert status.entry()["reason"] == "loading: export, 0 s so far"
    assert status.entry()["reason"] == ""
