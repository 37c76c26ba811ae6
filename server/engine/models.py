"""Served models: a package (or an exported .onnx) + a backend + one batcher queue per function."""

from __future__ import annotations

import base64
import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from export import cache
from export.onnx import read_metadata
from export.phases import Phases, current, phase, recording
from softmoe_models import routing as routing_lib
from softmoe_models.config import from_dict
from softmoe_models.package import read_package
from softmoe_models.preprocess import PreprocessConfig
from softmoe_models.tokenizer import Tokenizer

from server.backends.base import PIXELS, ROUTING, Backend
from server.backends.cuda import resolve_precision
from server.backends.onnxruntime_backend import OnnxRuntimeBackend, exported_files
from server.backends.tensorrt_backend import TensorRTBackend
from server.backends.torch_backend import TorchBackend
from server.batching.batcher import Batcher, ModelQueue, Rows
from server.errors import ModelLoadError
from server.metrics import Metrics
from server.settings import Settings

DEFAULT_TEMPLATES = ["a photo of a {}.", "a picture of a {}.", "an image of a {}.", "{}"]


@dataclass
class RoutingState:
    """A model's routing function (/v1/routing) and its statistics: which calls of the plain image
    function are sampled, the live window, the reference profile, the metric series."""

    layout: Any  # routing_lib.Layout (Soft MoE) or sparse_routing.SparseLayout (sparse V-MoE)
    plain: str  # the image function whose calls are sampled: classify | image
    profile: dict[str, Any] | None  # the package's reference routing profile
    window: routing_lib.Window
    sample: int  # statistics from 1 in `sample` calls of `plain` (0: off)
    shared: bool = False  # a sampled call runs the routing graph alone (start-up proved it bitwise equal)
    lone: bool = False  # --wide-lone-batches: a call that runs alone runs the routing graph (when shared)
    beside: bool = True  # --wide-lone-batches: calls may run beside others (a full batch is long enough)
    why: str = ""  # why calls run alone or beside (start-up's measurement or the flag), for the start-up line
    calls: int = 0
    series: dict[str, Any] = field(default_factory=dict)  # the model's metric children

    def sampling(self, call, backend: Backend):
        """``call`` (the plain function's queue function), returning the statistics too on 1 call in
        ``sample``: from the routing graph alone when ``shared``, else from a second call. Runs on
        the worker; the rows of padding are dropped by the batcher like any output row."""
        names = backend.functions[self.plain].outputs

        lock = threading.Lock()  # concurrent batches: workers share the count

        def run(rows):
            with lock:
                self.calls += 1
                sampled = bool(self.sample) and self.calls % self.sample == 0
            if not sampled:
                return call(rows)
            if self.shared:
                out = backend.run(ROUTING, rows)
                return {k: out[k] for k in (*names, *self.stats)}
            out = call(rows)
            extra = backend.run(ROUTING, rows)
            return {**out, **{k: extra[k] for k in self.stats}}

        return run

    def lanes(self, call, backend: Backend):
        """``(plan, fn)`` of the plain function's queue under ``--wide-lone-batches``
        (``ModelQueue.plan`` and ``.fn``). The plan decides on the worker, under the batcher's lock:
        beside other calls, ``call`` (the plain graph's session, a share of the threads); alone, the
        routing graph's (every thread; its plain outputs proven bitwise equal, ``shared``); a sampled
        call alone, with the statistics. ``fn`` then runs what its worker's plan decided. Until
        proven (or if the proof failed), every call runs beside, as ``sampling`` has it."""
        names = backend.functions[self.plain].outputs
        fallback = self.sampling(call, backend) if self.sample else call
        lock = threading.Lock()
        decided = threading.local()  # the lane of the call this worker is about to make

        def plan(beside: bool) -> bool:
            if not self.shared:
                decided.lane = None
                return True
            with lock:
                self.calls += 1
                sampled = bool(self.sample) and self.calls % self.sample == 0
            decided.lane = "stats" if sampled else "beside" if beside and self.beside else "alone"
            return decided.lane == "beside"

        def run(rows):
            lane = getattr(decided, "lane", None)
            if lane is None:
                return fallback(rows)
            if lane == "beside":
                return call(rows)
            out = backend.run(ROUTING, rows)
            return {k: out[k] for k in (*names, *(self.stats if lane == "stats" else ()))}

        return plan, run

    def count_drops(self, dropped: np.ndarray) -> None:
        """Add ``(k, L)`` dropped token choices of k routed images to the drop counters (with the
        k * choices-per-image they were dropped out of, so the rate is one ratio of two counters)."""
        if "dropped" not in self.series:
            return
        for counter, total, n in zip(self.series["dropped"], self.series["choices"], np.asarray(dropped).sum(axis=0)):
            counter.inc(float(n))
            total.inc(float(len(dropped) * self.layout.choices))

    @property
    def stats(self) -> tuple[str, ...]:
        """The per-image statistics a sampled call returns (sparse models add ``dropped_choices``)."""
        return routing_lib.stats_of(self.layout)

    def bind(self, metrics: Metrics, model: str) -> None:
        """Create the model's routing series and keep them (no label lookups on the hot path)."""
        layers = [str(b) for b in self.layout.layers]
        metrics.init_routing(model, self.layout.layers, self.layout.num_experts, self.profile is not None)
        self.series = {
            "dispatch": [metrics.routing_dispatch_entropy.labels(model, b) for b in layers],
            "combine": [metrics.routing_combine_entropy.labels(model, b) for b in layers],
            "share": [[metrics.routing_expert_share.labels(model, b, str(e)) for e in range(self.layout.num_experts)]
                      for b in layers],
            "window": metrics.routing_window_images.labels(model),
            "drift": metrics.routing_drift.labels(model) if self.profile is not None else None,
            "baseline": metrics.routing_drift_baseline.labels(model) if self.profile is not None else None,
        }
        if "dropped_choices" in self.stats:
            self.series["dropped"] = [metrics.routing_dropped_choices.labels(model, b) for b in layers]
            self.series["choices"] = [metrics.routing_token_choices.labels(model, b) for b in layers]

    def record(self, outputs: list[dict[str, np.ndarray]]) -> None:
        """Take the statistics out of ``outputs`` (one dict per item, changed in place) and update the
        histograms, the live window, the expert shares and the drift."""
        rows = []
        for out in outputs:
            stats = [out.pop(k, None) for k in self.stats]
            if stats[0] is not None:
                rows.append(stats)
        if not rows or not self.series:
            return
        h_dispatch, h_combine, shares, *dropped = (np.stack(col) for col in zip(*rows))  # (k, L), (k, L), (k, L, n)
        if dropped:
            self.count_drops(dropped[0])
        for i, (hd, hc) in enumerate(zip(h_dispatch.T.tolist(), h_combine.T.tolist())):
            for v in hd:
                self.series["dispatch"][i].observe(v)
            for v in hc:
                self.series["combine"][i].observe(v)
        self.window.add(shares)
        for gauges, mean in zip(self.series["share"], self.window.mean().tolist()):
            for g, v in zip(gauges, mean):
                g.set(v)
        self.series["window"].set(self.window.count)
        if self.profile is not None:
            self.series["drift"].set(self.window.drift(self.profile))
            self.series["baseline"].set(self.window.baseline(self.profile))


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
    routing: RoutingState | None = None  # image models with Soft MoE layers (--routing)
    ready: bool = False
    opened_s: float = 0.0  # seconds its package took to open (backend, export or cache): part of its load time
    phases: Phases = field(default_factory=Phases)  # where its load time went (export.phases)
    inherited: bool = False  # its start-up findings are those of the version it replaced (proofs.carries)
    proofs_from: str = ""  # the cache entry its start-up findings were read from (proof_cache), if any

    def can(self, fn: str) -> bool:
        return fn in self.backend.functions or (fn == ROUTING and self.routing is not None)

    @property
    def pixel_input(self) -> str | None:
        """The name of the image functions' input: ``pixel_values`` (float32) or ``pixels`` (uint8
        transfer); None for a model without images."""
        for fn in ("classify", "image"):
            spec = self.backend.functions.get(fn)
            if spec is not None:
                return next((s.name for s in spec.inputs if s.name in ("pixel_values", PIXELS)), None)
        return None


