"""PyTorch backend (CPU or CUDA; fp32, fp16 or bf16), the package's fused routing, batched experts.

On CUDA: the device is checked (torch's CUDA build, a visible device, every parameter and buffer
really on it), weights are read straight onto it in the compute precision, LayerNorm and every
softmax run in fp32 under fp16/bf16, TF32 and autotuning are off, and calls run on the backend's own
stream through pinned host buffers, replaying one CUDA graph per padded batch shape (both
switchable). With ``pixel_transfer="uint8"`` image functions take the resized uint8 RGB rows
(``pixels``, a quarter of float32's bytes to stage and copy) and map them to the model's value
range on the device, bitwise as the host would. A CUDA error that poisons the context is raised as ``FatalBackendError``; an
out-of-memory error propagates as ``torch.cuda.OutOfMemoryError``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from torch import nn

from export.graphs import graphs_for
from softmoe_models.batch_invariance import set_batch_invariant
from softmoe_models.package import load_model, read_package
from softmoe_models.preprocess import pixel_table
from softmoe_models.soft_moe import configure_routing

from server.backends.failures import FatalBackendError
from server.backends.base import PIXELS, ROUTING, FunctionSpec, InputSpec, Rows, all_functions, routing_spec, specs_from_graphs, warm
from server.backends.cuda import (
    TorchCudaRunner, check_module_device, configure_torch_determinism, is_sticky_cuda_error, require_torch_cuda,
    resolve_precision,
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class TorchBackend:
    """One model package (or an already built module) served by PyTorch.

    Args:
        package: a model package directory, or a module built for ``device`` and ``precision``
            (benchmarks: random-weight models too large to write to disk).
        device: cpu | cuda.
        precision: auto | fp32 | fp16 | bf16 (auto: fp32 on CPU; bf16 on CUDA where the GPU has
            native bf16, else fp16).
        max_batch_size: the largest batch ``run`` receives.
        threads: intra-op CPU threads (0: torch's default).
        cuda_graphs: on CUDA, capture one CUDA graph per padded batch shape and replay it.
        pinned_staging: on CUDA, copy through pinned host buffers with async copies.
        routing: offer the routing function (``export.graphs.RoutingGraph``, the same module).
        pixel_transfer: float32 (image functions take ``pixel_values``, NCHW in the model's value
            range) or uint8 (they take ``pixels``, NHWC uint8 RGB at the model's size, mapped to the
            value range on the backend's device by ``Uint8Pixels``).
        value_range: the model's pixel value range, for uint8 transfer (default: the package's).
        batch_invariant: on CPU, run the batch-invariant forms of the layers
            (``softmoe_models.batch_invariance``: an image's outputs the same bits at every batch
            size, so strict mode can prove padded shapes of 1 and 2). Ignored on CUDA.
    """

    name = "torch"

    def __init__(self, package: str | Path | nn.Module, *, device: str = "cpu", precision: str = "fp32",
                 max_batch_size: int = 8, threads: int = 0, cuda_graphs: bool = True,
                 pinned_staging: bool = True, routing: bool = True, pixel_transfer: str = "float32",
                 value_range: tuple[float, float] | None = None, batch_invariant: bool = False) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {device!r}: use cpu or cuda")
        if pixel_transfer not in ("float32", "uint8"):
            raise ValueError(f"unknown pixel_transfer {pixel_transfer!r}: use float32 or uint8")
        if threads:
            torch.set_num_threads(threads)
        self.precision = resolve_precision("torch", device, precision)
        dtype = DTYPES[self.precision]
        self.device = require_torch_cuda() if device == "cuda" else torch.device("cpu")
        if device == "cuda":
            configure_torch_determinism()
        self.max_batch_size = max_batch_size
        if isinstance(package, nn.Module):
            self.model = package
        else:
            self.model = load_model(package, device=self.device, dtype=None if dtype == torch.float32 else dtype)
        configure_routing(self.model, experts_form="batched")  # one batched GEMM pair, never a loop
        self.batch_invariant = batch_invariant and self.device.type == "cpu"
        set_batch_invariant(self.model, self.batch_invariant)
        check_module_device(self.model, self.device)
        graphs = graphs_for(self.model, dtype)
        self._modules = {"classify": graphs.get("classifier"), "image": graphs.get("image"),
                         "text": graphs.get("text"), "encoder": graphs.get("encoder"), ROUTING: graphs.get(ROUTING)}
        self.functions = specs_from_graphs(graphs)
        self.routing = routing_spec(graphs) if routing else None
        self.pixel_transfer = pixel_transfer
        if pixel_transfer == "uint8":
            if value_range is None:
                if isinstance(package, nn.Module):
                    raise ValueError("uint8 pixel transfer of a module needs its value_range")
                value_range = read_package(package).preprocess.value_range
            table = torch.from_numpy(pixel_table(value_range)).to(self.device)
            for fn in ("classify", "image", ROUTING):
                if self._modules[fn] is not None and (fn != ROUTING or self.routing is not None):
                    g = self._modules[fn]
                    self._modules[fn] = dataclasses.replace(g, module=Uint8Pixels(g.module, table))
            self.functions = {fn: _uint8_spec(spec) if fn in ("classify", "image") else spec
                              for fn, spec in self.functions.items()}
            self.routing = _uint8_spec(self.routing) if self.routing is not None else None
        self._specs = all_functions(self)
        self._outputs = {fn: spec.outputs for fn, spec in self._specs.items()}
        self._cuda = (TorchCudaRunner(self.device, max_batch_size, cuda_graphs=cuda_graphs, pinned=pinned_staging)
                      if self.device.type == "cuda" else None)

    def run(self, fn: str, inputs: Rows) -> Rows:
        graph = self._modules[fn]
        names = [s.name for s in self._specs[fn].inputs]
        try:
            if self._cuda is not None:
                outs = self._cuda.run(fn, graph.module, [inputs[n] for n in names])
                return dict(zip(self._outputs[fn], outs))
            args = [torch.from_numpy(np.ascontiguousarray(inputs[n])) for n in names]
            with torch.inference_mode():
                out = graph.module(*args)
            outs = out if isinstance(out, tuple) else (out,)
            return {name: t.float().numpy() for name, t in zip(self._outputs[fn], outs)}
        except torch.cuda.OutOfMemoryError:
            raise  # transient: the batch fails, the device stays usable
        except RuntimeError as e:
            if is_sticky_cuda_error(e):
                raise FatalBackendError(f"CUDA context unusable: {' '.join(str(e).split())[:300]}") from e
            raise

    def warmup(self, batch_sizes: list[int]) -> None:
        if self._cuda is not None:
            self._cuda.warming = True
        try:
            warm(self, batch_sizes)
        finally:
            if self._cuda is not None:
                self._cuda.warming = False

    def describe(self) -> dict:
        param = next(self.model.parameters())
        out = {"backend": "torch", "device": str(param.device), "precision": self.precision,
               "dtype": str(param.dtype).removeprefix("torch."), "torch": torch.__version__}
        if any(fn in self.functions for fn in ("classify", "image")):
            out["pixel_transfer"] = self.pixel_transfer
        if self._cuda is not None:
            out.update(gpu=torch.cuda.get_device_name(self.device), cuda=torch.version.cuda,
                       cuda_graphs=self._cuda.cuda_graphs, pinned_staging=self._cuda.pinned)
        else:
            out.update(threads=torch.get_num_threads(), batch_invariant=self.batch_invariant)
        return out

    def close(self) -> None:
        if self._cuda is not None:
            self._cuda.close()
        self.model = None


class Uint8Pixels(nn.Module):
    """``(N, S, S, 3)`` uint8 RGB -> ``inner``'s float32 NCHW ``pixel_values``, on the module's device.

    Each value is looked up in the model's ``pixel_table``: a gather, so the float32 pixel values
    are bitwise the ones the host's ``to_pixel_values`` computes (no device arithmetic that could
    round differently), laid out contiguous NCHW as the host path's are.
    """

    def __init__(self, inner: nn.Module, table: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("table", table, persistent=False)

    def forward(self, pixels: torch.Tensor):
        index = pixels.permute(0, 3, 1, 2).contiguous().int()
        values = self.table.index_select(0, index.view(-1)).view(index.shape)
        return self.inner(values)


def _uint8_spec(spec: FunctionSpec) -> FunctionSpec:
    """``spec`` with its ``pixel_values`` (3, S, S) float32 input replaced by ``pixels`` (S, S, 3) uint8."""
    inputs = tuple(InputSpec(PIXELS, (s.shape[1], s.shape[2], s.shape[0]), np.dtype(np.uint8))
                   if s.name == "pixel_values" else s for s in spec.inputs)
    return FunctionSpec(inputs, spec.outputs)
