"""Every metric and label the recording rules, alerts, dashboard and adapter reference exists in
server/metrics.py (DCGM_* series excepted), and the dashboard covers what it must."""

from __future__ import annotations

import re

import yaml

from helpers.deploy import DCGM_LABELS, DEPLOY, TARGET_LABELS, adapter_config, dashboard, dashboard_targets, rules_file


# ------------------------------------------------------------------------------------------ metric names

def server_metrics() -> dict[str, set[str]]:
    """Every series name the server can export -> its label names (histograms: _bucket/_sum/_count)."""
    from prometheus_client.metrics import MetricWrapperBase

    from server.metrics import Metrics

    m = Metrics()
    out: dict[str, set[str]] = {}
    for collector in set(m.registry._collector_to_names):
        if not isinstance(collector, MetricWrapperBase):
            continue
        name, labels, kind = collector._name, set(collector._labelnames), collector._type
        if kind == "histogram":
            out[f"{name}_bucket"] = labels | {"le"}
            out[f"{name}_sum"] = out[f"{name}_count"] = labels
        elif kind == "counter":
            out[f"{name}_total"] = labels
        else:
            out[name] = labels
    assert out, "no metrics found in server.metrics.Metrics().registry"
    return out


def _strip(expr: str) -> str:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values)
    return re.sub(r"\[[^\]]*\]", "", expr)  # range durations


def referenced(expr: str) -> tuple[set[str], list[tuple[str, set[str]]], set[str]]:
    """(metric names, [(metric, matcher label names)], labels in by/without/on/ignoring/group_* clauses)."""
    bare = _strip(expr.replace("<<.LabelMatchers>>", "").replace("<<.GroupBy>>", "pod"))
    selectors = [(m.group(1), set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(2))))
                 for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}", bare)]
    clause = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
    grouping = {x.strip() for m in re.finditer(clause, bare) for x in m.group(1).split(",") if x.strip()}
    rest = re.sub(r"\{[^}]*\}", " ", re.sub(clause, " ", bare))
    names = {t for t in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", rest)
             if t.startswith(("softmoe_", "DCGM_")) or ":" in t}
    return names | {n for n, _ in selectors}, selectors, grouping


def all_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every rule, dashboard target and variable, adapter query, test series."""
    out = [(f"rule {r.get('record') or r.get('alert')}", r["expr"]) for g in rules_file()["groups"] for r in g["rules"]]
    dash = dashboard()
    out += [(f"panel {title}", e) for title, e in dashboard_targets(dash)]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q)
            assert m, f"variable {v['name']}: {q}"
            out.append((f"variable {v['name']}", m.group(1)))
    _, config = adapter_config()
    for r in config["rules"]:
        out += [("adapter seriesQuery", r["seriesQuery"]), ("adapter metricsQuery", r["metricsQuery"])]
    tests = yaml.safe_load((DEPLOY / "prometheus" / "rules_test.yaml").read_text())["tests"]
    for t in tests:
        out += [("promtool test series", s["series"]) for s in t["input_series"]]
        out += [("promtool test expr", e["expr"]) for e in t.get("promql_expr_test", [])]
    return out


def test_every_referenced_metric_and_label_exists():
    metrics = server_metrics()
    records = {r["record"] for g in rules_file()["groups"] for r in g["rules"] if "record" in r}
    known_labels = set().union(*metrics.values()) | TARGET_LABELS | DCGM_LABELS
    problems = []
    for where, expr in all_expressions():
        names, selectors, grouping = referenced(expr)
        for n in names:
            if n.startswith("DCGM_") or n == "up" or n in metrics or n in records:
                continue
            problems.append(f"{where}: unknown metric {n}")
        for n, labels in selectors:
            if n in metrics:
                allowed = metrics[n] | TARGET_LABELS
            elif n.startswith("DCGM_"):
                allowed = DCGM_LABELS
            elif n in records or n == "up":
                allowed = known_labels
            else:
                continue
            if labels - allowed:
                problems.append(f"{where}: {n} has no label(s) {sorted(labels - allowed)}")
        if grouping - known_labels:
            problems.append(f"{where}: grouping by unknown label(s) {sorted(grouping - known_labels)}")
    assert not problems, "\n".join(problems)


def test_the_name_checker_catches_mistakes():
    metrics = server_metrics()
    names, selectors, grouping = referenced('sum by (status) (rate(softmoe_request_duration_count{modle="x"}[5m]))')
    assert "softmoe_request_duration_count" in names and "softmoe_request_duration_count" not in metrics
    assert selectors == [("softmoe_request_duration_count", {"modle"})] and grouping == {"status"}
    assert "softmoe_image_latency_seconds_bucket" in metrics and "le" in metrics["softmoe_image_latency_seconds_bucket"]
    assert "softmoe_requests_rejected_total" in metrics and "reason" in metrics["softmoe_requests_rejected_total"]


# ------------------------------------------------------------------------------------------ dashboard

def test_dashboard_structure_and_coverage():
    dash = dashboard()
    assert 36 <= dash["schemaVersion"] <= 41 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids, refs = [], set()
    for p in dash["panels"]:
        ids.append(p["id"])
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(set(ref_ids)) == len(ref_ids)
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"].strip()
            used = set(re.findall(r"\$\{?(\w+)", t["expr"])) - {"__rate_interval", "__interval", "__range"}
            assert used <= set(variables), f"{p['title']}: undefined variables {used - set(variables)}"
            refs |= referenced(t["expr"])[0]
    assert len(set(ids)) == len(ids)
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}"
    wanted = {
        "softmoe_image_latency_seconds_bucket",  # per-image latency by stage
        "softmoe_images_total",  # throughput by endpoint
        "softmoe_batch_size_bucket", "softmoe_batch_padding_ratio_sum",  # batching
        "softmoe_queue_depth", "softmoe_requests_rejected_total", "softmoe_request_duration_seconds_count",
        "softmoe_model_ready", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED",
        "softmoe_routing_expert_share", "softmoe_routing_drift", "softmoe_routing_drift_baseline",  # routing
        "softmoe_routing_dispatch_entropy_sum", "softmoe_routing_combine_entropy_sum",
        "job_model:softmoe_routing_drift:ratio",
        "softmoe_routing_dropped_choices_total", "softmoe_routing_token_choices_total",  # sparse V-MoE drops
    }
    assert wanted <= refs, wanted - refs
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for word in ("p50", "p95", "p99", "throughput", "batch size", "padding", "queue depth", "rejections",
                 "status class", "ready", "gpu utilization", "framebuffer", "expert share", "drift", "entropy",
                 "dropped"):
        assert word in titles, word
