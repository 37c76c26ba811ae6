"""``create_app(settings)``: the HTTP door. Its lifespan has the engine (server.engine) load and
warm the models, then reports ready; model control (server.engine.control) may change them while
it serves.

Shared objects live on ``app.state``: settings, metrics, engine, control, models (the engine's
map of what serves), batcher, service, door, ready, draining. Routes are thin; errors go through
one handler; every request is timed and admitted at the door (server.api.door).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from softmoe_models import __version__

from server import context
from server.errors import BadRequest, PayloadTooLarge, QueueFull, RequestTimeout, ServiceError, Unavailable
from server.observability import tracing as traces
from server.metrics import DOOR, Metrics
from server.api.door import CONTROL, Door, new_request_id
from server.api import schemas
from server.api.keys import Keys
from server.engine.control import ModelControl
from server.engine.core import Engine
from server.engine.models import ServedModel
from server.api.service import Service, is_ready
from server.http.routes import oip, openai, page, routing, v1
from server.settings import Settings

log = logging.getLogger("softmoe.server")
access = logging.getLogger("softmoe.access")  # one line a request, with --log-format json


def _error(exc: ServiceError, path: str = "", metrics: Metrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.errors.labels(exc.type).inc()
    return _ErrorJSON(_body(exc.body(), path), status_code=exc.status, headers=exc.headers)


class _ErrorJSON(JSONResponse):
    """An error body, in ASCII: a message may quote what the client sent, lone surrogates included."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def _body(body: dict, path: str) -> dict:
    """Open Inference Protocol routes use its error shape, ``{"error": "<message>"}``."""
    if path.startswith("/v2"):
        return {"error": body["error"]["message"]}
    return body


ERROR_TYPES = ("invalid_request", "not_found", "payload_too_large", "unsupported_media_type", "overloaded",
               "unavailable", "deadline_exceeded", "client_disconnected", "internal_error", "inference_failed",
               "http_error", "request_timeout", "headers_too_large", "response_timeout", "unauthorized")
STATUSES = (200, 400, 401, 404, 405, 408, 413, 415, 422, 429, 431, 499, 500, 503, 504)
EXEMPT = ("/v2/health", "/metrics")
KEYED = ("/v1", "/v2")  # with --api-key: every path under these but EXEMPT needs a key; the page and docs do not
BODY_GRACE_S = 2.0  # a body starts late by this much before --min-body-rate counts


class Observe:
    """Outermost, pure ASGI (``receive`` reaches the routes untouched, so a client's disconnect is
    seen). For every request: an id (``x-request-id``, echoed or made) and a deadline in the
    request context, timing headers, request metrics, and the one error path: a ServiceError
    raised anywhere below, or any unexpected exception, becomes a JSON error response carrying the
    request id and counted with its status; an unexpected exception's text is logged with the
    request id, never sent. Each request is carried through these steps by an ``_Exchange``.

    Admission is a reservation made here, at the door, atomically (one event loop, no await
    between check and take): one in-flight place and the body's declared bytes against
    ``max_in_flight`` and ``max_in_flight_bytes``; a chunked body reserves its bytes as they
    arrive. Bodies over ``max_body_bytes`` get 413: from Content-Length before reading, else as
    soon as the count passes the limit. A body must arrive at ``min_body_rate`` on average after
    ``BODY_GRACE_S``, and within ``request_timeout_s``, both counted over the time spent waiting
    for its bytes only: a request that waits for the busy event loop is not charged for it, and a
    body already held is taken whatever the clock says (``_receive_within``). A slower one gets 408
    and the connection is closed, which frees its place and its bytes (request heads are bounded in
    server.http.connection).

    API keys (server.api.keys) are checked first, before admission: 401 with a Bearer challenge.
    With tracing on (server.observability.tracing) the request's server span begins here, from its
    ``traceparent``, and a sampled request's stage spans are built here once it is answered; with
    ``--log-format json`` its line (method, path, status, duration, request id, model, trace id)
    is written here too.
    """

    def __init__(self, app: ASGIApp, state, metrics: Metrics, settings: Settings) -> None:
        self.app, self.state, self.metrics, self.settings = app, state, metrics, settings
        self.door: Door = state.door
        self.keys: Keys = state.keys
        self.tracing: traces.Tracing | None = state.tracing
        self.access_log = settings.log_format == "json"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        exchange = _Exchange(self, scope, receive, send)
        exchange.enter_context()
        try:
            if await exchange.admit():
                await self.app(scope, exchange.receive_body if not exchange.exempt else receive, exchange.send)
        except ServiceError as exc:  # raised outside a route's handlers (e.g. while reading the body)
            if not exchange.started:
                await exchange.answer(exc)
        except Exception:  # noqa: BLE001 - the one error path: JSON, request id, counted, text only logged
            await exchange.answer_unexpected()
        finally:
            exchange.release()
        if not exchange.exempt:
            exchange.record()


