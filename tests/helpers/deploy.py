"""What the deploy tests read from deploy/: the recording rules, the dashboard, the adapter's
config, and the labels every scraped series may carry."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

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
