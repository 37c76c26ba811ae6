"""A graph exported once per structure, and another package's weights bound into it.

An exported graph depends on a package's structure (variant, shapes, routing, export settings),
not on its weights' values: the initializers are the model's parameters and buffers, some of them
transposed or one row of a stacked tensor (``graph_passes.fold_constant_gathers`` slices each expert out of
its stack). So after an export, each initializer's *recipe* is found by value: which tensor of the
exported module it is, and how it was taken (``same``, ``T``, ``row`` i, ``rowT`` i). The
structure graph keeps the nodes and the initializers' names, types and shapes, its weight data
cleared; binding a package of the structure (``Binder``) points every initializer its recipe
names at its data: most are bytes of the package's own weights file, read from there when a
session is made (``export.weights_file``), and the rest (transposed or derived tensors) go into
one small file beside the graphs. Initializers that are no tensor of the module (shapes, indices,
the token-mean row of ``graph_passes.token_means_as_matmuls``) and one-element ones (epsilons, powers) stay as
exported.

A recipe is found on one set of weights, where two tensors may hold the same values (biases of
zeros, LayerNorm scales of ones), so a graph bound by it is verified against PyTorch on the new
weights like every export (``export.onnx.bind_onnx``): a graph whose constant was in fact derived
from the weights in a way no recipe names fails that check, and the package is exported instead.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
from torch import nn

from . import weights_file
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
    return a.shape, a.dtype.str, blake3.blake3(memoryview(a.reshape(-1).view(np.uint8))).hexdigest(length=16)


def _found(a: np.ndarray) -> list:
    """A recipe step's record of the value it was found on (``_fingerprint``, as JSON keeps it)."""
    shape, dtype, digest = _fingerprint(a)
    return [list(shape), dtype, digest]


def _candidates(tensors: dict[str, np.ndarray], wanted: set[tuple]) -> dict[tuple, list[dict]]:
    """Every way a tensor of the module can stand in a graph, by the fingerprint of its value;
    only the ways whose ``(shape, dtype.str)`` is in ``wanted`` (an initializer's) are hashed."""
    found: dict[tuple, list[dict]] = {}

    def add(value: np.ndarray, source: str, op: str, index: int | None = None) -> None:
        if (value.shape, value.dtype.str) in wanted:
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


def _named_after(name: str, options: list[dict]) -> dict | None:
    """The option an initializer's name settles among tensors of one value (zero biases, unit
    scales): the exporter names a parameter it uses as it is after the parameter's path in the
    module exported, which holds the package's model under a prefix (``model.``, ``plain.model.``),
    and one row of a stacked parameter after that path and the row (``export.graph_passes``'
    folded gathers: ``...mlp.b1__5``). The option whose name ends the initializer's, the longest
    such; None when none does."""

    def own(o: dict) -> str | None:
        return o["source"] if o["op"] == "same" else f"{o['source']}__{o['index']}" if o["op"] == "row" else None

    named = [o for o in options if own(o) is not None and (name == own(o) or name.endswith("." + own(o)))]
    return max(named, key=lambda o: len(own(o)), default=None)


def _initializer_values(graph_file: Path):
    """``(model, values)``: the graph at ``graph_file`` without its external data loaded, and each
    initializer's value, by name, read from where it lies (memory-mapped external data)."""
    # onnx: heavy, out of this module's import (the server imports it)
    import onnx
    # onnx as well: heavy, out of this module's import
    from onnx import numpy_helper

    model = onnx.load(str(graph_file), load_external_data=False)
    maps: dict[str, np.ndarray] = {}
    values: dict[str, np.ndarray] = {}
    for init in model.graph.initializer:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
        if init.data_location != onnx.TensorProto.EXTERNAL:
            values[init.name] = numpy_helper.to_array(init)
            continue
        where = {e.key: e.value for e in init.external_data}
        path = graph_file.parent / where["location"]
        if str(path) not in maps:
            maps[str(path)] = np.memmap(path, np.uint8, mode="r")
        start = int(where.get("offset", 0))
        raw = maps[str(path)][start:start + int(where["length"])]
        values[init.name] = np.frombuffer(raw, dtype).reshape(tuple(init.dims))
    return model, values


def recipes_for(graph_files: list[Path], tensors: dict[str, np.ndarray]) -> dict[Path, tuple[list[dict] | None, str]]:
    """Per graph, ``(recipe, "")``: how every initializer of more than one element that is a tensor
    of the module is taken from ``tensors``; ``(None, why)`` when none is (nothing to bind). The
    module's tensors are fingerprinted once for all the graphs."""
    graphs = {f: _initializer_values(f)[1] for f in graph_files}
    wanted = {(v.shape, v.dtype.str) for values in graphs.values() for v in values.values() if v.size > 1}
    found = _candidates(tensors, wanted)
    out: dict[Path, tuple[list[dict] | None, str]] = {}
    for f, values in graphs.items():
        recipe = []
        for name, value in values.items():
            if value.size <= 1:
                continue
            options = found.get(_fingerprint(value))
            if not options:  # a constant of the graph's own (shapes, indices, the token-mean row): kept
                continue
            named = _named_after(name, options)
            step = named or options[0]
            recipe.append({"name": name, **step, "ambiguous": len(options) > 1 and named is None,
                           "found": _found(value)})
        out[f] = (recipe, "") if recipe else (None, "no initializer of the graph is a tensor of the model")
    return out


