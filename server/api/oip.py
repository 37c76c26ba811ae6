"""The Open Inference Protocol v2's request model, independent of the transport: which tensors a
model takes and gives, every input checked and converted (400 naming the field), the rows run
through the model's queues, Triton's classification extension. HTTP (server.http.routes.oip) and
gRPC (server.grpc_api) speak it over their own wire formats.

Tensors: ``pixel_values`` (FP32, NCHW, the model's input range) -> ``logits`` (+ ``pre_logits``)
for classifiers; two-tower ``pixel_values`` -> ``image_embeds``, ``input_ids`` (INT32 or INT64)
-> ``text_embeds``, or ``text`` (BYTES: UTF-8 strings, shape ``[N]`` or ``[N, 1]``, tokenized here as
/v1/embed does) -> ``text_embeds``. With ``--pixel-transfer uint8`` the image input is ``pixels`` (UINT8, NHWC RGB
at the model's size) instead. Each row goes through the batcher on its own, so OIP requests get the same
batching and determinism as the /v1 endpoints.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import ValidationError

from server.api.schemas import OIPInferRequest, validation_error
from server.api.service import Timings, not_served
from server.errors import BadRequest, NotFound, Unprocessable
from server.pipeline.body import loads

EXTENSIONS = ["binary_tensor_data", "classification", "model_repository"]  # what /v2 and ServerMetadata list
DTYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT32": np.int32, "INT64": np.int64,
          "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64}
OIP_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
BINARY_HEADER = "inference-header-content-length"

# input name -> (function, accepted datatypes) per model kind; a model takes those of its backend's
# functions' inputs (``pixels``: --pixel-transfer uint8, in place of ``pixel_values``)
_INPUTS = {
    "classifier": {"pixel_values": ("classify", ("FP32",)), "pixels": ("classify", ("UINT8",))},
    "two-tower": {"pixel_values": ("image", ("FP32",)), "pixels": ("image", ("UINT8",)),
                  "input_ids": ("text", ("INT32", "INT64"))},
    "encoder": {"inputs_embeds": ("encoder", ("FP32",))},
}


TEXT = "text"  # a two-tower model with a tokenizer takes strings (BYTES), as Triton users send them


def accepted_inputs(model) -> dict[str, tuple[str, tuple[str, ...]]]:
    functions = model.backend.functions
    out = {name: (fn, types) for name, (fn, types) in _INPUTS.get(model.kind, {}).items()
           if fn in functions and any(s.name == name for s in functions[fn].inputs)}
    if "input_ids" in out and model.tokenizer is not None:
        out[TEXT] = ("text", ("BYTES",))
    return out


def served_model(models: dict, name: str, version: str | None = None, control=None):
    model = models.get(name)
    if model is None:
        raise not_served(name, models, control)
    if version not in (None, "", "1"):
        raise NotFound(f"model {name!r} has no version {version[:40]!r}; it has version '1'")
    return model


def tensors_of(model) -> tuple[list[dict], list[dict]]:
    ins, outs = [], []
    for fn, spec in model.backend.functions.items():
        for s in spec.inputs:
            ins.append({"name": s.name, "datatype": OIP_NAMES[np.dtype(s.dtype)], "shape": [-1, *s.shape]})
        if fn == "text" and TEXT in accepted_inputs(model):
            ins.append({"name": TEXT, "datatype": "BYTES", "shape": [-1]})
        for o in spec.outputs:
            outs.append({"name": o, "datatype": "FP32", "shape": [-1, -1]})
    return ins, outs


MAX_DIMS = 8
MAX_DIM = 2**31 - 1
PIXEL_RANGE = 1e4  # preprocessed pixels sit in [-1, 1] (vmoe) or a few units with mean/std: far inside this


def parse_body(raw: bytes, header_len: str | None) -> tuple[OIPInferRequest, bytes]:
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
    value = (params or {}).get(key, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{where}.parameters.{key} must be true or false, got {type(value).__name__}",
                         param=f"{where}.parameters.{key}")
    return value


def _count(params: dict | None, key: str, where: str, lo: int, hi: int) -> int | None:
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


def tensors_in(model, req: OIPInferRequest, binary: bytes, settings) -> list[tuple[str, str, np.ndarray]]:
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


async def compute(svc, model, req: OIPInferRequest, tensors: list[tuple[str, str, np.ndarray]], timings: Timings,
                  receive=None) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Run checked inputs through the model's queues (every row on its own, as /v1 does): the wanted
    outputs, in the order asked for (else every computed one), and the top-k count of each output
    asked for as a classification (0: the tensor itself). Shared by HTTP and gRPC."""
    outputs: dict[str, np.ndarray] = {}
    for fn, name, arr in tensors:
        results = await svc.run(model, fn, [{name: r} for r in arr], timings, receive, param=name)
        for out_name in model.backend.functions[fn].outputs:
            outputs[out_name] = np.stack([r.outputs[out_name] for r in results]).astype(np.float32)
    wanted = [o.name for o in req.outputs] if req.outputs else list(outputs)
    missing = [n for n in wanted if n not in outputs]
    if missing:
        raise BadRequest(f"requested output(s) {missing} not computed from the given inputs; available {sorted(outputs)}")
    classes = {o.name: _count(o.parameters, "classification", "outputs", 0, 1_000_000) or 0 for o in (req.outputs or [])}
    return {n: outputs[n] for n in wanted}, classes


def _vocab(model) -> int:
    return model.vocab_size or 2**31 - 1


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
