"""The Open Inference Protocol v2's codec: request tensors -> checked numpy arrays, result arrays ->
response tensors, for its three wire forms. The doors (server.http.routes.oip, server.grpc_api) only
move bytes: each builds its wire (``HttpWire``, ``GrpcWire``) and hands it to ``server.api.oip.infer``.

- HTTP JSON: tensors as JSON ``data``; the answer a JSON object (``application/json``).
- HTTP binary (Triton's binary tensor extension): a JSON head of ``inference-header-content-length``
  bytes, then each tensor flagged ``binary_data_size`` as its raw little-endian bytes, in order;
  outputs asked for with ``binary_data`` (or all, ``binary_data_output``) come back so
  (``application/octet-stream``).
- gRPC: ``raw_input_contents`` (one per input, in order) or typed ``contents``; every output in
  ``raw_output_contents``, the bytes HTTP binary sends for it.

One function makes every response tensor (``response_tensor``), so gRPC's raw contents and HTTP's
binary chunks are the same bytes, and HTTP's JSON ``data`` are those floats. Each wire's
``encode`` returns the finished bytes (a gRPC answer serialized here, not by gRPC after the
handler), so the encode stage (``postprocess`` in the stage histogram) times all of it.

Tensors: ``pixel_values`` (FP32, NCHW, the model's input range) -> ``logits`` (+ ``pre_logits``)
for classifiers; two-tower ``pixel_values`` -> ``image_embeds``, ``input_ids`` (INT32 or INT64)
-> ``text_embeds``, or ``text`` (BYTES: UTF-8 strings, shape ``[N]`` or ``[N, 1]``, tokenized here as
/v1/embed does) -> ``text_embeds``. With ``--pixel-transfer uint8`` the image input is ``pixels`` (UINT8,
NHWC RGB at the model's size) instead. Every check fails with a 400 naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
from pydantic import ValidationError

from server.api.schemas import OIPInferRequest, validation_error
from server.errors import BadRequest, Unprocessable
from server.pipeline.body import loads

DTYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT32": np.int32, "INT64": np.int64,
          "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64}
OIP_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
BINARY_HEADER = "inference-header-content-length"
# Typed contents per datatype, for gRPC clients that send InferTensorContents instead of raw bytes.
CONTENTS = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT8": "int_contents", "INT16": "int_contents",
            "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
            "UINT32": "uint_contents", "UINT64": "uint64_contents", "BOOL": "bool_contents", "BYTES": "bytes_contents"}

# input name -> (function, accepted datatypes) per model kind; a model takes those of its backend's
# functions' inputs (``pixels``: --pixel-transfer uint8, in place of ``pixel_values``)
_INPUTS = {
    "classifier": {"pixel_values": ("classify", ("FP32",)), "pixels": ("classify", ("UINT8",))},
    "two-tower": {"pixel_values": ("image", ("FP32",)), "pixels": ("image", ("UINT8",)),
                  "input_ids": ("text", ("INT32", "INT64"))},
    "encoder": {"inputs_embeds": ("encoder", ("FP32",))},
}
TEXT = "text"  # a two-tower model with a tokenizer takes strings (BYTES), as Triton users send them

MAX_DIMS = 8
MAX_DIM = 2**31 - 1
PIXEL_RANGE = 1e4  # preprocessed pixels sit in [-1, 1] (vmoe) or a few units with mean/std: far inside this


def accepted_inputs(model) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Input name -> (backend function, accepted datatypes) of ``model``."""
    functions = model.backend.functions
    out = {name: (fn, types) for name, (fn, types) in _INPUTS.get(model.kind, {}).items()
           if fn in functions and any(s.name == name for s in functions[fn].inputs)}
    if "input_ids" in out and model.tokenizer is not None:
        out[TEXT] = ("text", ("BYTES",))
    return out


# ------------------------------------------------------------------ the wires


@dataclass
class Reply:
    """An encoded HTTP answer."""

    body: bytes
    media_type: str
    headers: dict[str, str]  # the body's own (Inference-Header-Content-Length), none of the request's


