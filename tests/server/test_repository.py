"""The model repository and its control (Triton's extension): a real `softmoe serve` on a repository
folder, driven by the unchanged tritonclient (HTTP and gRPC); and the engine's swap, drain and
poll in process.

The repository holds copies of the shipped digits package: ``a`` and ``b`` (the same weights),
``broken`` (a config that is not JSON); ``digits_v2`` (outside it) is digits with other head
biases, so its logits differ from v1's by exactly that bias and a test can tell the versions apart.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers.images import b64, random_pngs
from helpers.live import free_port, live_server, stop_process, wait_until
from server.engine.defaults import SHIPPED
from server.http.app import create_app
from server.settings import Settings

tritonclient_http = pytest.importorskip("tritonclient.http")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

ROOT = str(SHIPPED.parents[1])
DIGITS = SHIPPED / "digits"


def other_version(dst, shift: float = 0.5):
    """digits with every head bias moved by ``shift`` times its index: other logits, a package all the same."""
    shutil.copytree(DIGITS, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights["head.bias"] = (weights["head.bias"] + shift * np.arange(10, dtype=np.float32)).astype(np.float32)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "softmoe-package"})
    return dst


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    repo = root / "models"
    repo.mkdir()
    for name in ("a", "b"):
        shutil.copytree(DIGITS, repo / name)
    (repo / "broken").mkdir()
    (repo / "broken" / "config.json").write_text("{ not json")
    other_version(root / "digits_v2")
    return root


def pixels(seed: int = 0) -> np.ndarray:
    """A preprocessed 8x8 batch of one (vmoe's [-1, 1] range)."""
    return np.random.default_rng(seed).uniform(-1, 1, (1, 3, 8, 8)).astype(np.float32)


# ------------------------------------------------------------------ a real server, tritonclient


@pytest.fixture(scope="module")
def served(repository):
    port, grpc_port = free_port(), free_port()
    log = open(repository / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--port", str(port), "--grpc-port", str(grpc_port),
         "--model-repository", str(repository / "models"), "--model-control-mode", "explicit", "--load-model", "a",
         "--cache-dir", str(repository / "cache"), "--log-level", "info"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(f"http://127.0.0.1:{port}/v2/health/ready", 240, lambda: proc.poll() is None)
        yield {"http": f"127.0.0.1:{port}", "grpc": f"127.0.0.1:{grpc_port}", "url": f"http://127.0.0.1:{port}",
               "log": repository / "serve.log", "proc": proc}
    finally:
        stop_process(proc)
        log.close()


def index(client) -> dict[str, dict]:
    """The repository index by name, from tritonclient.http (a list of dicts) or .grpc (a message)."""
    entries = client.get_model_repository_index()
    if not isinstance(entries, list):
        entries = [{"name": m.name, "version": m.version, "state": m.state, "reason": m.reason} for m in entries.models]
    return {e["name"]: e for e in entries}


def test_explicit_mode_loads_only_the_named_model(served):
    client = tritonclient_http.InferenceServerClient(served["http"])
    entries = index(client)
    assert entries["a"]["state"] == "READY" and entries["a"]["version"] == "1"
    assert entries["b"]["state"] == "UNAVAILABLE" and entries["broken"]["state"] == "UNAVAILABLE"
    assert client.is_model_ready("a") and not client.is_model_ready("b")
    assert "model_repository" in client.get_server_metadata()["extensions"]
    r = httpx.post(f"{served['url']}/v1/classify", json={"model": "b", "images": [b64(random_pngs(1)[0])]})
    assert r.status_code == 404 and "'b' is not loaded (UNAVAILABLE" in r.json()["error"]["message"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_load_and_unload_with_tritonclient(served, protocol):
    lib = tritonclient_http if protocol == "http" else tritonclient_grpc
    client = lib.InferenceServerClient(served[protocol])
    client.load_model("b")
    assert client.is_model_ready("b")
    assert index(client)["b"]["state"] == "READY"
    inp = lib.InferInput("pixel_values", [1, 3, 8, 8], "FP32")
    inp.set_data_from_numpy(pixels())
    out_b = client.infer("b", [inp]).as_numpy("logits")
    out_a = client.infer("a", [inp]).as_numpy("logits")
    np.testing.assert_array_equal(out_a, out_b)  # the same package
    text = httpx.get(f"{served['url']}/metrics").text
    assert 'softmoe_model_ready{model="b"} 1.0' in text
    client.unload_model("b")
    assert not client.is_model_ready("b")
    entries = index(client)
    assert entries["b"]["state"] == "UNAVAILABLE" and entries["b"]["reason"] == "unloaded"
    text = httpx.get(f"{served['url']}/metrics").text
    b_series = [line for line in text.splitlines() if 'model="b"' in line and not line.startswith("#")]
    assert b_series and all(line.startswith(("softmoe_model_loads_", "softmoe_model_load_duration", "softmoe_model_load_phase"))
                            for line in b_series), b_series
    assert 'softmoe_model_loads_total{model="b",outcome="success"}' in text
    with pytest.raises(InferenceServerException, match="not loaded"):
        client.infer("b", [inp])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_control_requests_change_nothing(served, protocol):
    lib = tritonclient_http if protocol == "http" else tritonclient_grpc
    client = lib.InferenceServerClient(served[protocol])
    codes = {"http": ("400", "404", "409"), "grpc": ("StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND",
                                                     "StatusCode.FAILED_PRECONDITION")}[protocol]
    with pytest.raises(InferenceServerException) as bad:
        client.load_model("broken")
    assert "broken" in str(bad.value) and "invalid JSON" in str(bad.value)
    assert str(bad.value.status()) == codes[0]
    with pytest.raises(InferenceServerException) as missing:
        client.load_model("nope")
    assert "'nope' is not in the model repository" in str(missing.value) and str(missing.value.status()) == codes[1]
    with pytest.raises(InferenceServerException) as idle:
        client.unload_model("b")
    assert "'b' is not loaded" in str(idle.value) and str(idle.value.status()) == codes[2]
    entries = index(client)
    assert entries["a"]["state"] == "READY" and entries["a"]["version"] == "1"
    assert entries["broken"]["state"] == "UNAVAILABLE" and "load failed" in entries["broken"]["reason"]
    assert client.is_model_ready("a")


def test_every_change_is_one_log_line(served):
    httpx.post(f"{served['url']}/v2/repository/models/b/load").raise_for_status()
    httpx.post(f"{served['url']}/v2/repository/models/b/unload").raise_for_status()
    deadline = time.monotonic() + 10
    while "model b: unloaded" not in served["log"].read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = served["log"].read_text().splitlines()
    assert any("model b: version" in line and "serves" in line for line in lines)
    assert any("model b: unloaded and released" in line for line in lines)
    assert any("model broken: load failed" in line for line in lines)


def test_http_control_bodies_are_checked(served):
    url = served["url"]
    r = httpx.post(f"{url}/v2/repository/models/a/load", json={"parameters": {"config": "{}"}})
    assert r.status_code == 400 and "parameters.config" in r.json()["error"]
    r = httpx.post(f"{url}/v2/repository/index", content=b"[1]")
    assert r.status_code == 400
    r = httpx.post(f"{url}/v2/repository/index", json={"ready": True})
    assert [e["name"] for e in r.json()] == ["a"]


# ------------------------------------------------------------------ the swap, in process


INFER = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 8, 8],
                     "data": pixels().ravel().tolist()}]}


