"""The pod the overlays render, against the server it runs: GPU and CPU specifics, security and
volumes, probes that hit real routes, an env that is valid Settings, a termination grace period
that covers preStop + drain + uvicorn's graceful shutdown (server/run.py), and the CPU overlay's
container run for real (its args and env): start-up, probes, SIGTERM drain.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers.deploy import DEPLOY, OVERLAYS, PREPARED, by_kind, container, env_of, render, render_overlay
from helpers.live import free_port

BIN = Path(sys.executable).parent
rendered = pytest.fixture(scope="module", params=OVERLAYS)(render_overlay)


def test_gpu_and_cpu_specifics(rendered):
    name, docs = rendered
    pod = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    c, env = container(docs), env_of(docs)
    res = c["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]
    startup = c["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    if name == "gpu":
        assert str(res["limits"]["nvidia.com/gpu"]) == "1"
        assert "nvidia.com/gpu" not in res["requests"]  # GPUs go in limits (requests default to them)
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert env["SOFTMOE_BACKEND"] == "tensorrt" and env["SOFTMOE_DEVICE"] == "cuda"
        assert c["image"].endswith("-gpu")
        assert budget >= 20 * 60, "the startup probe must cover a cold TensorRT engine build"
    else:
        assert "nvidia.com/gpu" not in res.get("limits", {}) and "tolerations" not in pod and "nodeSelector" not in pod
        assert env["SOFTMOE_DEVICE"] == "cpu" and c["image"].endswith("-cpu")
        assert int(env["SOFTMOE_THREADS"]) == int(res["requests"]["cpu"]), "intra-op threads = CPU request"
        if name in PREPARED:  # reads and sets up sessions only; a pod that would export cannot (read-only cache)
            assert 60 <= budget <= 5 * 60
        else:
            assert budget >= 5 * 60


def test_pod_security_and_volumes(rendered):
    name, docs = rendered
    pod = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert pod["enableServiceLinks"] is False  # service env vars would land in the SOFTMOE_ namespace
    assert pod["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    cache = env_of(docs)["SOFTMOE_CACHE_DIR"]
    cache_mount = next(m for m in c["volumeMounts"] if m["mountPath"] == cache)
    if name in PREPARED:
        assert cache_mount.get("readOnly") is True and volumes[mounts[cache]]["persistentVolumeClaim"]["readOnly"]
    else:
        assert "emptyDir" in volumes[mounts[cache]] and not cache_mount.get("readOnly")
    # emptyDirs count against the container's ephemeral storage: the limit must hold them all.
    units = {"Mi": 2**20, "Gi": 2**30}

    def size(q: str) -> int:
        return int(q[:-2]) * units[q[-2:]]

    dirs = sum(size(v["emptyDir"]["sizeLimit"]) for v in volumes.values() if "emptyDir" in v)
    assert dirs <= size(c["resources"]["limits"]["ephemeral-storage"])


class Routes:
    """``path in routes``: the app answers GET ``path`` with something other than 404/405."""

    def __init__(self) -> None:
        from fastapi.testclient import TestClient

        from server.http.app import create_app
        from server.settings import Settings

        self.client = TestClient(create_app(Settings()))  # not entered: no lifespan, no model loaded

    def __contains__(self, path: str) -> bool:
        return self.client.get(path).status_code not in (404, 405)


@pytest.fixture(scope="module")
def routes() -> Routes:
    return Routes()


def _grpc_health(port: int, timeout: float) -> str:
    """What Kubernetes' grpc probe asks: grpc.health.v1.Health/Check for the server ("")."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _probe_port(c: dict, port) -> int:
    if isinstance(port, int):
        return port
    (p,) = [p for p in c["ports"] if p["name"] == port]
    return p["containerPort"]


