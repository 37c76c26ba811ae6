"""Smoke of `python -m loadtests.budget_cost` (README's per-request cost figures): it runs, and
every hostile case is refused with its 4xx while the at-budget request is served. No timings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_budget_cost_runs_and_refuses_the_hostile_cases():
    r = subprocess.run([sys.executable, "-m", "loadtests.budget_cost"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {line[:52].strip(): line[52:].split() for line in r.stdout.splitlines()[1:] if line.strip()}
    statuses = {name: int(cols[0]) for name, cols in rows.items()}
    refused = {name: s for name, s in statuses.items() if "(refused)" in name}
    assert len(refused) == 6 and all(400 <= s < 500 for s in refused.values()), statuses
    assert statuses["3 flat 16-bit PNGs, 25.2 MP (at the pixel budget)"] == 200
