"""What the endpoints do, on decoded inputs: routes parse HTTP, this computes, nothing touches
tensors in a route. Every image and text carries its own stage timings into the metrics."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np

from softmoe_models import routing as routing_lib
from softmoe_models import routing_png
from softmoe_models.preprocess import to_pixel_values

from server import context
from server.batching.batcher import Batcher, ModelQueue, Result
from server.errors import BadRequest, ClientDisconnected, NotFound, ServiceError, Unavailable, Unprocessable
from server.metrics import Metrics
from server.pipeline import postprocess as post
from server.pipeline.gpu_decode import open_decoder
from server.pipeline.prepare import prepare_image
from server.pipeline.probe import ImageInfo, budget, probe
from server.engine.models import PIXELS, ROUTING, ServedModel
from server.settings import Settings

MAX_TEMPLATES = 32
PNG_MAX_PIXELS = 16_777_216  # /v1/routing?format=png: the sheet's size (48 MiB of RGB)


@dataclass
class Timings:
    """Per-item stage durations (seconds) of one request; headers report the max over items."""

    items: list[dict[str, float]] = field(default_factory=list)

    def add(self, stage: str, values: list[float]) -> None:
        while len(self.items) < len(values):
            self.items.append({})
        for d, v in zip(self.items, values):
            d[stage] = d.get(stage, 0.0) + v

    def headers(self) -> dict[str, str]:
        out = {}
        for stage in ("decode", "preprocess", "queue", "inference", "postprocess"):
            vals = [d[stage] for d in self.items if stage in d]
            if vals:
                out[f"x-{stage}-time"] = f"{max(vals) * 1e3:.2f}"
        return out


def decode_b64(value: str, param: str) -> bytes:
    """base64 or ``data:image/...;base64,`` string -> bytes; URLs are refused (never fetched)."""
    if not isinstance(value, str):
        raise BadRequest("expected a base64 string or a data URI", param=param)
    v = value.strip()
    low = v[:16].lower()
    if low.startswith(("http://", "https://", "ftp://", "file:", "s3://", "gs://", "//")):
        raise Unprocessable("image URLs are not fetched; send the image bytes (base64 or a data URI)", param=param)
    if low.startswith("data:"):
        header, sep, payload = v.partition(",")
        if not sep or ";base64" not in header.lower():
            raise BadRequest("malformed data URI: expected data:image/<type>;base64,<data>", param=param)
        if not header[5:].lower().startswith("image/"):
            raise Unprocessable(f"data URI media type {header[5:].split(';')[0]!r} is not an image", param=param)
        v = payload
    try:
        data = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("invalid base64 image data", param=param) from None
    if not data:
        raise BadRequest("empty image", param=param)
    return data


async def _until_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return when the client disconnects (the body is already read: nothing else arrives)."""
    while (await receive()).get("type") != "http.disconnect":
        pass


def _consume(fut: asyncio.Future) -> None:
    """Retrieve a finished gather's outcome so asyncio never logs it as unretrieved."""
    if not fut.cancelled():
        fut.exception()


class Reservation:
    """Places held in one model queue for a request's items, taken before its images are decoded
    (all or nothing, 429 when they do not fit) and filled by its submits; what is left is given
    back when the request ends, however it ends."""

    def __init__(self, batcher: Batcher, queue: ModelQueue, n: int) -> None:
        batcher.reserve(queue, n)
        self.batcher, self.queue, self.left = batcher, queue, n

    def take(self) -> bool:
        if self.left > 0:
            self.left -= 1
            return True
        return False

    def close(self) -> None:
        self.batcher.release(self.queue, self.left)
        self.left = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LabelCache:
    """Bounded LRU of text embeddings keyed by (model, text)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._d: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()

    def get(self, key: tuple[str, str]) -> np.ndarray | None:
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
        return v

    def put(self, key: tuple[str, str], value: np.ndarray) -> None:
        if self.size <= 0:
            return
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.size:
            self._d.popitem(last=False)


def lower_priority(nice: int) -> None:
    """Raise the calling thread's niceness by ``nice`` (Linux schedules threads one by one).

    Decode and preprocessing share the cores with the backend's intra-op threads, and a parallel
    step of the backend waits for its slowest thread: a decode thread taking one of its cores
    stalls every core. At a lower priority decode runs in the backend's gaps and still gets a core
    when the backend is idle. Raising niceness needs no privilege; where the platform has no
    per-thread priority nothing changes.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


