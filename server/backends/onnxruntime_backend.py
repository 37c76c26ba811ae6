"""ONNX Runtime backend: loads exported .onnx files (exporting the package first if needed).

Execution providers are chosen from what is installed and reported as ORT really uses them:
TensorRT EP and CUDA EP when onnxruntime-gpu is present and ``device='cuda'``, else CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from export.onnx import read_metadata
from export.runtime import ort_session

from .base import FunctionSpec, InputSpec, Rows, warm

ROLE_TO_FN = {"classifier": "classify", "image": "image", "text": "text", "encoder": "encoder"}


def cache_root(cache_dir: str) -> Path:
    return Path(cache_dir or os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / ("" if cache_dir else "softmoe-serve")


def exported_files(package: Path, cache_dir: str, precision: str, log=print) -> list[Path]:
    """The package's ONNX graphs (split towers), exported once and cached by weights + settings."""
    from export.onnx import export_onnx
    from softmoe_models import __version__

    h = hashlib.sha256()
    with open(package / "model.safetensors", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    h.update(json.dumps([precision, "per-expert", 20, __version__]).encode())
    out = cache_root(cache_dir) / "onnx" / h.hexdigest()[:24]
    done = out / "done.json"
    if done.is_file():
        return [out / name for name in json.loads(done.read_text())]
    out.mkdir(parents=True, exist_ok=True)
    files = export_onnx(package, out / "model.onnx", precision=precision, towers="split", log=log)
    done.write_text(json.dumps([f.path.name for f in files]))
    return [f.path for f in files]


class OnnxRuntimeBackend:
    name = "onnxruntime"

    def __init__(self, files: list[Path], *, device: str = "cpu", max_batch_size: int = 8, threads: int = 0) -> None:
        import onnxruntime as ort

        available = ort.get_available_providers()
        providers = ["CPUExecutionProvider"]
        if device == "cuda":
            gpu = [p for p in ("TensorrtExecutionProvider", "CUDAExecutionProvider") if p in available]
            if not gpu:
                raise RuntimeError("--device cuda with onnxruntime needs onnxruntime-gpu (pip install 'softmoe-serve[gpu]')")
            providers = gpu + providers
        self.device, self.max_batch_size = device, max_batch_size
        self.sessions = {}
        self.functions: dict[str, FunctionSpec] = {}
        self.metadata: dict[str, dict] = {}
        for path in files:
            meta = read_metadata(path)
            fn = ROLE_TO_FN.get(meta.get("graph", ""))
            if fn is None:
                continue
            sess = ort_session(path, threads=threads or None, providers=providers)
            self.sessions[fn] = sess
            self.metadata[fn] = meta
            inputs = tuple(
                InputSpec(i.name, tuple(int(d) for d in i.shape[1:]), np.dtype(np.int64 if "int64" in i.type else np.float32))
                for i in sess.get_inputs()
            )
            self.functions[fn] = FunctionSpec(inputs, tuple(o.name for o in sess.get_outputs()))
        self.providers = {fn: s.get_providers() for fn, s in self.sessions.items()}

    def run(self, fn: str, inputs: Rows) -> Rows:
        sess = self.sessions[fn]
        names = self.functions[fn].outputs
        outs = sess.run(list(names), {k: np.ascontiguousarray(v) for k, v in inputs.items()})
        return dict(zip(names, outs))

    def warmup(self, batch_sizes: list[int]) -> None:
        warm(self, batch_sizes)

    def describe(self) -> dict:
        import onnxruntime as ort

        return {"backend": "onnxruntime", "device": self.device, "providers": self.providers, "onnxruntime": ort.__version__}

    def close(self) -> None:
        self.sessions.clear()