class HttpWire:
    """OIP over HTTP: a JSON body, or Triton's binary tensor extension (``header_len``: the value of
    the ``inference-header-content-length`` header, None for plain JSON)."""

    endpoint = "oip_infer"  # the images counter's endpoint label

    def __init__(self, raw: bytes, header_len: str | None) -> None:
        self.raw, self.header_len = raw, header_len

    def request(self) -> tuple[OIPInferRequest, bytes]:
        """The checked request and the binary tensor bytes after its JSON head."""
        return parse_body(self.raw, self.header_len)

    def encode(self, model, req: OIPInferRequest, outputs: dict[str, np.ndarray]) -> Reply:
        """The answer: JSON, or a JSON head and the outputs asked for as binary."""
        body = {"model_name": model.name, "model_version": "1", "outputs": []}
        if req.id is not None:
            body["id"] = req.id
        binary, classes, chunks = binary_outputs(req, outputs), classes_asked(req), []
        for name, arr in outputs.items():
            tensor, data = response_tensor(name, arr, classes.get(name, 0), model.labels, name in binary)
            if data is not None:
                tensor["parameters"] = {"binary_data_size": len(data)}
                chunks.append(data)
            body["outputs"].append(tensor)
        head = _json(body)
        if not chunks:
            return Reply(head, "application/json", {})
        chunks.insert(0, head)
        return Reply(b"".join(chunks), "application/octet-stream", {"Inference-Header-Content-Length": str(len(head))})


class GrpcWire:
    """OIP over gRPC: a parsed ``ModelInferRequest``; the answer a serialized ``ModelInferResponse``
    (``response_type``: its message class, from server.grpc_api's descriptor pool)."""

    endpoint = "grpc_infer"  # the images counter's endpoint label

    def __init__(self, message, response_type: type) -> None:
        self.message, self.response_type = message, response_type

    def request(self) -> tuple[OIPInferRequest, bytes]:
        """The message as HTTP's checked request and binary tail: raw_input_contents become binary
        tensor data (each input's ``binary_data_size`` its raw bytes), typed contents become ``data``."""
        message = self.message
        raw = list(message.raw_input_contents)
        if raw and len(raw) != len(message.inputs):
            raise BadRequest(f"raw_input_contents has {len(raw)} entries for {len(message.inputs)} inputs; give one "
                             "per input, in order, or none", param="raw_input_contents")
        inputs = []
        for i, t in enumerate(message.inputs):
            params = _parameters(t.parameters)
            entry = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "parameters": params}
            if raw:
                params["binary_data_size"] = len(raw[i])
                dtype = DTYPES.get(t.datatype)
                if dtype is not None and all(0 <= d for d in t.shape):
                    want = math.prod(t.shape) * np.dtype(dtype).itemsize
                    if want != len(raw[i]):
                        raise BadRequest(f"input {t.name!r}: raw_input_contents[{i}] holds {len(raw[i])} bytes; shape "
                                         f"{list(t.shape)} of {t.datatype} is {want}", param=f"inputs.{i}")
            elif t.HasField("contents"):
                field = CONTENTS.get(t.datatype)
                entry["data"] = list(getattr(t.contents, field)) if field else []
            inputs.append(entry)
        payload = {"inputs": inputs, "parameters": _parameters(message.parameters),
                   "outputs": [{"name": o.name, "parameters": _parameters(o.parameters)}
                               for o in message.outputs] or None}
        if message.id:
            payload["id"] = message.id
        return request_from(payload), b"".join(raw)

    def encode(self, model, req: OIPInferRequest, outputs: dict[str, np.ndarray]) -> bytes:
        """The serialized answer: every output in raw_output_contents."""
        response = self.response_type(model_name=model.name, model_version="1", id=req.id or "")
        classes = classes_asked(req)
        for name, arr in outputs.items():
            if name in classes:
                tensor, data = response_tensor(name, arr, classes[name], model.labels, True)
                response.outputs.add(name=name, datatype=tensor["datatype"], shape=tensor["shape"])
            else:  # response_tensor's FP32 bytes, without the tensor dict gRPC has no use for
                response.outputs.add(name=name, datatype="FP32", shape=arr.shape)
                data = raw_bytes(arr)
            response.raw_output_contents.append(data)
        return response.SerializeToString()


def _parameters(params) -> dict:
    """A protobuf map of InferParameter as plain values."""
    out = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = getattr(p, which) if which else None
    return out


