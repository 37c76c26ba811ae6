"""What hostile and at-budget requests cost the server, in its own CPU-seconds.

    python -m loadtests.budget_cost

Starts `softmoe serve` with its defaults on loopback, sends each case once, and prints the
status, the server's CPU time (from /proc) and the wall time. Refused cases must cost next to
nothing (they are refused from headers and counters before the work); the at-budget cases show
the most a request the budgets admit can cost. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import io
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from loadtests.procs import cpu_seconds
from loadtests.run import ServerProcess, wait_ready


def _cpu_seconds(pid: int) -> float:
    return cpu_seconds(pid) or 0.0  # 0 where /proc is not there


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def cases() -> dict[str, dict]:
    b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
    bomb = _png(np.full((6000, 6000), 7, np.uint8))  # ~100 KB declaring 36 MP
    flat16 = _png(np.full((2896, 2896), 1000, np.uint16))  # 16-bit PNG: the costliest decode per MP
    return {
        "64 PNGs declaring 6000x6000 (refused)": dict(json={"images": [b64(bomb)] * 64}),
        "OIP binary_data_size 'abc' (refused)": dict(url="/v2/models/digits/infer", json={"inputs": [
            {"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 8, 8], "parameters": {"binary_data_size": "abc"}}]}),
        "OIP shape [2**62, 4] (refused)": dict(url="/v2/models/digits/infer", json={"inputs": [
            {"name": "pixel_values", "datatype": "FP32", "shape": [2**62, 4], "data": [1]}]}),
        "JSON nested 10^6 deep (refused)": dict(content=b"[" * 1_000_000, headers={"content-type": "application/json"}),
        "gzip inflating to 64 MiB (refused)": dict(content=gzip.compress(b"[" + b" " * (64 << 20) + b"]"),
                                                   headers={"content-type": "application/json", "content-encoding": "gzip"}),
        "16 MB of tiny JSON objects (refused)": dict(content=b"[" + b'{"a":1},' * 2_000_000 + b"0]",
                                                     headers={"content-type": "application/json"}),
        "3 flat 16-bit PNGs, 25.2 MP (at the pixel budget)": dict(json={"images": [b64(flat16)] * 3}),
    }


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    server = ServerProcess("", Path(tempfile.mkdtemp(prefix="softmoe-budget-")) / "server.log")
    try:
        wait_ready(server.url, 600, server)
        print(f"{'case':52} {'status':>6} {'server CPU-s':>12} {'wall s':>7}")
        for name, kw in cases().items():
            url = server.url + kw.pop("url", "/v1/classify")
            c0, t0 = _cpu_seconds(server.proc.pid), time.perf_counter()
            r = httpx.post(url, timeout=120, **kw)
            cpu, wall = _cpu_seconds(server.proc.pid) - c0, time.perf_counter() - t0
            print(f"{name:52} {r.status_code:>6} {cpu:12.2f} {wall:7.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
