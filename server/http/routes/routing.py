"""/v1/routing: what every Soft MoE layer does with an image (per-slot dispatch maps, per-patch
combine weights, statistics), as JSON or as a rendered PNG sheet."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.api.schemas import ErrorResponse
from server.http.routes.inputs import parse

router = APIRouter(tags=["inference"])
ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 413, 415, 422, 429, 500, 503, 504)}


class RoutingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=256, description="served model name; default: the first model with "
                              "Soft MoE image layers")
    images: list[str] = Field(..., min_length=1, description="base64 strings or data:image/...;base64, URIs")
    format: Literal["json", "png"] = Field("json", description="json: the weights; png: the image with the most "
                                           "focused slots' dispatch maps over its patch grid, per Soft MoE layer")
    layers: list[int] | None = Field(None, max_length=256, description="Soft MoE block indices to return "
                                     "(default all); in a query or form field also '2,3'")
    slots: int = Field(4, ge=1, le=64, description="png: slots drawn per layer, the most focused first")

    @field_validator("layers", mode="before")
    @classmethod
    def _comma_list(cls, value):
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value


class LayerRouting(BaseModel):
    layer: int = Field(description="encoder block index")
    dispatch: list[list[list[float]]] = Field(description="[slot][row][col]: the slot's dispatch weights over the "
                                              "patch grid (with cls_dispatch, sum 1 per slot); slot j is expert j // p")
    combine: list[list[list[float]]] = Field(description="[row][col][slot]: the patch's combine weights (sum 1)")
    dispatch_entropy: float = Field(description="mean over slots of the dispatch entropy / log(tokens)")
    combine_entropy: float = Field(description="mean over tokens of the combine entropy / log(slots)")
    expert_share: list[float] = Field(description="each expert's share of the layer's combine mass (sum 1)")
    cls_dispatch: list[float] | None = Field(None, description="cls token's dispatch weight per slot (if any)")
    cls_combine: list[float] | None = Field(None, description="cls token's combine weights (if any)")


class RoutingPrediction(BaseModel):
    label: str
    index: int
    score: float


class ImageRouting(BaseModel):
    prediction: RoutingPrediction | None = Field(description="classifiers: the top label, as /v1/classify scores it")
    layers: list[LayerRouting]


class RoutingResponse(BaseModel):
    model: str
    grid: list[int] = Field(description="patch rows, columns")
    tokens: int
    num_experts: int
    slots_per_expert: int
    results: list[ImageRouting]


BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": RoutingRequest.model_json_schema()},
    "multipart/form-data": {"schema": {"type": "object", "properties": {
        "images": {"type": "array", "items": {"type": "string", "format": "binary"}}}}},
    "image/*": {"schema": {"type": "string", "format": "binary"}},
}}}


@router.post("/v1/routing", response_model=RoutingResponse, openapi_extra=BODY,
             responses={**ERRORS, 200: {"content": {"image/png": {}}, "description": "JSON, or a PNG with format=png"}},
             summary="Soft MoE routing per image: dispatch maps and combine weights of every Soft MoE layer")
async def routing(request: Request):
    req, blobs = await parse(request, RoutingRequest)
    svc = request.app.state.service
    model, body, timings = await svc.routing(req.model, blobs, req.format, req.layers, req.slots, request.receive)
    headers = {**timings.headers(), "x-model": model.name}
    if req.format == "png":
        return Response(body, media_type="image/png", headers=headers)
    return JSONResponse(body, headers=headers)