class _Exchange:
    """One HTTP request as :class:`Observe` follows it, from its head to its last metric: the
    request's id and deadline in the request context, its admission at the door and what it
    reserved there, its body counted against the limits as the routes read it, and the status and
    model its response declared, to count and log once it is answered."""

    def __init__(self, observe: Observe, scope: Scope, receive: Receive, send: Send) -> None:
        self.start = time.perf_counter()
        self.observe, self.scope = observe, scope
        self.server_receive, self.server_send = receive, send  # uvicorn's, as given
        self.settings, self.metrics, self.door = observe.settings, observe.metrics, observe.door
        self.path = scope.get("path", "")
        self.headers = {k.lower(): v for k, v in scope.get("headers") or []}
        rid = self.headers.get(b"x-request-id", b"").decode("latin-1")[:128]
        self.request_id = rid if rid and rid.isprintable() else new_request_id()
        self.status, self.model, self.started = 500, "none", False  # as the response start declares them
        self.exempt = self.path.startswith(EXEMPT)
        self.declared = _content_length(self.headers.get(b"content-length"))
        self.tokens: tuple = ()  # the request context's tokens, to reset
        self.span = self.records = None  # the server span; the stage records of a sampled request
        self.admitted = False
        self.reserved = 0  # body bytes reserved at the door
        self.epoch = None  # the door's epoch entered (every admitted path but CONTROL's)
        self.received = 0  # body bytes read
        self.waited = 0.0  # seconds spent waiting for this body's bytes: all a client is charged for
        self.body_done = False

    def enter_context(self) -> None:
        """Put the request id and the deadline in the request context; with tracing on, begin the
        server span from the request's ``traceparent``, and collect the stage records of a sampled
        request."""
        self.tokens = (context.request_id.set(self.request_id),
                       context.deadline.set(self.start + self.settings.request_timeout_s))
        tracing = self.observe.tracing
        if tracing is not None and not self.exempt:
            tp, ts = self.headers.get(b"traceparent"), self.headers.get(b"tracestate")
            self.span = tracing.begin(f"{self.scope.get('method', 'GET')} {self.path}", tp and tp.decode("latin-1"),
                                      ts and ts.decode("latin-1"), self.start, {})
            if self.span is not None and self.span.is_recording():
                self.records = []
                self.tokens += (context.stages.set(self.records),)

    async def send(self, message: Message) -> None:
        """``send`` for everything below: the response start notes its status and model and gains
        the ``x-request-id`` and ``x-total-time`` headers."""
        if message["type"] == "http.response.start":
            self.status, self.started = message["status"], True
            out = MutableHeaders(scope=message)
            self.model = out.get("x-model", "none")
            out["x-request-id"] = self.request_id
            out["x-total-time"] = f"{(time.perf_counter() - self.start) * 1e3:.2f}"
        await self.server_send(message)

    async def answer(self, exc: ServiceError, reason: str | None = None) -> None:
        """Answer ``exc`` as its JSON error, counted as a refusal at the door for ``reason`` when one
        is given."""
        if reason:
            self.metrics.rejected.labels(DOOR, reason).inc()
        await _error(exc, self.path, self.metrics)(self.scope, self.server_receive, self.send)

    async def admit(self) -> bool:
        """Whether the request goes on to the routes. An exempt path always does; any other is
        checked for its API key, the server draining, its declared Content-Length and the door's
        budgets, in this order, and the first that fails is answered here. An admitted request
        takes its place and its declared bytes at the door, and enters the door's epoch."""
        settings, declared, keys = self.settings, self.declared, self.observe.keys
        if self.exempt:
            self.admitted = True
        elif keys.enabled and self.path.startswith(KEYED) and not keys.accepts(
                auth := self.headers.get(b"authorization")):
            await self.answer(Keys.refusal(auth))
        elif self.observe.state.draining:
            await self.answer(Unavailable("the server is shutting down", retry_after_s=5), "draining")
        elif declared == -1:
            await self.answer(BadRequest("invalid Content-Length header"))
        elif declared is not None and declared > settings.max_body_bytes:
            await self.answer(PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of "
                                              f"{settings.max_body_bytes} (max_body_bytes)"), "over_budget")
        elif (refusal := self.door.refusal(declared or 0)) is not None:
            await self.answer(*refusal)
        else:
            self.admitted = True
            self.reserved = declared or 0
            self.door.take(1, self.reserved)
            if not self.path.startswith(CONTROL):
                self.epoch = self.door.enter()
        return self.admitted

    async def receive_body(self) -> Message:
        """``receive`` for the routes of a path that is not exempt: the body within its time and
        under its limits (``_receive_in_time``, ``_count_body``), then a disconnect, waited for
        unbounded."""
        if self.body_done:  # after the body only a disconnect can come: wait for it unbounded
            return await self.server_receive()
        message = await self._receive_in_time()
        if message["type"] == "http.request":
            self.body_done = not message.get("more_body", False)
            self._count_body(len(message.get("body", b"")))
        return message

    async def _receive_in_time(self) -> Message:
        """The next message, within what is left of ``request_timeout_s`` and of the time
        ``min_body_rate`` allows the bytes received so far, counting only the time spent waiting
        for them; RequestTimeout past that."""
        settings = self.settings
        timeout = settings.request_timeout_s
        by_rate = BODY_GRACE_S + self.received / settings.min_body_rate if settings.min_body_rate else timeout
        began = time.perf_counter()
        try:
            return await _receive_within(self.server_receive, min(timeout, by_rate) - self.waited)
        except asyncio.TimeoutError:
            self.metrics.rejected.labels(DOOR, "slow_client").inc()
            if by_rate < timeout:
                raise RequestTimeout(
                    f"the request body is arriving slower than {settings.min_body_rate} bytes/s "
                    f"(min_body_rate; {self.received} bytes in {self.waited + time.perf_counter() - began:.1f} s "
                    "of waiting)") from None
            raise RequestTimeout(f"the request body did not arrive within {settings.request_timeout_s:g} s "
                                 f"(request_timeout_s; {self.received} bytes came)") from None
        finally:
            self.waited += time.perf_counter() - began

    def _count_body(self, size: int) -> None:
        """Count ``size`` more body bytes: PayloadTooLarge past ``max_body_bytes``; past what was
        reserved (a chunked body), reserve the rest at the door, or QueueFull past
        ``max_in_flight_bytes``."""
        settings = self.settings
        self.received += size
        if self.received > settings.max_body_bytes:
            self.metrics.rejected.labels(DOOR, "over_budget").inc()
            raise PayloadTooLarge(f"request body exceeds the limit of {settings.max_body_bytes} "
                                  "bytes (max_body_bytes)")
        if not self.exempt and self.received > self.reserved:  # a chunked body reserves as it arrives
            more = self.received - self.reserved
            if self.door.in_flight_bytes + more > settings.max_in_flight_bytes:
                self.metrics.rejected.labels(DOOR, "body_budget").inc()
                raise QueueFull("the requests in flight hold too many body bytes "
                                f"(max_in_flight_bytes {settings.max_in_flight_bytes}); try again "
                                "shortly")
            self.door.take(0, more)
            self.reserved += more

    async def answer_unexpected(self) -> None:
        """After an unexpected exception: its text logged with the request id, and, unless a
        response has started, a JSON 500 that carries the request id and nothing of the text."""
        log.exception("unexpected error on %s (request id %s)", self.path, self.request_id)
        if not self.started:
            body = {"error": {"message": f"internal error (request id {self.request_id})", "type": "internal_error",
                              "code": 500}}
            self.metrics.errors.labels("internal_error").inc()
            await _ErrorJSON(_body(body, self.path), status_code=500)(self.scope, self.server_receive, self.send)

    def release(self) -> None:
        """Give back the place and the bytes taken at the door, leave its epoch, and reset the
        request context."""
        if self.admitted and not self.exempt:
            self.door.take(-1, -self.reserved)
        if self.epoch is not None:
            self.door.leave(self.epoch)
        context.request_id.reset(self.tokens[0])
        context.deadline.reset(self.tokens[1])
        if self.records is not None:
            context.stages.reset(self.tokens[2])

    def record(self) -> None:
        """Count the answered request (status, duration by model, endpoint and status class), end
        its server span when it was sampled, and write its access line with ``--log-format json``."""
        route = self.scope.get("route")
        endpoint = getattr(route, "path", None) or "unmatched"
        status = int(self.status)
        self.metrics.responses.labels(str(status)).inc()
        end = time.perf_counter()
        self.metrics.request_duration.labels(self.model, endpoint, f"{status // 100}xx").observe(end - self.start)
        trace_id = self._finish_span(endpoint, status, end) if self.records is not None else None
        if self.observe.access_log:
            method = self.scope.get("method")
            access.info("%s %s %d", method, self.path, status, extra={
                "method": method, "path": self.path, "status": status,
                "duration_ms": round((end - self.start) * 1e3, 3), "request_id": self.request_id,
                "model": self.model, "trace_id": trace_id})

    def _finish_span(self, endpoint: str, status: int, end: float) -> str | None:
        """End the sampled request's server span, renamed for its route, with its stage spans;
        its trace id, for the access line."""
        tracing = self.observe.tracing
        trace_id = tracing.trace_id(self.span)
        method = self.scope.get("method", "GET")
        self.span.update_name(f"{method} {endpoint}")
        tracing.finish(self.span, self.records, end, {
            "http.request.method": method, "url.path": self.path, "http.route": endpoint,
            "http.response.status_code": status, "softmoe.request_id": self.request_id,
            "softmoe.model": str(self.model)}, error=status >= 500)
        return trace_id


