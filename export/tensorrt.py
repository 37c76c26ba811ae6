"""TensorRT engines from the exported ONNX, written to the TensorRT 10 Python API.

NOT RUN HERE: TensorRT cannot be installed on our machines (its PyPI package needs NVIDIA's own
index) and the GPU machine we can borrow has none. Everything up to the ``tensorrt`` module
boundary is tested: profile shapes, cache keys, the ONNX it consumes, the sequence of builder
calls (against a recording stand-in of the API), and the error when the extra is missing.

Flow: package -> fp32 ONNX with batched experts (verified by ``export.onnx``) -> builder with one
optimization profile over the batch dimension, a persistent timing cache, TF32 off for fp32,
fp16/bf16 flags with the Soft MoE normalisation and softmax layers held in fp32 -> engine cached
under a key of (weights sha256, TensorRT version, GPU name, compute capability, precision,
profile) -> verification of the engine against PyTorch at the profile's min and opt batch.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import ExportError, MissingExtraError

INSTALL_HINT = (
    "TensorRT is not installed: pip install 'softmoe-serve[tensorrt]' "
    "--extra-index-url https://pypi.nvidia.com (needs an NVIDIA GPU and driver)"
)


def import_tensorrt() -> Any:
    """The ``tensorrt`` module, or a MissingExtraError naming the extra to install."""
    try:
        import tensorrt as trt  # noqa: PLC0415 - optional, imported lazily on purpose
    except ImportError:
        raise MissingExtraError(INSTALL_HINT) from None
    if not hasattr(trt, "Builder"):  # the PyPI placeholder package without NVIDIA's wheels
        raise MissingExtraError(INSTALL_HINT)
    return trt


@dataclass(frozen=True)
class BatchProfile:
    """min <= opt <= max batch sizes of the engine's optimization profile."""

    min: int = 1
    opt: int = 8
    max: int = 32

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise ExportError(f"batch profile must satisfy 1 <= min <= opt <= max, got {self.min}/{self.opt}/{self.max}")

    def shapes(self, shape: tuple[int | str, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(min, opt, max) concrete shapes for an input whose symbolic dims are the batch."""

        def fill(b: int) -> tuple[int, ...]:
            return tuple(b if isinstance(d, str) else int(d) for d in shape)

        return fill(self.min), fill(self.opt), fill(self.max)


@dataclass(frozen=True)
class EngineKey:
    """Everything that makes an engine valid for reuse."""

    weights_sha256: str
    graph: str  # classifier | image | text | encoder
    tensorrt_version: str
    gpu_name: str
    compute_capability: str  # e.g. "9.0"
    precision: str
    profile: tuple[int, int, int]
    workspace_bytes: int

    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def file_name(self) -> str:
        return f"{self.graph}-{self.precision}-{self.digest()}.engine"


def gpu_identity() -> tuple[str, str]:
    """(name, compute capability) of CUDA device 0, via torch."""
    import torch

    if not torch.cuda.is_available():
        raise ExportError("building a TensorRT engine needs a CUDA GPU; none is visible to torch")
    major, minor = torch.cuda.get_device_capability(0)
    return torch.cuda.get_device_name(0), f"{major}.{minor}"


# Layer types whose math must stay fp32 in reduced-precision builds: the Soft MoE token norm
# (sum of squares overflows fp16 past norm 256), softmaxes, LayerNorms.
FP32_LAYER_TYPES = ("REDUCE", "SOFTMAX", "NORMALIZATION", "UNARY")


def build_engine(
    trt: Any,
    onnx_path: Path,
    inputs: dict[str, tuple[int | str, ...]],
    precision: str,
    profile: BatchProfile,
    workspace_bytes: int,
    timing_cache: Path,
) -> bytes:
    """Parse ``onnx_path`` and build a serialized engine.

    Args:
        trt: the ``tensorrt`` module.
        onnx_path: the fp32 graph (external data next to it is found by the parser).
        inputs: input name -> shape with symbolic batch dims.
        precision: fp32 (TF32 disabled), fp16 or bf16.
        profile: the batch optimization profile.
        workspace_bytes: workspace memory pool limit.
        timing_cache: loaded if present, written back after the build.
    """
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(f"TensorRT could not parse {onnx_path}: {errors or 'unknown error'}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if precision == "fp32":
        config.clear_flag(trt.BuilderFlag.TF32)  # TF32 alone exceeds the 1e-4 parity budget
    else:
        config.set_flag(trt.BuilderFlag.FP16 if precision == "fp16" else trt.BuilderFlag.BF16)
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        keep = {getattr(trt.LayerType, name) for name in FP32_LAYER_TYPES}
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            if layer.type in keep:
                layer.precision = trt.float32
                for j in range(layer.num_outputs):
                    layer.set_output_type(j, trt.float32)
    opt_profile = builder.create_optimization_profile()
    for name, shape in inputs.items():
        lo, mid, hi = profile.shapes(shape)
        opt_profile.set_shape(name, lo, mid, hi)
    config.add_optimization_profile(opt_profile)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    config.set_timing_cache(cache, False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT failed to build an engine from {onnx_path} (see the log above)")
    timing_cache.parent.mkdir(parents=True, exist_ok=True)
    timing_cache.write_bytes(bytes(cache.serialize()))
    return bytes(serialized)


class EngineRunner:
    """Runs a serialized engine on CUDA with torch tensors (used for verification and serving)."""

    def __init__(self, trt: Any, engine_bytes: bytes) -> None:
        import torch

        self.trt, self.torch = trt, torch
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(engine_bytes)
        if self.engine is None:
            raise ExportError("TensorRT could not deserialize the engine (built for another GPU or version?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]

    def __call__(self, feeds: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        stream = torch.cuda.current_stream()
        keep = []
        for name in self.inputs:
            t = feeds[name].to("cuda").contiguous()
            keep.append(t)
            self.context.set_input_shape(name, tuple(t.shape))
            self.context.set_tensor_address(name, t.data_ptr())
        out = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            out[name] = torch.empty(shape, dtype=torch.float32, device="cuda")
            self.context.set_tensor_address(name, out[name].data_ptr())
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise ExportError("TensorRT execution failed")
        stream.synchronize()
        return {k: v.cpu() for k, v in out.items()}


def export_tensorrt(
    package: str | Path,
    out_dir: str | Path | None = None,
    *,
    precision: str = "fp16",
    profile: BatchProfile = BatchProfile(),
    workspace_gib: float = 4.0,
    log=print,
) -> list[Path]:
    """Build (or reuse from the cache) verified engines for every graph of ``package``.

    Raises:
        MissingExtraError: TensorRT is not installed (checked before any work).
        ExportError: no GPU, parse/build failure, failed verification.
    """
    trt = import_tensorrt()
    if precision not in ("fp32", "fp16", "bf16"):
        raise ExportError(f"unknown precision {precision!r}: use fp32, fp16 or bf16")
    package = Path(package)
    if not package.is_dir():
        raise ExportError(f"model package not found: {package}")
    gpu_name, capability = gpu_identity()
    from .onnx import _weights_sha, export_onnx, tolerance
    from softmoe_models.package import read_package

    pkg = read_package(package)
    weights = _weights_sha(pkg)
    # One directory per weights: models sharing a cache volume never overwrite each other.
    cache_dir = (Path(out_dir) if out_dir else package / "engines") / weights[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    roles = {"classifier": ["classifier"], "two-tower": ["image", "text"], "encoder": ["encoder"]}[pkg.kind]
    keys = {role: EngineKey(
        weights_sha256=weights, graph=role, tensorrt_version=trt.__version__, gpu_name=gpu_name,
        compute_capability=capability, precision=precision, profile=(profile.min, profile.opt, profile.max),
        workspace_bytes=int(workspace_gib * 2**30)) for role in roles}
    paths = {role: cache_dir / key.file_name() for role, key in keys.items()}
    if all(p.is_file() for p in paths.values()):  # verified when built; no re-export on restart
        for p in paths.values():
            log(f"reusing cached engine {p}")
        return list(paths.values())
    onnx_files = {f.role: f for f in export_onnx(package, cache_dir / "fp32.onnx", experts="batched",
                                                 towers="split", log=log)}
    for role, path in paths.items():
        exported = onnx_files[role]
        if not path.is_file():
            engine = build_engine(trt, exported.path, engine_inputs(exported.path), precision, profile,
                                  keys[role].workspace_bytes, cache_dir / f"timing-{trt.__version__}-{capability}.cache")
            _atomic_write(path, engine)
            _atomic_write(path.with_suffix(".json"), (json.dumps(asdict(keys[role]), indent=1) + "\n").encode())
            log(f"built {path}")
        _verify_engine(trt, path, exported.path, profile, precision, tolerance, log)
    return list(paths.values())


def _atomic_write(path: Path, data: bytes) -> None:
    """Write then rename: a replica sharing the cache volume never reads a half-written engine."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def engine_inputs(onnx_path: Path) -> dict[str, tuple[int | str, ...]]:
    """Input names and shapes (symbolic dims as strings) of an ONNX file."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    init = {i.name for i in model.graph.initializer}
    out = {}
    for inp in model.graph.input:
        if inp.name in init:
            continue
        dims = inp.type.tensor_type.shape.dim
        out[inp.name] = tuple(d.dim_param if d.dim_param else d.dim_value for d in dims)
    return out


def _verify_engine(trt, engine: Path, onnx_path: Path, profile: BatchProfile, precision: str, tol_fn, log) -> None:
    """The engine against ONNX Runtime (itself verified against PyTorch) at min and opt batch."""
    import torch

    from .runtime import ort_session

    runner = EngineRunner(trt, engine.read_bytes())
    session = ort_session(onnx_path)
    inputs = engine_inputs(onnx_path)
    for batch in sorted({profile.min, profile.opt}):
        gen = torch.Generator().manual_seed(batch)
        feeds = {}
        for name, shape in inputs.items():
            concrete = tuple(batch if isinstance(d, str) else d for d in shape)
            feeds[name] = (torch.randint(0, 2, concrete, generator=gen) if name == "input_ids"
                           else torch.rand(concrete, generator=gen) * 2 - 1)
        want = dict(zip(runner.outputs, session.run(runner.outputs, {k: v.numpy() for k, v in feeds.items()})))
        got = runner(feeds)
        for name in runner.outputs:
            err = float((got[name].double() - torch.from_numpy(want[name]).double()).abs().max())
            tol = tol_fn(precision, float(abs(want[name]).max()))
            log(f"verify engine {engine.name} {name} batch {batch}: max abs err {err:.2e} (tol {tol:.0e})")
            if err > tol:
                raise ExportError(f"{engine}: engine output {name} differs from ONNX Runtime by {err:.2e} > {tol:.0e}")
