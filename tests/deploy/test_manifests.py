"""Offline checks of everything under deploy/ and of the Dockerfile.

- Kustomize overlays rendered by deploy/render.py (no kustomize binary; compared with
  ``kubectl kustomize`` where one exists), every built-in kind validated by kubernetes-validate
  against Kubernetes 1.30 (strict: unknown fields fail), ServiceMonitor / PrometheusRule /
  prometheus-adapter config validated against the committed schemas in deploy/schemas;
- yamllint, hadolint, ``promtool check rules`` and ``promtool test rules``;
- consistency with the server (metric and label names: test_metric_names.py): probes hit real
  routes, the env is valid Settings, the termination grace period covers preStop + drain + uvicorn's graceful shutdown (server/run.py);
- the CPU overlay's container run for real (its args and env): start-up, probes, SIGTERM drain.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from helpers.deploy import DEPLOY, adapter_config, rules_file
from helpers.live import free_port

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = DEPLOY / "schemas"
OVERLAYS = ["gpu", "cpu", "cpu-hpa-fallback"]
# Pinned: the manifests must be valid on Kubernetes 1.30 (the oldest version we support), and are
# also checked against the newest schema kubernetes-validate ships, so no API they use is removed.
KUBERNETES_VERSION = "1.30.0"
BIN = Path(sys.executable).parent

_spec = importlib.util.spec_from_file_location("softmoe_deploy_render", DEPLOY / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)


# ------------------------------------------------------------------------------------------ helpers

@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render.build(DEPLOY / "overlays" / request.param)


def by_kind(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} resources"
    return found[0]


def container(docs: list[dict]) -> dict:
    (c,) = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def env_of(docs: list[dict]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(docs).get("env", [])}


def schema(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text())


def validator(name: str) -> jsonschema.protocols.Validator:
    s = schema(name)
    cls = jsonschema.validators.validator_for(s)
    cls.check_schema(s)
    return cls(s)


SERVICEMONITOR = "servicemonitor.monitoring.coreos.com-v1.schema.json"
PROMETHEUSRULE = "prometheusrule.monitoring.coreos.com-v1.schema.json"
ADAPTER = "prometheus-adapter-config.schema.json"


def tool(name: str) -> str:
    """A CLI the checks need: in the venv (yamllint, hadolint) or on PATH (promtool, from `make sysdeps`)."""
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} not found: `make sysdeps` (promtool) / `make setup` (yamllint, hadolint) install it")
        pytest.skip(f"{name} not installed (`make sysdeps` / `make setup`)")
    return str(path)


# ------------------------------------------------------------------------------------------ rendering

def test_overlays_render_to_the_expected_resources(rendered):
    name, docs = rendered
    assert sorted(d["kind"] for d in docs) == sorted(
        ["Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceMonitor", "PrometheusRule"])
    assert {d["metadata"]["name"] for d in docs} == {"softmoe-serve"}


def _canonical(x):
    if isinstance(x, dict):
        return {k: _canonical(v) for k, v in x.items()}
    if isinstance(x, list):
        items = [_canonical(v) for v in x]
        if items and all(isinstance(v, dict) and "name" in v for v in items):
            items.sort(key=lambda v: v["name"])  # strategic merge may order merged lists differently
        return items
    return x


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_agrees_with_real_kustomize(overlay):
    exe = shutil.which("kustomize") or shutil.which("kubectl")
    if exe is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    cmd = [exe, "build" if exe.endswith("kustomize") else "kustomize", str(DEPLOY / "overlays" / overlay)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"{exe} did not run: {e}")
    if out.returncode != 0:
        pytest.skip(f"{' '.join(cmd)} failed here: {out.stderr.strip()[:300]}")
    theirs = sorted((_canonical(d) for d in yaml.safe_load_all(out.stdout) if d), key=lambda d: d["kind"])
    ours = sorted((_canonical(d) for d in render.build(DEPLOY / "overlays" / overlay)), key=lambda d: d["kind"])
    assert ours == theirs


def test_renderer_semantics(tmp_path):
    base = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
            "spec": {"template": {"spec": {"containers": [
                {"name": "a", "image": "i:1", "env": [{"name": "K", "value": "1"}], "args": ["p", "q"]}],
                "tolerations": [{"key": "t"}]}}}}
    patch = {"spec": {"template": {"spec": {"containers": [
        {"name": "a", "env": [{"name": "K", "value": "2"}, {"name": "L", "value": "3"}], "args": ["r"]}],
        "tolerations": [{"key": "u"}]}}}}
    merged = render.strategic_merge(base, patch)
    c = merged["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "i:1" and c["env"] == [{"name": "K", "value": "2"}, {"name": "L", "value": "3"}]
    assert c["args"] == ["r"] and merged["spec"]["template"]["spec"]["tolerations"] == [{"key": "u"}]
    assert "image" not in render.strategic_merge(c, {"image": None})
    ops = [{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "z"},
           {"op": "replace", "path": "/metadata/name", "value": "y"},
           {"op": "remove", "path": "/spec/template/spec/tolerations"}]
    j = render.json6902(base, ops)
    assert j["metadata"]["name"] == "y" and j["spec"]["template"]["spec"]["containers"][0]["args"] == ["p", "q", "z"]
    assert "tolerations" not in j["spec"]["template"]["spec"] and base["metadata"]["name"] == "x"
    with pytest.raises(render.RenderError):
        render.json6902(base, [{"op": "replace", "path": "/spec/nope", "value": 1}])
    # Refused, not ignored: unknown kustomization fields, patches that match nothing, duplicates.
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["r.yaml"], "namePrefix": "p-"}))
    with pytest.raises(render.RenderError, match="namePrefix"):
        render.build(tmp_path)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"apiVersion": "apps/v1", "kind": "Deployment",
                                                     "metadata": {"name": "other"}}))
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": ["r.yaml"], "patches": [{"path": "p.yaml"}]}))
    with pytest.raises(render.RenderError, match="matches 0"):
        render.build(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["r.yaml", "r.yaml"]}))
    with pytest.raises(render.RenderError, match="duplicate"):
        render.build(tmp_path)


# ------------------------------------------------------------------------------------------ schemas

def test_builtin_kinds_validate_against_kubernetes(rendered):
    _, docs = rendered
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        for version in (KUBERNETES_VERSION, kubernetes_validate.utils.latest_version()):
            kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked == 4
    cm, _ = adapter_config()
    kubernetes_validate.validate(cm, KUBERNETES_VERSION, strict=True)


def test_strict_validation_catches_a_typo(rendered):
    _, docs = rendered
    bad = copy.deepcopy(by_kind(docs, "Deployment"))
    c = bad["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c["readinessProbe"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_monitoring_kinds_validate_against_committed_schemas(rendered):
    _, docs = rendered
    validator(SERVICEMONITOR).validate(by_kind(docs, "ServiceMonitor"))
    validator(PROMETHEUSRULE).validate(by_kind(docs, "PrometheusRule"))
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # why the committed schemas exist
        kubernetes_validate.validate(by_kind(docs, "ServiceMonitor"), KUBERNETES_VERSION, strict=True)


def test_committed_schemas_reject_typos():
    sm = yaml.safe_load((DEPLOY / "base" / "servicemonitor.yaml").read_text())
    pr = yaml.safe_load((DEPLOY / "base" / "prometheusrule.yaml").read_text())
    v_sm, v_pr = validator(SERVICEMONITOR), validator(PROMETHEUSRULE)
    mutations_sm = [
        lambda d: d["spec"]["endpoints"][0].update(intervall="15s"),
        lambda d: d["spec"]["endpoints"][0].update(interval="15 seconds"),
        lambda d: d["spec"].update(endpoint=d["spec"].pop("endpoints")),
        lambda d: d.update(kind="ServiceMonitors"),
    ]
    mutations_pr = [
        lambda d: d["spec"]["groups"][0]["rules"][0].update(exp=d["spec"]["groups"][0]["rules"][0].pop("expr")),
        lambda d: d["spec"]["groups"][0]["rules"][0].update(record="bad name"),
        lambda d: d["spec"]["groups"][0]["rules"][0].update(alert="Both"),
        lambda d: d["spec"]["groups"][1]["rules"][0].update({"for": "5 minutes"}),
        lambda d: d["spec"]["groups"][1]["rules"][0]["labels"].update({"bad-label": "x"}),
    ]
    for v, doc, mutations in ((v_sm, sm, mutations_sm), (v_pr, pr, mutations_pr)):
        v.validate(doc)
        for mutate in mutations:
            bad = copy.deepcopy(doc)
            mutate(bad)
            assert list(v.iter_errors(bad)), f"schema accepted a broken document: {mutate}"


def test_prometheusrule_equals_the_plain_rule_file():
    pr = yaml.safe_load((DEPLOY / "base" / "prometheusrule.yaml").read_text())
    plain = rules_file()
    assert set(plain) == {"groups"}
    assert pr["spec"]["groups"] == plain["groups"]
    spec_schema = {**schema(PROMETHEUSRULE)["properties"]["spec"], "$defs": schema(PROMETHEUSRULE)["$defs"]}
    jsonschema.Draft202012Validator(spec_schema).validate(plain)


def test_prometheus_adapter_rule_serves_the_hpa_metric(rendered):
    name, docs = rendered
    cm, config = adapter_config()
    validator(ADAPTER).validate(config)
    (rule,) = config["rules"]
    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": by_kind(docs, "Deployment")["metadata"]["name"]}
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)
    assert re.search(rule["name"]["matches"], series)
    assert rule["name"]["as"] == "softmoe_queue_seconds_per_image"
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert 'stage="queue"' in rule["seriesQuery"] and rule["metricsQuery"].count('stage="queue"') == 2
    assert "_sum{" in rule["metricsQuery"] and "_count{" in rule["metricsQuery"]
    (metric,) = hpa["spec"]["metrics"]
    if name == "cpu-hpa-fallback":
        assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
        assert metric["resource"]["target"]["type"] == "Utilization"
        assert container(docs)["resources"]["requests"]["cpu"]  # utilization is relative to the request
    else:
        assert metric["type"] == "Pods"
        assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
        assert metric["pods"]["target"]["type"] == "AverageValue"


# ------------------------------------------------------------------------------------------ linters

def test_yamllint():
    out = subprocess.run([tool("yamllint"), "-s", "-c", str(ROOT / ".yamllint"), "deploy"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint():
    out = subprocess.run([tool("hadolint"), "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_check_rules():
    out = subprocess.run([tool("promtool"), "check", "rules", "deploy/prometheus/rules.yaml"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_pass_and_cover_every_alert():
    out = subprocess.run([tool("promtool"), "test", "rules", "deploy/prometheus/rules_test.yaml"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    tests = yaml.safe_load((DEPLOY / "prometheus" / "rules_test.yaml").read_text())["tests"]
    rules = [r for g in rules_file()["groups"] for r in g["rules"]]
    alerts = {r["alert"] for r in rules if "alert" in r}
    fired = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if a["exp_alerts"]}
    quiet = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if not a["exp_alerts"]}
    assert alerts <= fired, f"alerts never shown firing: {alerts - fired}"
    assert alerts <= quiet, f"alerts never shown not firing: {alerts - quiet}"
    records = {r["record"] for r in rules if "record" in r}
    tested = " ".join(e["expr"] for t in tests for e in t.get("promql_expr_test", []))
    assert any(r in tested for r in records)


# ------------------------------------------------------------------------------------------ the pod

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
        assert budget >= 5 * 60


def test_pod_security_and_volumes(rendered):
    _, docs = rendered
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
    assert cache in mounts and "emptyDir" in volumes[mounts[cache]]
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

        from server.app import create_app
        from server.settings import Settings

        self.client = TestClient(create_app(Settings()))  # not entered: no lifespan, no model loaded

    def __contains__(self, path: str) -> bool:
        return self.client.get(path).status_code not in (404, 405)


@pytest.fixture(scope="module")
def routes() -> Routes:
    return Routes()


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
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert "/v2/health/nothing" not in routes  # the check can fail
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] in routes
        assert _probe_port(c, get["port"]) == port
    svc = by_kind(docs, "Service")
    (sport,) = svc["spec"]["ports"]
    assert _probe_port(c, sport["targetPort"]) == port
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
    env.update(SOFTMOE_PORT=str(port), SOFTMOE_CACHE_DIR=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
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
        for probe in ("readinessProbe", "livenessProbe"):
            assert httpx.get(url + c[probe]["httpGet"]["path"], timeout=c[probe]["timeoutSeconds"]).status_code == 200
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
        assert httpx.get(url + c["readinessProbe"]["httpGet"]["path"], timeout=5).status_code == 503
        assert httpx.get(url + c["livenessProbe"]["httpGet"]["path"], timeout=5).status_code == 200
        pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
        left = pod["terminationGracePeriodSeconds"] - pre_stop
        assert proc.wait(timeout=left) == 0, log.read_text()[-3000:]
        assert time.monotonic() - stopped >= float(env["SOFTMOE_DRAIN_SECONDS"]) - 0.5  # it did drain
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------ Dockerfile

def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def stages() -> dict[str, list[str]]:
    """Instructions (continuations joined) per stage name."""
    text = re.sub(r"\\\n\s*", " ", dockerfile())
    out, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            current = m.group(2) or m.group(1)
            out[current] = [line]
        elif current:
            out[current].append(line)
    return out


def test_dockerfile_targets_match_the_manifests():
    st = stages()
    assert {"gpu", "cpu", "gpu-build", "cpu-build"} <= set(st)
    order = list(st)
    # The CPU stages come first: even a builder without BuildKit never builds a GPU stage for
    # `--target cpu` (BuildKit builds only what the target needs anyway).
    assert max(order.index(s) for s in ("cpu-build", "cpu")) < min(order.index(s) for s in ("gpu-build", "gpu"))
    text = dockerfile()
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S*)", text, re.M))
    # One Debian base for both targets (made from Debian packages by deploy/images/make-base.sh),
    # no CUDA base image: the CUDA libraries come from the hash-locked NVIDIA wheels.
    base = args["BASE_IMAGE"]
    assert ":" in base and not base.endswith(":latest"), f"untagged base image {base}"
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert set(froms) - set(st) - {"scratch"} == {"${BASE_IMAGE}"}, froms
    assert "nvidia/cuda" not in text and "nvcr.io" not in text
    gpu_build, cpu_build = " ".join(st["gpu-build"]), " ".join(st["cpu-build"])
    assert "requirements/gpu.lock" in gpu_build and "requirements/tensorrt.lock" in gpu_build
    assert "WITH_TENSORRT" in gpu_build and "https://pypi.nvidia.com" in gpu_build  # TensorRT's own index
    assert "requirements/cpu.lock" in cpu_build and "download.pytorch.org/whl/cpu" in cpu_build
    assert "gpu.lock" not in cpu_build and "cpu.lock" not in gpu_build
    assert "export tensorrt" not in text and "trtexec" not in text  # engines: at start-up only
    gpu_env = " ".join(ln for ln in st["gpu"] if ln.startswith("ENV "))
    ld_path = re.search(r"LD_LIBRARY_PATH=(\S+)", gpu_env).group(1).split(":")
    assert any(p.endswith("nvidia/cu13/lib") for p in ld_path) and any(p.endswith("nvidia/cudnn/lib") for p in ld_path)
    assert "SOFTMOE_BACKEND=${GPU_BACKEND}" in gpu_env and args["GPU_BACKEND"] == "tensorrt"
    for target, overlay in (("gpu", "gpu"), ("cpu", "cpu")):
        docs = render.build(DEPLOY / "overlays" / overlay)
        c, pod = container(docs), by_kind(docs, "Deployment")["spec"]["template"]["spec"]
        lines = st[target]
        user = [ln.split()[1] for ln in lines if ln.startswith("USER ")][-1]
        assert user.split(":")[0] == str(pod["securityContext"]["runAsUser"])
        assert user.split(":")[1] == str(pod["securityContext"]["runAsGroup"])
        expose = [ln.split()[1] for ln in lines if ln.startswith("EXPOSE ")]
        assert expose == [str(c["ports"][0]["containerPort"])]
        health = " ".join(ln for ln in lines if ln.startswith("HEALTHCHECK "))
        assert "/v2/health/live" in health and "curl" not in health and "urllib" in health
        env = " ".join(ln for ln in lines if ln.startswith("ENV "))
        assert f"SOFTMOE_CACHE_DIR={env_of(docs)['SOFTMOE_CACHE_DIR']}" in env
        volumes = " ".join(ln for ln in lines if ln.startswith("VOLUME "))
        assert '"/tmp"' in volumes and f'"{env_of(docs)["SOFTMOE_CACHE_DIR"]}"' in volumes
        assert [ln for ln in lines if ln.startswith("CMD ")] == ['CMD ["serve", "--host", "0.0.0.0"]']
        assert c["args"] == ["serve", "--host", "0.0.0.0"]
        assert c["image"].endswith(f"-{target}")