# One encoder for every answer; ASCII with escapes (json's fast path), compact, NaN refused.
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def _json(body: dict) -> bytes:
    """``body`` as compact JSON bytes (ASCII: a non-ASCII label comes escaped, the same string)."""
    return _ENCODER.encode(body).encode("ascii")


# ------------------------------------------------------------------ request tensors -> arrays


def parse_body(raw: bytes, header_len: str | None) -> tuple[OIPInferRequest, bytes]:
    """An HTTP body as the checked request and the binary tensor bytes after its JSON head
    (``header_len``: the ``inference-header-content-length`` value; None: all of it is JSON)."""
    if header_len is not None:
        text = header_len.strip()
        if not text.isdigit() or len(text) > 18:
            raise BadRequest(f"invalid {BINARY_HEADER} header {header_len[:40]!r}: expected a byte count")
        n = int(text)
        if not 0 < n <= len(raw):
            raise BadRequest(f"{BINARY_HEADER} {n} does not fit a body of {len(raw)} bytes")
        head, binary = raw[:n], raw[n:]
    else:
        head, binary = raw, b""
    payload = loads(head)
    if not isinstance(payload, dict):
        raise Unprocessable("request body must be a JSON object")
    return request_from(payload), binary


def request_from(payload: dict) -> OIPInferRequest:
    """An inference request checked field by field (HTTP's JSON, gRPC's message): 400 naming the field."""
    try:
        req = OIPInferRequest.model_validate(payload)
    except ValidationError as e:
        err = validation_error(e)
        raise BadRequest(err.message, param=err.param) from None  # OIP: a malformed request is 400
    _check_parameters(req)
    return req


def flag(params: dict | None, key: str, where: str, default: bool = False) -> bool:
    """The boolean parameter ``key`` of ``where`` (``default`` when absent); 400 if not a bool."""
    value = (params or {}).get(key, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{where}.parameters.{key} must be true or false, got {type(value).__name__}",
                         param=f"{where}.parameters.{key}")
    return value


def _count(params: dict | None, key: str, where: str, lo: int, hi: int) -> int | None:
    """The integer parameter ``key`` of ``where`` in [lo, hi], None when absent; 400 otherwise."""
    value = (params or {}).get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadRequest(f"{where}.parameters.{key} must be an integer in [{lo}, {hi}], got {str(value)[:40]!r}",
                         param=f"{where}.parameters.{key}")
    return value


def _check_parameters(req: OIPInferRequest) -> None:
    """Every parameter we read, type-checked up front: 400 naming the field, never a 500."""
    flag(req.parameters, "binary_data_output", "request")
    for i, t in enumerate(req.inputs):
        where = f"inputs[{i}]"
        if len(t.shape) > MAX_DIMS or any(not 0 <= d <= MAX_DIM for d in t.shape):
            raise BadRequest(f"{where} ({t.name!r}): shape {t.shape[:MAX_DIMS + 1]} must have at most {MAX_DIMS} "
                             f"dimensions, each in [0, {MAX_DIM}]", param=f"{where}.shape")
        _count(t.parameters, "binary_data_size", where, 0, 2**62)
    for i, o in enumerate(req.outputs or []):
        where = f"outputs[{i}]"
        flag(o.parameters, "binary_data", where)
        _count(o.parameters, "classification", where, 0, 1_000_000)


