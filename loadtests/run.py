"""A headless locust sweep over user counts, with a CSV and PNG report.

    python -m loadtests.run --url http://127.0.0.1:8000 [--users 1 4 16] [--step-seconds 10]
                            [--endpoints classify,zero-shot,embed,oip] [--out DIR]
    python -m loadtests.run --start-server --duration 20 --out runs/x

Locust runs as a library in this process (``locust.env.Environment`` + a local runner) under the
stepped ``StepLoadShape``: one step per ``--users`` value, each held for ``--step-seconds``
(``--duration`` splits a total time evenly instead). Before the sweep every endpoint is called
once outside the measurement (a pre-flight check that also fills the zero-shot label cache), and
``/metrics`` is scraped just before and just after the sweep.

DIR gets:

- ``steps.csv``: per step: users, seconds, requests, failures, images, req_per_s, images_per_s,
  p50/p95/p99/mean/max latency (ms, client-side, successful requests);
  ``steps_by_endpoint.csv``: the same per endpoint;
- ``latency_vs_throughput.png``, ``batch_sizes.png`` (``softmoe_batch_size`` buckets, delta over
  the sweep), ``stages.png`` (mean time per image by stage from ``softmoe_image_latency_seconds``,
  delta over the sweep); ``batch_sizes.csv``, ``stages.csv``;
- ``summary.json`` (settings, served models, image groups, totals, errors); ``failures.csv``
  when something failed; ``server.log`` with ``--start-server`` (when the server logged anything).

Exit status: 0; 1 when a request failed (unless ``--allow-failures``) or none succeeded; 2 when the
run could not start (server not ready, pre-flight request failed, bad arguments).
Bounded: the sweep stops after its steps, after ``--max-requests`` requests, or at a hard deadline
(sweep time + 60 s), whichever comes first; every request has ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_USERS = (1, 4, 16)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--start-server", action="store_true",
                       help="start `softmoe serve` on a free loopback port for the run, stop it after")
    p.add_argument("--server-args", default="", help="extra `softmoe serve` flags with --start-server, one string "
                   "(e.g. \"--max-batch-size 16 --threads 1\")")
    p.add_argument("--ready-timeout", type=float, default=None, help="seconds to wait for /v2/health/ready "
                   "(default 180 with --start-server, 30 with --url)")
    p.add_argument("--no-preflight", action="store_true", help="skip the pre-flight call of each endpoint (its "
                   "failures then show up in the sweep; the zero-shot label cache fills during the first step)")
    p.add_argument("--users", type=int, nargs="+", default=list(DEFAULT_USERS), help="user count of each step")
    p.add_argument("--step-seconds", type=float, default=10.0, help="seconds per step")
    p.add_argument("--duration", type=float, help="total sweep seconds, split evenly over the steps "
                   "(overrides --step-seconds)")
    p.add_argument("--endpoints", default=None, help="comma-separated: classify,zero-shot,embed,oip (default all)")
    p.add_argument("--out", type=Path, help="report directory (default runs/loadtest-<time>)")
    p.add_argument("--allow-failures", action="store_true", help="exit 0 even if requests failed")
    p.add_argument("--max-requests", type=int, default=200_000, help="stop the sweep after this many requests")
    p.add_argument("--spawn-rate", type=float, default=100.0, help="users started per second at a step change")
    p.add_argument("--wait", type=float, default=None, help="seconds each user waits between requests (default 0)")
    p.add_argument("--timeout", type=float, default=None, help="per-request timeout, seconds (default 30)")
    p.add_argument("--images-per-request", default=None, help="comma-separated counts picked uniformly (default 1,2,4)")
    p.add_argument("--image-sizes", default=None, help="comma-separated: digits and/or WxH (default digits,64x64,224x224,640x480)")
    p.add_argument("--image-formats", default=None, help="photo encodings: png,jpeg (default both)")
    p.add_argument("--seed", type=int, default=None, help="request randomness (default 0)")
    p.add_argument("--title", default="", help="title of the latency plot")
    args = p.parse_args(argv)
    if any(u < 1 for u in args.users):
        p.error("--users must be positive")
    if args.duration is not None:
        if args.duration <= 0:
            p.error("--duration must be positive")
        args.step_seconds = args.duration / len(args.users)
    if args.step_seconds <= 0:
        p.error("--step-seconds must be positive")
    if args.max_requests < 1:
        p.error("--max-requests must be positive")
    if args.url and args.server_args:
        p.error("--server-args needs --start-server")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(f"[loadtest] {msg}", file=sys.stderr, flush=True)


class ServerProcess:
    """``softmoe serve`` as a child process on a free loopback port."""

    def __init__(self, extra_args: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = shlex.split(extra_args)
        self.grpc_port = free_port() if "--grpc-port" not in extra else None  # never the well-known 8001
        self.cmd = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                    "--drain-seconds", "0", "--log-level", "warning",
                    *(["--grpc-port", str(self.grpc_port)] if self.grpc_port else []), *extra]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        log("starting: " + " ".join(shlex.quote(c) for c in self.cmd))
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM, wait (kill after 30 s), drop an empty log. Idempotent: a second call only
        returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log("server did not exit 30 s after SIGTERM; killing it")
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        try:
            if self.log_path.stat().st_size == 0:  # --log-level warning: usually nothing to keep
                self.log_path.unlink()
        except FileNotFoundError:  # stopped before: the empty log is gone already
            pass
        return self.proc.returncode


def wait_ready(url: str, timeout: float, server: ServerProcess | None = None) -> None:
    from .common import http_get

    deadline = time.monotonic() + timeout
    while True:
        status, _ = http_get(f"{url}/v2/health/ready", timeout=2)
        if status == 200:
            return
        if server is not None and server.proc.poll() is not None:
            raise RuntimeError(f"server exited with status {server.proc.returncode}:\n{server.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/v2/health/ready not 200 after {timeout:.0f} s (last: {status or 'no connection'})")
        time.sleep(0.2)


def preflight(url: str, plan, rng, rounds: int = 2) -> list[str]:
    """Every endpoint ``rounds`` times, outside the measurement. Returns the errors."""
    from .common import http_post

    errors = []
    for _ in range(rounds):
        for ep in plan.cfg.endpoints:
            c = plan.call(ep, rng)
            status, headers, body = http_post(url + c.path, c.body, c.headers, timeout=plan.cfg.timeout_s)
            err = c.check(status, headers, body)
            if err:
                errors.append(f"{ep} ({c.group}, {c.images} images): {err}")
    return errors


def scrape(url: str) -> tuple[dict, str | None]:
    from .common import http_get
    from .report import parse_metrics

    status, body = http_get(f"{url}/metrics", timeout=10)
    if status != 200:
        return {}, f"GET /metrics answered {status or 'no connection'}"
    try:
        return parse_metrics(body.decode()), None
    except Exception as e:  # a malformed exposition should not lose the latency report
        return {}, f"/metrics could not be parsed: {e}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # locust monkey-patches the standard library with gevent on import: do it before any socket use.
    import gevent
    import locust
    from locust.env import Environment

    from . import report
    from .common import Config, Plan, discover, parse_endpoints
    from .images import describe
    from .shape import StepLoadShape
    from .users import set_plan, user_class

    out: Path = args.out or Path("runs") / time.strftime("loadtest-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    try:
        cfg = Config.from_env(
            endpoints=parse_endpoints(args.endpoints) if args.endpoints else None,
            images_per_request=tuple(int(n) for n in args.images_per_request.split(",")) if args.images_per_request else None,
            image_sizes=tuple(args.image_sizes.split(",")) if args.image_sizes else None,
            image_formats=tuple(args.image_formats.lower().split(",")) if args.image_formats else None,
            wait_s=args.wait, timeout_s=args.timeout, seed=args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    server = ServerProcess(args.server_args, out / "server.log") if args.start_server else None
    url = server.url if server else args.url.rstrip("/")
    try:
        try:
            wait_ready(url, args.ready_timeout or (180.0 if server else 30.0), server)
            served = discover(url)
            plan = Plan(cfg, served)
            problems = plan.problems()
            if problems:
                raise RuntimeError("; ".join(problems))
        except (RuntimeError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        import random

        errors = [] if args.no_preflight else preflight(url, plan, random.Random(cfg.seed + 999_983))
        if errors:
            print("error: pre-flight requests failed:\n  " + "\n  ".join(errors[:8]), file=sys.stderr)
            return 2
        set_plan(url, plan)
        log(f"{url}: models {served.kinds}; endpoints {','.join(cfg.endpoints)}; steps {args.users} users "
            f"x {args.step_seconds:g} s")

        before, metrics_error = scrape(url)
        shape = StepLoadShape(tuple(args.users), args.step_seconds, args.spawn_rate)
        env = Environment(user_classes=[user_class(cfg.endpoints, cfg.wait_s, "SweepUser")], shape_class=shape,
                          host=url, stop_timeout=cfg.timeout_s + 5)  # users finish their request: no disconnects
        records: list[report.Record] = []

        def on_request(request_type, name, response_time, response_length, exception=None, context=None, **_):
            ctx = context or {}
            records.append(report.Record(time.perf_counter(), float(response_time or 0.0), exception is not None,
                                         int(ctx.get("images", 0)), ctx.get("endpoint", name)))

        env.events.request.add_listener(on_request)
        runner = env.create_local_runner()
        runner.start_shape()
        deadline = time.perf_counter() + shape.duration + 60
        stopped_by = "steps"
        while not shape.finished:
            gevent.sleep(0.05)
            if len(records) >= args.max_requests:
                stopped_by = f"--max-requests {args.max_requests}"
                break
            if time.perf_counter() > deadline:
                stopped_by = "deadline"
                break
        end = shape.transitions[-1][0] if shape.finished else time.perf_counter()
        if shape.finished:  # the shape worker is stopping the users itself: let it finish
            from locust.runners import STATE_STOPPED

            wait_until = time.perf_counter() + env.stop_timeout + 5
            while runner.state != STATE_STOPPED and time.perf_counter() < wait_until:
                gevent.sleep(0.05)
        runner.quit()
        after, err2 = scrape(url)
        metrics_error = metrics_error or err2

        windows = report.step_windows(shape.transitions, end)
        rows, by_ep = report.summarize(records, windows, shape.steps)
        d = report.delta(before, after) if not metrics_error else {}
        hist = report.batch_histogram(d)
        stages = report.stage_means(d)

        report.write_csv(out / "steps.csv", rows, report.STEP_COLUMNS)
        report.write_csv(out / "steps_by_endpoint.csv", by_ep, report.ENDPOINT_COLUMNS)
        report.write_csv(out / "batch_sizes.csv",
                         [{"model": m, "bucket": b, "calls": c} for m, h in hist.items() for b, c in h["buckets"]],
                         ["model", "bucket", "calls"])
        report.write_csv(out / "stages.csv",
                         [{"model": m, "stage": s, "count": v["count"], "sum_s": v["sum_s"], "mean_ms": v["mean_ms"]}
                          for m, st in stages.items() for s, v in st.items()],
                         ["model", "stage", "count", "sum_s", "mean_ms"])
        max_batch = _flag(args.server_args, "--max-batch-size") if server else None
        report.plot_latency_throughput(rows, out / "latency_vs_throughput.png", args.title)
        report.plot_batch_sizes(hist, out / "batch_sizes.png", int(max_batch) if max_batch else None)
        report.plot_stages(stages, out / "stages.png")

        failures = sum(r["failures"] for r in rows)
        measured = sum(r["requests"] for r in rows)
        succeeded = measured - failures
        errors_seen = [{"endpoint": e.name, "error": str(e.error)[:300], "occurrences": e.occurrences}
                       for e in env.stats.errors.values()]
        exceptions = [{"message": x["msg"][:300], "count": x["count"]} for x in runner.exceptions.values()]
        if errors_seen:
            report.write_csv(out / "failures.csv", errors_seen, ["endpoint", "error", "occurrences"])
        summary = {
            "command": "python -m loadtests.run " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "url": url, "started_server": server.cmd if server else None,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                     "locust": locust.__version__},
            "models": served.info, "endpoints": list(cfg.endpoints),
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
            "image_groups": describe(plan.corpus),
            "steps": list(shape.steps), "step_seconds": args.step_seconds, "stopped_by": stopped_by,
            "requests_measured": measured, "requests_all": len(records), "failures": failures,
            "locust_errors": errors_seen, "locust_exceptions": exceptions,
            "locust_cpu_warning": bool(getattr(runner, "cpu_warning_emitted", False)),
            "metrics_error": metrics_error,
            "rows": rows, "batch_sizes": hist, "stages": stages,
        }
        (out / "summary.json").write_text(json.dumps(_clean(summary), indent=2, allow_nan=False) + "\n")

        _print_table(rows)
        for m, h in hist.items():
            if h["batches"]:
                print(f"batch size {m}: mean {h['mean']:.2f} over {int(h['batches'])} calls")
        for m, st in stages.items():
            parts = ", ".join(f"{s} {st[s]['mean_ms']:.2f}" for s in report.STAGES if s in st)
            print(f"ms per image {m}: {parts}")
        if metrics_error:
            log(f"warning: {metrics_error}")
        if summary["locust_cpu_warning"]:
            log("warning: locust's CPU usage passed 90%: the client may have limited the throughput")
        print(f"report: {out}")
        for e in errors_seen[:10]:
            log(f"failure x{e['occurrences']} {e['endpoint']}: {e['error']}")
        for x in exceptions[:5]:
            log(f"exception x{x['count']} in a locust user: {x['message']}")
        if (failures or exceptions) and not args.allow_failures:
            log(f"{failures} failed requests, {len(exceptions)} user exceptions: exit 1 (--allow-failures to ignore)")
            return 1
        if succeeded == 0:
            log("no request succeeded: exit 1")
            return 1
        return 0
    finally:
        if server is not None:
            code = server.stop()
            kept = f"; log: {server.log_path}" if server.log_path.exists() else ""
            log(f"server stopped (exit status {code}){kept}")


def _flag(text: str, name: str) -> str | None:
    parts = shlex.split(text)
    for i, p in enumerate(parts):
        if p == name and i + 1 < len(parts):
            return parts[i + 1]
        if p.startswith(name + "="):
            return p.split("=", 1)[1]
    return None


def _clean(o):
    """JSON-safe: numpy scalars to Python, NaN and infinities to null, tuples to lists."""
    import math

    import numpy as np

    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, np.generic):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def _print_table(rows: list[dict]) -> None:
    head = f"{'step':>4} {'users':>5} {'req':>6} {'fail':>4} {'req/s':>8} {'img/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}"
    print(head)
    for r in rows:
        print(f"{r['step']:>4} {r['users']:>5} {r['requests']:>6} {r['failures']:>4} {r['req_per_s']:>8.1f} "
              f"{r['images_per_s']:>8.1f} {r['p50_ms']:>8.1f} {r['p95_ms']:>8.1f} {r['p99_ms']:>8.1f}")


if __name__ == "__main__":
    sys.exit(main())
