"""/v1/classify, /v1/embed, /v1/zero-shot."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.api.schemas import (ClassifyRequest, ClassifyResponse, EmbedRequest, EmbedResponse, ErrorResponse,
                       ZeroShotRequest, ZeroShotResponse)
from server.http.routes.inputs import body_doc, parse

router = APIRouter(tags=["inference"])
ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 413, 415, 422, 429, 500, 503, 504)}


def _respond(body: dict, timings, model: str) -> JSONResponse:
    return JSONResponse(body, headers={**timings.headers(), "x-model": model})


@router.post("/v1/classify", response_model=ClassifyResponse, responses=ERRORS, openapi_extra=body_doc("ClassifyRequest"),
             summary="Classify images: top-k labels with scores")
async def classify(request: Request):
    req, blobs = await parse(request, ClassifyRequest)
    svc = request.app.state.service
    model, results, timings = await svc.classify(req.model, blobs, req.top_k, request.receive)
    return _respond({"model": model.name, "results": results}, timings, model.name)


@router.post("/v1/embed", response_model=EmbedResponse, response_model_exclude_none=True, responses=ERRORS,
             openapi_extra=body_doc("EmbedRequest"), summary="Image (and text) embeddings")
async def embed(request: Request):
    req, blobs = await parse(request, EmbedRequest, images_required=False)
    svc = request.app.state.service
    model, img, txt, timings = await svc.embed(req.model, blobs, req.texts or [], req.normalize, request.receive)
    body: dict = {"model": model.name}
    if img is not None:
        body["image_embeddings"] = [v.tolist() for v in img]
    if txt is not None:
        body["text_embeddings"] = [v.tolist() for v in txt]
    return _respond(body, timings, model.name)


@router.post("/v1/zero-shot", response_model=ZeroShotResponse, responses=ERRORS, openapi_extra=body_doc("ZeroShotRequest"),
             summary="Zero-shot classification against candidate labels (two-tower models)")
async def zero_shot(request: Request):
    req, blobs = await parse(request, ZeroShotRequest)
    svc = request.app.state.service
    model, results, timings = await svc.zero_shot(req.model, blobs, req.labels, req.templates, req.activation,
                                                  request.receive)
    return _respond({"model": model.name, "results": results}, timings, model.name)