def _array(t, binary: bytes, offset: int, limit: int) -> tuple[np.ndarray, int]:
    """Input ``t`` as an array of its datatype, from its binary bytes at ``offset`` or its JSON
    ``data``, at most ``limit`` bytes; the offset after it."""
    dtype = DTYPES.get(t.datatype)
    if dtype is None:
        raise BadRequest(f"input {t.name!r}: datatype {t.datatype} is not supported", param=t.name)
    count = math.prod(t.shape)  # Python integers: no overflow, whatever the shape
    nbytes = count * np.dtype(dtype).itemsize
    if nbytes > limit:
        raise BadRequest(f"input {t.name!r}: shape {t.shape} declares {nbytes} bytes of {t.datatype}; a request body "
                         f"holds at most {limit} (max_body_bytes)", param=t.name)
    size = (t.parameters or {}).get("binary_data_size")
    if size is not None:
        if size != nbytes or offset + size > len(binary):
            raise BadRequest(f"input {t.name!r}: binary_data_size {size} does not match shape {t.shape} "
                             f"({nbytes} bytes) and the {len(binary) - offset} binary bytes left", param=t.name)
        arr = np.frombuffer(binary, dtype=dtype, count=count, offset=offset).reshape(t.shape)
        return arr, offset + size
    if t.data is None:
        raise BadRequest(f"input {t.name!r} has no data", param=t.name)
    try:
        arr = np.asarray(t.data)
        if np.dtype(dtype).kind in "iu" and arr.size:  # integers stay integers: no 1.5 -> 1, no 300 -> 44
            info = np.iinfo(dtype)
            if arr.dtype.kind not in "iu" or arr.min() < info.min or arr.max() > info.max:
                raise ValueError
        arr = arr.astype(dtype)
    except (ValueError, TypeError, OverflowError):
        raise BadRequest(f"input {t.name!r}: data is not a {t.datatype} array", param=t.name) from None
    if arr.size != count:
        raise BadRequest(f"input {t.name!r}: {arr.size} values for shape {t.shape}", param=t.name)
    return arr.reshape(t.shape), offset


def _strings(t, where: str, binary: bytes, offset: int, settings) -> tuple[list[str], int]:
    """A BYTES input as texts: JSON strings, or Triton's binary form (a 4-byte little-endian length before
    each element); each must be Unicode (UTF-8) within ``max_text_chars``: 400 naming the element otherwise."""
    if len(t.shape) not in (1, 2) or (len(t.shape) == 2 and t.shape[1] != 1) or t.shape[0] == 0:
        raise BadRequest(f"input {t.name!r} has shape {list(t.shape)}; expected [N] or [N, 1]", param=t.name)
    count = t.shape[0]
    if count > settings.max_texts_per_request:
        raise Unprocessable(f"{count} texts in one request; the limit is {settings.max_texts_per_request}", param=t.name)
    size = (t.parameters or {}).get("binary_data_size")
    if size is not None:
        if offset + size > len(binary):
            raise BadRequest(f"input {t.name!r}: binary_data_size {size} exceeds the {len(binary) - offset} binary "
                             "bytes left", param=t.name)
        items, at, end = [], offset, offset + size
        for j in range(count):
            n = int.from_bytes(binary[at:at + 4], "little") if at + 4 <= end else -1
            if n < 0 or at + 4 + n > end:
                raise BadRequest(f"{where}.data.{j}: the element overruns binary_data_size {size}", param=f"{where}.data.{j}")
            items.append(binary[at + 4:at + 4 + n])
            at += 4 + n
        if at != end:
            raise BadRequest(f"input {t.name!r}: {end - at} bytes after {count} elements in binary_data_size {size}",
                             param=t.name)
        offset = end
    elif t.data is None:
        raise BadRequest(f"input {t.name!r} has no data", param=t.name)
    else:
        items = t.data
        if len(items) == count and all(isinstance(x, list) and len(x) == 1 for x in items):
            items = [x[0] for x in items]  # [[s], ...] for shape [N, 1]
        if len(items) != count:
            raise BadRequest(f"input {t.name!r}: {len(items)} values for shape {t.shape}", param=t.name)
    texts = []
    for j, x in enumerate(items):
        param = f"{where}.data.{j}"
        try:
            text = x.decode("utf-8") if isinstance(x, bytes) else x.encode("utf-8").decode() if isinstance(x, str) else None
        except UnicodeError:
            raise BadRequest(f"{param}: text is not Unicode (UTF-8)", param=param) from None
        if text is None:
            raise BadRequest(f"{param}: a BYTES element must be a string, got {type(x).__name__}", param=param)
        if len(text) > settings.max_text_chars:
            raise Unprocessable(f"{param}: text of {len(text)} characters; the limit is {settings.max_text_chars}",
                                param=param)
        texts.append(text)
    return texts, offset


