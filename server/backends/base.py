"""The backend interface: what a model can compute, on fixed-name numpy tensors.

Functions (the same names on every backend):
    classify:  pixel_values (B, 3, S, S) float32 -> logits (B, K), pre_logits (B, D)
    image:     pixel_values (B, 3, S, S) float32 -> image_embeds (B, D), L2-normalised
               (uint8 transfer, torch: ``pixels`` (B, S, S, 3) uint8 RGB in place of pixel_values)
    text:      input_ids (B, L) int64            -> text_embeds (B, D), L2-normalised
    encoder:   inputs_embeds (B, T, E) float32    -> hidden (B, H)

and, on image models with Soft MoE layers, the optional ``routing`` function (``backend.routing``,
a FunctionSpec or None; not in ``functions``, which lists what serves traffic):
    routing:   pixel_values -> the classify (or image) outputs, then the per-layer routing and its
               statistics (``softmoe_models.routing.OUTPUTS``)
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np

Rows = dict[str, np.ndarray]


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]  # without the batch axis
    dtype: np.dtype


@dataclass(frozen=True)
class FunctionSpec:
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]


ROUTING = "routing"
PIXELS = "pixels"  # uint8 transfer: (S, S, 3) uint8 RGB rows in place of pixel_values (torch backend)


class Backend(Protocol):
    name: str  # torch | onnxruntime | tensorrt
    functions: dict[str, FunctionSpec]
    routing: FunctionSpec | None  # the routing function, where the model has one
    max_batch_size: int

    def run(self, fn: str, inputs: Rows) -> Rows: ...

    def warmup(self, batch_sizes: list[int]) -> None: ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...


def specs_from_graphs(graphs) -> dict[str, FunctionSpec]:
    """FunctionSpecs from ``export.graphs`` Graph objects, keyed by server function name."""
    # torch: heavy; this module is read by the pipeline, which loads no torch
    import torch

    role_to_fn = {"classifier": "classify", "image": "image", "text": "text", "encoder": "encoder"}
    out = {}
    for role, g in graphs.items():
        if role not in role_to_fn:
            continue
        inputs = tuple(
            InputSpec(s.name, tuple(int(d) for d in s.shape[1:]), np.dtype(np.int64 if s.dtype == torch.int64 else np.float32))
            for s in g.inputs
        )
        out[role_to_fn[role]] = FunctionSpec(inputs, tuple(g.outputs))
    return out


def structure_of(backend: Backend) -> str | None:
    """The backend's ``structure()`` where it has one (what it computes and how, the weights'
    values left out; equal structures run the same kernels on the same shapes), else None."""
    structure = getattr(backend, "structure", None)
    return structure() if structure is not None else None


def all_functions(backend: Backend) -> dict[str, FunctionSpec]:
    """``functions`` plus the routing function where there is one."""
    routing = getattr(backend, "routing", None)
    return {**backend.functions, ROUTING: routing} if routing is not None else dict(backend.functions)


def routing_spec(graphs) -> FunctionSpec | None:
    """The routing FunctionSpec from ``export.graphs`` Graph objects (None without a routing graph)."""
    g = graphs.get(ROUTING)
    if g is None:
        return None
    inputs = tuple(InputSpec(s.name, tuple(int(d) for d in s.shape[1:]), np.dtype(np.float32)) for s in g.inputs)
    return FunctionSpec(inputs, tuple(g.outputs))


def warm(backend: Backend, batch_sizes: list[int]) -> None:
    """Run every function (routing included) once at every batch size (zeros): no lazy work on the
    request path."""
    for fn, spec, b in warming_calls(backend, lambda fn: batch_sizes):
        backend.run(fn, {s.name: np.zeros((b, *s.shape), dtype=s.dtype) for s in spec.inputs})


def warming_calls(backend: Backend, sizes: Callable[[str], Iterable[int]]) -> list[tuple[str, FunctionSpec, int]]:
    """``(function, spec, batch size)``: each function of ``backend`` (routing included) at each of
    ``sizes(function)``, less the calls that warm nothing new. A backend whose ``sessions`` maps
    functions to the runtime sessions that serve them (``OnnxRuntimeBackend``: a plain image
    function is served by its routing graph's session, which computes its outputs and more) runs
    each session once per shape: a call warms a session's kernels and memory plan for the shape of
    its inputs, whichever of its outputs are fetched. Functions with more outputs come first."""
    sessions = getattr(backend, "sessions", {})
    functions = sorted(all_functions(backend).items(), key=lambda kv: -len(kv[1].outputs))
    seen: set[tuple] = set()
    calls = []
    for fn, spec in functions:
        owner = id(sessions[fn]) if fn in sessions else fn
        for size in sizes(fn):
            if (owner, size) not in seen:
                seen.add((owner, size))
                calls.append((fn, spec, size))
    return calls