def parse_spec(spec: str) -> tuple[str | None, Path]:
    """``NAME=PATH`` or ``PATH``."""
    if "=" in spec and not Path(spec).exists():
        name, _, path = spec.partition("=")
        return name.strip() or None, Path(path)
    return None, Path(spec)


def load_served_model(spec: str, settings: Settings, log=print, background: bool = False) -> ServedModel:
    """The package (or .onnx) of ``spec`` (``NAME=PATH`` or ``PATH``) on its backend; ModelLoadError
    (one line) when it cannot be served. ``background``: the process serves other batches
    meanwhile, so the backend's set-up runs at the lowest CPU priority where it can (ONNX Runtime
    on CPU: ``export.runtime.BackgroundBuiltSession``). Its phases (hash, export or bind, session)
    are counted in ``ServedModel.phases``. ``--jpeg-draft`` applies to it here (``jpeg_draft``)."""
    started = time.perf_counter()
    name, path = parse_spec(spec)  # the cache entries the load builds name the model and package (softmoe cache)
    # the load's own record, if the engine opened one
    with recording(current() or Phases()) as record, cache.made_by(name or path.name, path.absolute()):
        model = _load_served_model(spec, settings, log, background)
    model.opened_s, model.phases = time.perf_counter() - started, record
    try:
        jpeg_draft(model, settings.jpeg_draft)
    except ModelLoadError:
        model.backend.close()
        raise
    return model


