"""Every runnable script of the repository imports and parses its arguments: ``python -m X --help``
exits 0 with a usage line and starts nothing. The benches' smokes (test_bench_smoke, test_soak_smoke,
test_gpu_code_on_cpu, ...) run the work itself; this catches a script whose imports rotted (the soak
imported a function that no longer existed) before anyone runs it for real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP = {"loadtests.peers.litserve_app", "loadtests.peers.ray_app"}  # the peers' own venv (SOFTMOE_PEERS_PYTHON)


def scripts() -> list[str]:
    found = []
    for top in ("softmoe_models", "export", "server", "loadtests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if 'if __name__ == "__main__"' in path.read_text():
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                if module not in SKIP:
                    found.append(module)
    return found


def test_the_list_is_not_empty():
    assert {"loadtests.bench", "loadtests.soak", "loadtests.gpu_check", "export.bench"} <= set(scripts())


@pytest.mark.parametrize("module", scripts())
def test_help_exits_zero_and_starts_nothing(module):
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "usage:" in r.stdout
    assert "[loadtest] starting" not in r.stdout + r.stderr