def oip_logits(url: str, model: str) -> np.ndarray:
    r = httpx.post(f"{url}/v2/models/{model}/infer", timeout=60, json=INFER)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["outputs"][0]["data"], dtype=np.float32)


def explicit_app(tmp_path):
    """A repository of one copy of digits, ``a``, and an app serving it (torch) in explicit mode."""
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(DIGITS, repo / "a")
    settings = Settings(model_repository=str(repo), model_control_mode="explicit", load_model=["a"],
                        backend="torch", cache_dir=str(tmp_path / "cache"), grpc_port=0)
    return repo, create_app(settings)


def test_a_reload_under_load_loses_nothing_and_never_mixes_versions(repository, tmp_path):
    repo, app = explicit_app(tmp_path)
    with live_server(app) as url:
        v1 = oip_logits(url, "a")
        shift = 0.5 * np.arange(10, dtype=np.float32)
        stop, results, errors, started_after = threading.Event(), [], [], []
        swapped = threading.Event()

        def client() -> None:
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    after = swapped.is_set()
                    r = c.post(f"{url}/v2/models/a/infer", json=INFER)
                    if r.status_code != 200:
                        errors.append(r.text)
                        continue
                    logits = np.asarray(r.json()["outputs"][0]["data"], dtype=np.float32)
                    (started_after if after else results).append(logits)

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        shutil.rmtree(repo / "a")
        other_version(repo / "a")
        r = httpx.post(f"{url}/v2/repository/models/a/load", timeout=120)
        assert r.status_code == 200, r.text
        swapped.set()
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        v2 = v1 + shift
        for logits in results:  # sent before the call returned: one version or the other, whole
            assert np.array_equal(logits, v1) or np.allclose(logits, v2, atol=1e-5), logits
        assert started_after and all(np.allclose(x, v2, atol=1e-5) and not np.allclose(x, v1, atol=1e-3)
                                     for x in started_after)
        engine = app.state.engine
        assert engine.status["a"].version == 2
        deadline = time.monotonic() + 30  # the old version drains, then its queues leave the batcher
        while len([q for q in engine.batcher.queues if q.label == "a"]) != len(engine.models["a"].queues):
            assert time.monotonic() < deadline, "the old version's queues were never removed"
            time.sleep(0.05)


