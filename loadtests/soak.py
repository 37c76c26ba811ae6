"""Soak test (not in CI): minutes at ~70% of measured capacity, with locust.

    python -m loadtests.soak [--url URL --pid PID | --start-server] [--minutes 10] [--load 0.7]

1. Calibrate: locust users with no wait time (a closed loop) for --calibrate-seconds (20) measure
   capacity (answered requests/s) on /v1/classify with a real digit PNG (the built-in model).
2. Soak: locust users at a constant throughput adding up to ``load`` x capacity, for --minutes.
3. Every --window seconds: server RSS (/proc/PID), p50/p99 of that window, error counts, the
   number of Prometheus series /metrics exposes.
Report (last line JSON): errors other than 503 (must be 0), RSS growth after the first window
(warm-up), p99 drift (last window / first window), series count at start and end.
"""

from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import base64  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402
import httpx  # noqa: E402
from locust import HttpUser, constant, constant_throughput, task  # noqa: E402
from locust.env import Environment  # noqa: E402

BODY: dict = {}
RATE_PER_USER = 1.0


class SoakUser(HttpUser):
    wait_time = constant_throughput(1.0)  # replaced before the run

    @task
    def classify(self) -> None:
        with self.client.post("/v1/classify", json=BODY, name="classify", catch_response=True) as r:
            if r.status_code == 503:
                r.success()  # shed load is allowed; counted separately
                STATS["shed"] += 1
            elif r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")


STATS = {"shed": 0}


class CalibrateUser(HttpUser):
    """A closed-loop client: its next request as soon as the last is answered; only 200s count."""

    wait_time = constant(0)

    @task
    def classify(self) -> None:
        with self.client.post("/v1/classify", json=BODY, name="classify", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def series(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def calibrate(url: str, seconds: float = 20.0, concurrency: int = 8) -> float:
    """Capacity in answered requests/s: ``concurrency`` closed-loop locust users for ``seconds``."""
    env = Environment(user_classes=[CalibrateUser], host=url)
    runner = env.create_local_runner()
    runner.start(concurrency, spawn_rate=concurrency)
    gevent.sleep(min(2.0, seconds / 4))  # connections open, first batches formed
    env.stats.reset_all()
    t0 = time.monotonic()
    gevent.sleep(seconds)
    total = env.stats.total
    answered, failures, elapsed = total.num_requests - total.num_failures, total.num_failures, time.monotonic() - t0
    runner.quit()
    if failures:
        raise SystemExit(f"calibration saw {failures} failed requests: {dict(env.stats.errors)}")
    if not answered:
        raise SystemExit(f"calibration: no request answered in {seconds:g} s")
    return answered / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url")
    parser.add_argument("--pid", type=int, help="server process id (RSS sampling)")
    parser.add_argument("--start-server", action="store_true", help="run `softmoe serve` (default models) here")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--load", type=float, default=0.7, help="fraction of measured capacity")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--calibrate-seconds", type=float, default=20.0)
    args = parser.parse_args(argv)

    from sklearn.datasets import load_digits

    from softmoe_models.demo.data import digit_png

    BODY.update({"images": [base64.b64encode(digit_png(load_digits().data[0])).decode()], "top_k": 1})
    proc = None
    url, pid = args.url, args.pid
    if args.start_server:
        from loadtests.harness import serve

        proc = serve([])
        url, pid = proc.url, proc.proc.pid
    if not url or not pid:
        raise SystemExit("give --url and --pid, or --start-server")
    try:
        capacity = calibrate(url, args.calibrate_seconds)
        target = args.load * capacity
        SoakUser.wait_time = constant_throughput(target / args.users)
        print(f"capacity {capacity:.1f} req/s; soaking at {target:.1f} req/s ({args.load:.0%}) with {args.users} users "
              f"for {args.minutes:g} min", flush=True)
        env = Environment(user_classes=[SoakUser], host=url)
        runner = env.create_local_runner()
        runner.start(args.users, spawn_rate=args.users)
        windows = []
        end = time.monotonic() + args.minutes * 60
        while time.monotonic() < end:
            env.stats.reset_all()
            gevent.sleep(min(args.window, max(1.0, end - time.monotonic())))
            total = env.stats.total
            w = {"t": round(args.minutes * 60 - (end - time.monotonic())), "rps": round(total.total_rps, 2),
                 "p50_ms": total.get_response_time_percentile(0.5), "p99_ms": total.get_response_time_percentile(0.99),
                 "failures": total.num_failures, "rss_mb": round(rss(pid) / 2**20, 1), "series": series(url)}
            windows.append(w)
            print(json.dumps(w), flush=True)
        runner.quit()
        first, last = windows[0], windows[-1]
        report = {
            "capacity_rps": round(capacity, 2), "target_rps": round(target, 2), "minutes": args.minutes,
            "errors_non_503": sum(w["failures"] for w in windows), "shed_503": STATS["shed"],
            "rss_growth_mb_after_warmup": round(last["rss_mb"] - first["rss_mb"], 1),
            "p99_drift": round((last["p99_ms"] or 0) / max(first["p99_ms"] or 1, 1), 3),
            "series_start": first["series"], "series_end": last["series"],
        }
        print(json.dumps(report))
        if report["errors_non_503"]:
            sys.exit(1)
    finally:
        if proc is not None:
            proc.stop()


if __name__ == "__main__":
    main()
