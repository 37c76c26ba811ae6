"""Open Inference Protocol v2 (KServe / Triton REST), with Triton's binary tensor extension.

Tensors: ``pixel_values`` (FP32, NCHW, the model's input range) -> ``logits`` (+ ``pre_logits``)
for classifiers; two-tower ``pixel_values`` -> ``image_embeds``, ``input_ids`` (INT32 or INT64)
-> ``text_embeds``. Each row goes through the batcher on its own, so OIP requests get the same
batching and determinism as the /v1 endpoints.
"""

from __future__ import annotations

import json
import time

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from softmoe_models import __version__

from ..errors import BadRequest, NotFound, Unavailable, Unprocessable
from ..schemas import (Health, ModelReadiness, OIPError, OIPInferRequest, OIPInferResponse, OIPModelMetadata,
                       OIPServerMetadata, RepositoryEntry)
from ..service import Timings
from .inputs import validation_error

router = APIRouter(tags=["open inference protocol v2"])
ERRORS = {code: {"model": OIPError} for code in (400, 404, 413, 415, 422, 429, 503, 504)}
DTYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT32": np.int32, "INT64": np.int64,
          "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64}
OIP_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
BINARY_HEADER = "inference-header-content-length"

# input name -> (function, accepted datatypes) per model kind
_INPUTS = {
    "classifier": {"pixel_values": ("classify", ("FP32",))},
    "two-tower": {"pixel_values": ("image", ("FP32",)), "input_ids": ("text", ("INT32", "INT64"))},
    "encoder": {"inputs_embeds": ("encoder", ("FP32",))},
}


def _model(request: Request, name: str, version: str | None = None):
    model = request.app.state.models.get(name)
    if model is None:
        raise NotFound(f"model {name!r} is not served; served: {sorted(request.app.state.models)}")
    if version not in (None, "", "1"):
        raise NotFound(f"model {name!r} has no version {version!r}; it has version '1'")
    return model


def _tensors(model) -> tuple[list[dict], list[dict]]:
    ins, outs = [], []
    for fn, spec in model.backend.functions.items():
        for s in spec.inputs:
            ins.append({"name": s.name, "datatype": OIP_NAMES[np.dtype(s.dtype)], "shape": [-1, *s.shape]})
        for o in spec.outputs:
            outs.append({"name": o, "datatype": "FP32", "shape": [-1, -1]})
    return ins, outs


@router.get("/v2", response_model=OIPServerMetadata, summary="Server metadata")
async def server_metadata():
    return {"name": "softmoe-serve", "version": __version__, "extensions": ["binary_tensor_data", "classification"]}


@router.get("/v2/health/live", response_model=Health, responses={503: {"model": Health}},
            summary="Liveness: the process can serve (its device worker is alive)")
async def live(request: Request):
    batcher = request.app.state.batcher
    if batcher is not None and batcher.dead:
        return JSONResponse({"live": False, "reason": batcher.dead}, status_code=503)
    return JSONResponse({"live": True})


@router.get("/v2/health/ready", response_model=Health, responses={503: {"model": Health}},
            summary="Readiness: every model loaded and warmed up, not draining")
async def ready(request: Request):
    state = request.app.state
    ok = state.ready and not state.draining and all(m.ready for m in state.models.values())
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


@router.get("/v2/models/{model_name}", response_model=OIPModelMetadata, responses=ERRORS, summary="Model metadata")
@router.get("/v2/models/{model_name}/versions/{version}", response_model=OIPModelMetadata, responses=ERRORS,
            include_in_schema=False)
async def model_metadata(request: Request, model_name: str, version: str | None = None):
    model = _model(request, model_name, version)
    ins, outs = _tensors(model)
    return {"name": model.name, "versions": ["1"], "platform": f"softmoe_{model.backend.name}", "inputs": ins, "outputs": outs}


@router.get("/v2/models/{model_name}/ready", response_model=ModelReadiness,
            responses={**ERRORS, 503: {"model": ModelReadiness}}, summary="Model readiness")
@router.get("/v2/models/{model_name}/versions/{version}/ready", include_in_schema=False)
async def model_ready(request: Request, model_name: str, version: str | None = None):
    model = _model(request, model_name, version)
    return JSONResponse({"name": model.name, "ready": model.ready}, status_code=200 if model.ready else 503)


