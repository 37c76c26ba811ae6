"""The bench's machinery: servers as child processes, a minimal keep-alive HTTP/1.1 load generator
(closed loop, the same bytes to every server), interleaved windows and the request bodies. Used by
loadtests/bench.py and every section that lives beside it (peers_bench, invariance_bench, soak).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

from loadtests.procs import cpu_seconds
from loadtests.run import ServerProcess, wait_ready

ROOT = Path(__file__).resolve().parents[1]


def pick(mode: str, full, quick, smoke):
    """The value of a setting for the run's mode."""
    return {"full": full, "quick": quick, "smoke": smoke}[mode]


# ------------------------------------------------------------------ processes


def serve_many(specs: dict[str, list[str]], parallel: bool = True) -> dict[str, ServerProcess]:
    """`softmoe serve` with each flag list (loadtests.run's child process on a free loopback port),
    returned when every one is ready. ``parallel``: all started at once (small models); else one
    after the other, each ready before the next starts (a heavy server's memory peaks while it
    loads, above what it holds after; docs/benchmarks.md has soft-s16-e128's)."""
    servers: dict[str, ServerProcess] = {}
    try:
        for name, args in specs.items():
            servers[name] = ServerProcess(shlex.join(args), Path(tempfile.mkdtemp(prefix="softmoe-bench-")) / "server.log")
            if not parallel:
                wait_ready(servers[name].url, 900, servers[name])
        for s in servers.values():
            wait_ready(s.url, 900, s)
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers


def serve(args: list[str]) -> ServerProcess:
    return serve_many({"server": args})["server"]


class Child(ServerProcess):
    """Any server command on a given loopback port, stopped as ServerProcess stops `softmoe serve`
    (SIGTERM, kill after 30 s), then whatever it left in its own process group (Ray's agents)."""

    def __init__(self, cmd: list[str], port: int, env: dict[str, str] | None = None) -> None:  # noqa: D107
        self.port, self.url, self.cmd = port, f"http://127.0.0.1:{port}", cmd
        self.log_path = Path(tempfile.mkdtemp(prefix="softmoe-bench-")) / "server.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)

    def stop(self) -> int | None:
        code = super().stop()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return code


# ------------------------------------------------------------------ the client


def wire(path: str, body: bytes, content_type: str) -> bytes:
    """One HTTP/1.1 POST, ready to send on a keep-alive connection."""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def jpeg_request(path: str, data: bytes) -> bytes:
    return wire(path, data, "image/jpeg")


def json_request(path: str, obj: dict) -> bytes:
    return wire(path, json.dumps(obj).encode(), "application/json")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> tuple[int, bool]:
    """Send one request, read its whole response; (status, whether the server closes)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length, chunked, close = None, False, False
    for line in lines[1:]:
        key, _, value = line.partition(b":")
        key, value = key.strip().lower(), value.strip().lower()
        if key == b"content-length":
            length = int(value)
        elif key == b"transfer-encoding":
            chunked = b"chunked" in value
        elif key == b"connection":
            close = value == b"close"
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length is not None:
        await reader.readexactly(length)
    elif status not in (204, 304):
        await reader.read()
        close = True
    return status, close


@dataclass
class Load:
    """One window of a closed loop."""

    seconds: float
    requests: int = 0  # successful
    items: int = 0  # images in the successful requests
    errors: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds, successful requests
    client_cpu: float = 0.0  # CPU seconds of this process (the load generator)
    server_cpu: float | None = None  # CPU seconds of the given server processes

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds

    def ms(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) * 1e3 if self.latencies else float("nan")


async def _closed_loop(ports: list[int], requests: list[tuple[bytes, int]], seconds: float, concurrency: int,
                       min_requests: int, timeout: float) -> Load:
    """``concurrency`` clients, client i on ``ports[i % len(ports)]``, each sending its next request
    as soon as the last one is answered, for ``seconds`` (and at least ``min_requests`` requests)."""
    conns = [list(await asyncio.open_connection("127.0.0.1", ports[i % len(ports)])) for i in range(concurrency)]
    out = Load(0.0)
    t0 = time.perf_counter()
    stop = t0 + seconds

    async def client(i: int) -> None:
        reader, writer = conns[i]
        k = i
        while time.perf_counter() < stop or out.requests + out.errors < min_requests:
            request, items = requests[k % len(requests)]
            k += concurrency
            start = time.perf_counter()
            try:
                status, close = await asyncio.wait_for(_exchange(reader, writer, request), timeout)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ValueError):
                status, close = 0, True
            if status == 200:
                out.latencies.append(time.perf_counter() - start)
                out.requests += 1
                out.items += items
            else:
                out.errors += 1
            if close:
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", ports[i % len(ports)])
                conns[i] = [reader, writer]

    try:
        await asyncio.gather(*(client(i) for i in range(concurrency)))
    finally:
        out.seconds = time.perf_counter() - t0
        for _, writer in conns:
            writer.close()
    return out


ERRORS: dict[str, int] = {}


def load(ports: list[int], requests: list[tuple[bytes, int]], seconds: float, concurrency: int, *,
         min_requests: int = 0, pids: list[int] = (), label: str = "", timeout: float = 120.0) -> Load:
    """One closed-loop window (see ``_closed_loop``); failed requests are counted under ``label``
    (the run's ``errors``) unless it is empty (warm-up, readiness polls)."""
    server0 = [cpu_seconds(p) for p in pids]
    client0 = time.process_time()
    out = asyncio.run(_closed_loop(ports, requests, seconds, concurrency, min_requests, timeout))
    out.client_cpu = time.process_time() - client0
    server1 = [cpu_seconds(p) for p in pids]
    if pids and None not in server0 + server1:
        out.server_cpu = sum(b - a for a, b in zip(server0, server1))
    if out.errors and label:
        ERRORS[label] = ERRORS.get(label, 0) + out.errors
    return out


async def _open_loop(url: str, path: str, body: bytes, rate: float, seconds: float, marks
                     ) -> list[tuple[float, float, int, str]]:
    """Send one JPEG request every 1/``rate`` s for ``seconds``, whatever the answers do; (send
    time, latency, status, window) of each. ``marks()`` is read at each send: the window it is in."""
    out: list[tuple[float, float, int, str]] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def one(mark) -> None:
            t0 = time.perf_counter()
            try:
                r = await client.post(path, content=body, headers={"content-type": "image/jpeg"})
                status = r.status_code
            except httpx.HTTPError:
                status = 0
            out.append((t0, time.perf_counter() - t0, status, mark))

        tasks, start = [], time.perf_counter()
        k = 0
        while (due := start + k / rate) < start + seconds:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(marks())))
            k += 1
        await asyncio.gather(*tasks)
    return out


