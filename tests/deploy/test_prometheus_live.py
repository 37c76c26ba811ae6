"""The rules, the dashboard and the autoscaling query against a REAL Prometheus scraping the REAL server.

The app (built-in digits models) runs under uvicorn on loopback and gets a steady mix of traffic:
classify and zero-shot with PNGs of real sklearn digits, OIP infer, image and text embeddings,
4xx requests and over-sized requests refused with 429 (queue_full). /usr/bin/prometheus scrapes it
every second and evaluates deploy/prometheus/rules.yaml every second. Then every recording rule,
every dashboard target (template variables substituted) and the prometheus-adapter query must parse
and return data; every alert expression must parse, every rule must evaluate without error, and
the alerts must say what the traffic says (429 share above 1%: pending; no 5xx: inactive).

Everything listens on 127.0.0.1 only and is stopped at the end; the whole test is bounded (< 90 s).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from helpers.live import free_port, live_server, stop_process, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules.yaml"
MIN_SCRAPING_S = 10.0  # traffic observed by Prometheus before the verdict
VERDICT_DEADLINE_S = 40.0  # after Prometheus is ready
MAX_QUEUE = 48  # a 56-image request is refused at admission (429 queue_full), deterministically

pytestmark = pytest.mark.timeout(120)


def prometheus_binary() -> str:
    exe = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus not found: `make sysdeps` installs it")
        pytest.skip("prometheus not installed (`make sysdeps`)")
    return exe


# ------------------------------------------------------------------------------------------ traffic

class Traffic:
    """A background client sending a realistic mix until stopped; counts status codes."""

    def __init__(self, url: str) -> None:
        from sklearn.datasets import load_digits

        from softmoe_models.demo.data import WORDS, digit_png, pixels_from_png

        digits = load_digits()
        pngs = [digit_png(v) for v in digits.data[:64]]
        self.images = [base64.b64encode(p).decode() for p in pngs]
        self.pixels = np.stack([pixels_from_png(p) for p in pngs[:4]]).astype(np.float32)
        self.words = list(WORDS)
        self.url = url
        self.statuses: Counter[int] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def __enter__(self) -> "Traffic":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _requests(self, i: int):
        img = self.images
        k = (i * 4) % 56
        yield "POST", "/v1/classify", {"json": {"images": img[k:k + 4], "top_k": 3}}
        yield "POST", "/v1/zero-shot", {"json": {"images": img[k:k + 2], "labels": self.words}}
        body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(self.pixels.shape),
                            "data": self.pixels.reshape(-1).tolist()}]}
        yield "POST", "/v2/models/digits/infer", {"json": body}
        yield "POST", "/v1/embed", {"json": {"model": "digits-lit", "images": img[k:k + 2]}}
        yield "POST", "/v1/embeddings", {"json": {"model": "digits-lit", "input": ["the number seven", "a digit"]}}
        yield "POST", "/v1/routing", {"json": {"images": img[k:k + 1]}}
        yield "POST", "/v1/classify", {"json": {"images": ["not base64!"]}}  # 400
        yield "POST", "/v1/classify", {"json": {"model": "nope", "images": img[:1]}}  # 404
        yield "POST", "/v1/classify", {"json": {"images": []}}  # 422
        if i % 3 == 0:
            yield "POST", "/v1/classify", {"json": {"images": img[:56]}}  # 429: more than --max-queue

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            i = 0
            while not self._stop.is_set():
                for method, path, kw in self._requests(i):
                    try:
                        r = client.request(method, path, **kw)
                        self.statuses[r.status_code] += 1
                    except httpx.HTTPError as e:
                        self.errors.append(f"{path}: {e!r}")
                i += 1
                self._stop.wait(0.05)


# ------------------------------------------------------------------------------------------ prometheus

@contextlib.contextmanager
def prometheus(tmp_path: Path, target: str):
    exe = prometheus_binary()
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "softmoe", "static_configs": [{"targets": [target]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(
        [exe, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until(f"{url}/-/ready", 30, lambda: proc.poll() is None, "prometheus")
        except RuntimeError as e:
            raise RuntimeError(f"{e}:\n{(tmp_path / 'prometheus.log').read_text()[-3000:]}") from None
        yield url
    finally:
        stop_process(proc, 15)
        log.close()


def query(prom: str, expr: str) -> dict:
    return httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()


# ------------------------------------------------------------------------------------------ what is asked

def substitute(expr: str) -> str:
    """Grafana's variables as Grafana would send them with every 'All' selected."""
    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return "1m" if name in ("__rate_interval", "__interval", "__range") else ".*"

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "dashboard.json").read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t['refId']}", substitute(t["expr"])))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            selector = re.fullmatch(r"label_values\((.*),\s*\w+\)", q).group(1)
            out.append((f"variable {v['name']}", substitute(selector)))
    return out


def adapter_query() -> str:
    cm = yaml.safe_load((DEPLOY / "prometheus-adapter" / "rules.yaml").read_text())
    (rule,) = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    # What prometheus-adapter sends for "every pod of this HPA": its label matchers and grouping.
    return rule["metricsQuery"].replace("<<.LabelMatchers>>", 'job="softmoe"').replace("<<.GroupBy>>", "instance")


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


# ------------------------------------------------------------------------------------------ the test