@router.post("/v2/repository/index", response_model=list[RepositoryEntry], summary="Models in the repository (Triton extension)")
async def repository_index(request: Request):
    return JSONResponse([{"name": m.name, "version": "1", "state": "READY" if m.ready else "UNAVAILABLE"}
                         for m in request.app.state.models.values()])


def _parse_body(raw: bytes, header_len: str | None) -> tuple[OIPInferRequest, bytes]:
    if header_len is not None:
        try:
            n = int(header_len)
        except ValueError:
            raise BadRequest(f"invalid {BINARY_HEADER} header") from None
        if not 0 < n <= len(raw):
            raise BadRequest(f"{BINARY_HEADER} {n} does not fit a body of {len(raw)} bytes")
        head, binary = raw[:n], raw[n:]
    else:
        head, binary = raw, b""
    try:
        payload = json.loads(head)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    try:
        return OIPInferRequest.model_validate(payload), binary
    except Exception as e:  # pydantic ValidationError
        raise validation_error(e) if hasattr(e, "errors") else BadRequest(str(e)) from None


def _array(t, binary: bytes, offset: int) -> tuple[np.ndarray, int]:
    dtype = DTYPES.get(t.datatype)
    if dtype is None:
        raise BadRequest(f"input {t.name!r}: datatype {t.datatype} is not supported", param=t.name)
    if any(d < 0 for d in t.shape):
        raise BadRequest(f"input {t.name!r}: negative dimension in shape {t.shape}", param=t.name)
    count = int(np.prod(t.shape)) if t.shape else 1
    size = (t.parameters or {}).get("binary_data_size")
    if size is not None:
        size = int(size)
        if size != count * np.dtype(dtype).itemsize or offset + size > len(binary):
            raise BadRequest(f"input {t.name!r}: binary_data_size {size} does not match shape {t.shape}", param=t.name)
        arr = np.frombuffer(binary, dtype=dtype, count=count, offset=offset).reshape(t.shape)
        return arr, offset + size
    if t.data is None:
        raise BadRequest(f"input {t.name!r} has no data", param=t.name)
    try:
        arr = np.asarray(t.data, dtype=dtype)
    except (ValueError, TypeError, OverflowError):
        raise BadRequest(f"input {t.name!r}: data is not a {t.datatype} array", param=t.name) from None
    if arr.size != count:
        raise BadRequest(f"input {t.name!r}: {arr.size} values for shape {t.shape}", param=t.name)
    return arr.reshape(t.shape), offset


