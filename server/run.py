"""Start the server: bind, load, warm up, then serve under uvicorn with a graceful drain.

Start-up happens before uvicorn takes over, in this order, and any failure is a
:class:`StartupError` (one line for the user; the traceback is logged at debug level):

1. bind the port (``--port`` in use fails here, before minutes of loading), and ``--grpc-port``;
2. check the backend and device can run at all (onnxruntime installed, a CUDA device, ...);
3. open every model (:func:`server.engine.startup.load_models`);
4. the app's lifespan, whose ``Engine.bring_up`` (the start-up of every door) attaches, warms and
   proves them and starts the batcher, entered here rather than by uvicorn, so a failure there
   is ours to report and not a uvicorn traceback with exit 3.

On SIGTERM/SIGINT: readiness turns false and new requests get 503 (Retry-After) for
``drain_seconds`` (so load balancers and Kubernetes endpoints stop sending), then uvicorn stops
accepting, finishes the requests in flight (the batcher drains its queue), and the process exits.

gRPC (``--grpc-port``, server.grpc_api) is served from the same event loop and app as HTTP once the
lifespan is entered; on a signal it refuses new calls while HTTP drains (UNAVAILABLE) and lets the
calls in flight finish before the lifespan ends.

``--frontend-workers N`` (N >= 2): this process binds the port and supervises one engine process
(the models, the batcher) and N front-end processes serving the port (``_frontend_main``); see
``server.workers.supervisor.Supervisor``. Start-up errors and signals behave as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import sys
import threading
from types import FrameType

import uvicorn
from uvicorn.config import LOOP_FACTORIES
from uvicorn.importer import import_from_string

from server.api.keys import KeyFileError, Keys
from server.grpc_api import service as grpc_service
from server.http.app import create_app
from server.http.connection import bounded_protocol, default_max_connections
from server.observability import logs
from server.settings import Settings
from server.engine.startup import StartupError, check_backend, describe, load_models
from server.workers.process import child_setup, tell
from server.workers.remote import RemoteBatcher, merge_process_metrics
from server.workers.supervisor import Supervisor

log = logging.getLogger("softmoe.server")

class DrainingServer(uvicorn.Server):
    """uvicorn with a drain phase between the signal and closing the listener."""

    def __init__(self, config: uvicorn.Config, drain_seconds: float) -> None:
        super().__init__(config)
        self.drain_seconds = drain_seconds
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining:  # a second signal: stop now (in-flight requests still finish)
            self.should_exit = True
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        self._draining = True
        self.config.app.state.draining = True
        self.config.app.state.metrics.server_ready.set(0)
        log.info("%s: not ready; draining for %.1fs, then finishing in-flight requests", signal.Signals(sig).name,
                 self.drain_seconds)
        timer = threading.Timer(self.drain_seconds, self._stop)
        timer.daemon = True
        timer.start()

    def _stop(self) -> None:
        self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not yet listen on) ``host:port``; uvicorn listens once the models are ready.

    Raises:
        StartupError: the address cannot be resolved or the port is taken.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(f"--host {host}: cannot resolve the address ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


async def _serve(server: DrainingServer, sock: socket.socket) -> None:
    """Enter the app's lifespan (warm-up, queues, batcher), then serve until a signal."""
    app = server.config.app
    async with contextlib.AsyncExitStack() as stack:
        try:
            await stack.enter_async_context(app.router.lifespan_context(app))
        except Exception as e:
            log.debug("start-up failed", exc_info=True)
            raise StartupError(f"start-up failed: {describe(e)}") from None
        host, port = sock.getsockname()[:2]
        grpc = await _start_grpc(app, server.config.timeout_graceful_shutdown)
        loop = type(asyncio.get_running_loop())
        sock.listen(server.config.backlog)  # before the line says so: uvicorn's own listen() comes later
        log.info("listening on http://%s:%d (event loop %s.%s, http %s)%s", f"[{host}]" if ":" in host else host, port,
                 loop.__module__, loop.__name__, _http_parser(server.config.http),
                 f", grpc on port {grpc.port}" if grpc else "")
        try:
            await server.serve(sockets=[sock])
        finally:
            if grpc:
                await grpc.stop(server.config.timeout_graceful_shutdown)


async def _start_grpc(app, grace: float, reuse_port: bool = False):
    """The gRPC server on ``--grpc-port`` (None when 0)."""
    settings = app.state.settings
    if not settings.grpc_port:
        return None
    try:
        return await grpc_service.start(app, settings.host, settings.grpc_port, reuse_port=reuse_port)
    except OSError as e:
        raise StartupError(f"--grpc-port {settings.grpc_port}: {e} (0 turns gRPC off)") from None


def _server(app, settings: Settings) -> DrainingServer:
    # lifespan="off": _serve enters the app's lifespan itself, before uvicorn starts.
    config = uvicorn.Config(app, lifespan="off", **uvicorn_options(settings, app.state.metrics),
                            **logs.uvicorn_log_config(settings.log_format))
    return DrainingServer(config, settings.drain_seconds)


def uvicorn_options(settings: Settings, metrics) -> dict:
    """What every uvicorn serving an app here is given (tests' live servers too): the HTTP protocol
    with bounded request heads (server.http.connection), no access log, and a graceful shutdown that
    outlasts the longest request."""
    return dict(host=settings.host, port=settings.port, log_level=settings.log_level.lower(), access_log=False,
                http=bounded_protocol(settings.header_timeout_s, settings.max_header_bytes, settings.request_timeout_s,
                                          settings.max_connections or default_max_connections(), metrics),
                timeout_graceful_shutdown=max(30, settings.request_timeout_s + 5))


