"""Served models: a package (or an exported .onnx) + a backend + one batcher queue per function."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from softmoe_models.package import read_package
from softmoe_models.preprocess import PreprocessConfig
from softmoe_models.tokenizer import Tokenizer

from .backends.base import Backend
from .batching.batcher import Batcher, ModelQueue
from .metrics import Metrics
from .settings import Settings

DEFAULT_TEMPLATES = ["a photo of a {}.", "a picture of a {}.", "an image of a {}.", "{}"]


class ModelLoadError(Exception):
    """A model could not be loaded; the server does not start."""


@dataclass
class ServedModel:
    name: str
    kind: str  # classifier | two-tower | encoder
    source: str
    backend: Backend
    preprocess: PreprocessConfig | None
    labels: list[str] | None = None
    head_activation: str | None = None
    tokenizer: Tokenizer | None = None
    text_contract: dict[str, Any] = field(default_factory=dict)
    logit_scale: float | None = None
    logit_bias: float | None = None
    templates: list[str] = field(default_factory=lambda: list(DEFAULT_TEMPLATES))
    vocab_size: int | None = None
    queues: dict[str, ModelQueue] = field(default_factory=dict)
    proven_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # strict mode, per function
    ready: bool = False

    def can(self, fn: str) -> bool:
        return fn in self.backend.functions


def parse_spec(spec: str) -> tuple[str | None, Path]:
    """``NAME=PATH`` or ``PATH``."""
    if "=" in spec and not Path(spec).exists():
        name, _, path = spec.partition("=")
        return name.strip() or None, Path(path)
    return None, Path(spec)


def load_served_model(spec: str, settings: Settings, log=print) -> ServedModel:
    name, path = parse_spec(spec)
    if not path.exists():
        raise ModelLoadError(f"model path not found: {path}")
    if path.is_file() and path.suffix == ".onnx":
        return _from_onnx(name or path.stem, path, settings)
    try:
        pkg = read_package(path)
    except Exception as e:  # PackageError and friends: one line
        raise ModelLoadError(str(e)) from None
    name = name or path.name
    backend = _backend_for_package(path, settings, log)
    model = ServedModel(
        name=name, kind=pkg.kind, source=str(path), backend=backend,
        preprocess=pkg.preprocess if pkg.meta.get("preprocess") else None,
        labels=pkg.labels, head_activation=pkg.head_activation, text_contract=pkg.text,
        templates=pkg.meta.get("zero_shot_templates") or list(DEFAULT_TEMPLATES),
    )
    if pkg.tokenizer_path is not None:
        model.tokenizer = Tokenizer.from_contract(pkg.tokenizer_path, pkg.text)
    if pkg.kind == "two-tower":
        model.logit_scale, model.logit_bias = _scale_bias(path)
        model.vocab_size = pkg.config.text.vocab_size
    return model


def _scale_bias(package: Path) -> tuple[float, float]:
    from safetensors import safe_open

    with safe_open(str(package / "model.safetensors"), "pt") as f:
        s = float(f.get_tensor("s").exp())
        b = float(f.get_tensor("b")) if "b" in f.keys() else 0.0
    return s, b


def _backend_for_package(path: Path, settings: Settings, log) -> Backend:
    from .backends.cuda import resolve_precision

    precision = resolve_precision(settings.backend, settings.device, settings.precision)
    if settings.backend == "torch":
        from .backends.torch_backend import TorchBackend

        return TorchBackend(path, device=settings.device, precision=precision,
                            max_batch_size=settings.max_batch_size, threads=settings.threads,
                            cuda_graphs=settings.cuda_graphs, pinned_staging=settings.pinned_staging)
    if settings.backend == "onnxruntime":
        from .backends.onnxruntime_backend import OnnxRuntimeBackend, exported_files

        files = exported_files(path, settings.cache_dir, precision, log=log, device=settings.device)
        return OnnxRuntimeBackend(files, device=settings.device, max_batch_size=settings.max_batch_size,
                                  threads=settings.threads, cuda_graph=settings.ort_cuda_graph)
    from .backends.tensorrt_backend import TensorRTBackend

    return TensorRTBackend(path, precision=precision, max_batch_size=settings.max_batch_size,
                           cache_dir=settings.cache_dir)


def _from_onnx(name: str, path: Path, settings: Settings) -> ServedModel:
    """An exported file on its own: everything the server needs is in its metadata."""
    from export.onnx import read_metadata

    from .backends.onnxruntime_backend import OnnxRuntimeBackend

    if settings.backend != "onnxruntime":
        raise ModelLoadError(f"{path}: an .onnx file is served with --backend onnxruntime")
    meta = read_metadata(path)
    if not meta.get("graph"):
        raise ModelLoadError(f"{path}: not exported by `softmoe export onnx` (no softmoe.* metadata)")
    files = [path]
    if meta["graph"] == "two-tower":  # serve the per-tower siblings
        stem = path.name[: -len(".onnx")]
        files = [path.with_name(f"{stem}.image.onnx"), path.with_name(f"{stem}.text.onnx")]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{path}: a two-tower model is served from its tower files; missing {missing}")
    elif meta["graph"] in ("image", "text"):
        stem = path.name[: -len(f".{meta['graph']}.onnx")]
        files = [p for p in (path.with_name(f"{stem}.image.onnx"), path.with_name(f"{stem}.text.onnx")) if p.is_file()]
    backend = OnnxRuntimeBackend(files, device=settings.device, max_batch_size=settings.max_batch_size,
                                 threads=settings.threads, cuda_graph=settings.ort_cuda_graph)
    pkg_meta = meta.get("package_config") or {}
    model = ServedModel(
        name=name, kind=meta["kind"], source=str(path), backend=backend,
        preprocess=PreprocessConfig.from_dict(meta["preprocess"]) if meta.get("preprocess") else None,
        labels=meta.get("labels"), head_activation=pkg_meta.get("head_activation"), text_contract=pkg_meta.get("text") or {},
        templates=pkg_meta.get("zero_shot_templates") or list(DEFAULT_TEMPLATES),
    )
    if meta["kind"] == "two-tower":
        model.vocab_size = int(pkg_meta["model"]["text"]["vocab_size"])
    text_meta = next((m for m in backend.metadata.values() if "tokenizer_b64" in m), None)
    if text_meta is not None:  # loaded from the bytes: no file, no temp dir left behind
        model.tokenizer = Tokenizer.from_contract(base64.b64decode(text_meta["tokenizer_b64"]), model.text_contract)
    scale_meta = next((m for m in backend.metadata.values() if "logit_scale" in m), None)
    if scale_meta is not None:
        model.logit_scale, model.logit_bias = float(scale_meta["logit_scale"]), float(scale_meta["logit_bias"])
    return model


def attach_queues(model: ServedModel, batcher: Batcher, settings: Settings, metrics: Metrics) -> None:
    """One batcher queue per function of the model, all on the device's one worker."""
    for fn in model.backend.functions:
        def call(rows, fn=fn, backend=model.backend):
            return backend.run(fn, rows)

        model.queues[fn] = batcher.add_queue(ModelQueue(
            f"{model.name}/{fn}", model.name, call, max_batch_size=settings.max_batch_size,
            max_delay_s=settings.max_delay_ms / 1000, max_queue=settings.max_queue,
            pad=settings.strict_determinism, metrics=metrics,
        ))