def _load_served_model(spec: str, settings: Settings, log, background: bool = False) -> ServedModel:
    name, path = parse_spec(spec)
    if not path.exists():
        raise ModelLoadError(f"model path not found: {path}")
    if path.is_file() and path.suffix == ".onnx":
        return _from_onnx(name or path.stem, path, settings, background)
    try:
        pkg = read_package(path)
    except Exception as e:  # PackageError and friends: one line
        raise ModelLoadError(str(e)) from None
    name = name or path.name
    backend = _backend_for_package(path, settings, log, background)
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
    try:
        model.routing = _routing_state(backend, pkg.config, pkg.routing_profile(), settings)
    except Exception as e:  # PackageError, a profile for another model: one line
        raise ModelLoadError(f"{path}: {e}") from None
    return model


def _routing_state(backend: Backend, config, profile: dict[str, Any] | None, settings: Settings) -> RoutingState | None:
    """The routing state of a model whose backend has a routing function, else None."""
    layout = routing_lib.any_layout(config)
    if getattr(backend, "routing", None) is None or layout is None:
        return None
    if profile is not None:
        routing_lib.check_profile(profile, layout)
    plain = "classify" if "classify" in backend.functions else "image"
    window = routing_lib.Window(settings.routing_drift_window, len(layout.layers), layout.num_experts)
    return RoutingState(layout, plain, profile, window, settings.routing_stats_sample)


def _scale_bias(package: Path) -> tuple[float, float]:
    with safe_open(str(package / "model.safetensors"), "pt") as f:
        s = float(f.get_tensor("s").exp())
        b = float(f.get_tensor("b")) if "b" in f.keys() else 0.0
    return s, b


def _check_pixel_transfer(settings: Settings) -> None:
    if settings.pixel_transfer == "uint8" and settings.backend != "torch":
        raise ModelLoadError(
            f"--pixel-transfer uint8 maps pixels to the model's range inside the torch backend; --backend "
            f"{settings.backend} takes float32 pixel_values (use --pixel-transfer float32 or --backend torch)"
        )


def _check_concurrency(settings: Settings) -> None:
    if settings.concurrent_batches > 1 and (settings.device != "cpu" or settings.backend == "tensorrt"):
        raise ModelLoadError(
            f"--concurrent-batches {settings.concurrent_batches} runs CPU backends only (not verified on a GPU, "
            f"where one engine's calls share a stream); use --concurrent-batches 1 with --device {settings.device}"
            + (" --backend tensorrt" if settings.backend == "tensorrt" else "")
        )
    threads = total_threads(settings)
    if settings.concurrent_batches > threads:  # each batch's activations are held at once: bounded by the cores
        raise ModelLoadError(
            f"--concurrent-batches {settings.concurrent_batches} is more batches at once than the {threads} intra-op "
            f"threads ({'--threads' if settings.threads else 'the CPUs available'}) can run, one thread each; use at "
            f"most {threads}")