def test_a_second_load_of_the_same_model_while_one_runs_is_refused(tmp_path, monkeypatch):
    _, app = explicit_app(tmp_path)
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        engine = app.state.engine
        gate, entered = threading.Event(), threading.Event()
        build = engine._build

        def slow_build(name, spec, serving):
            entered.set()
            gate.wait(30)
            return build(name, spec, serving)

        monkeypatch.setattr(engine, "_build", slow_build)
        first = threading.Thread(target=lambda: client.post("/v2/repository/models/a/load"))
        first.start()
        assert entered.wait(30)
        r = client.post("/v2/repository/models/a/load")
        assert r.status_code == 409 and "already under way" in r.json()["error"]
        r = client.post("/v2/repository/models/a/unload")
        assert r.status_code == 409
        assert client.post("/v2/models/a/infer", json=INFER).status_code == 200
        gate.set()
        first.join(60)
        assert engine.status["a"].version == 2 and engine.status["a"].state == "READY"


def test_a_new_version_that_does_not_fit_is_refused_before_building(tmp_path, monkeypatch):
    from server.engine import core

    _, app = explicit_app(tmp_path)
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        monkeypatch.setattr(core, "available_memory", lambda device: 1000)
        r = client.post("/v2/repository/models/a/load")
        assert r.status_code == 409 and "unload_first" in r.json()["error"], r.text
        assert app.state.engine.status["a"].version == 1
        r = client.post("/v2/repository/models/a/load", json={"parameters": {"unload_first": True}})
        assert r.status_code == 200, r.text
        assert app.state.engine.status["a"].version == 2


