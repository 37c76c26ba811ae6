"""Load tests, run for real but short, against real servers on loopback.

- ``python -m loadtests.run`` sweeps 1 and 4 users (2 steps x 4 s) against a live server: zero
  failures, a CSV with the expected columns and sane numbers, three valid PNGs;
- the locustfiles run under the ``locust`` CLI with the stepped shape from the environment;
- ``--start-server`` starts and stops ``softmoe serve`` itself, and a run with failing requests
  exits 1 with the failures in the report; an unreachable server is exit status 2;
- the report arithmetic (step windows, percentiles, /metrics deltas) on fixed inputs.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.live import free_port, live_server
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `loadtests` is a top-level package of the repository, like `server`
    sys.path.insert(0, str(ROOT))

from loadtests import report  # noqa: E402  (never imports locust: that would gevent-patch pytest)
from loadtests.common import Config, parse_endpoints  # noqa: E402
PNGS = ("latency_vs_throughput.png", "batch_sizes.png", "stages.png")
pytestmark = pytest.mark.timeout(180)


def _run(args: list[str], timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "MPLBACKEND": "Agg", **(env or {})})


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def server_url():
    from server.http.app import create_app
    from server.settings import Settings

    with live_server(create_app(Settings())) as url:
        yield url


def test_sweep_against_live_server(server_url, tmp_path):
    out = tmp_path / "report"
    r = _run(["-m", "loadtests.run", "--url", server_url, "--users", "1", "4", "--step-seconds", "4",
              "--out", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr

    rows = _rows(out / "steps.csv")
    assert list(rows[0]) == report.STEP_COLUMNS
    assert [int(x["users"]) for x in rows] == [1, 4]
    for x in rows:
        v = {k: float(x[k]) for k in report.STEP_COLUMNS}
        assert v["failures"] == 0
        assert v["requests"] > 0 and v["images"] >= v["requests"]
        assert v["req_per_s"] > 0 and v["images_per_s"] >= v["req_per_s"]
        assert 3.0 <= v["seconds"] <= 6.0
        assert 0 < v["p50_ms"] <= v["p95_ms"] <= v["p99_ms"] <= v["max_ms"]
        assert math.isclose(v["req_per_s"], v["requests"] / v["seconds"], rel_tol=1e-2)

    by_ep = _rows(out / "steps_by_endpoint.csv")
    assert {x["endpoint"] for x in by_ep} == {"classify", "zero-shot", "embed", "oip"}
    assert all(int(x["failures"]) == 0 for x in by_ep)

    for name in PNGS:
        path = out / name
        assert path.stat().st_size < 200_000
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            assert im.format == "PNG" and im.width >= 400 and im.height >= 200

    # /metrics deltas: real batches of both models, every stage timed
    calls = _rows(out / "batch_sizes.csv")
    assert {x["model"] for x in calls} == {"digits", "digits-lit"}
    assert sum(float(x["calls"]) for x in calls) > 0
    stages = {(x["model"], x["stage"]): float(x["mean_ms"]) for x in _rows(out / "stages.csv")}
    for model in ("digits", "digits-lit"):
        for stage in report.STAGES:
            assert stages[(model, stage)] >= 0
        assert stages[(model, "inference")] > 0

    summary = json.loads((out / "summary.json").read_text())
    assert summary["failures"] == 0 and summary["stopped_by"] == "steps"
    assert summary["steps"] == [1, 4]
    groups = {g["group"] for g in summary["image_groups"]}
    assert {"digit-png-8x8", "photo-png-224x224", "photo-jpeg-640x480"} <= groups
    assert "--url" in summary["command"]


def test_locustfiles_under_the_locust_cli(server_url, tmp_path):
    """All four per-endpoint locustfiles at once (one user class each) under the env-configured shape."""
    prefix = tmp_path / "cli"
    r = _run(["-m", "locust", "-f", "loadtests/locustfiles", "--host", server_url, "--headless", "--only-summary",
              "--stop-timeout", "10", "--csv", str(prefix)], env={"LOADTEST_STEPS": "4", "LOADTEST_STEP_SECONDS": "2"})
    assert r.returncode == 0, r.stdout + r.stderr
    stats = {x["Name"]: x for x in _rows(Path(f"{prefix}_stats.csv"))}
    assert {"classify", "zero-shot", "embed", "oip"} <= set(stats)
    for name in ("classify", "zero-shot", "embed", "oip", "Aggregated"):
        assert int(stats[name]["Request Count"]) > 0, name
        assert int(stats[name]["Failure Count"]) == 0, (name, (Path(f"{prefix}_failures.csv")).read_text())


def test_start_server_and_failures_exit_nonzero(tmp_path):
    """``--start-server`` with a server that refuses images over 64x64 pixels: 224x224 photos get 413."""
    out = tmp_path / "failing"
    r = _run(["-m", "loadtests.run", "--start-server", "--server-args", "--max-image-pixels 4096 --threads 1",
              "--no-preflight", "--image-sizes", "digits,224x224", "--endpoints", "classify,zero-shot",
              "--users", "2", "--step-seconds", "2", "--out", str(out)])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "server stopped (exit status 0)" in r.stderr
    rows = _rows(out / "steps.csv")
    assert int(rows[0]["failures"]) > 0 and float(rows[0]["req_per_s"]) > 0  # the digits still succeed
    failures = _rows(out / "failures.csv")
    assert failures and all("413" in x["error"] for x in failures)
    assert {x["endpoint"] for x in failures} <= {"classify", "zero-shot"}


def test_unreachable_server_is_exit_2(tmp_path):
    r = _run(["-m", "loadtests.run", "--url", f"http://127.0.0.1:{free_port()}", "--ready-timeout", "1",
              "--users", "1", "--step-seconds", "1", "--out", str(tmp_path / "x")], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "health/ready" in r.stderr


# ------------------------------------------------------------------------------ report arithmetic


def test_step_windows_and_percentiles():
    transitions = [(10.0, 0), (12.0, 1), (14.0, None)]
    windows = report.step_windows(transitions, end=20.0)
    assert windows == [(0, 10.0, 12.0), (1, 12.0, 14.0)]
    recs = [report.Record(9.0, 5.0, False, 1, "classify")]  # before the first step: dropped
    recs += [report.Record(10.0 + i / 100, float(i + 1), False, 2, "classify") for i in range(100)]  # step 1
    recs += [report.Record(12.5, 7.0, True, 4, "oip"), report.Record(13.0, 3.0, False, 4, "oip")]  # step 2
    recs += [report.Record(15.0, 1.0, False, 1, "oip")]  # after the end: dropped
    rows, by_ep = report.summarize(recs, windows, (1, 4))
    assert [r["users"] for r in rows] == [1, 4]
    a, b = rows
    assert (a["requests"], a["failures"], a["images"]) == (100, 0, 200)
    assert a["req_per_s"] == 50.0 and a["images_per_s"] == 100.0
    assert a["p50_ms"] == pytest.approx(50.5) and a["p99_ms"] == pytest.approx(99.01) and a["max_ms"] == 100.0
    assert (b["requests"], b["failures"], b["images"], b["req_per_s"]) == (2, 1, 4, 0.5)
    assert b["p50_ms"] == b["p99_ms"] == 3.0  # failed requests are not in the latency
    assert [(r["step"], r["endpoint"], r["requests"]) for r in by_ep] == [(1, "classify", 100), (2, "oip", 2)]


METRICS_BEFORE = """\
# TYPE softmoe_batch_size histogram
softmoe_batch_size_bucket{le="1.0",model="m"} 2.0
softmoe_batch_size_bucket{le="2.0",model="m"} 2.0
softmoe_batch_size_bucket{le="4.0",model="m"} 3.0
softmoe_batch_size_bucket{le="+Inf",model="m"} 3.0
softmoe_batch_size_count{model="m"} 3.0
softmoe_batch_size_sum{model="m"} 5.0
# TYPE softmoe_image_latency_seconds histogram
softmoe_image_latency_seconds_sum{model="m",stage="decode"} 1.0
softmoe_image_latency_seconds_count{model="m",stage="decode"} 10.0
"""
METRICS_AFTER = """\
# TYPE softmoe_batch_size histogram
softmoe_batch_size_bucket{le="1.0",model="m"} 3.0
softmoe_batch_size_bucket{le="2.0",model="m"} 5.0
softmoe_batch_size_bucket{le="4.0",model="m"} 9.0
softmoe_batch_size_bucket{le="+Inf",model="m"} 9.0
softmoe_batch_size_count{model="m"} 9.0
softmoe_batch_size_sum{model="m"} 25.0
# TYPE softmoe_image_latency_seconds histogram
softmoe_image_latency_seconds_sum{model="m",stage="decode"} 1.5
softmoe_image_latency_seconds_count{model="m",stage="decode"} 110.0
softmoe_image_latency_seconds_sum{model="m",stage="inference"} 0.2
softmoe_image_latency_seconds_count{model="m",stage="inference"} 20.0
"""


def test_metrics_deltas():
    d = report.delta(report.parse_metrics(METRICS_BEFORE), report.parse_metrics(METRICS_AFTER))
    h = report.batch_histogram(d)["m"]
    assert h["buckets"] == [("1", 1.0), ("2", 2.0), ("3-4", 3.0), (">4", 0.0)]
    assert (h["batches"], h["items"], h["mean"]) == (6.0, 20.0, 20.0 / 6.0)
    s = report.stage_means(d)["m"]
    assert s["decode"]["count"] == 100.0 and s["decode"]["mean_ms"] == pytest.approx(5.0)
    assert s["inference"]["mean_ms"] == pytest.approx(10.0)


def test_plots_without_data_still_write_pngs(tmp_path):
    report.plot_latency_throughput([], tmp_path / "a.png")
    report.plot_batch_sizes({}, tmp_path / "b.png")
    report.plot_stages({}, tmp_path / "c.png")
    for name in ("a.png", "b.png", "c.png"):
        with Image.open(tmp_path / name) as im:
            im.verify()


def test_config_from_env():
    cfg = Config.from_env({"LOADTEST_ENDPOINTS": "zero_shot,oip", "LOADTEST_IMAGES_PER_REQUEST": "1,8",
                           "LOADTEST_OIP_BINARY": "0", "LOADTEST_LABELS": "cat,dog"})
    assert cfg.endpoints == ("zero-shot", "oip") and cfg.images_per_request == (1, 8)
    assert not cfg.oip_binary and cfg.labels == ("cat", "dog")
    with pytest.raises(ValueError):
        parse_endpoints("classify,nope")


SHAPE_CHECK = """
from loadtests.shape import StepLoadShape
shape = StepLoadShape()
now = [0.0]
shape.get_run_time = lambda: now[0]
ticks = []
for t in (0.0, 4.9, 5.0, 10.0):
    now[0] = t
    ticks.append(shape.tick())
print(ticks, shape.finished, [k for _, k in shape.transitions])
"""


def test_step_shape():
    """In a subprocess: importing locust monkey-patches the interpreter with gevent."""
    r = _run(["-c", SHAPE_CHECK], timeout=60, env={"LOADTEST_STEPS": "2,8", "LOADTEST_STEP_SECONDS": "5"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[(2, 100.0), (2, 100.0), (8, 100.0), None] True [0, 1, None]"