def wide_lone(settings: Settings) -> bool:
    """Whether ``--wide-lone-batches`` applies: several batches at once on onnxruntime on cpu."""
    return (settings.wide_lone_batches and settings.concurrent_batches > 1 and settings.device == "cpu"
            and settings.backend == "onnxruntime")


def lone_threads(settings: Settings) -> int:
    """Intra-op threads of the sessions that run alone under ``--wide-lone-batches`` (all of
    them), else 0 (every session has ``backend_threads``)."""
    return total_threads(settings) if wide_lone(settings) else 0


def backend_threads(settings: Settings) -> int:
    """Intra-op threads of one backend call: ``--threads`` (0: the backend's default, the CPUs
    available), divided among ``--concurrent-batches`` (at least 1 each: more batches than threads
    are refused at load)."""
    if settings.concurrent_batches == 1:
        return settings.threads
    return max(1, total_threads(settings) // settings.concurrent_batches)


def total_threads(settings: Settings) -> int:
    """``--threads``, else the CPUs this process may run on."""
    return settings.threads or len(os.sched_getaffinity(0))


def _backend_for_package(path: Path, settings: Settings, log, background: bool = False) -> Backend:
    _check_pixel_transfer(settings)
    _check_concurrency(settings)

    precision = resolve_precision(settings.backend, settings.device, settings.precision)
    if settings.backend == "torch":
        with phase("session"):
            return TorchBackend(path, device=settings.device, precision=precision,
                                max_batch_size=settings.max_batch_size, threads=backend_threads(settings),
                                cuda_graphs=settings.cuda_graphs, pinned_staging=settings.pinned_staging,
                                routing=settings.routing, pixel_transfer=settings.pixel_transfer,
                                batch_invariant=settings.strict_determinism and settings.proven_shapes)
    if settings.backend == "onnxruntime":
        files = exported_files(path, settings.cache_dir, precision, log=log, device=settings.device,
                               routing=settings.routing, beside_batches=background)
        with phase("session"):
            return OnnxRuntimeBackend(files, device=settings.device, max_batch_size=settings.max_batch_size,
                                      threads=backend_threads(settings), cuda_graph=settings.ort_cuda_graph,
                                      routing=settings.routing, spin=settings.ort_spinning,
                                      lone_threads=lone_threads(settings), background=background,
                                      weights=path / "model.safetensors")  # what the graphs read their weights from
    with phase("session"):  # a TensorRT engine built, or read from its cache
        return TensorRTBackend(path, precision=precision, max_batch_size=settings.max_batch_size,
                               cache_dir=settings.cache_dir, routing=settings.routing)


def _from_onnx(name: str, path: Path, settings: Settings, background: bool = False) -> ServedModel:
    """An exported file on its own: everything the server needs is in its metadata."""
    if settings.backend != "onnxruntime":
        raise ModelLoadError(f"{path}: an .onnx file is served with --backend onnxruntime")
    _check_pixel_transfer(settings)
    _check_concurrency(settings)
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
    with phase("session"):
        backend = OnnxRuntimeBackend(files, device=settings.device, max_batch_size=settings.max_batch_size,
                                     threads=backend_threads(settings), cuda_graph=settings.ort_cuda_graph,
                                     routing=settings.routing, spin=settings.ort_spinning,
                                     lone_threads=lone_threads(settings), background=background)
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
    if backend.routing is not None:
        profile = backend.metadata.get(ROUTING, {}).get("routing_profile")
        try:
            model.routing = _routing_state(backend, from_dict(meta["kind"], pkg_meta["model"]), profile, settings)
        except Exception as e:
            raise ModelLoadError(f"{path}: {e}") from None
    return model


def jpeg_draft(model: ServedModel, names: list[str]) -> None:
    """JPEG draft mode on for ``model`` if ``--jpeg-draft`` (``names``) has its name, or ``*`` and
    it takes images: the one rule, applied as each model is opened (``load_served_model``).

    Raises:
        ModelLoadError: ``names`` has its name and it takes no images.
    """
    if model.name in names and model.preprocess is None:
        raise ModelLoadError(f"--jpeg-draft {model.name}: model {model.name!r} takes no images")
    if model.preprocess is not None and ("*" in names or model.name in names):
        model.preprocess = dataclasses.replace(model.preprocess, jpeg_draft=True)


def check_jpeg_draft(models: list[ServedModel], names: list[str]) -> None:
    """Every name ``--jpeg-draft`` gives is one of ``models``.

    Raises:
        ModelLoadError: naming the first that is not.
    """
    served = [m.name for m in models]
    for name in names:
        if name != "*" and name not in served:
            raise ModelLoadError(f"--jpeg-draft {name}: no served model has that name (served: {', '.join(served)})")


@dataclass(frozen=True)
class BackendCall:
    """The batcher's call into a served model (``batching.batcher.Call``): one batch through
    function ``fn`` of ``backend``."""

    backend: Backend
    fn: str

    def __call__(self, rows: Rows) -> Rows:
        return self.backend.run(self.fn, rows)


def attach_queues(model: ServedModel, batcher: Batcher, settings: Settings, metrics: Metrics,
                  group: str | None = None) -> None:
    """One batcher queue per function of the model, all on the device's one worker; ``group`` names
    this version's queues (the engine's: two versions of a model share its label while one drains).

    Under ``--wide-lone-batches`` every queue gets a plan: the image function that has a routing
    graph runs beside other calls on its own session (a share of the threads) and alone on the
    routing graph's (all of them, ``RoutingState.lanes``); every other function runs alone."""
    lone = wide_lone(settings)
    narrow = getattr(model.backend, "narrow", set())
    for fn in model.backend.functions:
        call = BackendCall(model.backend, fn)
        queue = model.queues[fn] = batcher.add_queue(ModelQueue(
            f"{model.name}/{fn}", model.name, call, max_batch_size=settings.max_batch_size,
            max_delay_s=settings.max_delay_ms / 1000, max_queue=settings.max_queue,
            pad=settings.strict_determinism, metrics=metrics, eager=settings.eager_batching, group=group,
        ))
        if lone:
            if model.routing is not None and fn == model.routing.plain and fn in narrow:
                model.routing.lone = True
                queue.plan, queue.fn = model.routing.lanes(call, model.backend)
            else:
                queue.plan = _alone
    if model.routing is not None:
        _attach_routing(model, batcher, settings, metrics, group)


def _alone(beside: bool) -> bool:
    """The plan of a queue whose every call runs alone (its session has every thread)."""
    return False


def _attach_routing(model: ServedModel, batcher: Batcher, settings: Settings, metrics: Metrics,
                    group: str | None) -> None:
    """The routing queue (/v1/routing, batched like the rest), the sampled plain queue, the series."""
    state = model.routing
    if state.sample and not state.lone:  # under --wide-lone-batches the plan samples
        plain = model.queues[state.plain]
        plain.fn = state.sampling(plain.fn, model.backend)
    queue = model.queues[ROUTING] = batcher.add_queue(ModelQueue(
        f"{model.name}/{ROUTING}", model.name, BackendCall(model.backend, ROUTING),
        max_batch_size=settings.max_batch_size, max_delay_s=settings.max_delay_ms / 1000,
        max_queue=settings.max_queue, pad=settings.strict_determinism, metrics=metrics,
        eager=settings.eager_batching, group=group,
    ))
    if wide_lone(settings):
        queue.plan = _alone
    # Its places are for inspecting routing, not serving capacity: the gauge keeps the serving queues' sum.
    metrics.queue_capacity.labels(model.name).set(sum(q.max_queue for q in queue.siblings if q is not queue))
    state.bind(metrics, model.name)


def batching_parameters(model: ServedModel, settings: Settings) -> dict:
    """The batch shapes the model runs (strict mode's proven padded shapes per function) and how
    many batches run at once."""
    queues = model.queues
    out = {"max_batch_size": max((q.max_batch_size for q in queues.values()), default=0),
           "concurrent_batches": settings.concurrent_batches,
           "strict_determinism": any(q.pad for q in queues.values()),
           "batch_shapes": {fn: list(q.shapes) for fn, q in queues.items() if q.pad}}
    if model.routing is not None and model.routing.lone:  # --wide-lone-batches, in effect for this model
        state = model.routing  # proven: alone on the routing graph; beside: at load, beside other calls
        out["wide_lone_batches"] = {"proven": state.shared, "beside": not state.shared or state.beside}
    if model.preprocess is not None:
        out["jpeg_draft"] = model.preprocess.jpeg_draft  # --jpeg-draft: faster JPEG decode, other pixels
    return out