def test_a_next_version_of_the_same_graphs_inherits_the_start_up_findings(tmp_path, packages, monkeypatch):
    """ONNX Runtime: a version whose graphs differ only in their weights inherits the serving one's
    proofs and measurements (none is run again; every shape warmed; while batches are served its
    sessions are set up as load work) and answers with its own weights; a model of other graphs
    under the name proves anew, and with no batch served lately it is set up at full speed."""
    import asyncio

    from export.runtime import BackgroundBuiltSession
    from server.engine import core, proofs
    from server.engine.core import Engine
    from server.engine.startup import load_models
    from server.metrics import Metrics

    shutil.copytree(DIGITS, tmp_path / "a")
    settings = Settings(models=[f"a={tmp_path / 'a'}"], backend="onnxruntime", cache_dir=str(tmp_path / "cache"))
    engine = Engine(settings, Metrics(), say=lambda line: None)
    [first] = load_models(settings)
    engine.adopt([first])
    engine.warm(first)
    engine.start()
    proved = []
    for proof in ("prove_shapes", "prove_routing", "check_concurrent_batches"):
        real = getattr(proofs, proof)
        monkeypatch.setattr(proofs, proof, lambda *a, real=real, proof=proof, **k: proved.append(proof) or real(*a, **k))
    try:
        assert not first.inherited and not isinstance(first.backend.sessions["classify"], BackgroundBuiltSession)
        shapes = {fn: q.shapes for fn, q in first.queues.items()}
        structure = first.backend.structure()
        x = np.random.default_rng(0).uniform(-1, 1, (8, 3, 8, 8)).astype(np.float32)
        old_logits = first.backend.run("classify", {"pixel_values": x})["logits"]

        async def served() -> None:  # one request through the batcher: batches are being served
            await engine.batcher.submit(first.queues["classify"], {"pixel_values": x[0]}, 30)

        asyncio.run(served())
        new = engine.load("a", str(other_version(tmp_path / "v2")))
        assert new.inherited and not proved
        assert isinstance(new.backend.sessions["classify"], BackgroundBuiltSession)
        assert new.backend.structure() == structure
        assert {fn: q.shapes for fn, q in new.queues.items()} == shapes
        assert "inherited" in proofs.serving_line(new, settings)
        new_logits = engine.models["a"].queues["classify"].fn({"pixel_values": x})["logits"]
        np.testing.assert_allclose(new_logits - old_logits, np.broadcast_to(0.5 * np.arange(10), (8, 10)), atol=1e-5)

        monkeypatch.setattr(core, "SERVING_WITHIN_S", 0.0)  # no batch served lately
        other = engine.load("a", str(packages["golden"]))  # a Soft MoE classifier: other graphs
        assert not other.inherited and proved == ["prove_shapes", "prove_routing", "check_concurrent_batches"]
        assert not any(isinstance(s, BackgroundBuiltSession) for s in other.backend.sessions.values())
        assert other.backend.structure() != new.backend.structure()
    finally:
        engine.close()


def test_warming_runs_each_session_once_per_shape(tmp_path):
    """digits on ONNX Runtime: its classify function is served by the routing graph's session, so
    warming runs that session once per shape (as the routing function, which fetches every output);
    a backend without sessions runs every function at every shape."""
    from types import SimpleNamespace

    from server.backends.base import warming_calls
    from server.engine.startup import load_models

    settings = Settings(models=[f"a={DIGITS}"], backend="onnxruntime", cache_dir=str(tmp_path / "cache"))
    [model] = load_models(settings)
    try:
        backend = model.backend
        assert backend.sessions["classify"] is backend.sessions["routing"]
        calls = warming_calls(backend, lambda fn: [1, 2, 8])
        assert [(fn, size) for fn, _, size in calls] == [("routing", 1), ("routing", 2), ("routing", 8)]
        plain = SimpleNamespace(functions=backend.functions, routing=backend.routing)
        assert sorted((fn, size) for fn, _, size in warming_calls(plain, lambda fn: [1, 8])) == \
            [("classify", 1), ("classify", 8), ("routing", 1), ("routing", 8)]
    finally:
        model.backend.close()


def test_modes_none_and_poll_refuse_control_requests(tmp_path):
    from fastapi.testclient import TestClient

    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(DIGITS, repo / "a")
    for mode in ("none", "poll"):
        settings = Settings(model_repository=str(repo), model_control_mode=mode, backend="torch",
                            cache_dir=str(tmp_path / "cache"), grpc_port=0, repository_poll_s=3600)
        with TestClient(create_app(settings)) as client:
            assert [e["name"] for e in client.post("/v2/repository/index").json()] == ["a"]
            r = client.post("/v2/repository/models/a/load")
            assert r.status_code == 409 and "--model-control-mode" in r.json()["error"]
            assert client.post("/v2/repository/models/a/unload").status_code == 409