def _prepare(settings: Settings) -> DrainingServer:
    """Check the backend, load the models and build the app and the uvicorn server."""
    try:
        check_backend(settings)
        models = load_models(settings)
        return _server(create_app(settings, models=models), settings)
    except StartupError:
        raise
    except Exception as e:  # e.g. a broken optional install (an ImportError inside onnxruntime)
        log.debug("start-up failed", exc_info=True)
        raise StartupError(f"start-up failed: {describe(e)}") from None


def serve(settings: Settings) -> None:
    """Run the server until SIGTERM/SIGINT.

    Raises:
        StartupError: the server could not start (nothing was served).
    """
    levels = list(uvicorn.config.LOG_LEVELS)
    if settings.log_level.lower() not in levels:
        raise StartupError(f"--log-level {settings.log_level}: expected one of {', '.join(levels)}")
    # The server's log goes to stdout; stderr carries only a start-up failure's one `error:` line.
    logs.configure(uvicorn.config.LOG_LEVELS[settings.log_level.lower()], settings.log_format)
    try:
        check_operations(settings)
    except StartupError as e:
        log.error("%s", e)  # the log pipeline sees it too; cli prints the `error:` line
        raise
    sock = bind_socket(settings.host, settings.port)
    if settings.grpc_port:  # taken now, as --port is, so a busy port fails before the models load
        try:
            bind_socket(settings.host, settings.grpc_port).close()
        except StartupError as e:
            sock.close()
            raise StartupError(f"--grpc-port: {e} (0 turns gRPC off)") from None
    try:
        if settings.frontend_workers >= 2:  # N front-end processes and one engine process
            Supervisor(settings, sock, _frontend_main).run()
        else:
            run_on_uvicorns_loop(_serve(_prepare(settings), sock))
    finally:
        sock.close()


def check_operations(settings: Settings) -> None:
    """The keys file readable and holding a key, the OTLP endpoint a URL, before anything binds.

    Raises:
        StartupError: naming the flag.
    """
    try:
        Keys(settings)
    except KeyFileError as e:
        raise StartupError(str(e)) from None
    url = settings.otlp_endpoint
    if url and not url.startswith(("http://", "https://")):
        raise StartupError(f"--otlp-endpoint {url[:200]}: expected an http:// or https:// URL (OTLP over HTTP; "
                           "the spans go to URL/v1/traces)")


def run_on_uvicorns_loop(coro) -> None:
    """``asyncio.run(coro)`` on the event loop ``uvicorn.run`` would pick: uvloop where it is
    installed (a project dependency on Linux), else asyncio's. With uvloop and httptools (which
    uvicorn's ``http="auto"`` picks) the front end spends about a quarter less CPU per request."""
    # the factory from uvicorn's own table, not uvicorn.Config(): that would reconfigure logging
    factory = import_from_string(LOOP_FACTORIES["auto"])(use_subprocess=False)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(coro)
        return
    loop = factory() if factory is not None else asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(coro)
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _http_parser(http) -> str:
    """The HTTP protocol uvicorn runs: ours (server.http.connection, on httptools), or what its
    ``http="auto"`` resolves to, httptools where installed, else h11."""
    if isinstance(http, type):
        return f"{getattr(http, 'parser_name', http.__name__)}, {getattr(http, 'limits', 'no limits')}"
    if http != "auto":
        return http
    return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"


# ------------------------------------------------------------------ --frontend-workers N


def _frontend_main(settings: Settings, index: int, sock: socket.socket, path: str, token: bytes, lock,
                   metrics_dir: str, report) -> None:
    """A front-end process: the app with a RemoteBatcher, uvicorn on the shared socket."""
    child_setup(settings.log_level, lambda: os.kill(os.getpid(), signal.SIGTERM), settings.log_format)
    try:
        run_on_uvicorns_loop(_serve_frontend(settings, index, sock, path, token, lock, metrics_dir, report))
    except StartupError as e:
        tell(report, ("error", str(e)))
        raise SystemExit(2) from None
    except Exception:  # noqa: BLE001 - logged (stdout), not a traceback on stderr
        log.exception("front end %d failed", index)
        raise SystemExit(1) from None


async def _serve_frontend(settings: Settings, index: int, sock: socket.socket, path: str, token: bytes, lock,
                          metrics_dir: str, report) -> None:
    """Connect to the engine, build the app from its description, enter the lifespan (no warm-up:
    the engine did it), report ready, serve until a signal."""
    remote = RemoteBatcher(settings.device, index, lock)
    try:
        await remote.connect(path, token)
        # The engine warmed up and proved the shapes; the front end's models have no weights.
        app = create_app(settings.model_copy(update={"warmup": False}), models=remote.served_models(), batcher=remote)
        remote.metrics = app.state.metrics
        merge_process_metrics(app.state.metrics, metrics_dir, remote.info["pid"])
        server = _server(app, settings)
    except Exception as e:
        log.debug("front end %d: start-up failed", index, exc_info=True)
        raise StartupError(f"front end {index}: {describe(e)}") from None
    async with contextlib.AsyncExitStack() as stack:
        try:
            await stack.enter_async_context(app.router.lifespan_context(app))
        except Exception as e:
            log.debug("front end %d: start-up failed", index, exc_info=True)
            raise StartupError(f"front end {index}: start-up failed: {describe(e)}") from None
        # Every front end serves gRPC on the port too, the kernel spreading connections (SO_REUSEPORT).
        grpc = await _start_grpc(app, server.config.timeout_graceful_shutdown, reuse_port=True)
        sock.listen(server.config.backlog)  # before the supervisor's line says so: uvicorn's comes later
        tell(report, ("ready", os.getpid()))
        try:
            await server.serve(sockets=[sock])
        finally:
            if grpc:
                await grpc.stop(server.config.timeout_graceful_shutdown)
