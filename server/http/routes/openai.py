"""OpenAI-compatible ``POST /v1/embeddings``: texts and ``data:image/...;base64,`` images."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.errors import Unavailable, Unprocessable
from server.api.schemas import EmbeddingsRequest, EmbeddingsResponse, ErrorResponse
from server.engine.models import batching_parameters
from server.api.service import Timings, decode_b64, not_served
from server.http.routes.inputs import body_doc, parse

router = APIRouter(tags=["openai"])
ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 413, 415, 422, 429, 500, 503, 504)}


@router.post("/v1/embeddings", response_model=EmbeddingsResponse, responses=ERRORS,
             openapi_extra=body_doc("EmbeddingsRequest", images=False), summary="OpenAI-compatible embeddings")
async def embeddings(request: Request):
    req, _ = await parse(request, EmbeddingsRequest, image_field="__none__", images_required=False)
    svc = request.app.state.service
    t0, timings = time.perf_counter(), Timings()
    model = svc.models.get(req.model)
    if model is None:
        raise not_served(req.model, svc.models, svc.control)
    if not model.ready:
        raise Unavailable(f"model {model.name!r} is not ready", retry_after_s=2)
    items = [req.input] if isinstance(req.input, str) else list(req.input)
    svc.check_count(len(items), svc.settings.max_texts_per_request, "inputs", "input")
    is_image = [s.strip()[:11].lower() == "data:image/" for s in items]
    images = await asyncio.to_thread(lambda: [decode_b64(s, f"input[{i}]") for i, s in enumerate(items) if is_image[i]])
    texts = [s for s, img in zip(items, is_image) if not img]
    vecs: list[np.ndarray | None] = [None] * len(items)
    if images:
        if not (model.can("image") or model.can("classify")):
            raise Unprocessable(f"model {model.name!r} cannot embed images", param="input")
        it = iter(await svc.embed_images(model, images, True, timings, request.receive))
        for i, img in enumerate(is_image):
            if img:
                vecs[i] = next(it)
    tokens = 0
    if texts:
        if not model.can("text"):
            raise Unprocessable(f"model {model.name!r} cannot embed text", param="input")
        it = iter(await svc.embed_texts(model, texts, timings, request.receive, param="input"))
        for i, img in enumerate(is_image):
            if not img:
                vecs[i] = next(it)
        tokens = sum(model.tokenizer.count(t) for t in texts)
    dim = len(vecs[0])
    if req.dimensions is not None and req.dimensions != dim:
        raise Unprocessable(f"dimensions {req.dimensions} not supported: model {model.name!r} returns {dim}", param="dimensions")
    data = []
    for i, v in enumerate(vecs):
        emb = base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    svc.finish(model, "embeddings", timings, time.perf_counter(), t0)
    body = {"object": "list", "data": data, "model": model.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return JSONResponse(body, headers={**timings.headers(), "x-model": model.name})


@router.get("/v1/models", summary="Served models (OpenAI list format)")
async def list_models(request: Request):
    data = [{"id": m.name, "object": "model", "created": 0, "owned_by": "softmoe-serve", "kind": m.kind,
             "ready": m.ready, "backend": m.backend.describe(), "source": m.source,
             "batching": batching_parameters(m, request.app.state.settings)}
            for m in list(request.app.state.models.values())]
    return JSONResponse({"object": "list", "data": data})