def test_poll_loads_new_and_changed_packages_and_unloads_removed_ones(tmp_path):
    from fastapi.testclient import TestClient

    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(DIGITS, repo / "a")
    settings = Settings(model_repository=str(repo), model_control_mode="poll", backend="torch",
                        cache_dir=str(tmp_path / "cache"), grpc_port=0, repository_poll_s=3600)
    app = create_app(settings)
    with TestClient(app) as client:
        control, engine = app.state.control, app.state.engine
        control.poll()  # nothing changed: nothing reloads
        assert engine.status["a"].version == 1
        shutil.copytree(DIGITS, repo / "c")
        (repo / ".partial").mkdir()  # a folder being written: skipped
        control.poll()
        assert sorted(engine.models) == ["a", "c"]
        shutil.rmtree(repo / "a")
        other_version(repo / "a")
        (repo / "c2").mkdir()
        (repo / "c2" / "config.json").write_text("{}")
        shutil.rmtree(repo / "c")
        control.poll()
        assert sorted(engine.models) == ["a"] and engine.status["a"].version == 2
        assert engine.status["c"].state == "UNAVAILABLE" and engine.status["c"].reason == "unloaded"
        assert engine.status["c2"].state == "UNAVAILABLE" and "load failed" in engine.status["c2"].reason
        control.poll()  # the broken package is not tried again until it changes
        text = client.get("/metrics").text
        assert 'softmoe_model_loads_total{model="c2",outcome="failure"} 1.0' in text


def test_control_settings_are_checked_at_start(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="needs --model-repository"):
        Settings(model_control_mode="explicit")
    with pytest.raises(ValidationError, match="--load-model names"):
        Settings(model_repository=str(tmp_path), load_model=["a"])
    with pytest.raises(ValidationError, match="--frontend-workers"):
        Settings(model_repository=str(tmp_path), model_control_mode="poll", frontend_workers=2)
    from server.engine.startup import StartupError, model_specs

    with pytest.raises(StartupError, match="--load-model x: model 'x' is not in the model repository"):
        model_specs(Settings(model_repository=str(tmp_path), model_control_mode="explicit", load_model=["x"]))
    with pytest.raises(StartupError, match="not a folder"):
        model_specs(Settings(model_repository=str(tmp_path / "none")))


def test_an_unload_waits_for_the_requests_the_model_admitted(tmp_path):
    from fastapi.testclient import TestClient

    _, app = explicit_app(tmp_path)
    with TestClient(app) as client:
        engine = app.state.engine
        model = engine.models["a"]
        gate, held = threading.Event(), threading.Event()

        def hold(queue, items):
            if queue.label == "a":
                held.set()
                gate.wait(30)

        engine.batcher.before_call = hold
        answers = {}
        inflight = threading.Thread(target=lambda: answers.update(infer=client.post("/v2/models/a/infer", json=INFER)))
        inflight.start()
        assert held.wait(30)
        unloading = threading.Thread(target=lambda: answers.update(unload=client.post("/v2/repository/models/a/unload")))
        unloading.start()
        deadline = time.monotonic() + 10
        while engine.status["a"].state != "UNLOADING":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.3)
        assert unloading.is_alive() and "unload" not in answers  # it waits for the admitted request
        r = client.post("/v2/models/a/infer", json=INFER)  # a new request no longer reaches the model
        assert r.status_code == 404 and "not loaded (UNLOADING)" in r.json()["error"]
        gate.set()
        inflight.join(30)
        unloading.join(30)
        assert answers["infer"].status_code == 200 and answers["unload"].status_code == 200
        assert engine.status["a"].state == "UNAVAILABLE" and "a" not in engine.models
        assert not [q for q in engine.batcher.queues if q.label == "a"] and not model.queues

