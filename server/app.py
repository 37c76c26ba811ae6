"""``create_app(settings)``: load models, build backends, warm up every batch shape, then ready.

Shared objects live on ``app.state``: settings, metrics, batcher, models, service, ready,
draining. Routes are thin; errors go through one handler; every request is timed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from softmoe_models import __version__

from .batching.batcher import Batcher
from .errors import PayloadTooLarge, QueueFull, ServiceError, Unavailable
from .metrics import Metrics
from .registry import ServedModel, attach_queues, load_served_model, warmup
from .service import Service
from .settings import Settings

log = logging.getLogger("softmoe.server")


def _error(exc: ServiceError, path: str = "") -> JSONResponse:
    return JSONResponse(_body(exc.body(), path), status_code=exc.status, headers=exc.headers)


def _body(body: dict, path: str) -> dict:
    """Open Inference Protocol routes use its error shape, ``{"error": "<message>"}``."""
    if path.startswith("/v2"):
        return {"error": body["error"]["message"]}
    return body


class BodyLimit:
    """413 past ``limit`` bytes: from Content-Length before reading, else by counting the stream."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.limit
            except ValueError:
                too_big = False
            if too_big:
                too_large = PayloadTooLarge(f"request body of {int(length)} bytes exceeds the limit of {self.limit}")
                return await _error(too_large, scope.get("path", ""))(scope, receive, send)
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # raised inside the route: the error handler answers 413
                    raise PayloadTooLarge(f"request body exceeds the limit of {self.limit} bytes")
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, tracking_send)
        except PayloadTooLarge as exc:  # raised where no handler runs (e.g. a middleware reading)
            if not started:
                await _error(exc, scope.get("path", ""))(scope, receive, send)


EXEMPT = ("/v2/health", "/metrics")


class Observe:
    """Outermost (pure ASGI, so ``receive`` reaches the routes untouched and a client's disconnect
    is seen): request id, timing headers, request metrics, in-flight cap, draining."""

    def __init__(self, app: ASGIApp, state, metrics: Metrics, settings: Settings) -> None:
        self.app, self.state, self.metrics, self.settings = app, state, metrics, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        path = scope.get("path", "")
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        seen: dict[str, object] = {"status": 500, "model": "none"}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                out = MutableHeaders(scope=message)
                seen["model"] = out.get("x-model", "none")
                out["x-request-id"] = request_id
                out["x-total-time"] = f"{(time.perf_counter() - start) * 1e3:.2f}"
            await send(message)

        exempt = path.startswith(EXEMPT)
        if self.state.draining and not exempt:
            await _error(Unavailable("the server is shutting down", retry_after_s=5), path)(scope, receive, send_wrapper)
        elif not exempt and self.metrics.in_flight._value.get() >= self.settings.max_in_flight:
            self.metrics.rejected.labels("none", "too_many_requests").inc()
            too_many = QueueFull(f"{self.settings.max_in_flight} requests in flight; try again shortly")
            await _error(too_many, path)(scope, receive, send_wrapper)
        else:
            self.metrics.in_flight.inc()
            try:
                await self.app(scope, receive, send_wrapper)
            finally:
                self.metrics.in_flight.dec()
        if not exempt:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            status = int(seen["status"])  # type: ignore[arg-type]
            self.metrics.request_duration.labels(seen["model"], endpoint, f"{status // 100}xx").observe(
                time.perf_counter() - start)


def create_app(settings: Settings | None = None, *, models: list[ServedModel] | None = None) -> FastAPI:
    """Build the app. ``models`` (already loaded) replaces ``settings.models`` (tests, embedding)."""
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state = app.state
        specs = settings.models or default_model_specs(settings)
        loaded = models if models is not None else [await asyncio.to_thread(load_served_model, s, settings, log.info) for s in specs]
        names = [m.name for m in loaded]
        if len(set(names)) != len(names):
            raise RuntimeError(f"two models share a name: {names}")
        batcher = Batcher(settings.device, metrics)
        for m in loaded:
            metrics.model_ready.labels(m.name).set(0)
            attach_queues(m, batcher, settings, metrics)
        state.models = {m.name: m for m in loaded}
        state.batcher = batcher
        state.service = Service(settings, state.models, batcher, metrics)
        for m in loaded:
            await asyncio.to_thread(warmup, m, settings)
            m.ready = True
            metrics.model_ready.labels(m.name).set(1)
        batcher.start()
        state.ready = True
        metrics.server_ready.set(1)
        log.info("ready: %s", ", ".join(f"{m.name} ({m.kind}, {m.backend.name})" for m in loaded))
        try:
            yield
        finally:
            state.ready = False
            metrics.server_ready.set(0)
            batcher.stop()
            state.service.close()
            for m in loaded:
                m.ready = False
                metrics.model_ready.labels(m.name).set(0)
                m.backend.close()

    app = FastAPI(title="softmoe-serve", version=__version__, lifespan=lifespan,
                  description="Soft MoE ViT and LiT two-tower inference: classify, embed, zero-shot, OpenAI "
                              "embeddings and Open Inference Protocol v2.")
    app.state.settings, app.state.metrics = settings, metrics
    app.state.ready, app.state.draining = False, False
    app.state.models, app.state.batcher = {}, None

    from .routes import oip, openai, v1

    app.include_router(v1.router)
    app.include_router(openai.router)
    app.include_router(oip.router)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        for m in app.state.models.values():
            for q in m.queues.values():
                q._gauge()
        ok = app.state.ready and not app.state.draining and all(m.ready for m in app.state.models.values())
        metrics.server_ready.set(1 if ok else 0)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError):
        return _error(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        body = {"error": {"message": f"{loc}: {err.get('msg', 'invalid request')}", "type": "invalid_request", "code": 422}}
        return JSONResponse(_body(body, request.url.path), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        body = {"error": {"message": str(exc.detail), "type": "http_error", "code": exc.status_code}}
        return JSONResponse(_body(body, request.url.path), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        body = {"error": {"message": "internal error", "type": "internal_error", "code": 500}}
        return JSONResponse(_body(body, request.url.path), status_code=500)

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(Observe, state=app.state, metrics=metrics, settings=settings)  # outermost
    _openapi_components(app)
    return app


def _openapi_components(app: FastAPI) -> None:
    """Add the request schemas referenced by the hand-written request bodies."""
    from . import schemas

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


def default_model_specs(settings: Settings) -> list[str]:
    """The built-in default model(s), created on first use."""
    from .default_model import default_packages

    return default_packages(settings.cache_dir)