async def _receive_within(receive: Receive, seconds: float) -> Message:
    """The next message, waiting at most ``seconds`` for it; asyncio.TimeoutError past that.

    A message the HTTP layer already holds is taken whatever ``seconds`` says: a busy event loop
    can run a request's first ``receive`` seconds after its body arrived, or fire the timer in the
    same turn as the bytes (the bytes are read first, the waiting task wakes after the timer), and
    the client is not to blame for either. So at zero, or when the wait times out, one more
    ``receive`` is tried that may not wait: uvicorn's returns at once when a message is ready.
    """
    if seconds > 0:
        try:
            async with _timeout(seconds):
                return await receive()
        except asyncio.TimeoutError:
            pass
    async with _timeout(0):  # fires at the loop's next turn: only a message ready now comes back
        return await receive()


if sys.version_info >= (3, 11):
    _timeout = asyncio.timeout  # a timer on this task, not a new task as wait_for makes before 3.12
else:
    @asynccontextmanager
    async def _timeout(seconds: float):
        """asyncio.timeout for Python 3.10: the task is cancelled after ``seconds`` (at the loop's
        next turn when <= 0), and that cancellation comes out as asyncio.TimeoutError."""
        task, fired = asyncio.current_task(), []

        def fire() -> None:
            fired.append(True)
            task.cancel()

        handle = asyncio.get_running_loop().call_later(max(seconds, 0.0), fire)
        try:
            yield
        except asyncio.CancelledError:
            if fired:
                raise asyncio.TimeoutError from None
            raise
        finally:
            handle.cancel()


