"""What the deploy tests read from deploy/: the recording rules, the dashboard, the adapter's
config, and the labels every scraped series may carry."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = ["gpu", "cpu", "cpu-hpa-fallback", "cpu-prepared"]
# Overlays whose pods serve from artifacts a Job prepared (a read-only cache volume).
PREPARED = {"cpu-prepared"}

# deploy/render.py (the kustomize renderer the tests use) is a script, not a package module.
_spec = importlib.util.spec_from_file_location("softmoe_deploy_render", DEPLOY / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)

# Labels every scraped series carries besides its own: Prometheus target labels and those the
# prometheus-operator ServiceMonitor scrape adds in Kubernetes.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "endpoint", "container"}
# Labels of DCGM exporter series (with its Kubernetes pod mapping).
DCGM_LABELS = {"gpu", "UUID", "device", "modelName", "Hostname", "namespace", "pod", "container", "job", "instance"}


def rules_file() -> dict:
    return yaml.safe_load((DEPLOY / "prometheus" / "rules.yaml").read_text())


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboard.json").read_text())


def adapter_config() -> tuple[dict, dict]:
    cm = yaml.safe_load((DEPLOY / "prometheus-adapter" / "rules.yaml").read_text())
    return cm, yaml.safe_load(cm["data"]["config.yaml"])


def dashboard_targets(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target."""
    out = []
    for p in dash["panels"]:
        for sub in [p, *p.get("panels", [])]:
            out += [(sub["title"], t["expr"]) for t in sub.get("targets", [])]
    return out


def by_kind(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} resources"
    return found[0]


def container(docs: list[dict]) -> dict:
    (c,) = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def env_of(docs: list[dict]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(docs).get("env", [])}


def render_overlay(request) -> tuple[str, list[dict]]:
    """(overlay name, its rendered resources): a test module's ``rendered`` fixture, as
    ``rendered = pytest.fixture(scope="module", params=OVERLAYS)(render_overlay)``."""
    return request.param, render.build(DEPLOY / "overlays" / request.param)
