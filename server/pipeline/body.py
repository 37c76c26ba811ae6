"""Request bodies -> Python objects, bounded, meant to run off the event loop (``asyncio.to_thread``).

Every function takes bytes already capped at ``max_body_bytes`` by the observe middleware and
bounds what it makes of them: inflation counted against the same limit while inflating, JSON
nesting and big numbers refused with 400 (never a RecursionError), multipart parts counted and
kept in memory (no spooling to disk: the body's bytes are already reserved at the door, so the
parts are bounded by the same budget).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

from python_multipart.multipart import MultipartParser, parse_options_header

from server.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

MAX_PARTS = 1024
MAX_PART_HEADER_BYTES = 4096


def inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    """gzip / deflate bodies (tritonclient's compression), inflated to at most ``limit`` bytes.

    The inflated size is counted while inflating (``max_length``): a gzip bomb stops at the limit
    with 413, whatever its ratio.
    """
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
        raise PayloadTooLarge(f"decompressed request body exceeds the limit of {limit} bytes (max_body_bytes)")
    if not d.eof:
        raise BadRequest(f"request body is truncated {encoding} data")
    return out


class DuplicateKey(Exception):
    """A JSON object names a key twice (RFC 8259 leaves the meaning open: refused, not last-wins)."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def loads(raw: bytes) -> object:
    """JSON -> Python; 400 for invalid JSON, a key twice in one object, absurd nesting or giant numbers.

    Nesting is bounded by the C decoder's recursion guard (Python's recursion limit, ~1000
    levels: a RecursionError here, turned into 400); the shapes of what parses are then checked
    by the request schemas. Integers are bounded by Python's 4300-digit conversion limit.
    """
    try:
        return json.loads(raw, object_pairs_hook=_unique_keys)
    except DuplicateKey as e:
        raise BadRequest(f"request body has a JSON object with the key {e.args[0]!r} twice", param=e.args[0][:100]) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    except RecursionError:
        raise BadRequest("request body nests JSON too deeply") from None
    except ValueError as e:  # an integer of thousands of digits
        raise BadRequest(f"request body is not acceptable JSON: {str(e)[:80]}") from None


@dataclass
class Part:
    name: str
    filename: str | None
    content_type: str
    data: bytes


def multipart(body: bytes, content_type: str, max_parts: int = MAX_PARTS) -> list[Part]:
    """multipart/form-data -> parts, in memory, at most ``max_parts`` (400 beyond, and when malformed)."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadRequest("multipart/form-data without a boundary")
    parts: list[Part] = []
    state: dict = {"field": b"", "value": b"", "headers": {}, "chunks": []}

    def on_part_begin() -> None:
        if len(parts) >= max_parts:
            raise BadRequest(f"more than {max_parts} multipart parts")
        state["headers"], state["chunks"] = {}, []

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["value"] += data[start:end]
        if len(state["value"]) > MAX_PART_HEADER_BYTES:
            raise BadRequest("a multipart part header is too long")

    def on_header_end() -> None:
        state["headers"][state["field"].lower()] = state["value"]
        state["field"], state["value"] = b"", b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        state["chunks"].append(data[start:end])

    def on_part_end() -> None:
        disposition, options = parse_options_header(state["headers"].get(b"content-disposition", b""))
        if disposition != b"form-data" or b"name" not in options:
            raise BadRequest("a multipart part has no Content-Disposition: form-data; name=...")
        filename = options.get(b"filename")
        ctype = state["headers"].get(b"content-type", b"").decode("latin-1")
        parts.append(Part(options[b"name"].decode("utf-8", "replace"),
                          filename.decode("utf-8", "replace") if filename is not None else None,
                          ctype, b"".join(state["chunks"])))

    parser = MultipartParser(boundary, {
        "on_part_begin": on_part_begin, "on_header_field": on_header_field, "on_header_value": on_header_value,
        "on_header_end": on_header_end, "on_part_data": on_part_data, "on_part_end": on_part_end,
    }, max_header_count=16, max_header_size=MAX_PART_HEADER_BYTES)
    try:
        parser.write(body)
        parser.finalize()
    except BadRequest:
        raise
    except Exception as e:  # noqa: BLE001 - python-multipart's MultipartParseError and friends
        raise BadRequest(f"malformed multipart body: {str(e)[:200]}") from None
    return parts


def text_field(part: Part) -> str:
    try:
        return part.data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest(f"form field {part.name!r} is not UTF-8 text", param=part.name) from None