def warmup(model: ServedModel, settings: Settings, log=print) -> None:
    """Every batch shape the server will run: the proven padded shapes (strict) or 1..max (loose)."""
    if not settings.warmup:
        return
    if settings.strict_determinism:
        model.backend.warmup([settings.max_batch_size])
        if settings.proven_shapes:
            prove_shapes(model, settings.max_batch_size, log)
        return
    model.backend.warmup(sorted({1, 2, settings.max_batch_size}))


def candidate_shapes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below ``max_batch_size``: the smaller padded shapes worth proving."""
    out, s = [], 1
    while s < max_batch_size:
        out.append(s)
        s *= 2
    return out


def prove_shapes(model: ServedModel, max_batch_size: int, log=print, seed: int = 0) -> dict[str, tuple[int, ...]]:
    """Prove, on this machine and backend, which smaller padded shapes are bitwise equal to the maximal one.

    For each model function: ``max_batch_size`` random rows are run at the maximal shape (the
    reference); then, for each candidate shape ``s``, the same rows in consecutive calls of ``s``
    rows (the last one zero-padded as the batcher pads), so every slot position of ``s`` carries a
    different random row. ``s`` is proven when every row's every output is bitwise equal to the
    reference row. Unproven shapes are never used; the queue falls back to the maximal shape.
    This also warms every shape it proves.
    """
    rng = np.random.default_rng(seed)
    proven: dict[str, tuple[int, ...]] = {}
    for fn, spec in model.backend.functions.items():
        rows = {}
        for s in spec.inputs:
            shape = (max_batch_size, *s.shape)
            if np.issubdtype(s.dtype, np.integer):
                rows[s.name] = rng.integers(0, model.vocab_size or 2, shape).astype(s.dtype)
            else:
                rows[s.name] = rng.uniform(-1, 1, shape).astype(s.dtype)
        reference = model.backend.run(fn, rows)
        good = []
        for size in candidate_shapes(max_batch_size):
            same = True
            for start in range(0, max_batch_size, size):
                chunk = {}
                for name, arr in rows.items():
                    part = np.zeros((size, *arr.shape[1:]), dtype=arr.dtype)
                    got = arr[start:start + size]
                    part[:len(got)] = got
                    chunk[name] = part
                out = model.backend.run(fn, chunk)
                n = min(size, max_batch_size - start)
                if any(not np.array_equal(out[k][:n], reference[k][start:start + n]) for k in reference):
                    same = False
                    break
            if same:
                good.append(size)
        shapes = tuple(good) + (max_batch_size,)
        proven[fn] = shapes
        queue = model.queues.get(fn)
        if queue is not None:
            queue.shapes = shapes
        rejected = sorted(set(candidate_shapes(max_batch_size)) - set(good))
        log(f"{model.name}/{fn}: padded shapes proven bitwise equal to {max_batch_size}: {list(shapes)}"
            + (f"; not used (outputs differ): {rejected}" if rejected else ""))
    model.proven_shapes = proven
    return proven
