"""OIP v2 over gRPC: the same models, admission, budgets, deadlines, batcher and metrics as HTTP.

``start(app, settings)`` runs a ``grpc.aio`` server on the app's event loop, serving
``inference.GRPCInferenceService`` (ServerLive, ServerReady, ModelReady, ServerMetadata,
ModelMetadata, ModelInfer, and the repository extension: RepositoryIndex, RepositoryModelLoad,
RepositoryModelUnload) and ``grpc.health.v1.Health``. A call goes through
what an HTTP request goes through, in the same order:

- the door (``app.state.door``): one in-flight place per call, taken before its message is read,
  then the message's bytes against ``max_in_flight_bytes``; draining refuses (UNAVAILABLE);
- a message is at most ``max_body_bytes`` (gRPC's own limit: RESOURCE_EXHAUSTED above it) and is
  read within the request's deadline (``request_timeout_s``, or the client's sooner deadline):
  ModelInfer is served as a client stream of one message, which is the same bytes on the wire as a
  unary call, so its reading is timed here rather than before the handler starts;
- its tensors are decoded, checked and encoded by the codec HTTP uses too (server.api.oip_codec)
  and run through the model's queues row by row (server.api.oip), so a result is bitwise what
  HTTP gives; the answer leaves the codec serialized, so the encode stage times all of it;
- request ids come from ``x-request-id`` metadata or are made, and go back in the trailing
  metadata of every call, answered or refused, with the per-stage times (``x-inference-time`` ...)
  and ``retry-after``;
- with ``--api-key``, every RPC but ServerLive and ServerReady (and grpc.health.v1) needs
  ``authorization: Bearer KEY`` metadata (UNAUTHENTICATED without it); a ``traceparent`` in the
  metadata is continued when tracing is on; with ``--log-format json`` each call gets a line.

Errors map from the HTTP status of the same refusal: 400/413/415/422 INVALID_ARGUMENT (the
message names the field, as over HTTP), 404 NOT_FOUND, 429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE,
408/504 DEADLINE_EXCEEDED, 499 CANCELLED, anything else INTERNAL (its text only logged).

Messages are built from ``oip.binpb`` (``oip.proto`` compiled) in a descriptor pool of their own,
so a process that also imports tritonclient's copy of the same protocol has no clash.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from importlib import resources

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from softmoe_models import __version__

from server import context
from server.errors import BadRequest, ModelLoadError, RequestTimeout, ServiceError, Unavailable
from server.api import oip
from server.api.keys import Keys
from server.api.oip_codec import GrpcWire
from server.api.service import is_ready

log = logging.getLogger("softmoe.grpc")
access = logging.getLogger("softmoe.access")

SERVICE = "inference.GRPCInferenceService"
MESSAGES = ("ServerLiveRequest", "ServerLiveResponse", "ServerReadyRequest", "ServerReadyResponse",
            "ModelReadyRequest", "ModelReadyResponse", "ServerMetadataRequest", "ServerMetadataResponse",
            "ModelMetadataRequest", "ModelMetadataResponse", "ModelInferRequest", "ModelInferResponse",
            "RepositoryIndexRequest", "RepositoryIndexResponse", "InferParameter", "ModelRepositoryParameter",
            "RepositoryModelLoadRequest", "RepositoryModelLoadResponse", "RepositoryModelUnloadRequest",
            "RepositoryModelUnloadResponse")
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 413: grpc.StatusCode.INVALID_ARGUMENT,
         415: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
         429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
         408: grpc.StatusCode.DEADLINE_EXCEEDED, 504: grpc.StatusCode.DEADLINE_EXCEEDED,
         499: grpc.StatusCode.CANCELLED, 409: grpc.StatusCode.FAILED_PRECONDITION,
         401: grpc.StatusCode.UNAUTHENTICATED}
OPEN = ("ServerLive", "ServerReady")  # the probes' RPCs: no API key needed (grpc.health.v1 neither)
HEALTH_POLL_S = 0.25
RPC_HEADROOM = 32  # calls beyond --max-in-flight that gRPC itself admits (health, metadata)


def messages() -> dict[str, type]:
    """The protocol's message classes, from the compiled ``oip.proto``, in a pool of their own."""
    files = descriptor_pb2.FileDescriptorSet.FromString(
        resources.files(__package__).joinpath("oip.binpb").read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for f in files.file:
        pool.Add(f)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"inference.{name}"))
            for name in MESSAGES}


