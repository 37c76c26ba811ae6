"""Graceful shutdown of the real `softmoe serve` process: SIGTERM turns readiness false, new
requests get 503 with Retry-After, queued and in-flight requests finish with 200, the process
exits cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from helpers.images import b64, golden_pngs
from helpers.live import free_port, wait_until


def test_sigterm_drains_without_losing_requests(packages, tmp_path):
    port = free_port()
    env = {**os.environ, "SOFTMOE_MAX_DELAY_MS": "3000", "SOFTMOE_EAGER_BATCHING": "false"}  # env vars are settings too; items wait the window out
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--model", f"golden={packages['golden']}",
         "--port", str(port), "--max-batch-size", "32", "--drain-seconds", "1.5", "--cache-dir", str(tmp_path)],
        env=env, stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(f"{url}/v2/health/ready", 120, lambda: proc.poll() is None)

        statuses: list[int] = []
        body = {"images": [b64(golden_pngs()[0])]}

        def send() -> None:
            statuses.append(httpx.post(f"{url}/v1/classify", json=body, timeout=30).status_code)

        threads = [threading.Thread(target=send) for _ in range(12)]
        for t in threads:
            t.start()
        # All 12 admitted: they wait out the 3 s batching delay in the queue.
        deadline = time.monotonic() + 20
        while _queue_depth(url) < 12:
            assert time.monotonic() < deadline, "requests were not admitted"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        ready = httpx.get(f"{url}/v2/health/ready", timeout=5)
        late = httpx.post(f"{url}/v1/classify", json=body, timeout=5)
        live = httpx.get(f"{url}/v2/health/live", timeout=5)  # alive while draining
        for t in threads:
            t.join(30)
        assert statuses == [200] * 12
        assert ready.status_code == 503
        assert late.status_code == 503 and "Retry-After" in late.headers and "shutting down" in late.json()["error"]["message"]
        assert live.status_code == 200
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _queue_depth(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith('softmoe_queue_depth{model="golden"}'):
            return float(line.split()[-1])
    return 0.0
