"""The server's backend called directly, at a full batch, in a child process: what a benchmark
compares serving against (bench.py's serving section, embed_bench.py).

The child builds and warms the backend as `softmoe serve` does (the same settings and their
defaults), so the two sides differ only by what the server adds in front of the backend.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time

import numpy as np

from loadtests.harness import ROOT


def _raw_worker(conn, spec: str, batch: int, size: int, settings: dict) -> None:
    """RawBackend's child: the backend as `softmoe serve` builds and warms it, its classify queue's
    function called directly at a full batch, timed on request, the way the server runs it: with
    ``--wide-lone-batches``, the lane start-up chose (N calls at once beside each other, or one at a
    time alone on every thread); otherwise as many calls at once as ``--concurrent-batches``.
    Without routing statistics (the server samples 1 call in 16: the raw side never pays it)."""
    from server.engine.core import Engine
    from server.metrics import Metrics
    from server.settings import Settings

    resolved = Settings(**{**settings, "routing_stats_sample": 0, "models": [spec], "model_repository": ""})
    [model] = Engine(resolved, Metrics(), say=lambda m: None).bring_up(serve=False)  # the batcher never runs
    queue, state = model.queues["classify"], model.routing
    callers = resolved.concurrent_batches
    if queue.plan is not None and not (state is not None and state.shared and state.beside):
        callers = 1  # every full batch runs alone
    pixels = {"pixel_values": np.random.default_rng(0).uniform(-1, 1, (batch, 3, size, size)).astype(np.float32)}

    def call() -> None:
        if queue.plan is not None:
            queue.plan(callers > 1)  # the lane, decided on this thread as a worker decides it
        queue.fn(pixels)

    call()
    conn.send(("ready", callers))
    while (seconds := conn.recv()) is not None:
        t0, counts = time.perf_counter(), [0] * callers

        def loop(i: int) -> None:
            while time.perf_counter() - t0 < seconds or counts[i] == 0:
                call()
                counts[i] += batch

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        conn.send(sum(counts) / (time.perf_counter() - t0))
    model.backend.close()


class RawBackend:
    """The server's backend for ``spec`` called directly at a full batch, in a child process (its
    memory, GBs for soft-s16-e128, goes back when it exits); ``window(s)`` gives images/s,
    ``callers`` how many calls run at once."""

    def __init__(self, spec: str, batch: int, size: int, **settings) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_raw_worker, args=(child, spec, batch, size, settings), daemon=True)
        self.proc.start()
        child.close()
        ready = self._recv(900)
        if not (isinstance(ready, tuple) and ready[0] == "ready"):
            raise RuntimeError("the raw backend did not start")
        self.callers = ready[1]  # calls at once, as the server runs full batches

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise RuntimeError(f"the raw backend did not answer in {timeout:.0f} s (exit status {self.proc.exitcode})")
        return self.conn.recv()

    def window(self, seconds: float) -> float:
        self.conn.send(seconds)
        return self._recv(seconds + 600)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def warm_cache(spec: str, **settings) -> None:
    """Load the model once in a child process, as `softmoe serve` loads it, so the servers below
    reuse the export cache instead of each exporting soft-s16-e128 for minutes at its start."""
    code = ("import json, sys; from server.engine.models import load_served_model; from server.settings import Settings; "
            "load_served_model(sys.argv[1], Settings(**json.loads(sys.argv[2])), log=print).backend.close()")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, spec, json.dumps(settings)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    print(f"[{spec.split('=')[0]} loaded once in {time.perf_counter() - t0:.0f}s: the export cache is warm]", flush=True)