M = messages()


class Call:
    """What every RPC does around its handler: request id, deadline, the error mapping, metrics."""

    def __init__(self, app, method: str) -> None:
        self.app, self.method = app, method
        self.state, self.settings, self.metrics = app.state, app.state.settings, app.state.metrics
        self.keys: Keys = app.state.keys
        self.keyed = self.keys.enabled and method.rpartition("/")[2] not in OPEN
        self.tracing = app.state.tracing
        self.access_log = self.settings.log_format == "json"

    def deadline(self, ctx: aio.ServicerContext, start: float) -> float:
        left = ctx.time_remaining()
        return start + min(self.settings.request_timeout_s, left if left is not None else float("inf"))

    async def __call__(self, handler, request, ctx: aio.ServicerContext):
        start = time.perf_counter()
        metadata = dict(ctx.invocation_metadata() or ())
        given = metadata.get("x-request-id", "")[:128]
        rid = given if given and given.isprintable() else secrets.token_hex(16)
        tokens = context.request_id.set(rid), context.deadline.set(self.deadline(ctx, start))
        span = records = None
        if self.tracing is not None:
            span = self.tracing.begin(self.method, metadata.get("traceparent"), metadata.get("tracestate"), start, {})
            if span is not None and span.is_recording():
                records = []
                tokens += (context.stages.set(records),)
        # The request id rides in the trailing metadata, which goes out with the answer: sending
        # initial metadata on its own costs a completion-queue round per call (a fifth of a
        # one-row ModelInfer's server CPU; docs/benchmarks.md).
        failure, status, model = None, 200, "none"
        try:
            if self.keyed and not self.keys.accepts(auth := metadata.get("authorization")):
                raise Keys.refusal(auth)
            response, model, trailing = await handler(request, ctx)
            ctx.set_trailing_metadata((("x-request-id", rid), *trailing.items()))
            return response
        except ServiceError as e:
            failure, status = e, e.status
        except asyncio.CancelledError:
            status = 499
            raise
        except Exception:  # noqa: BLE001 - the text is logged with the request id, never sent
            log.exception("unexpected error in %s (request id %s)", self.method, rid)
            failure, status = ServiceError(f"internal error (request id {rid})"), 500
        finally:
            context.request_id.reset(tokens[0])
            context.deadline.reset(tokens[1])
            if records is not None:
                context.stages.reset(tokens[2])
            end = time.perf_counter()
            self.metrics.responses.labels(str(status)).inc()
            self.metrics.request_duration.labels(model, self.method, f"{status // 100}xx").observe(end - start)
            self._done(span, records, rid, model, status, start, end)
        self.metrics.errors.labels(failure.type).inc()
        retry = failure.headers.get("Retry-After")
        ctx.set_trailing_metadata((("x-request-id", rid), *((("retry-after", retry),) if retry else ())))
        await ctx.abort(CODES.get(failure.status, grpc.StatusCode.INTERNAL), failure.message)


    def _done(self, span, records, rid: str, model: str, status: int, start: float, end: float) -> None:
        """The call's spans (when traced) and its line (``--log-format json``)."""
        trace_id = None
        if records is not None:
            trace_id = self.tracing.trace_id(span)
            code = CODES.get(status, grpc.StatusCode.INTERNAL) if status != 200 else grpc.StatusCode.OK
            self.tracing.finish(span, records, end, {
                "rpc.system": "grpc", "rpc.method": self.method, "rpc.grpc.status_code": code.value[0],
                "softmoe.request_id": rid, "softmoe.model": model}, error=status >= 500)
        if self.access_log:
            access.info("%s %d", self.method, status, extra={
                "rpc": self.method, "status": status, "duration_ms": round((end - start) * 1e3, 3),
                "request_id": rid, "model": model, "trace_id": trace_id})


def _parse(cls, raw: bytes):
    try:
        return cls.FromString(raw)
    except DecodeError as e:
        raise BadRequest(f"the request is not a valid {cls.DESCRIPTOR.full_name} message ({e})") from None


