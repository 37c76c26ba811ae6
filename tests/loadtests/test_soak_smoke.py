"""The soak (not in CI at full length) cannot rot unseen: a seconds-long run against the built-in
model must calibrate, soak, print a window line per window and a JSON report with no errors; and a
calibration that gets no answers must stop with a message, not report a capacity."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def soak(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loadtests.soak", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)


def test_short_soak_reports_every_window_and_no_errors():
    r = soak("--start-server", "--minutes", "0.1", "--window", "2", "--calibrate-seconds", "2", "--users", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    windows, report = lines[:-1], lines[-1]
    assert len(windows) >= 2 and all(w["rps"] > 0 and w["failures"] == 0 for w in windows)
    assert report["capacity_rps"] > 0 and report["errors_non_503"] == 0
    assert report["series_start"] > 0 and report["series_end"] >= report["series_start"]
    assert report["target_rps"] == pytest.approx(0.7 * report["capacity_rps"], rel=0.01)


def test_calibration_without_answers_stops_with_a_message():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connection refused
    r = soak("--url", f"http://127.0.0.1:{port}", "--pid", "1", "--calibrate-seconds", "1")
    assert r.returncode != 0
    assert "calibration saw" in r.stderr and "failed requests" in r.stderr
    assert "capacity" not in r.stdout