def test_rules_dashboard_and_adapter_query_on_a_real_prometheus(tmp_path):
    from server.http.app import create_app
    from server.settings import Settings

    started = time.monotonic()
    records = [r["record"] for r in rules() if "record" in r]
    alerts = {r["alert"]: r["expr"] for r in rules() if "alert" in r}
    # No DCGM exporter runs here (no GPU, and this Prometheus scrapes only the app): the GPU panels
    # must parse, and are empty by construction.
    must_have_data = [(f"record {r}", r) for r in records] + [("prometheus-adapter metricsQuery", adapter_query())]
    gpu_only = []
    for where, expr in dashboard_queries():
        (gpu_only if "DCGM_" in expr else must_have_data).append((where, expr))
    assert len(gpu_only) == 2 and len(must_have_data) > 20

    # Routing statistics from every call (not 1 in 16), so the routing panels fill within the test.
    # Beside the built-in models a sparse V-MoE package (vmoe's golden Tokens Choice model), whose
    # drop counters the sparse panel divides.
    from conftest import SHARED
    from server.engine.defaults import default_packages
    from softmoe_models.convert import convert_checkpoint

    models = default_packages()
    sparse = SHARED / "golden" / "vmoe-sparse" / "vmoe_tc_e8k2.npz"
    if sparse.is_file():
        package, _ = convert_checkpoint(sparse, tmp_path / "sparse", router="tokens-choice", experts_per_token=2,
                                        capacity_factor=1.05)
        models.append(f"sparse={package}")
    else:
        must_have_data = [(w, e) for w, e in must_have_data if "dropped_choices" not in e]
    settings = Settings(models=models, max_queue=MAX_QUEUE, routing_stats_sample=1, cache_dir=str(tmp_path / "cache"))
    with live_server(create_app(settings)) as url, Traffic(url) as traffic:
        target = url.removeprefix("http://")
        with prometheus(tmp_path, target) as prom:
            t0 = time.monotonic()
            while True:
                time.sleep(1.0)
                missing = []
                for where, expr in must_have_data:
                    body = query(prom, expr)
                    assert body["status"] == "success", f"{where}: {expr}\n{body}"
                    if not body["data"]["result"]:
                        missing.append(where)
                states = {a["labels"]["alertname"]: a["state"]
                          for a in httpx.get(f"{prom}/api/v1/alerts", timeout=10).json()["data"]["alerts"]}
                saturated = states.get("SoftmoeQueueSaturated") in ("pending", "firing")
                elapsed = time.monotonic() - t0
                if not missing and saturated and elapsed >= MIN_SCRAPING_S:
                    break
                if elapsed > VERDICT_DEADLINE_S:
                    pytest.fail(f"after {elapsed:.0f}s of scraping: no data for {missing}; alerts {states}; "
                                f"traffic {dict(traffic.statuses)}\n"
                                f"{(tmp_path / 'prometheus.log').read_text()[-2000:]}")

            for where, expr in gpu_only:
                body = query(prom, expr)
                assert body["status"] == "success", f"{where}: {expr}\n{body}"
                assert body["data"]["result"] == [], f"{where}: DCGM data without a DCGM exporter?"
            for name, expr in alerts.items():
                body = query(prom, expr)
                assert body["status"] == "success", f"alert {name}: {expr}\n{body}"
            groups = httpx.get(f"{prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
            evaluated = {r["name"]: r for g in groups for r in g["rules"]}
            assert set(evaluated) == set(records) | set(alerts)
            for name, r in evaluated.items():
                assert r["health"] == "ok", f"{name}: {r.get('lastError')}"
            assert states.get("SoftmoeHighErrorRatio", "inactive") == "inactive"  # no 5xx was sent
            assert states.get("SoftmoeReadinessFlapping", "inactive") == "inactive"
            # The quantile records carry one series per (model, stage) the traffic went through.
            p95 = query(prom, "job_model_stage:softmoe_image_latency_seconds:p95")["data"]["result"]
            stages = {(s["metric"]["model"], s["metric"]["stage"]) for s in p95}
            for stage in ("decode", "preprocess", "queue", "inference", "postprocess", "total"):
                assert ("digits", stage) in stages, stage

    assert not traffic.errors, traffic.errors[:5]
    seen = set(traffic.statuses)
    assert {200, 400, 404, 422, 429} <= seen and not any(s >= 500 for s in seen), traffic.statuses
    assert time.monotonic() - started < 90


def test_rejection_rates_exist_per_reason_from_a_fresh_start(tmp_path):
    """No traffic at all: rate(softmoe_requests_rejected_total[5m]) already has a series (of 0) per
    reason, so the dashboard's rejected panel reads 0, not "no data"."""
    from server.http.app import create_app
    from server.metrics import REJECT_REASONS
    from server.settings import Settings

    with live_server(create_app(Settings())) as url:
        with prometheus(tmp_path, url.removeprefix("http://")) as prom:
            deadline = time.monotonic() + 30
            while True:
                result = query(prom, "sum by (reason) (rate(softmoe_requests_rejected_total[5m]))")["data"]["result"]
                reasons = {r["metric"]["reason"]: float(r["value"][1]) for r in result}
                if set(reasons) >= set(REJECT_REASONS) or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
    assert set(reasons) >= set(REJECT_REASONS), reasons
    assert all(v == 0 for v in reasons.values()), reasons