class Servicer:
    """The RPCs; each returns (response, model name for the metrics, trailing metadata)."""

    def __init__(self, app) -> None:
        self.app, self.state = app, app.state

    # ---------------------------------------------------------------- health and metadata

    async def server_live(self, request, ctx):
        batcher = self.state.batcher
        dead = batcher is not None and (batcher.dead or (self.state.ready and not batcher.alive and not self.state.draining))
        return M["ServerLiveResponse"](live=not dead), "none", {}

    async def server_ready(self, request, ctx):
        return M["ServerReadyResponse"](ready=is_ready(self.state)), "none", {}

    async def model_ready(self, request, ctx):
        """A model the repository knows but does not serve now is not ready; an unknown one is NOT_FOUND."""
        if request.name not in self.state.models and self.state.control.describe_missing(request.name):
            return M["ModelReadyResponse"](ready=False), "none", {}
        model = oip.served_model(self.state.models, request.name, request.version or None, self.state.control)
        return M["ModelReadyResponse"](ready=bool(model.ready)), model.name, {}

    async def server_metadata(self, request, ctx):
        return M["ServerMetadataResponse"](name="softmoe-serve", version=__version__,
                                           extensions=oip.EXTENSIONS), "none", {}

    async def model_metadata(self, request, ctx):
        model = oip.served_model(self.state.models, request.name, request.version or None, self.state.control)
        ins, outs = oip.tensors_of(model)
        meta = M["ModelMetadataResponse"](name=model.name, versions=["1"], platform=f"softmoe_{model.backend.name}")
        for t in ins:
            meta.inputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        for t in outs:
            meta.outputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return meta, model.name, {}

    async def repository_index(self, request, ctx):
        out = M["RepositoryIndexResponse"]()
        for entry in self.state.control.index(ready_only=request.ready):
            out.models.add(**entry)
        return out, "none", {}

    async def repository_model_load(self, request, ctx):
        """Triton's load: the one parameter taken is ``unload_first`` (bool); others are refused."""
        unload_first = False
        for key, value in request.parameters.items():
            if key != "unload_first" or value.WhichOneof("parameter_choice") != "bool_param":
                raise BadRequest(f"parameters.{key[:60]}: the one load parameter is unload_first (bool)",
                                 param=f"parameters.{key[:60]}")
            unload_first = value.bool_param
        try:
            await asyncio.to_thread(self.state.control.load, request.model_name, unload_first=unload_first)
        except ModelLoadError as e:
            raise BadRequest(f"model {request.model_name!r} could not be loaded: {e}", param="model_name") from None
        return M["RepositoryModelLoadResponse"](), "none", {}

    async def repository_model_unload(self, request, ctx):
        for key, value in request.parameters.items():
            if key != "unload_dependents" or value.WhichOneof("parameter_choice") != "bool_param":
                raise BadRequest(f"parameters.{key[:60]}: the one unload parameter is unload_dependents (bool)",
                                 param=f"parameters.{key[:60]}")
        await asyncio.to_thread(self.state.control.unload, request.model_name)
        return M["RepositoryModelUnloadResponse"](), "none", {}

    # ---------------------------------------------------------------- inference

    async def model_infer(self, requests, ctx):
        """One message read within the deadline, behind the door; then what HTTP's infer does."""
        door = self.state.door
        if self.state.draining:
            self.state.metrics.rejected.labels("none", "draining").inc()
            raise Unavailable("the server is shutting down", retry_after_s=5)
        if (refusal := door.refusal(0)) is not None:
            self.state.metrics.rejected.labels("none", refusal[1]).inc()
            raise refusal[0]
        door.take(1, 0)
        epoch = door.enter()
        held = 0
        try:
            raw = await _first_message(requests, context.remaining(), self.state.metrics)
            if (refusal := door.refusal(len(raw), place=False)) is not None:
                self.state.metrics.rejected.labels("none", refusal[1]).inc()
                raise refusal[0]
            door.take(0, len(raw))
            held = len(raw)
            return await self._infer(_parse(M["ModelInferRequest"], raw))
        finally:
            door.take(-1, -held)
            door.leave(epoch)

    async def _infer(self, request):
        started = time.perf_counter()
        model = oip.ready_model(self.state.models, request.model_name, request.model_version or None,
                                self.state.control)
        answer, timings = await oip.infer(self.state.service, model, GrpcWire(request, M["ModelInferResponse"]),
                                          started=started)
        return answer, model.name, timings.headers()