def test_probes_and_scrape_hit_real_server_routes(rendered, routes):
    _, docs = rendered
    c = container(docs)
    from server.settings import Settings

    port = int(env_of(docs).get("SOFTMOE_PORT", Settings().port))
    grpc_port = int(env_of(docs).get("SOFTMOE_GRPC_PORT", Settings().grpc_port))
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert "/v2/health/nothing" not in routes  # the check can fail
    for probe in ("startupProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] in routes
        assert _probe_port(c, get["port"]) == port
    # Readiness: the gRPC health service (the whole server: service ""), on the gRPC port by number.
    assert c["readinessProbe"]["grpc"].get("service", "") == "" and c["readinessProbe"]["grpc"]["port"] == grpc_port
    assert _probe_port(c, "grpc") == grpc_port != 0
    svc = by_kind(docs, "Service")
    sport, gport = svc["spec"]["ports"]
    assert _probe_port(c, sport["targetPort"]) == port and _probe_port(c, gport["targetPort"]) == grpc_port
    assert gport["appProtocol"] == "kubernetes.io/h2c"
    pod_labels = by_kind(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    sm = by_kind(docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == sport["name"] and ep["path"] == "/metrics" and "/metrics" in routes
    pdb = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"] == by_kind(docs, "Deployment")["spec"]["selector"]


@pytest.fixture
def env_settings(monkeypatch):
    def make(env: dict[str, str]):
        from server.settings import Settings

        for k in list(os.environ):
            if k.startswith("SOFTMOE_"):
                monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return Settings()
    return make


def test_env_is_valid_settings(rendered, env_settings):
    _, docs = rendered
    from server.settings import Settings

    env = env_of(docs)
    fields = {f"SOFTMOE_{f.upper()}" for f in Settings.model_fields}
    unknown = {k for k in env if k.startswith("SOFTMOE_")} - fields
    assert not unknown, f"not settings: {unknown}"
    s = env_settings(env)
    assert s.cache_dir == env["SOFTMOE_CACHE_DIR"]


def _graceful_shutdown_s(settings, monkeypatch) -> float:
    """uvicorn's timeout_graceful_shutdown as server/run.py configures it for ``settings``."""
    import server.run as run

    seen = {}

    def record(server):
        seen["graceful"] = server.config.timeout_graceful_shutdown
        seen["drain"] = server.drain_seconds

    async def fake_serve(server, *a, **k):
        record(server)

    # No backend check, models or app: only the uvicorn configuration is looked at.
    from types import SimpleNamespace

    from server.metrics import Metrics

    monkeypatch.setattr(run, "create_app", lambda *a, **k: SimpleNamespace(state=SimpleNamespace(metrics=Metrics())))
    for name, value in (("check_backend", None), ("load_models", [])):
        if hasattr(run, name):
            monkeypatch.setattr(run, name, lambda *a, _v=value, **k: _v)
    if hasattr(run, "_serve"):  # the server is started by run._serve(server, sock)
        monkeypatch.setattr(run, "_serve", fake_serve)
    monkeypatch.setattr(run.DrainingServer, "run", lambda self, *a, **k: record(self))
    monkeypatch.setattr(run.logging, "basicConfig", lambda **k: None)
    run.serve(settings)
    assert seen["drain"] == settings.drain_seconds
    return float(seen["graceful"])


def test_grace_period_covers_prestop_drain_and_in_flight_requests(rendered, env_settings, monkeypatch):
    _, docs = rendered
    from server.settings import Settings

    pod = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    grace = pod["terminationGracePeriodSeconds"]
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    settings = env_settings(env_of(docs))
    graceful = _graceful_shutdown_s(settings, monkeypatch)
    assert graceful >= settings.request_timeout_s  # a request queued at the close may use its whole deadline
    assert grace >= pre_stop + settings.drain_seconds + graceful, (grace, pre_stop, settings.drain_seconds, graceful)
    defaults = Settings.model_fields
    assert grace >= defaults["drain_seconds"].default + defaults["request_timeout_s"].default


@pytest.mark.timeout(240)
def test_the_cpu_pod_for_real(tmp_path):
    """The CPU overlay's container as Kubernetes would run it (its args and env; loopback, a free port
    and temporary volumes instead of the pod's): starts within the startup probe's budget, answers
    every probe, serves, and after SIGTERM turns unready, stays live, and exits 0 within the grace
    period left after preStop."""
    docs = render.build(DEPLOY / "overlays" / "cpu")
    c, pod = container(docs), by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOFTMOE_")}
    env.update(env_of(docs))
    grpc_port = free_port()
    env.update(SOFTMOE_PORT=str(port), SOFTMOE_GRPC_PORT=str(grpc_port), SOFTMOE_CACHE_DIR=str(tmp_path / "cache"),
               HOME=str(tmp_path / "home"))
    args = ["127.0.0.1" if a == "0.0.0.0" else a for a in c["args"]]
    exe = [str(BIN / "softmoe")] if (BIN / "softmoe").exists() else [sys.executable, "-m", "server"]
    log = tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    startup = c["startupProbe"]
    budget = min(120.0, startup["periodSeconds"] * startup["failureThreshold"])
    with open(log, "w") as out:
        proc = subprocess.Popen([*exe, *args], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(url + startup["httpGet"]["path"], timeout=startup["timeoutSeconds"]).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() - t0 < budget, f"not started within {budget}s\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        ready = c["readinessProbe"]
        assert _grpc_health(grpc_port, ready["timeoutSeconds"]) == "SERVING"
        live = c["livenessProbe"]
        assert httpx.get(url + live["httpGet"]["path"], timeout=live["timeoutSeconds"]).status_code == 200
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert {m["backend"]["backend"] for m in models} == {env["SOFTMOE_BACKEND"]}
        from sklearn.datasets import load_digits

        from softmoe_models.demo.data import digit_png

        image = base64.b64encode(digit_png(load_digits().data[0])).decode()
        r = httpx.post(f"{url}/v1/classify", json={"images": [image]}, timeout=30)
        assert r.status_code == 200 and r.json()["results"][0]["predictions"][0]["label"] == "0"

        proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        time.sleep(0.5)
        assert _grpc_health(grpc_port, 5) == "NOT_SERVING"
        assert httpx.get(url + c["livenessProbe"]["httpGet"]["path"], timeout=5).status_code == 200
        pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
        left = pod["terminationGracePeriodSeconds"] - pre_stop
        assert proc.wait(timeout=left) == 0, log.read_text()[-3000:]
        assert time.monotonic() - stopped >= float(env["SOFTMOE_DRAIN_SECONDS"]) - 0.5  # it did drain
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