def _content_length(value: bytes | None) -> int | None:
    """The declared body length; None when absent, -1 when malformed."""
    if value is None:
        return None
    text = value.decode("latin-1").strip()
    if not text.isdigit() or len(text) > 18:
        return -1
    return int(text)


def create_app(settings: Settings | None = None, *, models: list[ServedModel] | None = None,
               batcher=None) -> FastAPI:
    """Build the app. ``models`` (already loaded) replaces ``settings.models`` (tests, embedding);
    ``batcher`` replaces the in-process one (a front-end process's ``RemoteBatcher``, whose engine
    process warmed the models up: pass ``warmup=False`` settings with it)."""
    settings = settings or Settings()
    metrics = Metrics()
    given_batcher = batcher

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state = app.state
        engine = Engine(settings, metrics, batcher=given_batcher)
        loaded = await asyncio.to_thread(engine.bring_up, models)
        engine.checkpoints.append(state.door.checkpoint)
        state.engine, state.models, state.batcher = engine, engine.models, engine.batcher
        state.control = ModelControl(engine, settings)
        state.service = Service(settings, engine.models, engine.batcher, metrics, control=state.control)
        state.ready = True
        metrics.server_ready.set(1)
        log.info("ready: %s", ", ".join(f"{m.name} ({m.kind}, {m.backend.name})" for m in loaded) or "no model loaded")
        state.control.start()
        try:
            yield
        finally:
            state.ready = False
            metrics.server_ready.set(0)
            state.control.stop()
            await asyncio.to_thread(engine.close)  # the batcher stops (what is queued finishes), the models go
            state.service.close()
            if state.tracing is not None:
                await asyncio.to_thread(state.tracing.close)

    app = FastAPI(title="softmoe-serve", version=__version__, lifespan=lifespan,
                  description="Soft MoE ViT and LiT two-tower inference: classify, embed, zero-shot, OpenAI "
                              "embeddings and Open Inference Protocol v2.")
    app.state.settings, app.state.metrics = settings, metrics
    app.state.ready, app.state.draining = False, False
    app.state.models, app.state.batcher = {}, None
    app.state.door = Door(settings, metrics)
    app.state.keys = Keys(settings)
    app.state.tracing = traces.from_settings(settings, metrics)
    metrics.init_errors(ERROR_TYPES, STATUSES)
    app.include_router(v1.router)
    app.include_router(openai.router)
    app.include_router(oip.router)
    app.include_router(routing.router)
    app.include_router(page.router)  # the page at `/`: it calls the public routes above, nothing of its own

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        for m in list(app.state.models.values()):
            for q in m.queues.values():
                q._gauge()
        batcher = app.state.batcher
        metrics.worker_alive.set(1 if batcher is not None and batcher.alive else 0)
        metrics.server_ready.set(1 if is_ready(app.state) else 0)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError):
        return _error(exc, request.url.path, metrics)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        body = {"error": {"message": f"{loc}: {err.get('msg', 'invalid request')}", "type": "invalid_request", "code": 422}}
        metrics.errors.labels("invalid_request").inc()
        return _ErrorJSON(_body(body, request.url.path), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        body = {"error": {"message": str(exc.detail), "type": "http_error", "code": exc.status_code}}
        metrics.errors.labels("http_error").inc()
        return _ErrorJSON(_body(body, request.url.path), status_code=exc.status_code,
                          headers=getattr(exc, "headers", None))

    # Unexpected exceptions are answered by Observe (outermost), so they carry the request id too.
    app.add_middleware(Observe, state=app.state, metrics=metrics, settings=settings)  # outermost
    _openapi_components(app)
    return app


def _openapi_components(app: FastAPI) -> None:
    """Add the request schemas referenced by the hand-written request bodies."""
    original = app.openapi

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        doc = original()
        comps = doc.setdefault("components", {}).setdefault("schemas", {})
        for cls in (schemas.ClassifyRequest, schemas.EmbedRequest, schemas.ZeroShotRequest, schemas.EmbeddingsRequest,
                    schemas.OIPInferRequest):
            schema = cls.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in schema.pop("$defs", {}).items():
                comps.setdefault(name, sub)
            comps[cls.__name__] = schema
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