def open_loop_while(url: str, body: bytes, rate: float, work: Callable[[dict], None],
                    path: str = "/v1/classify?model=a") -> list[tuple[float, float, int, str]]:
    """An open loop of JPEG requests to ``path`` at ``rate`` per second while ``work(window)`` runs
    on a thread; ``work`` names the window each request is sent in by setting ``window["now"]``
    (it starts as ``steady``). (send time, latency, status, window) of each request."""
    window = {"now": "steady"}

    def run() -> None:
        try:
            work(window)
        finally:
            window["now"] = "done"

    thread = threading.Thread(target=run)
    thread.start()
    results: list = []

    async def drive() -> None:
        while window["now"] != "done":
            results.extend(await _open_loop(url, path, body, rate, 2.0, lambda: window["now"]))

    asyncio.run(drive())
    thread.join()
    return results


def wait_answers(server: ServerProcess, request: bytes, timeout: float) -> None:
    """Poll with a real request until one is answered 200 (servers without our readiness route)."""
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.cmd[2:4]} exited with status {server.proc.returncode}:\n{server.tail()}")
        try:
            if load([server.port], [(request, 1)], 0.0, 1, min_requests=1, timeout=10).requests:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.url} did not answer after {timeout:.0f} s:\n{server.tail()}")
        time.sleep(0.5)


def interleave(windows: dict[str, Callable[[], object]], rounds: int, seed: int = 0) -> dict[str, list]:
    """Run each named measurement once per round, in a shuffled order; collect the values."""
    rng = random.Random(seed)
    out: dict[str, list] = {k: [] for k in windows}
    for _ in range(rounds):
        order = list(windows)
        rng.shuffle(order)
        for name in order:
            out[name].append(windows[name]())
    return out


def median(values) -> float:
    return float(statistics.median(values))


@dataclass(frozen=True)
class Paired:
    """Two servers' windows compared round by round (``interleave`` measures both in every round,
    so a round's pair shares the machine's state of the moment): in how many rounds ``ours`` was
    better, and whether that count says more than chance. Ratios are theirs / ours, as the
    bench's ``*_ratio`` keys are."""

    ratios: list[float]  # per round, theirs / ours
    ahead: int  # rounds in which ours was better
    behind: int  # rounds in which theirs was better (equal rounds count in neither)
    p_ahead: float  # one-sided sign test: the chance of ``ahead`` or more such rounds if neither were better
    p_behind: float
    verdict: str  # "ahead", "behind" (p under ALPHA) or "tie"

    @property
    def rounds(self) -> int:
        return len(self.ratios)


