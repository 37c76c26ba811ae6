"""Offline checks of everything under deploy/ and of the Dockerfile.

- Kustomize overlays rendered by deploy/render.py (no kustomize binary; compared with
  ``kubectl kustomize`` where one exists), every built-in kind validated by kubernetes-validate
  against Kubernetes 1.30 (strict: unknown fields fail), ServiceMonitor / PrometheusRule /
  prometheus-adapter config validated against the committed schemas in deploy/schemas;
- yamllint, hadolint, ``promtool check rules`` and ``promtool test rules``;
- the Dockerfile's stages against the manifests.

The pod against the server (probes, env, grace period, the CPU pod for real) is test_pod.py;
metric and label names are test_metric_names.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helpers.deploy import (DEPLOY, OVERLAYS, PREPARED, adapter_config, by_kind, container, env_of, render, render_overlay,
                            rules_file)

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = DEPLOY / "schemas"
# Pinned: the manifests must be valid on Kubernetes 1.30 (the oldest version we support), and are
# also checked against the newest schema kubernetes-validate ships, so no API they use is removed.
KUBERNETES_VERSION = "1.30.0"
BIN = Path(sys.executable).parent
rendered = pytest.fixture(scope="module", params=OVERLAYS)(render_overlay)



# ------------------------------------------------------------------------------------------ helpers

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
    serving = ["Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceMonitor", "PrometheusRule"]
    prepared = ["PersistentVolumeClaim", "Job"] if name in PREPARED else []
    assert sorted(d["kind"] for d in docs) == sorted(serving + prepared)
    assert {d["metadata"]["name"] for d in docs if d["kind"] in serving} == {"softmoe-serve"}


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
    name, docs = rendered
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        for version in (KUBERNETES_VERSION, kubernetes_validate.utils.latest_version()):
            kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked == 4 + (2 if name in PREPARED else 0)  # Deployment, Service, PDB, HPA (+ PVC, Job)
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
        expose = [ln.split()[1:] for ln in lines if ln.startswith("EXPOSE ")]
        assert expose == [[str(p["containerPort"]) for p in c["ports"]]]  # HTTP and gRPC
        health = " ".join(ln for ln in lines if ln.startswith("HEALTHCHECK "))
        assert "/v2/health/live" in health and "curl" not in health and "urllib" in health
        env = " ".join(ln for ln in lines if ln.startswith("ENV "))
        assert f"SOFTMOE_CACHE_DIR={env_of(docs)['SOFTMOE_CACHE_DIR']}" in env
        for key in ("SOFTMOE_PORT", "SOFTMOE_GRPC_PORT"):
            assert f"{key}={env_of(docs)[key]}" in env
        volumes = " ".join(ln for ln in lines if ln.startswith("VOLUME "))
        assert '"/tmp"' in volumes and f'"{env_of(docs)["SOFTMOE_CACHE_DIR"]}"' in volumes
        assert [ln for ln in lines if ln.startswith("CMD ")] == ['CMD ["serve", "--host", "0.0.0.0"]']
        assert c["args"] == ["serve", "--host", "0.0.0.0"]
        assert c["image"].endswith(f"-{target}")