async def _first_message(requests, seconds: float, metrics) -> bytes:
    """The call's one message, waited for at most ``seconds``; a client that sends none is refused."""

    async def first() -> bytes | None:
        async for raw in requests:
            return raw
        return None

    try:
        raw = await asyncio.wait_for(first(), max(seconds, 0.0))
    except asyncio.TimeoutError:
        metrics.rejected.labels("none", "slow_client").inc()
        raise RequestTimeout("the request message did not arrive within the request's deadline "
                             "(request_timeout_s, or the client's deadline)") from None
    if raw is None:
        raise BadRequest("the call carried no ModelInferRequest message")
    return raw


# ------------------------------------------------------------------ the server


def _handlers(app) -> grpc.GenericRpcHandler:
    servicer = Servicer(app)
    unary = {"ServerLive": ("ServerLiveRequest", servicer.server_live),
             "ServerReady": ("ServerReadyRequest", servicer.server_ready),
             "ModelReady": ("ModelReadyRequest", servicer.model_ready),
             "ServerMetadata": ("ServerMetadataRequest", servicer.server_metadata),
             "ModelMetadata": ("ModelMetadataRequest", servicer.model_metadata),
             "RepositoryIndex": ("RepositoryIndexRequest", servicer.repository_index),
             "RepositoryModelLoad": ("RepositoryModelLoadRequest", servicer.repository_model_load),
             "RepositoryModelUnload": ("RepositoryModelUnloadRequest", servicer.repository_model_unload)}
    handlers = {}
    for method, (message, fn) in unary.items():
        call = Call(app, f"/{SERVICE}/{method}")

        async def handle(raw: bytes, ctx, call=call, fn=fn, cls=M[message]):
            async def run(raw, ctx):
                return await fn(_parse(cls, raw), ctx)

            return await call(run, raw, ctx)

        handlers[method] = grpc.unary_unary_rpc_method_handler(handle, response_serializer=_serialize)
    infer = Call(app, f"/{SERVICE}/ModelInfer")

    async def model_infer(requests, ctx):
        return await infer(servicer.model_infer, requests, ctx)

    # ModelInfer's answer comes serialized from the codec (its encoding timed as a stage).
    handlers["ModelInfer"] = grpc.stream_unary_rpc_method_handler(model_infer, response_serializer=bytes)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _serialize(message) -> bytes:
    return message.SerializeToString()


async def _health(state, servicer: health_aio.HealthServicer) -> None:
    """The health service follows readiness: SERVING while /v2/health/ready is 200, else NOT_SERVING."""
    last = None
    while True:
        status = health_pb2.HealthCheckResponse.SERVING if is_ready(state) else health_pb2.HealthCheckResponse.NOT_SERVING
        if status != last:
            for name in ("", SERVICE):
                await servicer.set(name, status)
            last = status
        await asyncio.sleep(HEALTH_POLL_S)


class GrpcServer:
    """A running gRPC server; ``stop`` lets calls in flight finish within ``grace`` seconds."""

    def __init__(self, server: aio.Server, port: int, watcher: asyncio.Task) -> None:
        self.server, self.port, self.watcher = server, port, watcher

    async def stop(self, grace: float) -> None:
        self.watcher.cancel()
        await self.server.stop(grace)


async def start(app, host: str, port: int, reuse_port: bool = False) -> GrpcServer:
    """Serve ``app``'s models over gRPC on ``host:port`` (0: a free port, see ``.port``).

    Raises:
        OSError: the port cannot be bound.
    """
    settings = app.state.settings
    options = [("grpc.max_receive_message_length", settings.max_body_bytes),
               ("grpc.so_reuseport", 1 if reuse_port else 0)]
    # The door limits inference calls (a place before the message is read); gRPC's own cap is a
    # backstop for every RPC, with room for health checks and metadata while inference is full.
    server = aio.server(options=options, maximum_concurrent_rpcs=settings.max_in_flight + RPC_HEADROOM)
    server.add_generic_rpc_handlers((_handlers(app),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"cannot listen on {address}: {e}") from None
    if not bound:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    watcher = asyncio.ensure_future(_health(app.state, health))
    return GrpcServer(server, bound, watcher)
