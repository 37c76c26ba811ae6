"""The local job engine of ``softmoe eval`` and ``softmoe embed``: samples are read in order, decoded
and preprocessed in a process pool (the server's own probe, budgets, decoder and preprocessing:
``server.pipeline.prepare``), then run through the server's engine (server.engine: its model
loading, start-up proofs and deterministic batcher; ``JobModel``), and handed in order to a sink
(Parquet shards, or metrics). No network door is involved.

Bounded: at most ``window`` chunks of ``max_batch_size`` samples are between the reader and the
sink at any time, whatever the dataset's size; each image's bytes, pixels and decode time are
bounded by the server's limits (``--max-body-bytes``, ``--max-image-pixels``, the request timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import numpy as np

from server.backends.base import PIXELS
from server.engine.core import Engine
from server.engine.models import ServedModel
from server.engine.startup import StartupError, check_backend, describe
from server.errors import ServiceError
from server.metrics import Metrics
from server.pipeline.prepare import prepare_image, probe_image
from server.settings import Settings
from server.jobs.data import Dataset, Sample, Unit, read_file

log = logging.getLogger("softmoe.jobs")

ITEM_TIMEOUT_S = 600.0  # an item's time in the batcher's queue (the window keeps it to a few batches)
DECODE_NICE = 19  # decode processes at the lowest priority: see DecodePool
MAX_DEATHS = 3  # files in a row whose decoder died, each alone in a fresh process: the job stops


class JobError(Exception):
    """The job stops: one line for the user (exit status 2)."""


@dataclass
class Outcome:
    """One sample's result: the outputs of its image (and text) function, or why it failed."""

    sample: Sample
    image: dict[str, np.ndarray] | None = None
    text: dict[str, np.ndarray] | None = None
    error: str | None = None


class Sink(Protocol):
    def begin(self, unit: Unit) -> None: ...

    def add(self, unit: Unit, outcome: Outcome) -> None: ...

    def end(self, unit: Unit) -> None: ...


# ------------------------------------------------------------------ the model, as the server serves it


@dataclass
class ModelFacts:
    """What the sinks need to know of the model (picklable: a Ray job's driver gets it from an actor)."""

    name: str
    kind: str
    image_fn: str  # classify (classifiers) or image (two-tower image towers)
    texts: bool  # a text tower with a tokenizer
    dims: dict[str, dict[str, int]]  # per function, each output's width
    labels: list[str] | None
    head_activation: str | None
    templates: list[str]
    logit_scale: float | None
    logit_bias: float | None
    max_text_chars: int
    description: dict[str, Any]  # backend, device, precision, batch shapes (JobModel.describe)
    preprocess: Any  # PreprocessConfig: how the decode workers make rows
    uint8: bool  # rows are uint8 pixels (the torch backend's uint8 transfer), else float32 pixel_values


