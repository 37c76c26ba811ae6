"""PyTorch backend (CPU or CUDA; fp32, fp16 or bf16), the package's fused routing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from export.graphs import graphs_for
from softmoe_models.package import load_model

from .base import Rows, specs_from_graphs, warm

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class TorchBackend:
    name = "torch"

    def __init__(self, package: str | Path, *, device: str = "cpu", precision: str = "fp32",
                 max_batch_size: int = 8, threads: int = 0) -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda requested but torch sees no CUDA device")
        if threads:
            torch.set_num_threads(threads)
        if device == "cuda":
            # Bitwise determinism and vmoe parity: no TF32, no autotuned kernel choice.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cudnn.benchmark = False
        self.device, self.precision, self.max_batch_size = device, precision, max_batch_size
        dtype = DTYPES[precision]
        self.model = load_model(package, device=device, dtype=None if dtype == torch.float32 else dtype)
        graphs = graphs_for(self.model, dtype)
        self._modules = {"classify": graphs.get("classifier"), "image": graphs.get("image"),
                         "text": graphs.get("text"), "encoder": graphs.get("encoder")}
        self.functions = specs_from_graphs(graphs)
        self._outputs = {fn: spec.outputs for fn, spec in self.functions.items()}

    def run(self, fn: str, inputs: Rows) -> Rows:
        graph = self._modules[fn]
        args = [torch.from_numpy(np.ascontiguousarray(inputs[s.name])).to(self.device) for s in self.functions[fn].inputs]
        with torch.inference_mode():
            out = graph.module(*args)
        outs = out if isinstance(out, tuple) else (out,)
        return {name: t.float().cpu().numpy() for name, t in zip(self._outputs[fn], outs)}

    def warmup(self, batch_sizes: list[int]) -> None:
        warm(self, batch_sizes)

    def describe(self) -> dict:
        return {"backend": "torch", "device": self.device, "precision": self.precision,
                "threads": torch.get_num_threads(), "torch": torch.__version__}

    def close(self) -> None:
        self.model = None
