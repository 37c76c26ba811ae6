"""Request parsing shared by the /v1 routes: JSON, multipart (files + form fields) or raw bytes.

The three forms carry the same fields; in multipart and raw bodies the non-image fields come as
form fields or query parameters (lists as repeated fields, or one JSON array string).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile

from ..errors import BadRequest, Unprocessable, UnsupportedMediaType
from ..service import decode_b64

M = TypeVar("M", bound=BaseModel)
LIST_FIELDS = ("labels", "templates", "texts")
MAX_PARTS = 1024


def validation_error(e: ValidationError) -> Unprocessable:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return Unprocessable(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")), param=loc or None)


def _coerce(fields: dict[str, list[str]], model: type[BaseModel]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    known = model.model_fields
    for key, values in fields.items():
        if key not in known:
            raise Unprocessable(f"unknown field {key!r}", param=key)
        if key in LIST_FIELDS:
            if len(values) == 1 and values[0].lstrip().startswith("["):
                try:
                    out[key] = json.loads(values[0])
                except json.JSONDecodeError:
                    raise BadRequest(f"{key}: invalid JSON array", param=key) from None
            else:
                out[key] = values
        else:
            out[key] = values[-1]
    return out


async def parse(request: Request, model: type[M], image_field: str = "images", images_required: bool = True) -> tuple[M, list[bytes]]:
    """The validated request fields and the raw image bytes, whatever the body form."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    query: dict[str, list[str]] = {}
    for k, v in request.query_params.multi_items():
        query.setdefault(k, []).append(v)
    if ctype in ("application/json", ""):
        if (await request.body()) == b"":
            raise BadRequest("empty request body: send JSON, multipart/form-data or image bytes")
        try:
            payload = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("request body is not valid JSON") from None
        if not isinstance(payload, dict):
            raise Unprocessable("request body must be a JSON object")
        payload = {**_coerce(query, model), **payload} if query else payload
        try:
            req = model.model_validate(payload)
        except ValidationError as e:
            raise validation_error(e) from None
        images = getattr(req, image_field, None) or []
        return req, [decode_b64(s, f"{image_field}[{i}]") for i, s in enumerate(images)]
    if ctype == "multipart/form-data":
        try:
            form = await request.form(max_files=MAX_PARTS, max_fields=MAX_PARTS)
        except Exception as e:  # malformed multipart, too many parts
            raise BadRequest(f"malformed multipart body: {str(e)[:200]}") from None
        blobs: list[bytes] = []
        fields = dict(query)
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                blobs.append(await value.read())
            else:
                fields.setdefault(key, []).append(value)
        await form.close()
        return _validate_fields(model, fields, blobs, image_field, images_required), blobs
    if ctype.startswith("image/") or ctype == "application/octet-stream":
        body = await request.body()
        if not body:
            raise BadRequest("empty request body")
        return _validate_fields(model, query, [body], image_field, images_required), [body]
    raise UnsupportedMediaType(
        f"content type {ctype!r} is not accepted: use application/json, multipart/form-data or image/*"
    )


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