ALPHA = 0.05  # a verdict other than "tie" needs a sign test under this: 5 of 5 rounds, 7 of 8, 9 of 10


def sign_test(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2): how often chance alone wins ``k`` or more of ``n`` rounds."""
    if n <= 0:
        return 1.0
    return sum(math.comb(n, i) for i in range(max(k, 0), n + 1)) / 2 ** n


def paired(ours: list[float], theirs: list[float], *, higher_is_better: bool) -> Paired:
    """Round-by-round comparison of two servers' windows (the same number of rounds each)."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired windows differ in number or are empty: {len(ours)} vs {len(theirs)}")
    sign = 1 if higher_is_better else -1
    ahead = sum(sign * (o - t) > 0 for o, t in zip(ours, theirs))
    behind = sum(sign * (t - o) > 0 for o, t in zip(ours, theirs))
    p_ahead, p_behind = sign_test(ahead, ahead + behind), sign_test(behind, ahead + behind)
    verdict = "ahead" if p_ahead < ALPHA else "behind" if p_behind < ALPHA else "tie"
    ratios = [t / o if o else float("nan") for o, t in zip(ours, theirs)]
    return Paired(ratios, ahead, behind, p_ahead, p_behind, verdict)


def report(result: dict, module: str, argv: list[str] | None) -> None:
    """A two-server bench's JSON line: ``result`` with ``errors`` (non-200 answers in the measured
    windows; 0 expected) and the ``command`` that reproduces it."""
    result["errors"] = sum(ERRORS.values())
    result["command"] = f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])
    print(json.dumps(result))


def saturation_and_c1(variants: dict[str, list[str]], requests: list[tuple[bytes, int]], *, rounds: int,
                      seconds: float, c1_seconds: float, clients: int, label: str, seed: int = 0
                      ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """`softmoe serve` with each variant's flags, started one at a time (each ready before the next:
    a heavy model peaks while it loads), warmed, then measured in interleaved windows: images/s
    at saturation (a closed loop of ``clients``) and p50 ms at concurrency 1. Returns both, each
    variant's windows by name."""
    servers = serve_many(variants, parallel=False)
    try:
        for s in servers.values():
            load([s.port], requests, min(3.0, seconds), clients)  # warm: connections, first batches
        sat = interleave({n: (lambda s=s: load([s.port], requests, seconds, clients, label=label).items_per_s)
                          for n, s in servers.items()}, rounds, seed=seed)
        c1 = interleave({n: (lambda s=s: load([s.port], requests, c1_seconds, 1, min_requests=3, label=label).ms(50))
                         for n, s in servers.items()}, rounds, seed=seed + 1)
    finally:
        for s in servers.values():
            s.stop()
    return sat, c1


def ab_parser(description: str, *, seconds: float, clients: int, max_batch_size: int) -> argparse.ArgumentParser:
    """The flags every two-server bench takes (``--package``, ``--rounds``, ``--seconds``,
    ``--clients``, ``--max-batch-size``), with that bench's defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--package", help="a model package directory (default: the built-in digits)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=seconds)
    parser.add_argument("--clients", type=int, default=clients)
    parser.add_argument("--max-batch-size", type=int, default=max_batch_size)
    return parser


def heavy_package(mode: str, workdir: Path) -> Path | None:
    """The two-server sections' heavy model: ``softmoe init soft-s16-e128`` in ``workdir`` (reused
    when the serving section made it: seed 0, the same weights, the same export); None in smoke
    mode, where those sections run the shipped digits."""
    if mode == "smoke":
        return None
    package = workdir / "soft-s16-e128"
    if not package.exists():
        subprocess.run([sys.executable, "-m", "softmoe_models.cli", "init", "soft-s16-e128", "--out", str(package)],
                       check=True, stdout=subprocess.DEVNULL)
    return package


def jpeg(width: int, height: int, seed: int) -> bytes:
    from PIL import Image
    from sklearn.datasets import load_sample_image

    photo = Image.fromarray(load_sample_image(["china.jpg", "flower.jpg"][seed % 2]))
    photo = photo.resize((width, height), Image.Resampling.LANCZOS)
    arr = np.asarray(photo).copy()
    arr[: 4 + seed % 7, : 4 + seed % 5] = seed % 255  # distinct images
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def rounded(values: list[float], digits: int = 2) -> list[float]:
    """``values`` rounded to ``digits`` places, for printing a section's windows."""
    return [round(v, digits) for v in values]


def proven_line(server: ServerProcess) -> str:
    """The 'padded shapes proven' line a server started with --log-level info wrote."""
    for line in server.tail(200).splitlines():
        if "padded shapes proven" in line:
            return line.split(": ", 2)[-1]
    return "(not logged)"
