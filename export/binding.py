"""A graph exported once per structure, and another package's weights bound into it.

An exported graph depends on a package's structure (variant, shapes, routing, export settings),
not on its weights' values: the initializers are the model's parameters and buffers, some of them
transposed or one row of a stacked tensor (``_fold_constant_gathers`` slices each expert out of
its stack). So after an export, each initializer's *recipe* is found by value: which tensor of the
exported module it is, and how it was taken (``same``, ``T``, ``row`` i, ``rowT`` i). The
structure graph keeps the nodes and the initializers' names, types and shapes, its weight data
cleared; binding another package of the same structure fills every initializer from that
package's module by its recipe. Initializers that are no tensor of the module (shapes, indices,
the token-mean row of ``_token_means_as_matmuls``) and one-element ones (epsilons, powers) stay as
exported.

A recipe is found on one set of weights, where two tensors may hold the same values (biases of
zeros, LayerNorm scales of ones), so a graph bound by it is verified against PyTorch on the new
weights like every export (``export.onnx.bind_onnx``): a graph whose constant was in fact derived
from the weights in a way no recipe names fails that check, and the package is exported instead.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .errors import ExportError

RECIPE = "recipe.json"
OPS = ("same", "T", "row", "rowT")


def model_tensors(module: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter and buffer of ``module`` (non-persistent ones too: the folded slot matrix),
    by name, as numpy arrays of the dtype the export wrote."""
    out: dict[str, np.ndarray] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.numel() == 0 or name in out:
            continue
        t = t.detach().cpu()
        out[name] = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return out


def derive(tensors: dict[str, np.ndarray], step: dict) -> np.ndarray:
    """The value an initializer takes from ``tensors`` by its recipe ``step``."""
    v = tensors[step["source"]]
    op, i = step["op"], step.get("index")
    if op == "same":
        return v
    if op == "T":
        return v.T
    if op == "row":
        return v[i]
    if op == "rowT":
        return v[i].T
    raise ExportError(f"unknown recipe step {op!r}")


def _fingerprint(a: np.ndarray) -> tuple:
    a = np.ascontiguousarray(a)
    return a.shape, a.dtype.str, hashlib.blake2b(a.tobytes(), digest_size=16).hexdigest()


def _candidates(tensors: dict[str, np.ndarray]) -> dict[tuple, list[dict]]:
    """Every way a tensor of the module can stand in a graph, by the fingerprint of its value."""
    found: dict[tuple, list[dict]] = {}

    def add(value: np.ndarray, source: str, op: str, index: int | None = None) -> None:
        found.setdefault(_fingerprint(value), []).append({"source": source, "op": op, "index": index})

    for name, v in tensors.items():
        add(v, name, "same")
        if v.ndim == 2:
            add(v.T, name, "T")
        if v.ndim >= 2 and v.shape[0] <= 4096:
            for i in range(v.shape[0]):
                add(v[i], name, "row", i)
                if v.ndim == 3:
                    add(v[i].T, name, "rowT", i)
    return found


def recipe_for(graph_file: Path, tensors: dict[str, np.ndarray]) -> tuple[list[dict] | None, str]:
    """``(recipe, "")``: how every initializer of more than one element of ``graph_file`` that is a
    tensor of the module is taken from ``tensors``; ``(None, why)`` when none is (nothing to bind)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(graph_file))
    found = _candidates(tensors)
    recipe = []
    for init in model.graph.initializer:
        value = numpy_helper.to_array(init)
        if value.size <= 1:
            continue
        options = found.get(_fingerprint(value))
        if not options:  # a constant of the graph's own (shapes, indices, the token-mean row): kept
            continue
        # the exporter names a parameter it uses as it is after the parameter itself
        step = next((o for o in options if o["source"] == init.name and o["op"] == "same"), options[0])
        recipe.append({"name": init.name, **step, "ambiguous": len(options) > 1})
    if not recipe:
        return None, "no initializer of the graph is a tensor of the model"
    return recipe, ""


def write_structure(graph_file: Path, recipe: list[dict], out: Path) -> None:
    """``graph_file`` without the weight data its recipe fills (names, types and shapes kept),
    one self-contained file."""
    import onnx

    model = onnx.load(str(graph_file))
    filled = {step["name"] for step in recipe}
    for init in model.graph.initializer:
        if init.name in filled:
            name, dims, dtype = init.name, list(init.dims), init.data_type
            init.Clear()
            init.name, init.data_type = name, dtype
            init.dims.extend(dims)
    onnx.save_model(model, str(out))


def write_recipe(recipes: dict[str, list[dict]], out: Path) -> None:
    out.write_text(json.dumps(recipes, sort_keys=True, indent=0) + "\n")


def bind(structure_file: Path, recipe: list[dict], tensors: dict[str, np.ndarray], out: Path,
         metadata: dict[str, str], external: bool) -> Path | None:
    """``structure_file`` with every initializer filled from ``tensors`` by ``recipe`` and its
    metadata replaced by ``metadata``, written to ``out``; its weights in ``out``.data when
    ``external``. Returns the external data file, if any.

    Raises:
        ExportError: a tensor the recipe names is missing or of another shape or type.
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(structure_file))
    by_name = {init.name: init for init in model.graph.initializer}
    for step in recipe:
        init = by_name.get(step["name"])
        if init is None or step["source"] not in tensors:
            raise ExportError(f"{structure_file}: the recipe's {step['name']} ({step['source']}) is not there")
        value = np.ascontiguousarray(derive(tensors, step))
        want = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
        if list(value.shape) != list(init.dims) or value.dtype != want:
            raise ExportError(f"{step['name']}: {step['source']} gives {value.dtype}{list(value.shape)}, the graph "
                              f"holds {np.dtype(want)}{list(init.dims)}")
        init.CopyFrom(numpy_helper.from_array(value, step["name"]))
    kept = [p for p in model.metadata_props if p.key not in metadata]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in metadata.items():
        model.metadata_props.add(key=key, value=value)
    data = out.with_name(out.name + ".data")
    data.unlink(missing_ok=True)
    if external:
        onnx.save_model(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024)
        return data
    onnx.save_model(model, str(out))
    return None