@router.post("/v2/models/{model_name}/infer", response_model=OIPInferResponse, responses=ERRORS, summary="Inference (OIP v2)",
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"$ref": "#/components/schemas/OIPInferRequest"}}}}})
@router.post("/v2/models/{model_name}/versions/{version}/infer", include_in_schema=False)
async def infer(request: Request, model_name: str, version: str | None = None):
    t0 = time.perf_counter()
    model = _model(request, model_name, version)
    if not model.ready:
        raise Unavailable(f"model {model.name!r} is not ready", retry_after_s=2)
    raw = _decompress(await request.body(), request.headers.get("content-encoding", ""),
                      request.app.state.settings.max_body_bytes)
    req, binary = _parse_body(raw, request.headers.get(BINARY_HEADER))
    accepted = _INPUTS.get(model.kind, {})
    if not req.inputs:
        raise Unprocessable("no inputs given", param="inputs")
    svc = request.app.state.service
    timings = Timings()
    outputs: dict[str, np.ndarray] = {}
    offset = 0
    seen = set()
    for t in req.inputs:
        if t.name not in accepted or t.name in seen:
            raise BadRequest(f"unexpected input {t.name!r}; model {model.name!r} takes {sorted(accepted)}", param=t.name)
        seen.add(t.name)
        fn, types = accepted[t.name]
        if t.datatype not in types:
            raise BadRequest(f"input {t.name!r} must be {' or '.join(types)}, got {t.datatype}", param=t.name)
        arr, offset = _array(t, binary, offset)
        spec = next(s for s in model.backend.functions[fn].inputs if s.name == t.name)
        if arr.ndim != 1 + len(spec.shape) or tuple(arr.shape[1:]) != spec.shape or arr.shape[0] == 0:
            raise BadRequest(f"input {t.name!r} has shape {list(arr.shape)}; expected [N, {', '.join(map(str, spec.shape))}]", param=t.name)
        limit = svc.settings.max_texts_per_request if fn == "text" else svc.settings.max_images_per_request
        svc.check_count(arr.shape[0], limit, f"rows of {t.name}", t.name)
        if fn == "text" and ((arr < 0).any() or (arr >= _vocab(model)).any()):
            raise BadRequest(f"input_ids must be in [0, {_vocab(model)})", param=t.name)
        rows = [{t.name: np.ascontiguousarray(r, dtype=spec.dtype)} for r in arr]
        results = await svc.run(model, fn, rows, timings, request.receive)
        for name in model.backend.functions[fn].outputs:
            outputs[name] = np.stack([r.outputs[name] for r in results]).astype(np.float32)
    wanted = [o.name for o in req.outputs] if req.outputs else list(outputs)
    missing = [n for n in wanted if n not in outputs]
    if missing:
        raise BadRequest(f"requested output(s) {missing} not computed from the given inputs; available {sorted(outputs)}")
    svc.finish(model, "oip_infer", timings, time.perf_counter(), t0)
    binary_all = bool((req.parameters or {}).get("binary_data_output"))
    binary_names = {o.name for o in (req.outputs or []) if (o.parameters or {}).get("binary_data", binary_all)}
    if not req.outputs and binary_all:
        binary_names = set(wanted)
    body = {"model_name": model.name, "model_version": "1", "outputs": []}
    if req.id is not None:
        body["id"] = req.id
    classes = {o.name: int((o.parameters or {}).get("classification") or 0) for o in (req.outputs or [])}
    chunks = []
    for name in wanted:
        arr = outputs[name]
        if classes.get(name):
            tensor, data = _classification(arr, classes[name], model.labels, name in binary_names)
            tensor["name"] = name
        else:
            tensor = {"name": name, "datatype": "FP32", "shape": list(arr.shape)}
            data = arr.astype("<f4").tobytes() if name in binary_names else None
            if data is None:
                tensor["data"] = arr.reshape(-1).tolist()
        if data is not None:
            tensor["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        body["outputs"].append(tensor)
    headers = {**timings.headers(), "x-model": model.name}
    if chunks:
        head = json.dumps(body).encode()
        headers["Inference-Header-Content-Length"] = str(len(head))
        return Response(head + b"".join(chunks), media_type="application/octet-stream", headers=headers)
    return JSONResponse(body, headers=headers)


def _vocab(model) -> int:
    return model.vocab_size or 2**31 - 1


def _classification(arr: np.ndarray, k: int, labels: list[str] | None, binary: bool) -> tuple[dict, bytes | None]:
    """Triton's classification extension: top-k ``"<score>:<index>[:<label>]"`` strings (BYTES)."""
    if arr.ndim != 2 or k < 1:
        raise BadRequest("classification needs a 2-D output and a positive class count")
    k = min(k, arr.shape[1])
    rows = []
    for row in arr:
        idx = np.argsort(-row, kind="stable")[:k]
        rows.append([f"{row[i]:f}:{i}" + (f":{labels[i]}" if labels and i < len(labels) else "") for i in idx])
    tensor = {"datatype": "BYTES", "shape": [arr.shape[0], k]}
    flat = [s for r in rows for s in r]
    if not binary:
        tensor["data"] = flat
        return tensor, None
    data = b"".join(len(e).to_bytes(4, "little") + e for e in (s.encode() for s in flat))
    return tensor, data


def _decompress(raw: bytes, encoding: str, limit: int) -> bytes:
    """gzip / deflate request bodies (tritonclient's compression), capped at ``limit`` bytes."""
    import zlib

    from ..errors import PayloadTooLarge, UnsupportedMediaType

    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in ("gzip", "deflate"):
        raise UnsupportedMediaType(f"content-encoding {encoding!r} is not supported (gzip, deflate)")
    d = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        out = d.decompress(raw, limit + 1)
    except zlib.error:
        raise BadRequest(f"request body is not valid {encoding} data") from None
    if len(out) > limit or d.unconsumed_tail:
        raise PayloadTooLarge(f"decompressed request body exceeds the limit of {limit} bytes")
    return out