def write_structure(graph_file: Path, recipe: list[dict], out: Path) -> None:
    """``graph_file`` without the weight data its recipe fills (names, types and shapes kept),
    one self-contained file."""
    # onnx: heavy, out of this module's import (the server imports it)
    import onnx

    model, values = _initializer_values(graph_file)
    filled = {step["name"] for step in recipe}
    for init in model.graph.initializer:
        if init.name not in filled and init.data_location != onnx.TensorProto.EXTERNAL:
            continue  # inline already: kept as it is
        # filled by a binding: no data; a constant of the graph's own read from outside: inline
        raw = None if init.name in filled else np.ascontiguousarray(values[init.name]).tobytes()
        name, dims, dtype = init.name, list(init.dims), init.data_type
        init.Clear()
        init.name, init.data_type = name, dtype
        init.dims.extend(dims)
        if raw is not None:
            init.raw_data = raw
    onnx.save_model(model, str(out))


def write_recipe(recipes: dict[str, list[dict]], out: Path) -> None:
    out.write_text(json.dumps(recipes, sort_keys=True, indent=0) + "\n")


class Binder:
    """Binds graphs of one structure into one directory, each initializer's data where it already
    is: a range of the package's weights file where its recipe takes a parameter as it is or one
    row of it and the package stores that parameter at the graph's type (``export.weights_file``;
    those bytes are compared with the tensor's first), else (transposed, converted or derived
    tensors) in ``derived``, one file of the directory that every graph bound here shares, each
    tensor once. ``close`` when done."""

    ALIGN = 4096  # ONNX Runtime maps external data whose offset is page-aligned instead of copying it

    def __init__(self, weights: Path | None, derived: Path) -> None:
        self.weights = weights
        self._index = weights_file.index(weights) if weights is not None else {}
        self._map = None
        if self._index:
            with open(weights, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.derived = derived
        self._out = open(derived, "wb")
        self._written: dict[tuple, tuple[int, int]] = {}
        self.bound: dict[Path, Any] = {}  # each graph written, as its ModelProto (its data outside it)
        self.package_bytes = 0
        self.derived_bytes = 0

    def bind(self, structure_file: Path, recipe: list[dict], tensors: dict[str, np.ndarray], out: Path,
             metadata: dict[str, str], found: bool = False) -> None:
        """``structure_file`` with every initializer its recipe names pointed at its data, taken
        from ``tensors``, and its metadata replaced by ``metadata``, written to ``out``. ``found``:
        ``tensors`` are those the recipe was found on, and each value must be the one it was
        found with (the graph exported and verified, its data read from elsewhere).

        Raises:
            ExportError: a tensor the recipe names is missing or of another shape or type, or
                (``found``) not the value the recipe was found with.
        """
        # onnx: heavy, out of this module's import (the server imports it)
        import onnx

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
            if found and _found(value) != step.get("found"):
                raise ExportError(f"{step['name']}: {step['op']} of {step['source']} is not the value the graph was "
                                  f"exported with")
            start = self._in_package(step, tensors, value)
            if start is not None:
                location = weights_file.LOCATION
                self.package_bytes += value.nbytes
            else:
                location, start = self.derived.name, self._derive(step, value)
            init.ClearField("raw_data")
            init.data_location = onnx.TensorProto.EXTERNAL
            del init.external_data[:]
            for key, v in (("location", location), ("offset", str(start)), ("length", str(value.nbytes))):
                init.external_data.add(key=key, value=v)
        kept = [p for p in model.metadata_props if p.key not in metadata]
        del model.metadata_props[:]
        model.metadata_props.extend(kept)
        for key, value in metadata.items():
            model.metadata_props.add(key=key, value=value)
        self._out.flush()  # the graph is read (verified) before the next one is bound
        out.write_bytes(model.SerializeToString())
        self.bound[out] = model

    def _in_package(self, step: dict, tensors: dict[str, np.ndarray], value: np.ndarray) -> int | None:
        """The offset in the package's weights file of bytes equal to ``value``'s, if its recipe
        takes it from there as it is."""
        stored = self._index.get(step["source"])
        if stored is None or step["op"] not in ("same", "row") or stored.dtype != value.dtype \
                or stored.shape != tuple(tensors[step["source"]].shape):
            return None
        start = stored.start + (step["index"] * value.nbytes if step["op"] == "row" else 0)
        if start + value.nbytes > stored.end:
            return None
        there = np.frombuffer(self._map, np.uint8, count=value.nbytes, offset=start)
        return start if np.array_equal(there, value.reshape(-1).view(np.uint8)) else None

    def _derive(self, step: dict, value: np.ndarray) -> int:
        key = (step["source"], step["op"], step.get("index"))
        if key not in self._written:
            at = -self._out.tell() % self.ALIGN
            self._out.write(b"\0" * at)
            self._written[key] = (self._out.tell(), value.nbytes)
            self._out.write(value.tobytes())
            self.derived_bytes += value.nbytes
        return self._written[key][0]

    def close(self) -> None:
        """The derived file closed (removed when nothing went into it)."""
        self._out.close()
        if not self._written:
            self.derived.unlink(missing_ok=True)
