"""Front-end capacity of `softmoe serve --frontend-workers N` against one process, on the digits model.

    python -m loadtests.frontend_bench [--workers 2] [--seconds 5] [--rounds 3] [--concurrency 32]
                                       [--server-args "--backend torch"]

Two servers on loopback, started side by side: one process (``--frontend-workers 0``) and N front
ends feeding one engine (``--frontend-workers N``), both serving the shipped ``digits`` model (8x8
inputs: the model costs next to nothing, so requests/s at saturation measure the front end:
HTTP, body, JPEG decode and resize of a 224x224 photo-sized image, preprocess, admission, the
batcher hand-off, postprocess). A closed loop of ``--concurrency`` keep-alive clients (a minimal
HTTP/1.1 client in this process) runs against each server in alternating windows, shuffled each
round; the figure is the median over rounds. ``scaling = rps_N / (N x rps_1)``; the goal of
issue 14 is >= 0.8 up to the cores available. Server CPU seconds (the process and its children)
give requests per server CPU-second, which does not depend on how busy the machine is.

``frontend_split_scaling()`` is the function ``loadtests/bench.py`` can call for its
``frontend`` section (it returns the keys printed in the last JSON line).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jpeg(seed: int, size: int = 224) -> bytes:
    """A photo-sized JPEG with some structure (gradients and noise), distinct per seed."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    base = np.stack([(x * (1 + seed % 3)) % 256, (y * 2) % 256, ((x + y) // 2) % 256], -1).astype(np.float32)
    img = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _request(body: bytes) -> bytes:
    return (b"POST /v1/classify?model=digits HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: image/jpeg\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class _Server:
    """`softmoe serve` on a free loopback port, in its own session; its log in a temporary file."""

    def __init__(self, workers: int, extra: list[str]) -> None:
        from server.engine.defaults import SHIPPED

        self.port, self.workers = _free_port(), workers
        self.log_path = Path(tempfile.mkdtemp(prefix="softmoe-fe-bench-")) / "server.log"
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "server", "serve", "--port", str(self.port), "--model",
               f"digits={SHIPPED / 'digits'}", "--frontend-workers", str(workers), "--drain-seconds", "0", "--grpc-port", "0",
               *extra]
        self.cmd = shlex.join(cmd)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait(self, timeout: float = 600) -> None:
        """Until it logs that it listens (every front end connected) and answers readiness."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_path.read_text()[-2000:]}")
            if "listening on" in self.log_path.read_text():
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/health/ready", timeout=5) as r:
                        if r.status == 200:
                            return
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {timeout:.0f} s")
            time.sleep(0.2)

    def engine_pid(self) -> int | None:
        import re

        found = re.search(r"engine pid (\d+)", self.log_path.read_text())
        return int(found[1]) if found else None

    def cpu_seconds(self) -> tuple[float, float] | None:
        """User + system CPU seconds of the server and its children, and of its engine process alone
        (0 for one process); None without psutil."""
        try:
            import psutil
        except ImportError:
            return None
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        total = engine = 0.0
        engine_pid = self.engine_pid()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
                if p.pid == engine_pid:
                    engine = t.user + t.system
        return total, engine

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        shutil.rmtree(self.log_path.parent, ignore_errors=True)


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> int:
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = 0
    for line in lines[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return int(lines[0].split()[1])


async def _closed_loop(port: int, requests: list[bytes], seconds: float, concurrency: int) -> tuple[int, int, float]:
    """(answered 200, others, seconds) of ``concurrency`` keep-alive clients for ``seconds``."""
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(concurrency)]
    ok = bad = 0
    start = time.perf_counter()
    stop = start + seconds

    async def client(i: int) -> None:
        nonlocal ok, bad
        reader, writer = conns[i]
        k = i
        while time.perf_counter() < stop:
            try:
                status = await asyncio.wait_for(_exchange(reader, writer, requests[k % len(requests)]), 60)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError):
                status = 0
                writer.close()
                reader, writer = conns[i] = await asyncio.open_connection("127.0.0.1", port)
            k += concurrency
            if status == 200:
                ok += 1
            else:
                bad += 1

    try:
        await asyncio.gather(*(client(i) for i in range(concurrency)))
    finally:
        elapsed = time.perf_counter() - start
        for _, writer in conns:
            writer.close()
    return ok, bad, elapsed


def _window(server: _Server, requests: list[bytes], seconds: float, concurrency: int) -> dict[str, float]:
    cpu0 = server.cpu_seconds()
    ok, bad, elapsed = asyncio.run(_closed_loop(server.port, requests, seconds, concurrency))
    cpu1 = server.cpu_seconds()
    cpu, engine = (b - a for a, b in zip(cpu0, cpu1)) if cpu0 and cpu1 else (float("nan"), float("nan"))
    return {"rps": ok / elapsed, "errors": bad, "cpu_busy": cpu / elapsed, "engine_busy": engine / elapsed,
            "per_cpu_s": ok / cpu if cpu else float("nan"),
            "engine_per_cpu_s": ok / engine if engine else float("nan")}


def frontend_split_scaling(workers: int = 2, *, seconds: float = 5.0, rounds: int = 3, concurrency: int = 32,
                           server_args: list[str] = (), seed: int = 0, log=print) -> dict[str, float | int | str]:
    """One process vs ``--frontend-workers workers`` on the digits model, measured side by side.

    Args:
        workers: front-end processes of the split server (>= 2).
        seconds: length of each measurement window.
        rounds: windows per server (alternating, shuffled); the figures are medians.
        concurrency: closed-loop keep-alive clients.
        server_args: more `softmoe serve` flags for both servers (e.g. ``["--backend", "torch"]``).
        seed: the window order.
        log: where the table goes.

    Returns:
        ``frontend_split_workers``, ``frontend_split_rps_1``, ``frontend_split_rps_n``,
        ``frontend_split_scaling`` (rps_n / (workers x rps_1)), ``frontend_split_per_cpu_s_1`` and
        ``_n`` (requests per server CPU-second), ``frontend_split_engine_per_cpu_s`` (requests per CPU-second
        of the engine process alone), ``frontend_split_errors``, ``frontend_split_cores``,
        ``frontend_split_command`` (the split server's command line).
    """
    if workers < 2:
        raise ValueError("workers: a split server has at least 2 front-end processes")
    requests = [_request(_jpeg(i)) for i in range(16)]
    servers = {1: _Server(0, list(server_args)), workers: _Server(workers, list(server_args))}
    try:
        for s in servers.values():
            s.wait()
        for s in servers.values():  # warm: first requests, label caches, lazy imports
            _window(s, requests, min(1.0, seconds), concurrency)
        results: dict[int, list[dict[str, float]]] = {k: [] for k in servers}
        rng = random.Random(seed)
        for _ in range(rounds):
            order = list(servers)
            rng.shuffle(order)
            for k in order:
                results[k].append(_window(servers[k], requests, seconds, concurrency))
    finally:
        for s in servers.values():
            s.stop()

    def med(k: int, key: str) -> float:
        return float(statistics.median(w[key] for w in results[k]))

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    log(f"front-end capacity on digits (224x224 JPEG -> 8x8, /v1/classify, {concurrency} keep-alive clients in "
        f"this process, {rounds} x {seconds:g} s windows, median; {cores} CPUs shared with the client)")
    log(f"  {'front ends':>16} {'req/s':>9} {'server CPUs busy':>17} {'of which engine':>16} "
        f"{'req per server CPU-s':>21} {'errors':>7}")
    for k, s in servers.items():
        label = "1 (one process)" if k == 1 else f"{k} + engine"
        log(f"  {label:>16} {med(k, 'rps'):9.1f} {med(k, 'cpu_busy'):17.2f} {med(k, 'engine_busy'):16.2f} "
            f"{med(k, 'per_cpu_s'):21.1f} {sum(w['errors'] for w in results[k]):7.0f}")
    log(f"  the engine process needs 1 CPU-second per {med(workers, 'engine_per_cpu_s'):.0f} requests: the split "
        "server's ceiling where front ends are not the limit")
    rps1, rpsn = med(1, "rps"), med(workers, "rps")
    return {
        "frontend_split_workers": workers,
        "frontend_split_rps_1": round(rps1, 1),
        "frontend_split_rps_n": round(rpsn, 1),
        "frontend_split_scaling": round(rpsn / (workers * rps1), 3),
        "frontend_split_per_cpu_s_1": round(med(1, "per_cpu_s"), 1),
        "frontend_split_per_cpu_s_n": round(med(workers, "per_cpu_s"), 1),
        "frontend_split_engine_per_cpu_s": round(med(workers, "engine_per_cpu_s"), 1),
        "frontend_split_errors": int(sum(w["errors"] for ws in results.values() for w in ws)),
        "frontend_split_cores": cores,
        "frontend_split_command": servers[workers].cmd,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtests.frontend_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="front-end processes of the split server")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds per window")
    p.add_argument("--rounds", type=int, default=3, help="windows per server")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    p.add_argument("--server-args", default="", help='more `softmoe serve` flags for both, e.g. "--backend torch"')
    args = p.parse_args(argv)
    out = frontend_split_scaling(args.workers, seconds=args.seconds, rounds=args.rounds, concurrency=args.concurrency,
                                 server_args=shlex.split(args.server_args))
    print(f"command: python -m loadtests.frontend_bench {shlex.join(sys.argv[1:] if argv is None else argv)}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
