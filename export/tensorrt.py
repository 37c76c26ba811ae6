"""TensorRT engines from the exported ONNX, written to the TensorRT 10 Python API.

NOT RUN HERE: TensorRT cannot be installed on our machines (its PyPI package needs NVIDIA's own
index) and the GPU machine we can borrow has none. Everything up to the ``tensorrt`` module
boundary is tested: profile shapes, cache keys, the ONNX it consumes, the sequence of builder
calls (against a recording stand-in of the API), and the error when the extra is missing.

Flow: package -> ONNX at the engine's precision with batched experts (verified by
``export.onnx``; fp16/bf16 graphs keep the Soft MoE normalisation, softmaxes and LayerNorms in
fp32 by explicit Casts; sparse V-MoE routing in the ops and types TensorRT 10 imports,
``export.op_support``, checked again before the build) -> a strongly typed network (the graph's
types decide; no weak-typing precision flags) with one optimization profile over the batch
dimension, a persistent timing cache, TF32 off -> engine cached under a key of (weights sha256, TensorRT version, GPU name,
compute capability, precision, profile, plus config.json, exporter versions and the ONNX
settings) -> verification of the engine against fp32 PyTorch at the profile's min, opt and max
batch, text engines on the package's tokenizer applied to real prompts -> only then published.

Cache (``export.cache``): the engines of a package are one entry under ``ROOT/engines`` (ROOT is
``--cache-dir``/``$SOFTMOE_CACHE_DIR``, else ``~/.cache/softmoe-serve``; never inside the package,
which is read-only in the images). They are built and verified in a temp dir under the entry's
file lock and published by one rename; every start checks them against their sha256 and
rebuilds a corrupt entry. The timing cache, shared by the builds of one TensorRT version and
compute capability, carries its own sha256 and is replaced atomically (temp file + os.replace).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from softmoe_models import routing
from softmoe_models.config import PRECISIONS
from softmoe_models.package import load_model, read_package
from softmoe_models.tokenizer import Tokenizer

from . import cache
from .errors import ExportError, MissingExtraError
from .graphs import graphs_for
from .onnx import DEFAULT_OPSET, export_onnx, tolerance
from .op_support import tensorrt_plugins, tensorrt_problems

INSTALL_HINT = (
    "TensorRT is not installed: pip install 'softmoe-serve[tensorrt]' "
    "--extra-index-url https://pypi.nvidia.com (needs an NVIDIA GPU and driver)"
)


def import_tensorrt() -> Any:
    """The ``tensorrt`` module, or a MissingExtraError naming the extra to install."""
    try:  # TensorRT: an optional extra, imported only when asked for
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

    weights_digest: str  # BLAKE3 of model.safetensors (export.cache.package_digests)
    graph: str  # classifier | image | text | encoder
    tensorrt_version: str
    gpu_name: str
    compute_capability: str  # e.g. "9.0"
    precision: str
    profile: tuple[int, int, int]
    workspace_bytes: int
    config_digest: str = ""  # BLAKE3 of config.json: labels, preprocessing and text contract end up in the graph's metadata

    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def file_name(self) -> str:
        return f"{self.graph}-{self.precision}-{self.digest()}.engine"


def gpu_identity() -> tuple[str, str]:
    """(name, compute capability) of CUDA device 0, via torch."""
    if not torch.cuda.is_available():
        raise ExportError("building a TensorRT engine needs a CUDA GPU; none is visible to torch")
    major, minor = torch.cuda.get_device_capability(0)
    return torch.cuda.get_device_name(0), f"{major}.{minor}"



def init_plugins(trt: Any, logger: Any) -> None:
    """Register TensorRT's standard plugins (libnvinfer_plugin) with its plugin registry, once per
    process: the ONNX parser takes ``ScatterElements`` with a reduction (Experts Choice's combine,
    ``export.op_support``) as the standard ``ScatterElements`` plugin, and an engine holding it
    deserializes only where the plugin is registered."""
    register = getattr(trt, "init_libnvinfer_plugins", None)  # absent only in test stand-ins of the API
    if register is not None:
        register(logger, "")


def build_engine(
    trt: Any,
    onnx_path: Path,
    inputs: dict[str, tuple[int | str, ...]],
    precision: str,
    profile: BatchProfile,
    workspace_bytes: int,
    timing_cache: Path,
    log=print,
) -> bytes:
    """Parse ``onnx_path`` into a strongly typed network and build a serialized engine.

    Strongly typed (TensorRT's replacement for the weak-typing precision flags, deprecated in
    10.12 and gone in 11): every tensor keeps the type the ONNX graph gives it, so the graph
    exported at the target precision decides what runs in fp16/bf16 and what stays fp32 (the
    Soft MoE token norm, softmaxes and LayerNorms, held in fp32 by explicit Casts at export); the
    builder may not pick a lower precision on its own. TF32 stays off for the fp32 parts.

    Args:
        trt: the ``tensorrt`` module.
        onnx_path: the graph exported at ``precision`` (external data next to it is found).
        inputs: input name -> shape with symbolic batch dims.
        precision: fp32, fp16 or bf16: the precision ``onnx_path`` was exported at.
        profile: the batch optimization profile.
        workspace_bytes: workspace memory pool limit.
        timing_cache: loaded if present and its sha256 matches, written back atomically after
            the build (callers hold the cache entry's lock).
        log: where progress lines go.
    """
    logger = trt.Logger(trt.Logger.WARNING)
    init_plugins(trt, logger)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(f"TensorRT could not parse {onnx_path}: {errors or 'unknown error'}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    config.clear_flag(trt.BuilderFlag.TF32)  # TF32 alone exceeds the fp32 parity budget
    log(f"building a strongly typed {precision} engine from {onnx_path.name}")
    opt_profile = builder.create_optimization_profile()
    for name, shape in inputs.items():
        lo, mid, hi = profile.shapes(shape)
        opt_profile.set_shape(name, lo, mid, hi)
    config.add_optimization_profile(opt_profile)
    cache = config.create_timing_cache(read_timing_cache(timing_cache, log))
    config.set_timing_cache(cache, False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT failed to build an engine from {onnx_path} (see the log above)")
    write_timing_cache(timing_cache, bytes(cache.serialize()))
    return bytes(serialized)


TIMING_MAGIC = b"softmoe-timing-cache/1 sha256="


def read_timing_cache(path: Path, log=print) -> bytes:
    """The timing cache's bytes, or b"" (a fresh cache) when missing or not matching its sha256."""
    if not path.is_file():
        return b""
    header, _, data = path.read_bytes().partition(b"\n")
    if header != TIMING_MAGIC + hashlib.sha256(data).hexdigest().encode():
        log(f"ignoring the timing cache {path}: it does not match its sha256 (it will be rewritten)")
        return b""
    return data


def write_timing_cache(path: Path, data: bytes) -> None:
    """``data`` behind a header with its sha256, replacing ``path`` atomically."""
    _atomic_write(path, TIMING_MAGIC + hashlib.sha256(data).hexdigest().encode() + b"\n" + data)


class EngineRunner:
    """Runs a serialized engine on CUDA with torch tensors (used for verification and serving)."""

    def __init__(self, trt: Any, engine_bytes: bytes) -> None:
        self.trt, self.torch = trt, torch
        logger = trt.Logger(trt.Logger.WARNING)
        init_plugins(trt, logger)
        self.runtime = trt.Runtime(logger)
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

    Args:
        package: model package directory.
        out_dir: the engine cache (default ``default_root() / "engines"``); one entry per key.
        precision: fp32 (TF32 off), fp16 or bf16.
        profile: the batch optimization profile.
        workspace_gib: workspace memory pool limit.
        log: where progress lines go.

    Returns:
        The engine files of the published, hash-checked cache entry, one per graph.

    Raises:
        MissingExtraError: TensorRT is not installed (checked before any work).
        ExportError: no GPU, parse/build failure, failed verification (nothing is published).
    """
    trt = import_tensorrt()
    if precision not in PRECISIONS:
        raise ExportError(f"unknown precision {precision!r}: use fp32, fp16 or bf16")
    package = Path(package)
    if not package.is_dir():
        raise ExportError(f"model package not found: {package}")
    gpu_name, capability = gpu_identity()
    pkg = read_package(package)
    digests = cache.package_digests(package)
    root = Path(out_dir) if out_dir else cache.default_root() / "engines"
    roles = {"classifier": ["classifier"], "two-tower": ["image", "text"], "encoder": ["encoder"]}[pkg.kind]
    with_routing = routing.any_layout(pkg.config) is not None
    if with_routing:  # the /v1/routing graph: its own engine, the plain ones unchanged
        roles = [*roles, "routing"]
    keys = {role: EngineKey(
        weights_digest=digests["model.safetensors"], graph=role, tensorrt_version=trt.__version__, gpu_name=gpu_name,
        compute_capability=capability, precision=precision, profile=(profile.min, profile.opt, profile.max),
        workspace_bytes=int(workspace_gib * 2**30), config_digest=digests["config.json"]) for role in roles}
    # The graph at the engine's precision (strongly typed networks take their types from it),
    # batched experts (one matmul over the stacked experts: what wins on GPU).
    onnx_settings = dict(opset=DEFAULT_OPSET, precision=precision, experts="batched", towers="split",
                         routing=with_routing)
    inputs = {
        "artifact": "tensorrt",
        "package": digests,
        "engines": [asdict(k) for k in keys.values()],
        "exporter": cache.versions("softmoe-serve", "torch", "onnxscript", "onnx-ir", "onnx"),
        "onnx": onnx_settings,
        "runtime": {"name": "tensorrt", "version": trt.__version__},
        "device": {"gpu": gpu_name, "compute_capability": capability},
        "verified_with": cache.versions("onnxruntime", "onnxruntime-gpu"),
    }
    timing = root / f"timing-{trt.__version__}-{capability}.cache"

    def build(tmp: Path) -> list[str]:
        work = tmp / "onnx"  # the graphs the engines come from; not part of the entry
        exported = {f.role: f for f in export_onnx(package, work / f"{precision}.onnx", log=log, **onnx_settings)}
        reference = _fp32_reference(package)
        names = []
        for role, key in keys.items():
            onnx_path = exported[role].path
            problems = tensorrt_problems(onnx_path)
            if problems:  # before minutes of building: what TensorRT 10's parser would refuse
                raise ExportError(f"{onnx_path.name} has what TensorRT 10 does not take: {'; '.join(problems[:5])}")
            plugins = tensorrt_plugins(onnx_path)
            if plugins:
                log(f"{onnx_path.name} uses TensorRT's standard plugin(s) {', '.join(plugins)} (libnvinfer_plugin)")
            engine = tmp / key.file_name()
            engine.write_bytes(build_engine(trt, onnx_path, engine_inputs(onnx_path), precision, profile,
                                            key.workspace_bytes, timing, log=log))
            engine.with_suffix(".json").write_text(json.dumps(asdict(key), indent=1) + "\n")
            feeds = verification_inputs(package, role, engine_inputs(onnx_path), profile)
            _verify_engine(trt, engine, reference[role], feeds, precision, tolerance, log)  # raises: nothing published
            log(f"built and verified {engine.name}")
            names.append(engine.name)
        shutil.rmtree(work)
        return names

    entry = cache.build(root, cache.cache_key(inputs), build, inputs=inputs, log=log)
    engines = [entry.files[name] for name in entry.meta]
    for path in engines:
        log(f"{'published' if entry.built else 'reusing cached'} engine {path} (hash-checked)")
    return engines


def _atomic_write(path: Path, data: bytes) -> None:
    """Write a temp file in the same directory, fsync, then rename over ``path``: a replica sharing
    the volume reads the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from replicas running as another user
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def engine_inputs(onnx_path: Path) -> dict[str, tuple[int | str, ...]]:
    """Input names and shapes (symbolic dims as strings) of an ONNX file."""
    # onnx: heavy, and no `softmoe` command loads it until it reads or writes a graph
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


def _fp32_reference(package: Path) -> dict[str, Any]:
    """role -> a function of torch feeds giving the fp32 PyTorch outputs (the ground truth)."""
    graphs = graphs_for(load_model(package), torch.float32)

    def runner(graph):
        def run(feeds: dict[str, Any]) -> dict[str, Any]:
            with torch.inference_mode():
                out = graph.module(*(feeds[spec.name] for spec in graph.inputs))
            outs = out if isinstance(out, tuple) else (out,)
            return dict(zip(graph.outputs, outs))
        return run

    return {role: runner(g) for role, g in graphs.items()}


# Prompts for verifying text engines on real tokenised text (the package's labels fill them when
# it has labels): punctuation, case, digits and long prompts that reach the sticky-EOS position.
VERIFY_PROMPTS = (
    "a photo of a {}.", "A PICTURE of the {}!", "an image of a small {}, taken at night", "{}",
    "This is a photo of {} number 7 (seven) in a very long caption that keeps on going well past the "
    "tokenizer's maximum length so the last position holds the sticky EOS token",
)
VERIFY_WORDS = ("cat", "dog", "zero", "one", "tree", "house", "bird", "boat")


def verification_inputs(package: Path, role: str, shapes: dict[str, tuple[int | str, ...]],
                        profile: BatchProfile, seed: int = 0) -> list[dict[str, Any]]:
    """Feeds at the profile's min, opt and max batch: image-like values in [-1, 1] for pixel
    inputs, and for text the package's tokenizer on real prompts (random valid ids where the
    package has no tokenizer), never the {0, 1} ids that a text engine could pass by accident."""
    pkg = read_package(package)
    tokenizer = None
    if role == "text" and pkg.tokenizer_path is not None:
        tokenizer = Tokenizer.from_contract(pkg.tokenizer_path, pkg.text)
    words = list(pkg.labels or VERIFY_WORDS)
    prompts = [t.replace("{}", w) for w in words for t in VERIFY_PROMPTS]
    feeds = []
    for batch in sorted({profile.min, profile.opt, profile.max}):
        gen = torch.Generator().manual_seed(seed + batch)
        feed = {}
        for name, shape in shapes.items():
            concrete = tuple(batch if isinstance(d, str) else d for d in shape)
            if name == "input_ids":
                if tokenizer is not None:
                    rows = [prompts[(i * 7 + batch) % len(prompts)] for i in range(batch)]
                    feed[name] = torch.from_numpy(tokenizer(rows).astype("int64"))
                else:
                    vocab = int(pkg.config.text.vocab_size)
                    feed[name] = torch.randint(0, vocab, concrete, generator=gen)
            else:
                feed[name] = torch.rand(concrete, generator=gen) * 2 - 1
        feeds.append(feed)
    return feeds


def _verify_engine(trt, engine: Path, reference, feeds: list[dict[str, Any]], precision: str, tol_fn, log) -> None:
    """The engine against fp32 PyTorch on ``feeds`` (every batch size of the profile)."""
    runner = EngineRunner(trt, engine.read_bytes())
    for feed in feeds:
        batch = next(iter(feed.values())).shape[0]
        want = reference(feed)
        got = runner(feed)
        for name in runner.outputs:
            ref = want[name].double()
            err = float((got[name].double() - ref).abs().max())
            tol = tol_fn(precision, float(ref.abs().max()))
            log(f"verify engine {engine.name} {name} batch {batch}: max abs err {err:.2e} (tol {tol:.0e})")
            if err > tol:
                raise ExportError(f"{engine}: engine output {name} differs from fp32 PyTorch by {err:.2e} > {tol:.0e}")