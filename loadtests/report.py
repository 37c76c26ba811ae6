"""The sweep report: per-step statistics, /metrics deltas, CSV files and PNG plots.

Pure functions (no locust, no network) so they can be tested on their own.

Per step, over the requests that *completed* while that step's user count was running:
``requests`` (all), ``failures``, ``req_per_s`` and ``images_per_s`` (successful ones per
second of the step), latency percentiles ``p50_ms``/``p95_ms``/``p99_ms`` (client-side,
successful requests, numpy linear interpolation), ``mean_ms``, ``max_ms``.
"""

from __future__ import annotations

import bisect
import csv
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STEP_COLUMNS = ["step", "users", "seconds", "requests", "failures", "images", "req_per_s", "images_per_s",
                "p50_ms", "p95_ms", "p99_ms", "mean_ms", "max_ms"]
ENDPOINT_COLUMNS = ["step", "users", "endpoint"] + STEP_COLUMNS[2:]
STAGES = ("decode", "preprocess", "queue", "inference", "postprocess")
BATCH_METRIC = "softmoe_batch_size"
STAGE_METRIC = "softmoe_image_latency_seconds"


@dataclass(frozen=True)
class Record:
    t: float  # perf_counter when the response completed
    ms: float  # client-side response time
    failed: bool
    images: int
    endpoint: str


# ------------------------------------------------------------------------------ steps


def step_windows(transitions: list[tuple[float, int | None]], end: float) -> list[tuple[int, float, float]]:
    """(step index, start, end) from the shape's recorded transitions; the run's end closes the last."""
    out = []
    for i, (t, k) in enumerate(transitions):
        if k is None:
            break
        stop = transitions[i + 1][0] if i + 1 < len(transitions) else end
        out.append((k, t, min(stop, end)))
    return [w for w in out if w[2] > w[1]]


def _stats(recs: list[Record], seconds: float) -> dict:
    ok = [r for r in recs if not r.failed]
    lat = np.array([r.ms for r in ok], dtype=np.float64)
    images = sum(r.images for r in ok)
    row = {"seconds": round(seconds, 3), "requests": len(recs), "failures": len(recs) - len(ok), "images": images,
           "req_per_s": len(ok) / seconds if seconds > 0 else math.nan,
           "images_per_s": images / seconds if seconds > 0 else math.nan}
    if lat.size:
        p50, p95, p99 = np.percentile(lat, [50, 95, 99])
        row.update(p50_ms=p50, p95_ms=p95, p99_ms=p99, mean_ms=float(lat.mean()), max_ms=float(lat.max()))
    else:
        row.update(p50_ms=math.nan, p95_ms=math.nan, p99_ms=math.nan, mean_ms=math.nan, max_ms=math.nan)
    return row


def summarize(records: list[Record], windows: list[tuple[int, float, float]], steps: tuple[int, ...]) -> tuple[list[dict], list[dict]]:
    """(one row per step, one row per step and endpoint). Records outside every window are dropped."""
    starts = [w[1] for w in windows]
    per: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        i = bisect.bisect_right(starts, r.t) - 1
        if i >= 0 and r.t <= windows[i][2]:
            per[i].append(r)
    rows, by_ep = [], []
    for i, (k, start, end) in enumerate(windows):
        recs = per.get(i, [])
        rows.append({"step": k + 1, "users": steps[k], **_stats(recs, end - start)})
        for ep in sorted({r.endpoint for r in recs}):
            by_ep.append({"step": k + 1, "users": steps[k], "endpoint": ep,
                          **_stats([r for r in recs if r.endpoint == ep], end - start)})
    return rows, by_ep


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in row.items()})


# ------------------------------------------------------------------------------ /metrics


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def delta(before: dict, after: dict) -> dict:
    """after - before per sample; a sample that went down (server restarted) counts from zero."""
    out = {}
    for key, v in after.items():
        b = before.get(key, 0.0)
        out[key] = v - b if v >= b else v
    return out


def _le(v: str) -> float:
    return math.inf if v in ("+Inf", "inf", "Inf") else float(v)


def batch_histogram(d: dict) -> dict[str, dict]:
    """model -> {"buckets": [(label, count)], "batches", "items", "mean"} from softmoe_batch_size deltas."""
    cum: dict[str, list[tuple[float, float]]] = defaultdict(list)
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    for (name, labels), v in d.items():
        lab = dict(labels)
        model = lab.get("model", "")
        if name == f"{BATCH_METRIC}_bucket":
            cum[model].append((_le(lab["le"]), v))
        elif name == f"{BATCH_METRIC}_sum":
            sums[model] += v
        elif name == f"{BATCH_METRIC}_count":
            counts[model] += v
    out = {}
    for model, pts in cum.items():
        pts.sort()
        buckets, prev_le, prev_c = [], 0.0, 0.0
        for le, c in pts:
            lo = int(prev_le) + 1
            if math.isinf(le):
                label = f">{int(prev_le)}"
            else:
                label = str(int(le)) if lo >= int(le) else f"{lo}-{int(le)}"
            buckets.append((label, max(0.0, c - prev_c)))
            prev_le, prev_c = le, c
        n = counts.get(model, 0.0)
        out[model] = {"buckets": buckets, "batches": n, "items": sums.get(model, 0.0),
                      "mean": sums.get(model, 0.0) / n if n else math.nan}
    return out


