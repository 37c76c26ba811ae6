"""Serving throughput with routing statistics on vs off, side by side in one run.

    python -m loadtests.routing_bench [--quick] [--backend torch|onnxruntime] [--rounds 6] [--seconds 4]

Three `softmoe serve` processes with the built-in models, identical but for
``--routing-stats-sample``: 0 (statistics off), 16 (the default) and 1 (every call). A closed loop
of concurrent clients posts one digit PNG per /v1/classify request to each in alternating windows
(shuffled each round); the figures are the median images/s over windows, the median over rounds
of each round's ratio to "off" (paired: both windows of a ratio ran seconds apart), and the
server's CPU seconds per image (less sensitive to other load on a shared machine).
The last line is one JSON object with the figures. From loadtests/bench.py: ``section(mode)``
(mode "quick", "smoke" or "full") prints the same table and returns that object.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtests.procs import cpu_seconds
from loadtests.run import ServerProcess, wait_ready

SAMPLES = {"off": 0, "default (1 in 16)": 16, "every call": 1}


def _pngs(n: int = 64) -> list[str]:
    from sklearn.datasets import load_digits

    from softmoe_models.demo.data import digit_png

    return [base64.b64encode(digit_png(v)).decode() for v in load_digits().data[:n]]


async def _closed_loop(url: str, images: list[str], seconds: float, concurrency: int) -> tuple[int, int]:
    """(images classified, errors) by ``concurrency`` clients, one image per request, for ``seconds``."""
    done = errors = 0
    stop = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def worker(i: int) -> None:
            nonlocal done, errors
            k = i
            while time.perf_counter() < stop:
                try:
                    r = await client.post("/v1/classify", json={"model": "digits", "images": [images[k % len(images)]]})
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                k += concurrency
                done += ok
                errors += not ok
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return done, errors


def _cpu_seconds(pid: int) -> float:
    return cpu_seconds(pid) or 0.0  # 0 where /proc is not there


def _sampled(url: str) -> float:
    """Images the server's routing statistics counted (layer 2 of digits)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name == "softmoe_routing_dispatch_entropy_count" and 'model="digits"' in rest and 'layer="2"' in rest:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def measure(rounds: int = 6, seconds: float = 4.0, concurrency: int = 16, backend: str | None = None,
            log=print) -> dict:
    """Start the three servers, run the interleaved windows, print the table, return the figures."""
    images = _pngs()
    extra = f" --backend {backend}" if backend else ""
    tmp = Path(tempfile.mkdtemp(prefix="softmoe-routing-bench-"))
    servers: dict[str, ServerProcess] = {}
    try:
        for i, (name, sample) in enumerate(SAMPLES.items()):
            servers[name] = ServerProcess(f"--routing-stats-sample {sample}{extra}", tmp / f"server{i}.log")
        for s in servers.values():
            wait_ready(s.url, 900, s)
        meta = httpx.get(f"{next(iter(servers.values())).url}/v2/models/digits", timeout=10).json()["parameters"]
        for s in servers.values():  # warm the connections and the code paths, outside the windows
            asyncio.run(_closed_loop(s.url, images, 1.0, concurrency))
        rng = random.Random(0)
        rates: dict[str, list[float]] = {k: [] for k in servers}
        cpu: dict[str, list[float]] = {k: [] for k in servers}
        errors = 0
        for _ in range(rounds):
            order = list(servers)
            rng.shuffle(order)
            for name in order:
                c0 = _cpu_seconds(servers[name].proc.pid)
                n, e = asyncio.run(_closed_loop(servers[name].url, images, seconds, concurrency))
                cpu[name].append((_cpu_seconds(servers[name].proc.pid) - c0) / max(n, 1) * 1e3)
                rates[name].append(n / seconds)
                errors += e
        sampled = {k: _sampled(s.url) for k, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    ms = {k: statistics.median(v) for k, v in cpu.items()}
    paired = {k: statistics.median(a / b for a, b in zip(v, rates["off"])) for k, v in rates.items()}
    off = med["off"]
    log(f"\nrouting statistics on vs off: /v1/classify on digits, one PNG per request, {concurrency} clients, "
        f"{rounds} rounds x {seconds:g}s windows; backend {meta.get('backend')} ({meta.get('device')}), "
        f"max batch {meta.get('max_batch_size')}")
    log(f"  {'--routing-stats-sample':20} {'img/s':>8} {'vs off':>7} {'paired':>7} {'CPU ms/img':>11} {'vs off':>7} "
        f"{'sampled':>8}  img/s windows")
    for k, v in med.items():
        log(f"  {k:20} {v:8.1f} {v / off:6.3f}x {paired[k]:6.3f}x {ms[k]:11.3f} {ms[k] / ms['off']:6.3f}x "
            f"{sampled[k]:8.0f}  {[round(x) for x in rates[k]]}")
    result = {"backend": meta.get("backend"), "img_per_s": {k: round(v, 1) for k, v in med.items()},
              "cpu_ms_per_img": {k: round(v, 3) for k, v in ms.items()},
              "ratio_default_vs_off": round(med["default (1 in 16)"] / off, 3),
              "paired_ratio_default_vs_off": round(paired["default (1 in 16)"], 3),
              "ratio_every_call_vs_off": round(med["every call"] / off, 3),
              "paired_ratio_every_call_vs_off": round(paired["every call"], 3), "errors": errors}
    log(json.dumps(result))
    return result


def section(mode: str = "full") -> dict:
    """For loadtests/bench.py: ``quick`` and ``smoke`` are shorter runs."""
    if mode == "smoke":
        return measure(rounds=1, seconds=1.0, concurrency=4)
    if mode == "quick":
        return measure(rounds=3, seconds=2.0)
    return measure()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 2 s windows (not for README figures)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one measurement window")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--backend", default=None, help="torch | onnxruntime (default: the server's default)")
    args = parser.parse_args(argv)
    rounds, seconds = (3, 2.0) if args.quick else (args.rounds, args.seconds)
    result = measure(rounds, seconds, args.concurrency, args.backend)
    sys.exit(1 if result["errors"] else 0)


if __name__ == "__main__":
    main()
