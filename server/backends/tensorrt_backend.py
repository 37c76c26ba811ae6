"""TensorRT backend: engines built (or loaded from the cache) by ``export.tensorrt`` on this GPU.

Not run here (no TensorRT on our machines); without the extra the server refuses to start with
a message naming it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .base import FunctionSpec, InputSpec, Rows, warm


class TensorRTBackend:
    name = "tensorrt"

    def __init__(self, package: Path, *, precision: str = "fp16", max_batch_size: int = 8, cache_dir: str = "") -> None:
        from export.tensorrt import BatchProfile, EngineRunner, engine_inputs, export_tensorrt, import_tensorrt

        trt = import_tensorrt()
        import torch

        self.max_batch_size = max_batch_size
        profile = BatchProfile(1, max_batch_size, max_batch_size)
        out = Path(cache_dir) / "engines" if cache_dir else None
        engines = export_tensorrt(package, out, precision=precision, profile=profile)
        self.runners, self.functions = {}, {}
        for engine in engines:
            role = engine.name.split("-")[0]
            fn = {"classifier": "classify"}.get(role, role)
            runner = EngineRunner(trt, engine.read_bytes())
            onnx_file = engine.parent / ("fp32.onnx" if role == "classifier" else f"fp32.{role}.onnx")
            shapes = engine_inputs(onnx_file) if onnx_file.is_file() else _shapes_from_engine(runner)
            self.runners[fn] = runner
            self.functions[fn] = FunctionSpec(
                tuple(InputSpec(n, tuple(int(d) for d in s[1:]), np.dtype(np.int64 if n == "input_ids" else np.float32))
                      for n, s in shapes.items()),
                tuple(runner.outputs),
            )
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


def _shapes_from_engine(runner) -> dict[str, tuple]:
    """Input shapes (batch symbolic) read from a deserialized engine."""
    out = {}
    for name in runner.inputs:
        dims = tuple(runner.engine.get_tensor_shape(name))
        out[name] = ("batch", *dims[1:])
    return out
