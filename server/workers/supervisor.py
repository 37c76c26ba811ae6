"""The supervisor of ``softmoe serve --frontend-workers N``: starts the engine process and the N
front-end processes on the shared listening socket, restarts a front end that dies, forwards
signals, and exits with the engine's verdict. ``engine.py`` holds the engine process and its
wire protocol."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.connection import wait as wait_any
from typing import Callable

from server.engine.startup import StartupError
from server.workers.process import engine_main, new_token, unlink_segments
from server.workers.remote import forget_process_metrics

slog = logging.getLogger("softmoe.server")  # the supervisor's lines: the server's own


class Supervisor:
    """``--frontend-workers N`` (N >= 2): N front-end processes (HTTP, parsing, decoding,
    preprocessing) on this process's listening socket, passed to each (spawn context: the
    descriptor is inherited; the kernel hands each connection to whichever front end accepts it
    first), feeding one engine process (``engine_main``: the Batcher and the backends,
    through shared memory). ``server.run.serve`` runs it in the process that bound the port, which
    supervises:

    * start-up: all start at once (the front ends import while the engine loads and warms up),
      the front ends connect once the engine listens; any failure is one line (StartupError) and
      every child is stopped;
    * SIGTERM/SIGINT: forwarded to every front end (each drains as one process does); once they
      have exited, the engine finishes what is queued and exits; exit status 0. A second signal is
      forwarded too (the front ends stop draining);
    * a front end that dies is started again (the engine released its places); an engine that
      dies leaves the front ends answering 503, unready and unlive (as a dead device worker does),
      and the exit status 1;
    * metrics: prometheus_client's multiprocess mode in a temporary directory; any front end's
      ``/metrics`` merges every process (server.workers.remote.merge_process_metrics).
    """

    def __init__(self, settings, sock: socket.socket, frontend: Callable) -> None:
        """
        Args:
            settings: the server's Settings (``frontend_workers`` >= 2).
            sock: the bound listening socket, shared by the front ends.
            frontend: a front-end process's target, called as ``frontend(settings, index, sock, path,
                token, lock, metrics_dir, report)`` (``server.run`` builds the app and runs uvicorn).
        """
        self.settings, self.sock, self.n, self.frontend = settings, sock, settings.frontend_workers, frontend
        self.ctx = multiprocessing.get_context("spawn")
        self.workdir = tempfile.mkdtemp(prefix="softmoe-serve-")  # 0700: the engine's socket, metric files
        self.path = os.path.join(self.workdir, "engine.sock")
        self.metrics_dir = os.path.join(self.workdir, "metrics")
        os.mkdir(self.metrics_dir)
        self.lock = self.ctx.Lock()
        self.token = new_token()
        self.prefix = f"softmoe_{os.getpid()}_{self.token.hex()[:8]}"
        self.engine = None
        self.frontends: list = [None] * self.n
        self.started_at = [0.0] * self.n
        self.signals = 0
        self.engine_lost = False

    def run(self) -> None:
        def interrupt(sig: int, frame) -> None:
            raise KeyboardInterrupt  # during start-up: stop the children, clean up, exit 130

        signal.signal(signal.SIGTERM, interrupt)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir  # read by the children at import
        try:
            # All at once: the front ends import while the engine loads, then connect when it listens.
            engine = self._spawn(self._engine_args(), "the engine")
            self.engine = engine[0]
            frontends = [self._spawn(self._frontend_args(i), f"front end {i}") for i in range(self.n)]
            self.frontends = [proc for proc, _ in frontends]
            self.started_at = [time.monotonic()] * self.n
            self._await_ready(*engine, "the engine")
            for i, (proc, recv) in enumerate(frontends):
                self._await_ready(proc, recv, f"front end {i}")
            host, port = self.sock.getsockname()[:2]
            slog.info("listening on http://%s:%d (%d front-end processes, engine pid %d)",
                      f"[{host}]" if ":" in host else host, port, self.n, self.engine.pid)
            self._supervise()
        finally:
            for p in [*self.frontends, self.engine]:
                if p is not None and p.is_alive():
                    p.kill()
                    p.join(5)
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            unlink_segments(self.prefix)
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self.engine_lost:
            raise SystemExit(1)

    def _engine_args(self):
        return engine_main, (self.settings, self.n, self.lock, self.path, self.token), {"prefix": self.prefix}

    def _frontend_args(self, i: int):
        return self.frontend, (self.settings, i, self.sock, self.path, self.token, self.lock, self.metrics_dir), {}

    def _spawn(self, spec, what: str):
        """Start a child; returns it and the end of the pipe it reports on."""
        target, args, kwargs = spec
        recv, send = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=target, args=(*args, send), kwargs=kwargs, name=f"softmoe {what}")
        proc.start()
        send.close()
        return proc, recv

    @staticmethod
    def _await_ready(proc, recv, what: str) -> None:
        """Until the child reports ready. Raises StartupError (its one line) if it cannot start."""
        try:
            ready = wait_any([recv, proc.sentinel])
            if recv in ready:
                try:
                    kind, value = recv.recv()
                except EOFError:
                    kind, value = "error", None
                if kind == "ready":
                    return
                proc.join(10)
                raise StartupError(value or f"{what} exited during start-up (exit code {proc.exitcode})")
            proc.join(1)
            raise StartupError(f"{what} exited during start-up (exit code {proc.exitcode})")
        finally:
            recv.close()

    def _supervise(self) -> None:
        def on_signal(sig: int, frame) -> None:
            self.signals += 1

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        forwarded = 0
        while True:
            if self.signals > forwarded:
                if not forwarded:
                    slog.info("stopping: the front ends drain, then the engine finishes its queue")
                forwarded = self.signals
                for p in self.frontends:
                    if p is not None and p.is_alive():
                        os.kill(p.pid, signal.SIGTERM)
            live = [p for p in self.frontends if p is not None]
            if forwarded and not any(p.is_alive() for p in live):
                break
            watched = [p.sentinel for p in live if p.is_alive()]
            wait_any(watched + ([self.engine.sentinel] if not self.engine_lost else []), timeout=0.2)
            for i, p in enumerate(self.frontends):
                if p is None or p.is_alive():
                    continue
                forget_process_metrics(p.pid, self.metrics_dir)
                if forwarded:
                    self.frontends[i] = None
                elif time.monotonic() - self.started_at[i] > 2.0:  # at most one start every 2 s
                    slog.warning("front end %d (pid %d) exited (code %s); starting another", i, p.pid, p.exitcode)
                    self.started_at[i] = time.monotonic()
                    self.frontends[i], recv = self._spawn(self._frontend_args(i), f"front end {i}")
                    recv.close()  # it reports nothing: it logs
            if not self.engine_lost and not self.engine.is_alive():
                self.engine_lost = True
                unlink_segments(self.prefix)
                forget_process_metrics(self.engine.pid, self.metrics_dir)
                slog.error("the engine (pid %d) exited (code %s): every front end answers 503 and fails liveness "
                          "until this replica is restarted", self.engine.pid, self.engine.exitcode)
        if self.engine.is_alive():
            self.engine.terminate()  # SIGTERM: finish the queue, answer it, release the shared memory
            self.engine.join(max(30, self.settings.request_timeout_s + 5))