class Service:
    def __init__(self, settings: Settings, models: dict[str, ServedModel], batcher: Batcher, metrics: Metrics,
                 control=None) -> None:
        """
        Args:
            models: the engine's map of what serves now (it changes while serving).
            control: the model control (engine.control.ModelControl), which says why a name does not serve.
        """
        self.settings, self.models, self.batcher, self.metrics = settings, models, batcher, metrics
        self.control = control
        self.pool = ThreadPoolExecutor(settings.decode_workers, thread_name_prefix="softmoe-decode",
                                       initializer=lower_priority, initargs=(settings.decode_nice,))
        self.label_cache = LabelCache(settings.label_cache_size)
        self.gpu_jpeg = None  # --decode-device cuda: nvJPEG (server/pipeline/gpu_decode.py)
        if settings.decode_device == "cuda":
            self.gpu_jpeg = open_decoder()

    # ------------------------------------------------------------------ model lookup

    def pick(self, name: str | None, fn: str, what: str) -> ServedModel:
        """The named model (it must support ``fn``), or the first served model that does."""
        if name:
            model = self.models.get(name)
            if model is None:
                raise not_served(name, self.models, self.control)
            if not model.can(fn):
                raise Unprocessable(f"model {name!r} ({model.kind}) cannot {what}", param="model")
        else:
            model = next((m for m in list(self.models.values()) if m.can(fn)), None)
            if model is None:
                raise NotFound(f"no served model can {what}", param="model")
        if not model.ready:
            raise Unavailable(f"model {model.name!r} is not ready", retry_after_s=2)
        return model

    def reserve(self, model: ServedModel, fn: str, n: int) -> Reservation:
        """Hold ``n`` places in the model function's queue before any decoding (429 if they do not fit)."""
        try:
            return Reservation(self.batcher, model.queues[fn], n)
        except ServiceError as e:
            e.headers.setdefault("x-model", model.name)
            raise

    def check_count(self, n: int, limit: int, what: str, param: str) -> None:
        if n == 0:
            raise Unprocessable(f"no {what} given", param=param)
        if n > limit:
            raise Unprocessable(f"{n} {what} in one request; the limit is {limit}", param=param)

    # ------------------------------------------------------------------ stages

    def probe_images(self, blobs: list[bytes], target_size: int | None, param: str = "images",
                     draft: bool = False) -> list[ImageInfo]:
        """Every image's size from its header, and the request's pixel budget: 413 before decoding."""
        infos = []
        for i, data in enumerate(blobs):
            try:
                infos.append(probe(data, target_size=target_size, draft=draft))
            except ServiceError as e:
                e.param = e.param or f"{param}[{i}]"
                raise
        try:
            budget(infos, self.settings.max_image_pixels, self.settings.max_request_pixels, param=param)
        except ServiceError as e:
            e.param = e.param or param
            self.metrics.rejected.labels("none", "over_budget").inc()
            raise
        return infos

    async def pixel_rows(self, model: ServedModel, blobs: list[bytes], timings: Timings,
                         param: str = "images") -> list[dict[str, np.ndarray]]:
        """Probe every image (sizes and the request's pixel budget), then decode and preprocess
        them in the thread pool, each decode bounded by the request's deadline: one backend row per
        image, ``pixel_values`` float32, or ``pixels`` uint8 where the backend takes uint8 transfer."""
        self.check_count(len(blobs), self.settings.max_images_per_request, "images", param)
        if model.preprocess is None:
            raise Unprocessable(f"model {model.name!r} takes no images", param="model")
        cfg, loop = model.preprocess, asyncio.get_running_loop()
        uint8 = model.pixel_input == PIXELS
        infos = await asyncio.to_thread(self.probe_images, blobs, cfg.image_size, param, cfg.jpeg_draft)
        deadline = context.deadline.get()
        max_pixels = self.settings.max_image_pixels

        records = context.stages.get()  # a traced request: each image's decode start, for its spans

        def work(data: bytes, info: ImageInfo, i: int) -> tuple[dict[str, np.ndarray], float, float]:
            try:
                began = time.perf_counter() if records is not None else 0.0
                out = prepare_image(data, cfg, uint8=uint8, max_pixels=max_pixels, info=info, deadline=deadline,
                                    jpeg_decoder=self.gpu_jpeg and self.gpu_jpeg.decode,
                                    on_fallback=self.metrics.gpu_decode_fallbacks.inc)
                if records is not None:
                    _, d, p = out
                    records.append(("decode", model.name, began, began + d, None))
                    records.append(("preprocess", model.name, began + d, began + d + p, None))
                return out
            except ServiceError as e:
                e.param = e.param or f"{param}[{i}]"
                raise

        jobs = [loop.run_in_executor(self.pool, work, b, info, i) for i, (b, info) in enumerate(zip(blobs, infos))]
        try:
            done = await asyncio.gather(*jobs)
        except BaseException:
            for j in jobs:  # images not started yet are never decoded
                j.cancel()
            raise
        timings.add("decode", [d for _, d, _ in done])
        timings.add("preprocess", [p for _, _, p in done])
        for _, d, p in done:
            self.metrics.image_latency.labels(model.name, "decode").observe(d)
            self.metrics.image_latency.labels(model.name, "preprocess").observe(p)
        return [px for px, _, _ in done]

    async def image_results(self, model: ServedModel, fn: str, blobs: list[bytes], timings: Timings, receive=None,
                            param: str = "images") -> list[Result]:
        """Images through one model function: places reserved in its queue first, then probe,
        decode, preprocess, and the batcher."""
        self.check_count(len(blobs), self.settings.max_images_per_request, "images", param)
        with self.reserve(model, fn, len(blobs)) as held:
            rows = await self.pixel_rows(model, blobs, timings, param)
            return await self.run(model, fn, rows, timings, receive, held=held,
                                  param=param)

    async def run(self, model: ServedModel, fn: str, rows: list[dict[str, np.ndarray]], timings: Timings,
                  receive: Callable[[], Awaitable[dict]] | None = None, *, held: Reservation | None = None,
                  param: str | None = None) -> list[Result]:
        """Submit every row to the model's queue and wait for all; a client that leaves cancels them.

        ``receive`` is the request's ASGI receive: once the body is read, its next message is the
        client's disconnect, so one waiting task detects it without polling (polling every
        waiting request kept the event loop busy, and the worker thread waited for the GIL
        between torch ops; docs/history.md has the measurement).
        """
        queue = model.queues[fn]
        own = held is None
        held = held or self.reserve(model, fn, len(rows))  # all or nothing: no partial submission to cancel
        futures = []
        deadline, tag = context.deadline.get(), context.request_id.get()
        try:
            for row in rows:
                futures.append(self.batcher.submit(queue, row, self.settings.request_timeout_s, deadline=deadline,
                                                   reserved=held.take(), tag=tag))
        except Exception:
            for f in futures:
                f.cancel()
            raise
        finally:
            if own:
                held.close()
        gathered = asyncio.ensure_future(asyncio.gather(*futures))
        gathered.add_done_callback(_consume)
        watcher = asyncio.ensure_future(_until_disconnect(receive)) if receive is not None else None
        try:
            waiting = {gathered} if watcher is None else {gathered, watcher}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if gathered not in done:
                self.metrics.rejected.labels(model.name, "client_disconnected").inc()
                raise ClientDisconnected("the client disconnected before its result was ready")
            results: list[Result] = gathered.result()
        except ServiceError as e:
            gathered.cancel()
            for f in futures:
                f.cancel()
            if param and not e.param:  # name the failing item
                failed = [i for i, f in enumerate(futures) if f.done() and not f.cancelled() and f.exception() is e]
                e.param = f"{param}[{failed[0]}]" if failed else param
            raise
        except BaseException:
            gathered.cancel()
            for f in futures:
                f.cancel()
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
        if model.routing is not None and fn == model.routing.plain:  # a sampled call's statistics
            model.routing.record([r.outputs for r in results])
        timings.add("queue", [r.timings["queue"] for r in results])
        timings.add("inference", [r.timings["inference"] for r in results])
        records = context.stages.get()
        if records is not None:  # a traced request: its spans (server.observability.tracing)
            for r in results:
                t, batch = r.timings, (r.timings.get("batch_id"), r.timings.get("batch_size"))
                if "started" not in t:
                    continue
                records.append(("queue", model.name, t["started"] - t["queue"], t["started"], batch))
                records.append(("inference", model.name, t["started"], t["started"] + t["inference"], batch))
        for r in results:
            self.metrics.image_latency.labels(model.name, "queue").observe(r.timings["queue"])
            self.metrics.image_latency.labels(model.name, "inference").observe(r.timings["inference"])
        return results

    def finish(self, model: ServedModel, endpoint: str, timings: Timings, t_post: float, t_start: float) -> None:
        post = time.perf_counter() - t_post
        records = context.stages.get()
        if records is not None:
            records.append(("postprocess", model.name, t_post, t_post + post, None))
        total = time.perf_counter() - t_start
        n = max(1, len(timings.items))
        timings.add("postprocess", [post] * n)
        for _ in range(n):
            self.metrics.image_latency.labels(model.name, "postprocess").observe(post)
            self.metrics.image_latency.labels(model.name, "total").observe(total)
        self.metrics.images.labels(model.name, endpoint).inc(n)

    # ------------------------------------------------------------------ endpoints

    async def classify(self, name, blobs, top_k, receive=None):
        t0, timings = time.perf_counter(), Timings()
        model = self.pick(name, "classify", "classify images")
        if "logits" not in model.backend.functions["classify"].outputs:
            raise Unprocessable(f"model {model.name!r} has no classifier head (features only): use /v1/embed",
                                param="model")
        results = await self.image_results(model, "classify", blobs, timings, receive)
        t_post = time.perf_counter()
        out = []
        for r in results:
            scores = post.class_scores(r.outputs["logits"], model.head_activation)
            idx = post.top_indices(scores, top_k)
            labels = model.labels or [str(i) for i in range(len(scores))]
            out.append({"predictions": [{"label": labels[i], "index": int(i), "score": float(scores[i])} for i in idx]})
        self.finish(model, "classify", timings, t_post, t0)
        return model, out, timings

    async def embed_images(self, model: ServedModel, blobs, normalize: bool, timings: Timings, receive=None,
                           param: str = "images"):
        fn, key = ("image", "image_embeds") if model.can("image") else ("classify", "pre_logits")
        results = await self.image_results(model, fn, blobs, timings, receive, param)
        vecs = [r.outputs[key].astype(np.float32) for r in results]
        if normalize and fn == "classify":
            vecs = [post.l2_normalize(v) for v in vecs]
        return vecs

    async def embed_texts(self, model: ServedModel, texts: list[str], timings: Timings, receive=None, param="texts"):
        self.check_count(len(texts), self.settings.max_texts_per_request, "texts", param)
        if model.tokenizer is None:
            raise Unprocessable(f"model {model.name!r} has no tokenizer: send token ids through "
                                f"/v2/models/{model.name}/infer (input_ids)", param=param)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise Unprocessable("texts must be strings", param=f"{param}[{i}]")
            if len(t) > self.settings.max_text_chars:
                raise Unprocessable(f"text of {len(t)} characters; the limit is {self.settings.max_text_chars}", param=f"{param}[{i}]")
        ids = model.tokenizer(texts)
        results = await self.run(model, "text", [{"input_ids": row} for row in ids], timings, receive, param=param)
        return [r.outputs["text_embeds"].astype(np.float32) for r in results]

    async def embed(self, name, blobs, texts, normalize, receive=None):
        t0, timings = time.perf_counter(), Timings()
        if not blobs and not texts:
            raise Unprocessable("send images and/or texts", param="images")
        fn = "text" if texts and not blobs else ("image" if texts else "classify")
        model = self.pick(name, fn, "embed texts" if fn == "text" else "embed images") if fn != "classify" else self._embedder(name)
        if not normalize and model.kind == "two-tower":
            raise Unprocessable("two-tower embeddings are always L2-normalised (vmoe); omit normalize or set it true",
                                param="normalize")
        image_vecs = await self.embed_images(model, blobs, normalize, timings, receive) if blobs else None
        text_vecs = await self.embed_texts(model, texts, Timings(), receive) if texts else None
        t_post = time.perf_counter()
        self.finish(model, "embed", timings, t_post, t0)
        return model, image_vecs, text_vecs, timings

    def _embedder(self, name):
        """Any image model can embed: two-tower image towers, or a classifier's pooled features."""
        if name:
            model = self.models.get(name)
            if model is None:
                raise not_served(name, self.models, self.control)
            if not (model.can("image") or model.can("classify")):
                raise Unprocessable(f"model {name!r} ({model.kind}) cannot embed images", param="model")
            if not model.ready:
                raise Unavailable(f"model {model.name!r} is not ready", retry_after_s=2)
            return model
        for fn in ("image", "classify"):
            m = next((m for m in list(self.models.values()) if m.can(fn)), None)
            if m is not None:
                return self.pick(m.name, fn, "embed images")
        raise NotFound("no served model can embed images", param="model")

    async def label_embeddings(self, model: ServedModel, labels: list[str], templates: list[str], receive=None) -> np.ndarray:
        """(len(labels), D): per label the renormalised mean of its prompts' embeddings, cached per prompt."""
        prompts = [[post.prompt(t, label) for t in templates] for label in labels]
        flat = sorted({p for ps in prompts for p in ps})
        table = {p: self.label_cache.get((model.name, p)) for p in flat}
        missing = [p for p, v in table.items() if v is None]
        self.metrics.cache_hits.labels(model.name, "hit").inc(len(flat) - len(missing))
        self.metrics.cache_hits.labels(model.name, "miss").inc(len(missing))
        step = max(1, min(self.settings.max_texts_per_request, model.queues["text"].max_queue // 2))
        for start in range(0, len(missing), step):
            chunk = missing[start: start + step]
            vecs = await self.embed_texts(model, chunk, Timings(), receive, param="labels")
            for p, v in zip(chunk, vecs):
                table[p] = v
                self.label_cache.put((model.name, p), v)
        return np.stack([post.label_vector([table[p] for p in ps]) for ps in prompts]).astype(np.float32)

    def check_prompts(self, model: ServedModel, labels, templates) -> list[str]:
        """Every zero-shot text input checked before any tower runs; returns the templates used."""
        limit = self.settings.max_text_chars
        self.check_count(len(labels), self.settings.max_texts_per_request, "labels", "labels")
        for i, label in enumerate(labels):
            if not isinstance(label, str) or not label.strip():
                raise Unprocessable("labels must be non-empty strings", param=f"labels[{i}]")
            if len(label) > limit:
                raise Unprocessable(f"label of {len(label)} characters; the limit is {limit}", param=f"labels[{i}]")
        if len(set(labels)) != len(labels):
            dup = next(i for i, v in enumerate(labels) if labels.index(v) != i)
            raise Unprocessable(f"labels must be distinct: {labels[dup][:40]!r} repeats", param=f"labels[{dup}]")
        given = templates is not None
        templates = templates or model.templates
        self.check_count(len(templates), MAX_TEMPLATES, "templates", "templates")
        for j, t in enumerate(templates):
            if not isinstance(t, str) or t.count("{}") > 1 or len(t) > limit:
                raise Unprocessable(f"a template is a string of at most {limit} characters with at most one '{{}}'",
                                    param=f"templates[{j}]")
        rows = len(labels) * len(templates)
        if rows > self.settings.max_text_rows_per_request:
            self.metrics.rejected.labels(model.name, "over_budget").inc()
            raise Unprocessable(f"{len(labels)} labels x {len(templates)} templates = {rows} prompts; the limit is "
                                f"{self.settings.max_text_rows_per_request} (max_text_rows_per_request)",
                                param="templates" if given else "labels")
        for i, label in enumerate(labels):
            for j, t in enumerate(templates):
                n = len(post.prompt(t, label))
                if n > limit:
                    raise Unprocessable(f"label {i} in template {j} ({t[:30]!r}) makes a prompt of {n} characters; "
                                        f"the limit is {limit}", param=f"labels[{i}]")
        return templates

    async def zero_shot(self, name, blobs, labels, templates, activation, receive=None):
        t0, timings = time.perf_counter(), Timings()
        model = self.pick(name, "text", "do zero-shot classification")
        if not model.can("image"):
            raise Unprocessable(f"model {model.name!r} has no image tower", param="model")
        templates = self.check_prompts(model, labels, templates)
        self.check_count(len(blobs), self.settings.max_images_per_request, "images", "images")
        with self.reserve(model, "image", len(blobs)) as held:
            # Images are probed, decoded and preprocessed (validated) before either tower runs.
            rows = await self.pixel_rows(model, blobs, timings)
            zlab = await self.label_embeddings(model, labels, templates, receive)
            results = await self.run(model, "image", rows, timings, receive,
                                     held=held, param="images")
        zimg = np.stack([r.outputs["image_embeds"].astype(np.float32) for r in results])
        t_post = time.perf_counter()
        scores = post.zero_shot_scores(zimg, zlab, model.logit_scale, model.logit_bias, activation)
        results = []
        for row in scores:
            order = post.zero_shot_order(row, labels)
            results.append({"scores": [{"label": labels[j], "score": float(row[j])} for j in order]})
        self.finish(model, "zero_shot", timings, t_post, t0)
        return model, results, timings

    async def routing(self, name, blobs, fmt: str, layers: list[int] | None, slots: int, receive=None):
        """Per image, every MoE layer's routing (``softmoe_models.routing``; sparse V-MoE models:
        ``softmoe_models.sparse_routing``, JSON only) through the
        model's routing queue: ``(model, body, timings)`` with ``body`` the JSON-ready dict, or
        the PNG bytes of the rendered sheet when ``fmt == 'png'``."""
        t0, timings = time.perf_counter(), Timings()
        model = self.pick(name, ROUTING, "show routing (it needs MoE image layers and --routing)")
        layout = model.routing.layout
        soft = isinstance(layout, routing_lib.Layout)
        unknown = sorted(set(layers or ()) - set(layout.layers))
        if unknown:
            raise Unprocessable(f"layer(s) {unknown} of model {model.name!r} are not MoE layers; "
                                f"those are {list(layout.layers)}", param="layers")
        self.check_count(len(blobs), self.settings.max_images_per_request, "images", "images")
        drawn = len(layers) if layers else len(layout.layers)
        if fmt == "png" and not soft:
            raise Unprocessable(f"model {model.name!r} routes sparsely ({layout.router}); the PNG draws Soft MoE "
                                "slots: ask for format json (combine weights per token and expert)", param="format")
        if fmt == "png" and routing_png.sheet_pixels(layout, len(blobs), drawn, slots) > PNG_MAX_PIXELS:
            raise Unprocessable(f"a PNG of {len(blobs)} images x {drawn} layers x {slots} slots exceeds "
                                f"{PNG_MAX_PIXELS} pixels; ask for fewer images, layers or slots", param="images")
        with self.reserve(model, ROUTING, len(blobs)) as held:
            rows = await self.pixel_rows(model, blobs, timings)
            results = await self.run(model, ROUTING, rows, timings, receive,
                                     held=held, param="images")
        t_post = time.perf_counter()
        outputs = [r.outputs for r in results]
        top = [self._top1(model, out) for out in outputs]
        if fmt == "png":
            captions = [f"pred {t['label']} ({t['score']:.2f})" if t else "" for t in top]
            cfg = model.preprocess

            def render() -> bytes:
                pixels = [to_pixel_values(r[PIXELS], cfg) if PIXELS in r else r["pixel_values"] for r in rows]
                return routing_png.render_png(layout, pixels, outputs, cfg.value_range, layers, slots, captions)

            body = await asyncio.to_thread(render)
        else:
            per_image = await asyncio.to_thread(lambda: [routing_lib.any_image_routing(layout, o, layers)
                                                         for o in outputs])
            body = {"model": model.name, "grid": [layout.grid, layout.grid], "tokens": layout.tokens,
                    "num_experts": layout.num_experts,
                    **({"slots_per_expert": layout.slots_per_expert} if soft else
                       {"router": layout.router, "experts_per_token": layout.experts_per_token, "cls": layout.cls}),
                    "results": [{"prediction": t, "layers": r} for t, r in zip(top, per_image)]}
        if not soft:  # these images' drops count too: the routing was computed
            model.routing.count_drops(np.stack([o["dropped_choices"] for o in outputs]))
        self.finish(model, "routing", timings, t_post, t0)
        return model, body, timings

    @staticmethod
    def _top1(model: ServedModel, outputs: dict[str, np.ndarray]) -> dict | None:
        """A classifier's top label (as /v1/classify scores it); None for image towers."""
        if "logits" not in outputs:
            return None
        scores = post.class_scores(outputs["logits"], model.head_activation)
        i = int(np.argmax(scores))
        labels = model.labels or [str(k) for k in range(len(scores))]
        return {"label": labels[i], "index": i, "score": float(scores[i])}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def not_served(name: str, models: dict, control=None) -> NotFound:
    """The 404 for a model name that serves no request, naming its state when the server knows it."""
    state = control.describe_missing(name) if control is not None else None
    why = f"is not loaded ({state})" if state else "is not served"
    return NotFound(f"model {name[:100]!r} {why}; served: {sorted(models)}", param="model")


def is_ready(state) -> bool:
    """Every model loaded and warmed up, the device worker alive, not draining."""
    batcher = state.batcher
    return bool(state.ready and not state.draining and batcher is not None and batcher.alive
                and all(m.ready for m in list(state.models.values())))