def stage_means(d: dict) -> dict[str, dict[str, dict]]:
    """model -> stage -> {"count", "sum_s", "mean_ms"} from softmoe_image_latency_seconds deltas."""
    acc: dict[str, dict[str, dict]] = defaultdict(lambda: defaultdict(lambda: {"count": 0.0, "sum_s": 0.0}))
    for (name, labels), v in d.items():
        lab = dict(labels)
        if name == f"{STAGE_METRIC}_sum":
            acc[lab.get("model", "")][lab.get("stage", "")]["sum_s"] += v
        elif name == f"{STAGE_METRIC}_count":
            acc[lab.get("model", "")][lab.get("stage", "")]["count"] += v
    out = {}
    for model, stages in acc.items():
        out[model] = {}
        for stage, a in stages.items():
            a = dict(a)
            a["mean_ms"] = 1000 * a["sum_s"] / a["count"] if a["count"] else math.nan
            out[model][stage] = a
    return {m: s for m, s in out.items() if any(v["count"] for v in s.values())}


# ------------------------------------------------------------------------------ plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_latency_throughput(rows: list[dict], path: Path, title: str = "") -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    pts = [r for r in rows if r["req_per_s"] == r["req_per_s"] and r["p50_ms"] == r["p50_ms"]]
    if pts:
        x = [r["req_per_s"] for r in pts]
        for key, style in (("p50_ms", "o-"), ("p95_ms", "s--"), ("p99_ms", "^:")):
            ax.plot(x, [r[key] for r in pts], style, label=key.split("_")[0])
        for r in pts:
            ax.annotate(f"{r['users']} users\n{r['images_per_s']:.0f} img/s", (r["req_per_s"], r["p99_ms"]),
                        textcoords="offset points", xytext=(-5, 6), ha="right", fontsize=7, color="0.3")
        ax.set_xlabel("throughput (successful requests/s)")
        ax.set_ylabel("latency (ms, client-side)")
        ax.set_ylim(bottom=0, top=max(r["p99_ms"] for r in pts) * 1.15)
        ax.set_xlim(left=0, right=max(x) * 1.1)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    else:
        _empty(ax, "no successful requests")
    ax.set_xlabel("throughput (successful requests/s)")
    ax.set_title(title or "Latency vs throughput (one point per user count)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_batch_sizes(hist: dict[str, dict], path: Path, max_batch_size: int | None = None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    models = [m for m, h in hist.items() if h["batches"] > 0]
    if models:
        labels = [b[0] for b in hist[models[0]]["buckets"]]
        used = [i for i in range(len(labels)) if any(hist[m]["buckets"][i][1] > 0 for m in models)]
        last = max(used) if used else 0
        labels = labels[: last + 1]
        width = 0.8 / len(models)
        for j, m in enumerate(models):
            counts = [c for _, c in hist[m]["buckets"][: last + 1]]
            xs = [i + (j - (len(models) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, counts, width=width, label=f"{m} (mean {hist[m]['mean']:.2f}, {int(hist[m]['batches'])} calls)")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("real items per backend call (histogram bucket)")
        ax.set_ylabel("backend calls during the run")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no softmoe_batch_size data in /metrics")
    extra = f", --max-batch-size {max_batch_size}" if max_batch_size else ""
    ax.set_title(f"Batch sizes (softmoe_batch_size, delta over the run{extra})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_stages(stages: dict[str, dict[str, dict]], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6 + 0.3 * max(0, len(stages) - 2)), dpi=100)
    models = list(stages)
    if models:
        colors = plt.get_cmap("tab10").colors
        for y, m in enumerate(models):
            left = 0.0
            for i, stage in enumerate(STAGES):
                v = stages[m].get(stage, {}).get("mean_ms", math.nan)
                v = 0.0 if v != v else v
                ax.barh(y, v, left=left, color=colors[i], label=stage if y == 0 else None, height=0.6)
                if v > 0.06 * max(1e-9, _row_total(stages[m])):
                    ax.text(left + v / 2, y, f"{v:.1f}", ha="center", va="center", fontsize=7, color="white")
                left += v
            total = stages[m].get("total", {}).get("mean_ms", math.nan)
            ax.text(left, y, f"  {left:.1f} ms" + (f"\n  (server total {total:.1f})" if total == total else ""),
                    va="center", fontsize=8)
        ax.set_yticks(range(len(models)), models)
        ax.set_xlabel("mean ms per image (or text) in each stage")
        ax.set_xlim(right=max(_row_total(stages[m]) for m in models) * 1.45)
        ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.22))
        ax.grid(axis="x", alpha=0.3)
        rect = (0, 0.07, 1, 1)
        fig.text(0.01, 0.01, "each stage: its own mean (sum/count); decode/preprocess count /v1 images only (OIP sends "
                 "tensors);\ninference: the whole backend call each item rode in; queue: batching wait + worker busy",
                 fontsize=6, color="0.35", va="bottom")
    else:
        rect = (0, 0, 1, 1)
        _empty(ax, "no softmoe_image_latency_seconds data in /metrics")
    ax.set_title("Where the time per image goes (softmoe_image_latency_seconds, delta over the run)", fontsize=9)
    fig.tight_layout(rect=rect)
    fig.savefig(path)
    plt.close(fig)


def _row_total(stages: dict[str, dict]) -> float:
    return sum(v for s in STAGES if (v := stages.get(s, {}).get("mean_ms", 0.0)) == v) or 1e-9
