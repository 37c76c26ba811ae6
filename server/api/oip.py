"""The Open Inference Protocol v2, whatever the wire: which tensors a model takes and gives, and
one inference from a wire's request to its encoded answer. The wire's own forms (HTTP JSON, HTTP
binary, gRPC) are the codec's (server.api.oip_codec); HTTP (server.http.routes.oip) and gRPC
(server.grpc_api) only build a wire from the bytes they were given and send the bytes ``infer``
returns.

Each row goes through the batcher on its own, so OIP requests get the same batching and
determinism as the /v1 endpoints, and an answer is the same numbers over every wire.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from server.api.oip_codec import OIP_NAMES, TEXT, accepted_inputs, arrays
from server.api.service import Timings, not_served
from server.errors import BadRequest, NotFound, Unavailable

EXTENSIONS = ["binary_tensor_data", "classification", "model_repository"]  # what /v2 and ServerMetadata list


def served_model(models: dict, name: str, version: str | None = None, control=None):
    """The model served as ``name`` (version '1' or none); NotFound naming what is served otherwise."""
    model = models.get(name)
    if model is None:
        raise not_served(name, models, control)
    if version not in (None, "", "1"):
        raise NotFound(f"model {name!r} has no version {version[:40]!r}; it has version '1'")
    return model


def ready_model(models: dict, name: str, version: str | None = None, control=None):
    """As ``served_model``, and ready to infer: Unavailable (retry shortly) while it warms up."""
    model = served_model(models, name, version, control)
    if not model.ready:
        raise Unavailable(f"model {model.name!r} is not ready", retry_after_s=2)
    return model


def tensors_of(model) -> tuple[list[dict], list[dict]]:
    """The model's input and output tensors as model metadata lists them."""
    ins, outs = [], []
    for fn, spec in model.backend.functions.items():
        for s in spec.inputs:
            ins.append({"name": s.name, "datatype": OIP_NAMES[np.dtype(s.dtype)], "shape": [-1, *s.shape]})
        if fn == "text" and TEXT in accepted_inputs(model):
            ins.append({"name": TEXT, "datatype": "BYTES", "shape": [-1]})
        for o in spec.outputs:
            outs.append({"name": o, "datatype": "FP32", "shape": [-1, -1]})
    return ins, outs


async def infer(svc, model, wire, receive=None, started: float | None = None):
    """One inference over ``wire`` (server.api.oip_codec's ``HttpWire`` or ``GrpcWire``): its
    request decoded and checked off the event loop, the rows run, the outputs encoded; the
    encoded answer and the request's timings. Encoding is the ``postprocess`` stage, so the stage
    histogram and the ``x-postprocess-time`` header include it. ``started``: when the door began
    the request (its total time counts from there); now if not given."""
    started = time.perf_counter() if started is None else started
    settings = svc.settings

    def decode():
        req, binary = wire.request()
        return req, arrays(model, req, binary, settings)

    req, tensors = await asyncio.to_thread(decode)
    timings = Timings()
    outputs = await _compute(svc, model, req, tensors, timings, receive)
    t_post = time.perf_counter()
    answer = wire.encode(model, req, outputs)
    svc.finish(model, wire.endpoint, timings, t_post, started)
    return answer, timings


async def _compute(svc, model, req, tensors: list[tuple[str, str, np.ndarray]], timings: Timings,
                   receive=None) -> dict[str, np.ndarray]:
    """Run checked inputs through the model's queues (every row on its own, as /v1 does): the
    wanted outputs, in the order asked for (else every computed one)."""
    outputs: dict[str, np.ndarray] = {}
    for fn, name, arr in tensors:
        results = await svc.run(model, fn, [{name: r} for r in arr], timings, receive, param=name)
        for out_name in model.backend.functions[fn].outputs:
            outputs[out_name] = np.stack([r.outputs[out_name] for r in results]).astype(np.float32)
    wanted = [o.name for o in req.outputs] if req.outputs else list(outputs)
    missing = [n for n in wanted if n not in outputs]
    if missing:
        raise BadRequest(f"requested output(s) {missing} not computed from the given inputs; available {sorted(outputs)}")
    return {n: outputs[n] for n in wanted}
