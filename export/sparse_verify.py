"""Verifying a sparse V-MoE graph where a near-tie was routed the other way.

A sparse router makes discrete choices on float gates: the C tokens with the largest gates per
expert (Experts Choice), the K experts with the largest gates per token, the batch-priority order
(Tokens Choice). ONNX Runtime and PyTorch compute those gates with different kernels, about 1e-6
apart relative after a few blocks, and two gates that close decide alike only by chance: measured
on ``softmoe init ec-s16-e128`` (random weights), the C-th and (C+1)-th gates of an expert in the
first MoE block were 4.1e-8 apart (2.297780e-2 vs 2.297776e-2), ONNX Runtime took the other token,
and the logits moved by 5.3e-4, over the fp32 export tolerance of 1e-4. Either choice is a correct
evaluation of the model; neither runtime is wrong.

So when a sparse graph's outputs miss the tolerance against PyTorch, ``verify`` checks it a second
way that still catches export errors: it reads the graph's own gates (the output of each sparse
layer's router softmax, a value of the graph) and runs PyTorch again with each layer routing on
those gates (``softmoe_models.sparse_moe``'s own ``tokens_choice`` / ``experts_choice``, so a graph
that decides differently from the same gates still fails), while every layer's router also
computes its own gates from its own input, which must be within the precision's tolerance of the
graph's. Outputs are then held to the usual tolerance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from softmoe_models import sparse_moe

from .runtime import ort_session

SPARSE_LAYER = "softmoe_models.sparse_moe.SparseMoE"  # in a node's pkg.torch.onnx.class_hierarchy


def gate_values(path: Path) -> list[str]:
    """Names of the router softmax outputs of the graph's sparse layers, in forward order (empty
    when the exporter left no module metadata on the nodes)."""
    # onnx: heavy, out of this module's import (the server imports it, via export.onnx)
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    names = []
    for node in model.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        if node.op_type == "Softmax" and SPARSE_LAYER in meta.get("pkg.torch.onnx.class_hierarchy", ""):
            names.append(node.output[0])
    return names


def graph_gates(path: Path, feeds: dict[str, np.ndarray], names: list[str],
                providers: list[str] | None = None, weights: Path | None = None) -> list[np.ndarray]:
    """The values ``names`` of the graph at ``path`` on ``feeds``: a copy of the graph that also
    outputs them, written beside it (so its external data is found) and removed after;
    ``weights``: the package's weights file a bound graph reads from (``export.weights_file``)."""
    # onnx: heavy, out of this module's import (the server imports it, via export.onnx)
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    outputs = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                              for n in names if n not in outputs)
    copy = path.with_name(f".{path.stem}.gates.onnx")
    onnx.save(model, str(copy))
    try:
        session = ort_session(copy, providers=providers, weights=weights)
        return session.run(names, feeds)
    finally:
        copy.unlink(missing_ok=True)


@contextlib.contextmanager
def routed_on(layers: list, gates: list[np.ndarray], own_gap: list[float]) -> Iterator[None]:
    """Every sparse layer in ``layers`` routes on the given gates (one array per layer, (G, S, E)),
    through its own routing functions; ``own_gap`` gets, per layer, the largest difference between
    them and the gates the layer computes from its own input."""
    def routing(layer, given: np.ndarray):
        original = layer.route

        def route(x: torch.Tensor):
            own, _ = original(x)
            forced = torch.from_numpy(np.ascontiguousarray(given)).to(own.dtype).reshape(own.shape)
            own_gap.append(float((forced - own).abs().max()))
            c = layer.capacity(own.shape[1])
            if layer.router_kind == "tokens-choice":
                return forced, sparse_moe.tokens_choice(forced, layer.experts_per_token, c, layer.batch_priority)
            return forced, sparse_moe.experts_choice(forced, c)

        return route

    for layer, given in zip(layers, gates):
        layer.route = routing(layer, given)  # an instance attribute, over the class's method
    try:
        yield
    finally:
        for layer in layers:
            del layer.route
