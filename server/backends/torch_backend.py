"""PyTorch backend (CPU or CUDA; fp32, fp16 or bf16), the package's fused routing, batched experts.

On CUDA: the device is checked (torch's CUDA build, a visible device, every parameter and buffer
really on it), weights are read straight onto it in the compute precision, LayerNorm and every
softmax run in fp32 under fp16/bf16, TF32 and autotuning are off, and calls run on the backend's own
stream through pinned host buffers, replaying one CUDA graph per padded batch shape (both
switchable). A CUDA error that poisons the context is raised as ``FatalBackendError``; an
out-of-memory error propagates as ``torch.cuda.OutOfMemoryError``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from export.graphs import graphs_for
from softmoe_models.package import load_model
from softmoe_models.soft_moe import configure_routing

from ..batching.batcher import FatalBackendError
from .base import ROUTING, Rows, all_functions, routing_spec, specs_from_graphs, warm
from .cuda import (
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
    """

    name = "torch"

    def __init__(self, package: str | Path | nn.Module, *, device: str = "cpu", precision: str = "fp32",
                 max_batch_size: int = 8, threads: int = 0, cuda_graphs: bool = True,
                 pinned_staging: bool = True, routing: bool = True) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {device!r}: use cpu or cuda")
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
        check_module_device(self.model, self.device)
        graphs = graphs_for(self.model, dtype)
        self._modules = {"classify": graphs.get("classifier"), "image": graphs.get("image"),
                         "text": graphs.get("text"), "encoder": graphs.get("encoder"), ROUTING: graphs.get(ROUTING)}
        self.functions = specs_from_graphs(graphs)
        self.routing = routing_spec(graphs) if routing else None
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
        if self._cuda is not None:
            out.update(gpu=torch.cuda.get_device_name(self.device), cuda=torch.version.cuda,
                       cuda_graphs=self._cuda.cuda_graphs, pinned_staging=self._cuda.pinned)
        else:
            out["threads"] = torch.get_num_threads()
        return out

    def close(self) -> None:
        if self._cuda is not None:
            self._cuda.close()
        self.model = None