def arrays(model, req: OIPInferRequest, binary: bytes, settings) -> list[tuple[str, str, np.ndarray]]:
    """Every input checked and converted (off the event loop): (function, name, array)."""
    accepted = accepted_inputs(model)
    if not req.inputs:
        raise Unprocessable("no inputs given", param="inputs")
    out, offset, seen = [], 0, set()
    for i, t in enumerate(req.inputs):
        if t.name not in accepted or t.name in seen:
            raise BadRequest(f"unexpected input {t.name!r}; model {model.name!r} takes {sorted(accepted)}", param=t.name)
        seen.add(t.name)
        fn, types = accepted[t.name]
        if t.datatype not in types:
            raise BadRequest(f"input {t.name!r} must be {' or '.join(types)}, got {t.datatype}", param=t.name)
        if t.name == TEXT:
            texts, offset = _strings(t, f"inputs.{i}", binary, offset, settings)
            out.append((fn, "input_ids", model.tokenizer(texts)))
            continue
        spec = next(s for s in model.backend.functions[fn].inputs if s.name == t.name)
        if len(t.shape) != 1 + len(spec.shape) or tuple(t.shape[1:]) != spec.shape or t.shape[0] == 0:
            raise BadRequest(f"input {t.name!r} has shape {list(t.shape)}; expected [N, {', '.join(map(str, spec.shape))}]",
                             param=t.name)
        limit = settings.max_texts_per_request if fn == "text" else settings.max_images_per_request
        if t.shape[0] > limit:
            raise Unprocessable(f"{t.shape[0]} rows of {t.name} in one request; the limit is {limit}", param=t.name)
        arr, offset = _array(t, binary, offset, settings.max_body_bytes)
        if fn == "text":
            if ((arr < 0) | (arr >= _vocab(model))).any():
                raise BadRequest(f"input_ids must be in [0, {_vocab(model)})", param=t.name)
        elif arr.dtype.kind == "f" and (not np.isfinite(arr).all() or np.abs(arr).max() > PIXEL_RANGE):
            raise BadRequest(f"input {t.name!r} must hold finite values in [-{PIXEL_RANGE:g}, {PIXEL_RANGE:g}] "
                             "(preprocessed pixels)", param=t.name)
        out.append((fn, t.name, np.ascontiguousarray(arr, dtype=spec.dtype)))
    return out


def _vocab(model) -> int:
    """The text tower's vocabulary size, or no bound below int32's when the model has none."""
    return model.vocab_size or 2**31 - 1


# ------------------------------------------------------------------ result arrays -> response tensors


def binary_outputs(req: OIPInferRequest, outputs: dict[str, np.ndarray]) -> set[str]:
    """The outputs HTTP sends as binary: each asked for with ``binary_data`` (its default the request's
    ``binary_data_output``), or every one when none is named and ``binary_data_output`` is set."""
    every = flag(req.parameters, "binary_data_output", "request")
    if not req.outputs:
        return set(outputs) if every else set()
    return {o.name for o in req.outputs if flag(o.parameters, "binary_data", "outputs", every)}


def classes_asked(req: OIPInferRequest) -> dict[str, int]:
    """Output name -> the top-k count asked for with ``classification`` (outputs asked so only)."""
    if not req.outputs:
        return {}
    asked = {o.name: _count(o.parameters, "classification", "outputs", 0, 1_000_000) for o in req.outputs}
    return {name: k for name, k in asked.items() if k}


def response_tensor(name: str, arr: np.ndarray, classes: int, labels: list[str] | None,
                    binary: bool) -> tuple[dict, bytes | None]:
    """One output as (tensor: name, datatype, shape and, unless ``binary``, JSON ``data``; its raw
    bytes when ``binary``, else None): the FP32 array, or with ``classes`` > 0 Triton's top-k
    strings (BYTES). Every wire's answer is made here, so gRPC's raw contents are HTTP binary's
    chunks and HTTP JSON's ``data`` are the same floats."""
    if classes:
        tensor, data = classification(arr, classes, labels, binary)
        return {"name": name, **tensor}, data
    tensor = {"name": name, "datatype": "FP32", "shape": list(arr.shape)}
    if binary:
        return tensor, raw_bytes(arr)
    tensor["data"] = arr.astype("<f4", copy=False).reshape(-1).tolist()
    return tensor, None


def raw_bytes(arr: np.ndarray) -> bytes:
    """An FP32 output's bytes on every binary wire: little-endian, C order whatever the layout."""
    return arr.astype("<f4", copy=False).tobytes()


def classification(arr: np.ndarray, k: int, labels: list[str] | None, binary: bool) -> tuple[dict, bytes | None]:
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
