"""A package's own weights file as the data of a graph's initializers: the graph holds no copy.

safetensors stores each tensor raw, little-endian and contiguous after a JSON index, so most
initializers of an exported graph (a parameter as it is, or one expert's row of a stacked
parameter) are a byte range of the package's ``model.safetensors``. A bound graph
(``export.binding.bind``) marks each such initializer as ONNX external data at ``location``
``model.safetensors`` with the range's offset and length; the few it cannot take from there
(transposed or derived tensors) are real external data in a file of the cache entry.

ONNX Runtime does not open ``model.safetensors`` itself: it refuses external data outside the
graph's directory, and the onnx package refuses a hard link into it as a "hardlink attack". The
session is given those initializers instead (``SessionOptions.add_external_initializers``), as
read-only views of one memory map of the weights file, which the caller has hash-checked: the
bytes on disk and in the page cache are the package's, once. Those views must outlive the session
(``PackageWeights`` keeps them).
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ExportError

LOCATION = "model.safetensors"  # the package's weights file, as an initializer's external location
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


@dataclass(frozen=True)
class Stored:
    """One tensor of a safetensors file: its dtype, shape and absolute byte range."""

    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def index(path: str | Path) -> dict[str, Stored]:
    """The tensors of the safetensors file ``path`` by name (dtypes numpy has no type for left out).

    Raises:
        ExportError: the file is not safetensors (no index, or ranges outside the file).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, 100 << 20):
            raise ExportError(f"{path} is not a safetensors file (index of {n} bytes)")
        try:
            table = json.loads(f.read(n))
        except ValueError as e:
            raise ExportError(f"{path}: unreadable safetensors index ({e})") from None
    out = {}
    for name, t in table.items():
        if name == "__metadata__" or not isinstance(t, dict) or t.get("dtype") not in DTYPES:
            continue
        begin, end = (8 + n + int(o) for o in t["data_offsets"])
        if not 8 + n <= begin <= end <= size:
            raise ExportError(f"{path}: {name}'s bytes lie outside the file")
        out[name] = Stored(np.dtype(DTYPES[t["dtype"]]), tuple(int(d) for d in t["shape"]), begin, end)
    return out


def uses_package(model) -> list:
    """The initializers of the ModelProto ``model`` whose data is the package's weights file."""
    return [t for t in model.graph.initializer if t.data_location == 1  # onnx.TensorProto.EXTERNAL
            and any(e.key == "location" and e.value == LOCATION for e in t.external_data)]


@dataclass
class PackageWeights:
    """The package-held initializers of one graph file, as views of a memory map of ``weights``
    (``names`` and ``values``, the OrtValues a session is given); kept alive with the session."""

    names: list[str] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)
    _map: Any = None

    @classmethod
    def of(cls, graph: str | Path, weights: str | Path | None) -> PackageWeights | None:
        """Those of ``graph``; None when it holds all its data itself.

        Raises:
            ExportError: the graph reads the package's weights and ``weights`` is not given, or a
                range lies outside that file.
        """
        # onnx: heavy, out of this module's import (the server imports it)
        import onnx
        # onnxruntime: an optional extra, out of this module's import
        import onnxruntime as ort

        model = onnx.load(str(graph), load_external_data=False)
        tensors = uses_package(model)
        if not tensors:
            return None
        if weights is None:
            raise ExportError(f"{graph} reads {len(tensors)} initializers from its package's {LOCATION}: "
                              f"give the session that file")
        weights = Path(weights)
        out = cls()
        with open(weights, "rb") as f:
            out._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        size = len(out._map)
        for t in tensors:
            info = {e.key: e.value for e in t.external_data}
            offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
            shape = tuple(int(d) for d in t.dims)
            count = int(np.prod(shape, dtype=np.int64))
            if length != count * dtype.itemsize or not 0 <= offset <= size - length:
                raise ExportError(f"{graph}: {t.name}'s bytes ({offset}+{length}) are not in {weights} "
                                  f"({size} bytes) as {dtype}{list(shape)}")
            view = np.frombuffer(out._map, dtype=dtype, count=count, offset=offset).reshape(shape)
            if offset % dtype.itemsize:  # kernels read whole elements: a misaligned range is copied
                view = view.copy()
            out.names.append(t.name)
            out.values.append(ort.OrtValue.ortvalue_from_numpy(view))
        return out

    def give(self, options) -> None:
        """Hand the initializers to the SessionOptions ``options``."""
        options.add_external_initializers(self.names, self.values)


def write_standalone(graph: str | Path, weights: str | Path, out: str | Path) -> Path:
    """A copy of the bound ``graph`` at ``out`` that holds all its data itself (past 2 GB, in
    ``out``.data), for tools that open an ONNX file on their own (another server, a profiler)."""
    # onnx: heavy, out of this module's import (the server imports it)
    import onnx

    graph, out = Path(graph), Path(out)
    model = onnx.load(str(graph), load_external_data=False)
    size = 0
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        source = Path(weights) if info["location"] == LOCATION else graph.parent / info["location"]
        with open(source, "rb") as f:
            f.seek(int(info.get("offset", 0)))
            t.raw_data = f.read(int(info["length"]))
        del t.external_data[:]
        t.ClearField("data_location")
        size += len(t.raw_data)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".data").unlink(missing_ok=True)
    onnx.save_model(model, str(out), save_as_external_data=size >= 2**31 - (64 << 20), all_tensors_to_one_file=True,
                    location=out.name + ".data", size_threshold=1024)
    return out