@dataclass
class JobModel:
    """A served model with its batcher started, built as ``softmoe serve`` builds it from the same
    settings (flags, then ``SOFTMOE_*``, then defaults): the backend, the start-up proofs, the padded
    batch shapes, the concurrent batches."""

    settings: Settings
    engine: Engine
    model: ServedModel
    image_fn: str  # classify (classifiers) or image (two-tower image towers)
    texts: bool  # the model has a text tower and a tokenizer
    dims: dict[str, dict[str, int]] = field(default_factory=dict)  # per function, each output's width

    @classmethod
    def load(cls, package: str, settings: Settings, say=print) -> JobModel:
        exported = settings.backend in ("onnxruntime", "tensorrt")
        say(f"{package}: loading on {settings.backend} ({settings.device})"
            + ("; a first load exports and verifies it, then it is cached" if exported else ""))
        engine = Engine(settings, Metrics(), say=say)
        try:
            check_backend(settings)
            model = engine.open(package)
        except StartupError as e:
            raise JobError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - ModelLoadError, PackageError, an export failure: one line
            raise JobError(f"cannot load {package}: {describe(e)}") from None
        image_fn = "image" if model.can("image") else "classify" if model.can("classify") else None
        if image_fn is None or model.preprocess is None:
            model.backend.close()
            raise JobError(f"{package}: a {model.kind} model takes no images")
        engine.bring_up([model], serve=False)  # the batcher starts once each output's width is known
        job = cls(settings, engine, model, image_fn, model.can("text") and model.tokenizer is not None)
        job.dims = {fn: job._dims(fn) for fn in ((image_fn, "text") if job.texts else (image_fn,))}
        engine.start()
        return job

    @property
    def batcher(self):
        return self.engine.batcher

    def _dims(self, fn: str) -> dict[str, int]:
        """Each output's width, from one call of zeros at the full batch shape (before the batcher starts)."""
        spec = self.model.backend.functions[fn]
        rows = self.settings.max_batch_size
        out = self.model.backend.run(fn, {s.name: np.zeros((rows, *s.shape), dtype=s.dtype) for s in spec.inputs})
        return {k: int(np.prod(v.shape[1:])) for k, v in out.items()}

    @property
    def uint8(self) -> bool:
        return self.model.pixel_input == PIXELS

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.close()

    async def run(self, fn: str, rows: list[dict[str, np.ndarray]]) -> list[Any]:
        """Rows through one function's queue, as one request's items: places reserved first, so the
        batcher waits for all of them (full batches) rather than run the first ones alone. Returns a
        dict of outputs or a ServiceError per row."""
        if not rows:
            return []
        queue = self.model.queues[fn]
        self.batcher.reserve(queue, len(rows))
        futures = [self.batcher.submit(queue, row, ITEM_TIMEOUT_S, reserved=True) for row in rows]
        done = await asyncio.gather(*futures, return_exceptions=True)
        out = []
        for d in done:
            if isinstance(d, BaseException) and not isinstance(d, ServiceError):
                raise d
            out.append(d if isinstance(d, ServiceError) else d.outputs)
        return out

    def check_text(self, text: str) -> str | None:
        """Why a text cannot be embedded (/v1/embed's limit), or None."""
        limit = self.settings.max_text_chars
        return f"text of {len(text)} characters exceeds the limit of {limit}" if len(text) > limit else None

    async def embed_texts(self, texts: list[str]) -> list[Any]:
        """Texts through the text tower (tokenised as /v1/embed does); outputs or errors per text."""
        if not texts:
            return []
        ids = self.model.tokenizer(texts)
        out = []
        step = max(1, self.model.queues["text"].max_queue // 2)
        for start in range(0, len(texts), step):
            out.extend(await self.run("text", [{"input_ids": row} for row in ids[start: start + step]]))
        return out

    def facts(self) -> ModelFacts:
        m = self.model
        return ModelFacts(m.name, m.kind, self.image_fn, self.texts, self.dims, m.labels, m.head_activation,
                          list(m.templates), m.logit_scale, m.logit_bias, self.settings.max_text_chars,
                          self.describe(), m.preprocess, self.uint8)

    def describe(self) -> dict:
        info = self.model.backend.describe()
        return {"backend": info.get("backend", self.model.backend.name), "device": info.get("device", self.settings.device),
                "precision": info.get("precision"), "max_batch_size": self.settings.max_batch_size,
                "batch_shapes": {fn: list(q.shapes) for fn, q in self.model.queues.items() if q.pad}}


# ------------------------------------------------------------------ decode workers (a process pool)


def init_worker(nice: int) -> None:
    """A decode process: a lower priority (the decoder's modules are imported with this module, before any work)."""
    if nice > 0 and hasattr(os, "nice"):
        with contextlib.suppress(OSError):
            os.nice(nice)


def _ready() -> int:
    return os.getpid()


def prepare_chunk(cfg, uint8: bool, limits: tuple[int, int, int, float],
                  entries: list[tuple[str | None, bytes | None]]) -> list[tuple[dict | None, str | None]]:
    """Per entry (a file path, or the bytes): ``(row, None)`` or ``(None, reason)``. ``cfg``: the
    model's PreprocessConfig; ``limits``: the server's max body bytes, image and request pixels, and
    request timeout (each image's decode deadline)."""
    max_bytes, max_image_pixels, max_request_pixels, timeout = limits
    out: list[tuple[dict | None, str | None]] = []
    for path, data in entries:
        try:
            if data is None:
                data = read_file(Sample(key="", path=path), max_bytes)
            elif len(data) > max_bytes:
                raise ValueError(f"image of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
            info = probe_image(data, cfg, max_image_pixels, max_request_pixels)
            row, _, _ = prepare_image(data, cfg, uint8=uint8, max_pixels=max_image_pixels, info=info,
                                      deadline=time.perf_counter() + timeout)
            out.append((row, None))
        except ServiceError as e:
            out.append((None, e.message))
        except ValueError as e:
            out.append((None, str(e)))
        except Exception as e:  # noqa: BLE001 - a decoder's own failure: reported with the item, never a crash
            out.append((None, f"cannot decode: {type(e).__name__}: {e}"[:300]))
    return out


def limits_of(settings: Settings) -> tuple[int, int, int, float]:
    return settings.max_body_bytes, settings.max_image_pixels, settings.max_request_pixels, settings.request_timeout_s


def decode_workers() -> int:
    """Decode processes: the CPUs this process may use (at most 32)."""
    return max(1, min(32, len(os.sched_getaffinity(0))))


class DecodePool:
    """A process pool of decode workers that survives a worker's death: a chunk whose worker died is
    retried one entry at a time in a fresh pool, so only the entry that kills a decoder fails.

    The processes run at the lowest priority (nice 19): the backend's intra-op threads spin between
    the parallel steps of a batch, and a decode process that preempts one stalls the whole step
    (docs/benchmarks.md, the embed section, has the measurement at nice 10 and 19). Decoding still
    gets every idle cycle, so a light model, where decoding is the work, loses nothing."""

    def __init__(self, settings: Settings, workers: int | None = None) -> None:
        """Starts the processes at once (they import the decoder while the model loads); ``use``
        names the model's preprocessing before the first ``prepare``."""
        self.limits = limits_of(settings)
        self.workers = workers or decode_workers()
        self.cfg, self.uint8 = None, False
        self.deaths = 0  # files in a row whose decoder died
        self.pool = self._new()

    def use(self, preprocess, uint8: bool) -> None:
        self.cfg, self.uint8 = preprocess, uint8

    def _new(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=init_worker, initargs=(DECODE_NICE,))
        for _ in range(self.workers):  # start every process now, not at the first chunk
            pool.submit(_ready)
        return pool

    async def prepare(self, entries: list[tuple[str | None, bytes | None]]) -> list[tuple[dict | None, str | None]]:
        loop = asyncio.get_running_loop()
        pool = self.pool
        try:
            return await loop.run_in_executor(pool, prepare_chunk, self.cfg, self.uint8, self.limits, entries)
        except BrokenProcessPool:
            self._renew(pool)
        out = []
        for entry in entries:
            pool = self.pool
            try:
                out.extend(await loop.run_in_executor(pool, prepare_chunk, self.cfg, self.uint8, self.limits, [entry]))
                self.deaths = 0
            except BrokenProcessPool:
                self._renew(pool)
                self.deaths += 1
                if self.deaths >= MAX_DEATHS:  # not a file: the processes cannot run at all
                    raise JobError(f"the decode processes died on {self.deaths} files in a row, each alone in a "
                                   "fresh process: they cannot run here (out of memory? a script that runs a job "
                                   "must guard it with `if __name__ == '__main__':`)") from None
                out.append((None, "the decoder process died on this file"))
        return out

    def _renew(self, broken: ProcessPoolExecutor) -> None:
        if self.pool is broken:
            broken.shutdown(wait=False, cancel_futures=True)
            self.pool = self._new()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------ progress


class Progress:
    """A progress bar on a terminal (tqdm: images/s, ETA, errors); elsewhere a log line every 10 s."""

    def __init__(self, what: str, total: int | None, stream=None) -> None:
        self.what, self.total = what, total
        self.stream = stream or sys.stderr
        self.done = self.errors = 0
        self.start = self.last = time.perf_counter()
        self.ended: float | None = None
        self.bar = None
        if self.stream.isatty():  # tqdm: an optional extra (jobs), only for a terminal's bar
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="img", desc=what, file=self.stream, dynamic_ncols=True)

    def update(self, n: int, errors: int) -> None:
        self.done += n
        self.errors += errors
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix(errors=self.errors, refresh=False)
            return
        now = time.perf_counter()
        if now - self.last >= 10.0:
            self.last = now
            self._line(now)

    def _line(self, now: float) -> None:
        rate = self.done / max(now - self.start, 1e-9)
        of = f"/{self.total}" if self.total is not None else ""
        eta = ""
        if self.total is not None and rate > 0:
            left = max(0, self.total - self.done) / rate
            eta = f", ETA {int(left // 60)}m{int(left % 60):02d}s"
        print(f"{self.what}: {self.done}{of} images, {rate:.1f} img/s{eta}, {self.errors} errors",
              file=self.stream, flush=True)

    def close(self) -> None:
        """The end of the work: the rate is frozen here (what follows, the pool's shutdown, is not the work)."""
        if self.ended is not None:
            return
        self.ended = time.perf_counter()
        if self.bar is not None:
            self.bar.close()
        else:
            self._line(self.ended)

    @property
    def rate(self) -> float:
        end = self.ended if self.ended is not None else time.perf_counter()
        return self.done / max(end - self.start, 1e-9)


# ------------------------------------------------------------------ the pipeline


@dataclass
class Chunk:
    unit: Unit
    samples: list[Sample]
    last: bool  # the unit's last chunk
    first: bool = False


def error_entry(unit: Unit, o: Outcome) -> dict[str, str]:
    """A failed sample in the reports: its key, the file it came from (the image's own path, or its
    WebDataset shard, or the manifest of a row without a path) and why."""
    return {"key": o.sample.key, "source": o.sample.path or unit.source, "reason": o.error}


class Tally:
    """Counts what the sink got, reports it to the progress, and stops the job past ``max_errors``."""

    def __init__(self, progress: Progress, max_errors: int | None) -> None:
        self.progress, self.max_errors = progress, max_errors
        self.done = self.errors = 0
        self.error_list: list[dict] = []

    def add(self, sink: Sink, unit: Unit, outcomes: list[Outcome]) -> None:
        errors = 0
        for o in outcomes:
            sink.add(unit, o)  # a sink may fail a sample too (eval: no label to score against)
            if o.error is not None:
                errors += 1
                self.error_list.append(error_entry(unit, o))
            else:
                self.done += 1
        self.errors += errors
        self.progress.update(len(outcomes), errors)
        if self.max_errors is not None and self.errors > self.max_errors:
            first = self.error_list[0]
            raise JobError(f"{self.errors} samples failed, more than --max-errors {self.max_errors} "
                           f"(the first: {first['key']}: {first['reason']})")


def chunks(units: list[Unit], size: int) -> Iterator[Chunk]:
    """Every pending unit's samples in chunks of ``size``; an empty unit is one empty chunk."""
    for unit in units:
        buf: list[Sample] = []
        first = True
        for sample in unit.samples():
            buf.append(sample)
            if len(buf) == size:
                yield Chunk(unit, buf, False, first)
                buf, first = [], False
        yield Chunk(unit, buf, True, first)


class Runner:
    """Reads, decodes, runs and sinks every pending unit, in order, bounded."""

    def __init__(self, job: JobModel, sink: Sink, *, texts: bool, max_errors: int | None, progress: Progress,
                 pool: DecodePool | None = None) -> None:
        self.job, self.sink, self.texts, self.max_errors, self.progress = job, sink, texts, max_errors, progress
        self.pool = pool or DecodePool(job.settings)
        self.pool.use(job.model.preprocess, job.uint8)
        self.tally = Tally(progress, max_errors)

    def run(self, units: list[Unit]) -> Tally:
        try:
            asyncio.run(self._run(units))
        finally:
            self.progress.close()
            self.pool.close()
        return self.tally

    async def _run(self, units: list[Unit]) -> None:
        s = self.job.settings
        size = s.max_batch_size
        # Chunks in flight: enough to keep every decode process and every batch busy, and never more
        # rows than a queue holds (each chunk reserves its places in the batcher's queue).
        window = min(2 * max(self.pool.workers, s.concurrent_batches) + 2, max(1, s.max_queue // size))
        pending: deque[tuple[Chunk, asyncio.Future]] = deque()
        try:
            for chunk in chunks(units, size):
                pending.append((chunk, asyncio.ensure_future(self._process(chunk))))
                while len(pending) >= window:
                    done, fut = pending[0]
                    self._finish(done, await fut)
                    pending.popleft()
            while pending:
                done, fut = pending[0]
                self._finish(done, await fut)
                pending.popleft()
        except BaseException:
            for _, fut in pending:
                fut.cancel()
            raise

    def _finish(self, chunk: Chunk, outcomes: list[Outcome]) -> None:
        if chunk.first:
            self.sink.begin(chunk.unit)
        self.tally.add(self.sink, chunk.unit, outcomes)
        if chunk.last:
            self.sink.end(chunk.unit)

    async def _process(self, chunk: Chunk) -> list[Outcome]:
        outcomes = [Outcome(s, error=s.error) for s in chunk.samples]
        todo = [o for o in outcomes if o.error is None]
        if self.texts:
            for o in todo:
                if o.sample.text is not None:
                    o.error = self.job.check_text(o.sample.text)
            todo = [o for o in todo if o.error is None]
        prepared = await self.pool.prepare([(o.sample.path, o.sample.data) for o in todo])
        ok = []
        for o, (row, why) in zip(todo, prepared):
            o.sample.data = None  # the bytes are no longer needed: free them
            if why is not None:
                o.error = why
            else:
                ok.append((o, row))
        image_out = await self.job.run(self.job.image_fn, [row for _, row in ok])
        with_text = []
        for (o, _), out in zip(ok, image_out):
            if isinstance(out, ServiceError):
                o.error = out.message
            else:
                o.image = out
                if self.texts and o.sample.text is not None:
                    with_text.append(o)
        text_out = await self.job.embed_texts([o.sample.text for o in with_text])
        for o, out in zip(with_text, text_out):
            if isinstance(out, ServiceError):
                o.error, o.image = out.message, None
            else:
                o.text = out
        return outcomes


def describe_dataset(ds: Dataset) -> str:
    count = ds.count
    return f"{ds.kind} at {ds.root}: {len(ds.units)} shard(s)" + (f", {count} samples" if count is not None else "")
