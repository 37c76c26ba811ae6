"""TensorRT backend: engines built (or loaded from the cache) by ``export.tensorrt`` on this GPU.

Not run here (no TensorRT on our machines); without the extra the server refuses to start with
a message naming it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from export import cache
from export.tensorrt import BatchProfile, EngineRunner, export_tensorrt, import_tensorrt
from server.backends.base import ROUTING, FunctionSpec, InputSpec, Rows, warm


class TensorRTBackend:
    name = "tensorrt"

    def __init__(self, package: Path, *, precision: str = "fp16", max_batch_size: int = 8, cache_dir: str = "",
                 routing: bool = True) -> None:
        """Engines for ``package``; a ``routing`` engine, where ``export_tensorrt`` built one, serves
        the routing function (unless ``routing`` is False)."""
        trt = import_tensorrt()

        self.max_batch_size = max_batch_size
        profile = BatchProfile(1, max_batch_size, max_batch_size)
        out = Path(cache_dir) / "engines" if cache_dir else None
        engines = export_tensorrt(package, out, precision=precision, profile=profile)
        self._held = cache.hold(engines)  # the engines' cache entries, held while served: no process removes them
        self.runners, self.functions = {}, {}
        self.routing: FunctionSpec | None = None
        for engine in engines:
            role = engine.name.split("-")[0]
            fn = {"classifier": "classify"}.get(role, role)
            runner = EngineRunner(trt, engine.read_bytes())
            shapes = _shapes_from_engine(runner)  # the ONNX the engine came from is not kept in the cache
            if fn == ROUTING and not routing:
                continue
            self.runners[fn] = runner
            spec = FunctionSpec(
                tuple(InputSpec(n, tuple(int(d) for d in s[1:]), np.dtype(np.int64 if n == "input_ids" else np.float32))
                      for n, s in shapes.items()),
                tuple(runner.outputs),
            )
            if fn == ROUTING:
                self.routing = spec
            else:
                self.functions[fn] = spec
        self._torch = torch

    def run(self, fn: str, inputs: Rows) -> Rows:  # noqa: D102
        out = self.runners[fn]({k: self._torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()})
        return {k: v.numpy() for k, v in out.items()}

    def warmup(self, batch_sizes: list[int]) -> None:
        warm(self, batch_sizes)

    def describe(self) -> dict:
        return {"backend": "tensorrt", "device": "cuda"}

    def close(self) -> None:
        self.runners.clear()
        for held in self._held:  # the entries may now be removed to make room
            held.release()


def _shapes_from_engine(runner) -> dict[str, tuple]:
    """Input shapes (batch symbolic) read from a deserialized engine."""
    out = {}
    for name in runner.inputs:
        dims = tuple(runner.engine.get_tensor_shape(name))
        out[name] = ("batch", *dims[1:])
    return out
