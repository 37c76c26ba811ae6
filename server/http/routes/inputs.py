"""Request parsing shared by the /v1 routes: JSON, multipart (files + form fields) or raw bytes.

The three forms carry the same fields; in multipart and raw bodies the non-image fields come as
form fields or query parameters (lists as repeated fields, or one JSON array string).
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from server.errors import BadRequest, ClientDisconnected, Unprocessable, UnsupportedMediaType
from server.pipeline.body import MAX_PARTS, inflate, loads, multipart, text_field
from server.api.schemas import validation_error
from server.api.service import decode_b64

M = TypeVar("M", bound=BaseModel)
LIST_FIELDS = ("labels", "templates", "texts")


def _coerce(fields: dict[str, list[str]], model: type[BaseModel]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    known = model.model_fields
    for key, values in fields.items():
        if key not in known:
            raise Unprocessable(f"unknown field {key!r}", param=key)
        if key in LIST_FIELDS:
            if len(values) == 1 and values[0].lstrip().startswith("["):
                try:
                    out[key] = loads(values[0].encode())
                except BadRequest:
                    raise BadRequest(f"{key}: invalid JSON array", param=key) from None
            else:
                out[key] = values
        elif len(values) > 1:
            raise Unprocessable(f"field {key!r} given {len(values)} times; it takes one value", param=key)
        else:
            out[key] = values[0]
    return out


def query_fields(raw: bytes) -> dict[str, list[str]]:
    """The query string's fields, each value a list. A value whose percent-escapes are not UTF-8
    is refused naming its field (Starlette's own parse would put U+FFFD in its place)."""
    fields: dict[str, list[str]] = {}
    for pair in raw.decode("latin-1").split("&"):
        try:
            for k, v in parse_qsl(pair, keep_blank_values=True, errors="strict"):
                fields.setdefault(k, []).append(v)
        except UnicodeDecodeError:
            name = parse_qsl(pair.split("=", 1)[0] + "=", keep_blank_values=True)[:1]
            key = name[0][0] if name else "?"
            raise BadRequest(f"query parameter {key!r} is not UTF-8 text", param=key) from None
    return fields


async def read_body(request: Request) -> bytes:
    """The whole body (capped by the observe middleware), inflated off the event loop when encoded."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientDisconnected("the client disconnected while sending its body") from None
    encoding = request.headers.get("content-encoding", "")
    if encoding.strip().lower() in ("", "identity"):
        return raw
    return await asyncio.to_thread(inflate, raw, encoding, request.app.state.settings.max_body_bytes)


async def parse(request: Request, model: type[M], image_field: str = "images", images_required: bool = True) -> tuple[M, list[bytes]]:
    """The validated request fields and the raw image bytes, whatever the body form.

    JSON decoding, validation, base64 and multipart parsing run in a worker thread: a 16 MiB
    body never stalls the event loop (health checks, other requests, disconnect detection).
    """
    ctype_header = request.headers.get("content-type", "")
    ctype = ctype_header.split(";")[0].strip().lower()
    query = query_fields(request.scope.get("query_string", b""))
    max_images = request.app.state.settings.max_images_per_request
    if ctype not in ("application/json", "", "multipart/form-data", "application/octet-stream") \
            and not ctype.startswith("image/"):
        raise UnsupportedMediaType(
            f"content type {ctype!r} is not accepted: use application/json, multipart/form-data or image/*"
        )
    body = await read_body(request)
    if not body:
        raise BadRequest("empty request body: send JSON, multipart/form-data or image bytes")
    if ctype in ("application/json", ""):
        return await asyncio.to_thread(_from_json, body, query, model, image_field, max_images)
    if ctype == "multipart/form-data":
        return await asyncio.to_thread(_from_multipart, body, ctype_header, query, model, image_field,
                                       images_required, max_images)
    return _validate_fields(model, query, [body], image_field, images_required), [body]


def _from_json(body: bytes, query: dict[str, list[str]], model: type[M], image_field: str,
               max_images: int) -> tuple[M, list[bytes]]:
    payload = loads(body)
    if not isinstance(payload, dict):
        raise Unprocessable("request body must be a JSON object")
    if query:
        both = sorted(set(query) & set(payload))
        if both:
            raise Unprocessable(f"field(s) {both} given both as query parameters and in the JSON body; give each once",
                                param=both[0])
        payload = {**_coerce(query, model), **payload}
    images = payload.get(image_field)
    if isinstance(images, list) and len(images) > max_images:  # before validating or decoding any of them
        raise Unprocessable(f"{len(images)} images in one request; the limit is {max_images}", param=image_field)
    try:
        req = model.model_validate(payload)
    except ValidationError as e:
        raise validation_error(e) from None
    images = getattr(req, image_field, None) or []
    return req, [decode_b64(s, f"{image_field}[{i}]") for i, s in enumerate(images)]


def _from_multipart(body: bytes, content_type: str, query: dict[str, list[str]], model: type[M], image_field: str,
                    images_required: bool, max_images: int) -> tuple[M, list[bytes]]:
    blobs: list[bytes] = []
    fields = dict(query)
    for part in multipart(body, content_type, MAX_PARTS):
        if part.filename is not None:
            blobs.append(part.data)
            if len(blobs) > max_images:
                raise Unprocessable(f"more than {max_images} images in one request; the limit is {max_images}",
                                    param=image_field)
        else:
            fields.setdefault(part.name, []).append(text_field(part))
    return _validate_fields(model, fields, blobs, image_field, images_required), blobs


def _validate_fields(model: type[M], fields: dict[str, list[str]], blobs: list[bytes], image_field: str, required: bool) -> M:
    data = _coerce(fields, model)
    if blobs or required:
        data[image_field] = ["-"] * max(1, len(blobs))  # placeholders: the files are the images
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def body_doc(schema: str, *, images: bool = True) -> dict:
    """OpenAPI requestBody for an endpoint that takes JSON, multipart or raw image bytes."""
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}
    if images:
        content["multipart/form-data"] = {"schema": {"type": "object", "properties": {
            "images": {"type": "array", "items": {"type": "string", "format": "binary"}}}}}
        content["image/*"] = {"schema": {"type": "string", "format": "binary"}}
    return {"requestBody": {"required": True, "content": content}}
