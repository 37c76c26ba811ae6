"""The engine: the one owner of served models' lives, under every door (HTTP, gRPC, the engine
process of ``--frontend-workers``, the eval/embed jobs).

A model's life: a package is opened (``models.load_served_model``: the backend or a refusal, the
hash-checked export cache), attached (one batcher queue per function, its metric series, the
backend it really got), warmed (every batch shape it will run, the start-up proofs), then serves
from ``Engine.models``, the one map every door reads. It leaves by ``unload`` (no new request
reaches it, the requests it admitted finish, then its queues, backend, memory and metric series
are released) or by a ``load`` of its next version, which builds, proves and warms the new
version beside the old one, moves the traffic in one assignment, and retires the old version in
the background as ``unload`` would, its metric series kept for the new one.

When is the old version no longer reachable? A request picks its model after the door admitted
it, so once the new version is in ``models``, a door's checkpoint (``api.door.Door.checkpoint``)
says when every request admitted before the swap has been answered; the old queues must also be
idle (nothing queued, reserved or running). Every request has a deadline, so this ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from export import cache_space
from export.phases import Phases, recording
from export.runtime import give_back_freed_memory
from server.batching.batcher import Batcher
from server.engine.models import ServedModel, attach_queues, load_served_model
from server.engine.proofs import load_summary, warmup
from server.engine.startup import describe, load_models
from server.errors import Conflict, ModelLoadError
from server.metrics import Metrics
from server.settings import Settings

log = logging.getLogger("softmoe.engine")

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"
# A served copy of a package costs about its weight bytes again beside them in resident memory
# (docs/benchmarks.md, the memory section); the room asked for a new version beside the old.
ROOM_PER_WEIGHT_BYTE = 1.3
# A model loads as load work beside batches (at a lower priority, on one CPU: its child and its
# sessions' set-up, ``export.runtime.lower_for_load``) while other models are served: while a
# batch ran within this many seconds. On a server that serves nothing meanwhile it takes every
# core, the way a first start does (soft-s16-e128's new weights on 2 idle cores: docs/benchmarks.md).
SERVING_WITHIN_S = 10.0


@dataclasses.dataclass
class ModelStatus:
    """What the repository index says of a model name."""

    name: str
    version: int = 0  # loads of this name that succeeded; the serving version's number
    state: str = UNAVAILABLE
    reason: str = ""  # why it is not READY, or why its last load failed
    source: str = ""  # where the serving version was loaded from
    loading: Phases | None = None  # the phases of the load under way, while state is LOADING

    def entry(self) -> dict:
        reason = self.reason
        now = self.loading.now() if self.state == LOADING and self.loading is not None else None
        if now is not None:  # where the load is: "loading: export, 12 s so far"
            reason = f"loading: {now[0]}, {now[1]:.0f} s so far"
        return {"name": self.name, "version": str(self.version) if self.version else "", "state": self.state,
                "reason": reason}


class Engine:
    """Served models, their batcher, their metric series, and every change to them."""

    def __init__(self, settings: Settings, metrics: Metrics, batcher=None, say: Callable[[str], None] | None = None):
        """
        Args:
            settings: the server's settings.
            metrics: where the models' series live.
            batcher: the batcher to queue on (a front end's ``RemoteBatcher``, whose engine process
                loads the models: this engine only mirrors them and counts no load); default: a new
                one on ``settings.device``.
            say: where each model's one-line description goes (the log by default).
        """
        self.settings, self.metrics = settings, metrics
        cache_space.set_limit(settings.cache_max_size)  # the bound of every cache entry this process writes
        self.mirror = batcher is not None
        self.batcher = batcher if batcher is not None else Batcher(settings.device, metrics,
                                                                  workers=settings.concurrent_batches)
        self.say = say or log.info
        # What serves now: every door reads this map. A load or unload changes a key from its own
        # thread, so a reader takes list(models.values()) before a loop that runs Python code.
        self.models: dict[str, ServedModel] = {}
        self.status: dict[str, ModelStatus] = {}
        # Each door's checkpoint maker (Door.checkpoint): a swap waits for the requests it admitted.
        self.checkpoints: list[Callable[[], Callable[[], bool]]] = []
        self._busy: set[str] = set()  # names with a load or unload under way
        self._lock = threading.Lock()
        self._retiring: list[threading.Thread] = []
        self._versions = 0  # queue groups: one per loaded version

    # ------------------------------------------------------------------ start-up

    def bring_up(self, models: list[ServedModel] | None = None, *, serve: bool = True) -> list[ServedModel]:
        """The start-up of every door: the configured models opened (``startup.load_models``; or
        ``models``, opened by the caller to fail before it binds a port), attached, warmed and
        proven, then, with ``serve``, the batcher started (without: the caller starts it, ``start``,
        once it can answer; ``softmoe prepare`` never does). Returns the models, which serve.

        Raises:
            StartupError: a model cannot be opened (``startup.load_models``).
            ModelLoadError: two share a name. Whatever a warm-up raises; every model is then
                released.
        """
        models = load_models(self.settings) if models is None else models
        try:
            self.adopt(models)
            for m in models:
                self.warm(m)
        except BaseException:
            for m in models:
                self.models.pop(m.name, None)
                self._release(m)
            raise
        if serve:
            self.start()
        return models

    def open(self, spec: str, background: bool = False) -> ServedModel:
        """A package (or .onnx) as a served model, not yet attached: its backend, or ModelLoadError.
        ``background``: models serve meanwhile (the backend is set up at low priority)."""
        return load_served_model(spec, self.settings, log.info, background)

    def attach(self, model: ServedModel) -> None:
        """Queue ``model``'s functions on the batcher and create its metric series."""
        m, metrics = model, self.metrics
        self._versions += 1
        metrics.model_ready.labels(m.name).set(1 if m.name in self.models else 0)
        metrics.init_model(m.name)
        attach_queues(m, self.batcher, self.settings, metrics, group=f"{m.name}#{self._versions}")
        info = m.backend.describe()
        providers = info.get("providers") or {}
        provider = sorted({p[0] for p in providers.values() if p})[0] if providers else info.get("device", "")
        metrics.backend_info.remove_by_labels({"model": m.name})
        metrics.backend_info.labels(m.name, info.get("backend", m.backend.name), info.get("device", ""),
                                    info.get("precision", self.settings.precision), provider).set(1)

    def adopt(self, models: list[ServedModel]) -> None:
        """Attach models loaded at start-up (``bring_up``'s first step)."""
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ModelLoadError(f"two models share a name: {names}")
        for m in models:
            self.attach(m)
            self.models[m.name] = m
            self.status[m.name] = ModelStatus(m.name, state=LOADING, source=m.source, loading=m.phases)

    def warm(self, model: ServedModel) -> None:
        """Warm-up and start-up proofs, then the model takes traffic (``bring_up``'s second step)."""
        warmup(model, self.settings, self.say)  # adds its time to model.opened_s
        model.ready = True
        self.metrics.model_ready.labels(model.name).set(1)
        status = self.status.setdefault(model.name, ModelStatus(model.name, source=model.source))
        status.version, status.state, status.reason, status.loading = status.version + 1, READY, "", None
        if not self.mirror:
            self._loaded(model, model.opened_s)

    def start(self) -> None:
        self.batcher.start()
        self.metrics.worker_alive.set(1)

    # ------------------------------------------------------------------ while serving

    def load(self, name: str, spec: str, *, unload_first: bool = False) -> ServedModel:
        """Load ``spec`` as model ``name``, or its next version: built, proven and warmed beside the
        serving one, then traffic moves at once; the old version drains in the background. Blocking.

        Raises:
            Conflict: a load or unload of ``name`` is under way, or both versions do not fit.
            ModelLoadError: the package cannot be served (one line; nothing changed).
        """
        with self._claim(name):
            started = time.perf_counter()
            old = self.models.get(name)
            status = self.status.setdefault(name, ModelStatus(name))
            status.loading = Phases()
            if old is None:
                status.state, status.reason = LOADING, ""
            try:
                if old is not None:
                    self._check_room(name, spec, unload_first)
                    if unload_first:
                        self._take_down(name, old, "unloaded before loading its next version (unload_first)")
                        old = None
                        status.state = LOADING
                with recording(status.loading):
                    model = self._build(name, spec, old)
            except Exception as e:
                status.loading = None
                text = e.message if isinstance(e, Conflict) else describe(e)
                status.reason = f"load failed: {text}"
                if old is None:
                    status.state = UNAVAILABLE
                self.metrics.model_loads.labels(name, "failure").inc()
                log.warning("model %s: load failed%s: %s", name,
                            f" (version {status.version} still serves)" if old is not None else "", text)
                if isinstance(e, Conflict):
                    raise
                raise ModelLoadError(text) from None
            self.models[name] = model  # from here every request picks the new version
            status.version, status.state, status.reason, status.source = status.version + 1, READY, "", model.source
            status.loading = None
            elapsed = time.perf_counter() - started
            self._loaded(model, elapsed)
            self.metrics.model_ready.labels(name).set(1)
            log.info("model %s: version %d from %s serves (%s, %s) after %.1f s (%s)%s", name, status.version,
                     model.source, model.backend.name, model.backend.describe().get("device", self.settings.device),
                     elapsed, load_summary(model), "; the previous version drains" if old is not None else "")
            if old is not None:
                self._retire_later(old)
            return model

    def unload(self, name: str) -> None:
        """Stop serving ``name``: no new request reaches it, those it admitted finish, then it is
        released. Blocking until then.

        Raises:
            Conflict: ``name`` is not loaded, or a load or unload of it is under way.
        """
        with self._claim(name):
            model = self.models.get(name)
            if model is None:
                status = self.status.get(name)
                state = f"{status.state}{': ' + status.reason if status.reason else ''}" if status else UNAVAILABLE
                raise Conflict(f"model {name!r} is not loaded ({state})")
            started = time.perf_counter()
            self._take_down(name, model, "unloaded")
            log.info("model %s: unloaded and released after %.1f s", name, time.perf_counter() - started)

    def index(self) -> list[dict]:
        return [s.entry() for _, s in sorted(self.status.items())]

    def close(self) -> None:
        """Stop the batcher (what is queued finishes) and release every model."""
        self.batcher.stop()
        for t in list(self._retiring):
            t.join(timeout=self.settings.request_timeout_s + 10)
        for m in list(self.models.values()):
            m.ready = False
            self.metrics.model_ready.labels(m.name).set(0)
            with contextlib.suppress(Exception):
                m.backend.close()

    # ------------------------------------------------------------------ inside

    def _loaded(self, model: ServedModel, seconds: float) -> None:
        """Count a successful load: its time, and the time of each of its phases."""
        self.metrics.model_loads.labels(model.name, "success").inc()
        self.metrics.model_load_duration.labels(model.name).observe(seconds)
        for name, spent in model.phases.ordered():
            self.metrics.model_load_phase_duration.labels(model.name, name).observe(spent)

    @contextlib.contextmanager
    def _claim(self, name: str):
        with self._lock:
            if name in self._busy:
                raise Conflict(f"a load or unload of model {name!r} is already under way; try again when it ends")
            self._busy.add(name)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(name)

    def _build(self, name: str, spec: str, serving: ServedModel | None) -> ServedModel:
        """The new version, attached and warmed (inheriting ``serving``'s start-up findings where
        ``proofs.carries``); while other models serve batches, its backend is built as load work."""
        beside = bool(self.models) and self.batcher.served_within(SERVING_WITHIN_S)
        model = self.open(f"{name}={spec}", background=beside)
        try:
            self.attach(model)
            warmup(model, self.settings, self.say, serving=serving, between=self.batcher.between)
        except BaseException:
            self._release(model)
            raise
        model.ready = True
        return model

    def _check_room(self, name: str, spec: str, unload_first: bool) -> None:
        """Refuse, before building anything, a new version that does not fit beside the old one."""
        if unload_first:
            return
        need = ROOM_PER_WEIGHT_BYTE * weight_bytes(Path(spec))
        free = available_memory(self.settings.device)
        if free is not None and need > free:
            raise Conflict(f"model {name!r}: its new version needs about {need / 2**20:.0f} MiB beside the serving "
                           f"one, and {free / 2**20:.0f} MiB are free on {self.settings.device}; load with "
                           "parameters {\"unload_first\": true} to unload the serving version first (requests "
                           "get 404 meanwhile), or free memory")

    def _take_down(self, name: str, model: ServedModel, reason: str) -> None:
        status = self.status[name]
        status.state = UNLOADING
        self.models.pop(name, None)
        model.ready = False
        self._drain(model)
        self._release(model)
        self.metrics.remove_model(name)
        status.state, status.reason = UNAVAILABLE, reason

    def _retire_later(self, model: ServedModel) -> None:
        def retire() -> None:
            self._drain(model)
            self._release(model)

        thread = threading.Thread(target=retire, name=f"softmoe-retire-{model.name}", daemon=True)
        self._retiring = [t for t in self._retiring if t.is_alive()] + [thread]
        thread.start()

    def _drain(self, model: ServedModel) -> bool:
        """Wait until no request can still reach ``model`` (taken out of ``models`` already)."""
        answered = [checkpoint() for checkpoint in self.checkpoints]
        queues = list(model.queues.values())
        deadline = time.monotonic() + self.settings.request_timeout_s + 5
        while time.monotonic() < deadline:
            if all(test() for test in answered) and self.batcher.idle(queues):
                return True
            time.sleep(0.01)
        log.warning("model %s: requests still held its old version after %.0f s; releasing it", model.name,
                    self.settings.request_timeout_s + 5)
        return False

    def _release(self, model: ServedModel) -> None:
        """The model's queues, backend and memory."""
        self.batcher.remove_queues(list(model.queues.values()))
        model.ready = False
        with contextlib.suppress(Exception):
            model.backend.close()
        model.queues.clear()
        model.routing = None
        gc.collect()
        give_back_freed_memory()


def weight_bytes(path: Path) -> int:
    """Bytes of a package's weight files (or of an .onnx file and its external data)."""
    if path.is_file():
        data = path.with_name(path.name + ".data")
        return path.stat().st_size + (data.stat().st_size if data.exists() else 0)
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def available_memory(device: str) -> int | None:
    """Bytes a new model may take on ``device``: on CPU the smaller of the kernel's MemAvailable
    and what the cgroup's limit leaves; on CUDA the device's free memory. None when unknown."""
    if device == "cuda":
        try:
            return int(torch.cuda.mem_get_info()[0])
        except Exception:  # noqa: BLE001 - no torch CUDA: unknown
            return None
    found = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    return min(found) if found else None
