"""Open Inference Protocol v2 over HTTP (KServe / Triton REST), with Triton's binary tensor
extension: the routes. They move bytes: an inference's tensors are decoded and encoded by
server.api.oip_codec, and run by server.api.oip."""

from __future__ import annotations

import asyncio
import time
from typing import TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from softmoe_models import __version__

from server.api import oip
from server.api.oip import EXTENSIONS, ready_model, served_model, tensors_of
from server.api.oip_codec import BINARY_HEADER, HttpWire
from server.api.schemas import (Health, ModelReadiness, OIPError, OIPInferResponse, OIPModelMetadata,
                                OIPServerMetadata, RepositoryEntry, RepositoryIndexRequest, RepositoryLoadRequest,
                                RepositoryUnloadRequest, validation_error)
from server.api.service import is_ready
from server.engine.models import batching_parameters
from server.errors import BadRequest, ModelLoadError
from server.http.routes.inputs import read_body
from server.pipeline.body import loads

M = TypeVar("M", bound=BaseModel)
router = APIRouter(tags=["open inference protocol v2"])
ERRORS = {code: {"model": OIPError} for code in (400, 404, 409, 413, 415, 422, 429, 500, 503, 504)}


def _model(request: Request, name: str, version: str | None = None):
    return served_model(request.app.state.models, name, version, request.app.state.control)


@router.get("/v2", response_model=OIPServerMetadata, summary="Server metadata")
async def server_metadata():
    return {"name": "softmoe-serve", "version": __version__, "extensions": EXTENSIONS}


@router.get("/v2/health/live", response_model=Health, responses={503: {"model": Health}},
            summary="Liveness: the process can serve (its device worker is alive)")
async def live(request: Request):
    batcher = request.app.state.batcher
    if batcher is not None and batcher.dead:
        return JSONResponse({"live": False, "reason": batcher.dead}, status_code=503)
    if batcher is not None and request.app.state.ready and not batcher.alive and not request.app.state.draining:
        return JSONResponse({"live": False, "reason": "the device worker is not running"}, status_code=503)
    return JSONResponse({"live": True})


@router.get("/v2/health/ready", response_model=Health, responses={503: {"model": Health}},
            summary="Readiness: every model loaded and warmed up, not draining")
async def ready(request: Request):
    ok = is_ready(request.app.state)
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


@router.get("/v2/models/{model_name}", response_model=OIPModelMetadata, responses=ERRORS, summary="Model metadata")
@router.get("/v2/models/{model_name}/versions/{version}", response_model=OIPModelMetadata, responses=ERRORS,
            include_in_schema=False)
async def model_metadata(request: Request, model_name: str, version: str | None = None):
    model = _model(request, model_name, version)
    ins, outs = tensors_of(model)
    # parameters: what actually runs (the provider ONNX Runtime really uses, not what was asked for).
    return {"name": model.name, "versions": ["1"], "platform": f"softmoe_{model.backend.name}", "inputs": ins,
            "outputs": outs, "parameters": {**model.backend.describe(), **batching_parameters(model, request.app.state.settings)}}


@router.get("/v2/models/{model_name}/ready", response_model=ModelReadiness,
            responses={**ERRORS, 503: {"model": ModelReadiness}}, summary="Model readiness")
@router.get("/v2/models/{model_name}/versions/{version}/ready", include_in_schema=False)
async def model_ready(request: Request, model_name: str, version: str | None = None):
    """A model the repository knows but does not serve now is not ready (503); an unknown one is 404."""
    control = request.app.state.control
    if model_name not in request.app.state.models and control.describe_missing(model_name):
        return JSONResponse({"name": model_name, "ready": False}, status_code=503)
    model = _model(request, model_name, version)
    return JSONResponse({"name": model.name, "ready": model.ready}, status_code=200 if model.ready else 503)


@router.post("/v2/repository/index", response_model=list[RepositoryEntry], responses=ERRORS,
             summary="Models in the repository and served (Triton's model repository extension)")
async def repository_index(request: Request):
    req = await _control_body(request, RepositoryIndexRequest)
    return JSONResponse(request.app.state.control.index(ready_only=req.ready))


@router.post("/v2/repository/models/{model_name}/load", responses=ERRORS,
             summary="Load a model from the repository, or reload it: the new version serves once loaded, "
                     "the old one finishes what it admitted")
async def repository_load(request: Request, model_name: str):
    req = await _control_body(request, RepositoryLoadRequest)
    await asyncio.to_thread(_load, request.app.state.control, model_name, req.parameters.unload_first)
    return Response(status_code=200)


@router.post("/v2/repository/models/{model_name}/unload", responses=ERRORS,
             summary="Unload a model: it takes no new request, finishes those it admitted, then is released")
async def repository_unload(request: Request, model_name: str):
    await _control_body(request, RepositoryUnloadRequest)
    await asyncio.to_thread(request.app.state.control.unload, model_name)
    return Response(status_code=200)


async def _control_body(request: Request, schema: type[M]) -> M:
    raw = await read_body(request)
    payload = loads(raw) if raw.strip() else {}
    if not isinstance(payload, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        return schema.model_validate(payload)
    except ValidationError as e:
        err = validation_error(e)
        raise BadRequest(err.message, param=err.param) from None


def _load(control, name: str, unload_first: bool) -> None:
    try:
        control.load(name, unload_first=unload_first)
    except ModelLoadError as e:
        raise BadRequest(f"model {name!r} could not be loaded: {e}", param="model") from None


@router.post("/v2/models/{model_name}/infer", response_model=OIPInferResponse, responses=ERRORS, summary="Inference (OIP v2)",
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"$ref": "#/components/schemas/OIPInferRequest"}}}}})
@router.post("/v2/models/{model_name}/versions/{version}/infer", include_in_schema=False)
async def infer(request: Request, model_name: str, version: str | None = None):
    started = time.perf_counter()
    state = request.app.state
    model = ready_model(state.models, model_name, version, state.control)
    wire = HttpWire(await read_body(request), request.headers.get(BINARY_HEADER))
    reply, timings = await oip.infer(state.service, model, wire, request.receive, started)
    return Response(reply.body, media_type=reply.media_type,
                    headers={**reply.headers, **timings.headers(), "x-model": model.name})
