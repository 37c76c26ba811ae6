"""The front-end side of ``--frontend-workers N``: a Batcher whose device lives in the engine process.

``RemoteBatcher`` has the interface the Service and the routes use (``reserve``, ``release``,
``submit`` -> an asyncio future of a ``Result``, ``alive``, ``dead``, ``depth``, ``start``,
``stop``, ``add_queue``), so ``create_app(settings, models=..., batcher=RemoteBatcher(...))``
serves the same endpoints with the same answers. Reservations and submits are checked against
the engine's shared admission table (engine.py), synchronously and globally; rows go into this
process's arena slot and a frame names the slot; results and errors come back as frames.

``served_models()`` builds the front end's ``ServedModel`` objects from the engine's description
(no weights: a ``RemoteBackend`` with the functions and the backend's description; preprocess,
labels, tokenizer, logit scale and bias, templates, vocab size, proven shapes).

Metrics: ``merge_process_metrics`` makes a front end's ``/metrics`` serve every process's metrics
(prometheus_client's multiprocess mode, one directory for the supervisor's children): counters
and histograms summed over the front ends and the engine; gauges as one process shows them where
one series has a meaning (queue depth and capacity from the engine, in-flight requests summed,
readiness and liveness the minimum: ``GAUGES``), else one series per front end (a ``pid`` label);
``process_*`` of the front end that answered. Knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import itertools
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from softmoe_models.tokenizer import Tokenizer

from server.errors import QueueFull, Unavailable
from server.batching.batcher import ModelQueue, Result, Rows
from server.engine.models import ServedModel
from server.workers.process import CANCEL, ERROR, FREED, HELLO, RESULT, STATE, SUBMIT, WELCOME, Link, unpack_error
from server.workers.shm import AdmissionTable, Arena

log = logging.getLogger("softmoe.frontend")


class RemoteBackend:
    """A model's backend as a front end sees it: its functions and its description. It runs in the
    engine process; nothing calls ``run`` here (the queues go to the engine)."""

    def __init__(self, name: str, functions: dict, info: dict, max_batch_size: int, routing=None) -> None:
        self.name, self.functions, self.info, self.max_batch_size = name, functions, info, max_batch_size
        self.routing = routing  # the routing function's spec, where the model has one

    def run(self, fn: str, inputs: Rows) -> Rows:
        raise RuntimeError("a front end's backend runs in the engine process")

    def warmup(self, batch_sizes: list[int]) -> None:
        pass

    def describe(self) -> dict:
        return dict(self.info)

    def close(self) -> None:
        pass


@dataclass
class _Item:
    future: asyncio.Future
    queue: int  # index in the engine's queue table
    row: Rows | None  # until sent
    due: float  # perf_counter deadline (CLOCK_MONOTONIC: the engine's clock too)
    tag: str
    sent: bool = False


class RemoteBatcher:
    """The engine's Batcher, seen from one front-end process."""

    def __init__(self, device: str, index: int, lock, metrics=None) -> None:
        """
        Args:
            device: the engine's device (for messages).
            index: this front end's column in the admission table (0..N-1).
            lock: the admission table's cross-process lock.
            metrics: the app's Metrics (queue_full refusals are counted here), set once the app exists.
        """
        self.device, self.index, self.lock, self.metrics = device, index, lock, metrics
        self.dead: str | None = None  # the engine's worker died, or the engine exited
        self.queues: list[ModelQueue] = []
        self.info: dict[str, Any] = {}
        self.table: AdmissionTable | None = None
        self.arena: Arena | None = None
        self._link = Link()
        self._qi: dict[str, int] = {}
        self._pending: dict[int, _Item] = {}
        self._waiting: deque[int] = deque()  # items waiting for a free slot
        self._free: list[int] = []
        self._ids = itertools.count()
        self._welcome: asyncio.Future | None = None
        self._connected = self._started = self._stopping = False

    # ------------------------------------------------------------------ connection

    async def connect(self, path: str, token: bytes, timeout: float = 60.0) -> dict:
        """Connect to the engine (waiting for it to listen: the supervisor stops this process if the
        engine cannot start), present the token, map the table and this front end's arena."""
        loop = asyncio.get_running_loop()
        self._welcome = loop.create_future()
        while True:  # the engine may still be loading: it listens once warmed up
            try:
                transport, _ = await loop.create_unix_connection(lambda: _Protocol(self), path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(0.05)
        transport.write(HELLO.pack(token, self.index, os.getpid()))
        info = self.info = await asyncio.wait_for(self._welcome, timeout)
        queues = info["queues"]
        self.table = AdmissionTable.attach(info["table"], self.lock, len(queues), info["frontends"])
        self.arena = Arena(shared_memory.SharedMemory(name=info["arena"]), queues, info["slots"])
        self._free = list(range(info["slots"] - 1, -1, -1))
        self._qi = {q["name"]: i for i, q in enumerate(queues)}
        self.dead = info.get("dead")
        return info

    def served_models(self) -> list:
        """ServedModel objects for the app, without weights (see the module docstring)."""
        models = []
        for d in self.info["models"]:
            m = ServedModel(name=d["name"], kind=d["kind"], source=d["source"],
                            backend=RemoteBackend(d["backend"], d["functions"], d["info"], d["max_batch_size"],
                                                  d["routing_spec"]),
                            preprocess=d["preprocess"], labels=d["labels"], head_activation=d["head_activation"],
                            text_contract=d["text_contract"], logit_scale=d["logit_scale"], logit_bias=d["logit_bias"],
                            templates=d["templates"], vocab_size=d["vocab_size"], proven_shapes=d["proven_shapes"])
            if d["tokenizer"] is not None:
                m.tokenizer = Tokenizer.from_contract(d["tokenizer"], d["text_contract"])
            if d["routing"] is not None:
                m.routing = d["routing"]
            models.append(m)
        return models

    def add_queue(self, queue: ModelQueue) -> ModelQueue:
        """Bind a model queue of the app to the engine's queue of the same name (limits, proven shapes)."""
        i = self._qi.get(queue.name)
        if i is None:
            raise RuntimeError(f"the engine serves no queue {queue.name!r}")
        spec = self.info["queues"][i]
        queue.max_batch_size, queue.max_queue, queue.pad = spec["max_batch_size"], spec["max_queue"], spec["pad"]
        queue.shapes = tuple(spec["shapes"])
        queue.metrics = None  # depth and capacity are the engine's series
        self.queues.append(queue)
        siblings = [q for q in self.queues if q.label == queue.label]
        for q in siblings:
            q.siblings = siblings
        return queue

    def start(self) -> None:
        self._started = True

    def stop(self, timeout: float = 30.0) -> None:
        """Disconnect (the requests in flight are answered by then: uvicorn finished them)."""
        self._stopping = True
        if self._link.transport is not None:
            self._link.transport.close()
        self._link.closed = True
        for part in (self.table, self.arena):
            if part is not None:
                part.close()
        self.table = self.arena = None

    @property
    def alive(self) -> bool:
        return self._connected and self._started and self.dead is None and not self._stopping

    def depth(self, queue: ModelQueue | None = None) -> int:
        """Items queued in the engine (every front end's)."""
        if self.table is None:
            return 0
        if queue is None:
            return int(self.table.queued.sum())
        return int(self.table.queued[self._qi[queue.name]])

    # ------------------------------------------------------------------ event-loop side

    def _check(self) -> None:
        if self.dead:
            raise Unavailable("the device worker stopped after a fatal error", retry_after_s=5)
        if self._stopping or self.table is None:
            raise Unavailable("the server is shutting down", retry_after_s=2)

    def reserve(self, queue: ModelQueue, n: int) -> None:
        """Take ``n`` places in ``queue`` (global: every front end's) before decoding; 429 when they do not fit."""
        self._check()
        q, table = self._qi[queue.name], self.table
        with table.hold():
            taken = table.taken(q)
            if taken + n > queue.max_queue:
                self._refused(queue)
                raise QueueFull(f"model {queue.label!r} cannot queue {n} more items: {taken} of "
                                f"{queue.max_queue} places taken")
            table.reserved[q, self.index] += n

    def release(self, queue: ModelQueue, n: int) -> None:
        table = self.table
        if n > 0 and table is not None:
            q = self._qi[queue.name]
            with table.hold():
                table.reserved[q, self.index] = max(0, int(table.reserved[q, self.index]) - n)

    def submit(self, queue: ModelQueue, row: Rows, timeout_s: float, *, deadline: float | None = None,
               reserved: bool = False, tag: str = "-") -> asyncio.Future:
        """Send one item to the engine; the future resolves to a ``Result`` or raises a ServiceError."""
        loop = asyncio.get_running_loop()
        self._check()
        q, table = self._qi[queue.name], self.table
        now = time.perf_counter()
        due = now + timeout_s if deadline is None else min(deadline, now + timeout_s)
        with table.hold():
            if reserved and table.reserved[q, self.index] > 0:
                table.reserved[q, self.index] -= 1
            elif table.taken(q) >= queue.max_queue:
                self._refused(queue)
                raise QueueFull(f"model {queue.label!r} has {int(table.queued[q])} items queued "
                                f"(limit {queue.max_queue})")
            table.sent[q, self.index] += 1
        fut = loop.create_future()
        item_id = next(self._ids)
        self._pending[item_id] = item = _Item(fut, q, row, due, tag)
        fut.add_done_callback(lambda f, i=item_id: self._settled(i, f))
        if self._free and not self._waiting:
            self._send(item_id, item)
        else:
            self._waiting.append(item_id)
        return fut

    def _refused(self, queue: ModelQueue) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(queue.label, "queue_full").inc()

    def _send(self, item_id: int, item: _Item) -> None:
        slot = self._free.pop()
        inline = None
        if not self.arena.write(slot, item.queue, item.row):  # not the model's input layout: in the frame
            self._free.append(slot)
            slot, inline = -1, item.row
        item.row, item.sent = None, True
        self._link.send((SUBMIT, item_id, item.queue, slot, inline, max(0.0, item.due - time.perf_counter()), item.tag))

    def _pump(self) -> None:
        while self._waiting and self._free:
            item_id = self._waiting.popleft()
            item = self._pending.get(item_id)
            if item is not None and not item.sent and not item.future.done():
                self._send(item_id, item)

    def _settled(self, item_id: int, fut: asyncio.Future) -> None:
        """A future done here first (its request was cancelled): tell the engine, or never send it."""
        item = self._pending.pop(item_id, None)
        if item is None or not fut.cancelled():
            return
        if item.sent:
            if self._connected:
                self._link.send((CANCEL, item_id))
        elif self.table is not None:
            with self.table.hold():
                self.table.sent[item.queue, self.index] -= 1

    # ------------------------------------------------------------------ frames from the engine

    def _received(self, data: bytes) -> None:
        for message in self._link.feed(data):
            kind = message[0]
            if kind == RESULT:
                item = self._pending.pop(message[1], None)
                if item is not None and not item.future.done():
                    item.future.set_result(Result(message[2], message[3]))
            elif kind == ERROR:
                item = self._pending.pop(message[1], None)
                if item is not None and not item.future.done():
                    item.future.set_exception(unpack_error(message[2]))
            elif kind == FREED:
                self._free.extend(message[1])
                self._pump()
            elif kind == STATE:
                self.dead = message[1]
                log.error("the engine's device worker stopped: %s", self.dead)
            elif kind == WELCOME and self._welcome is not None and not self._welcome.done():
                self._connected = True
                self._welcome.set_result(message[1])

    def _lost(self, exc: Exception | None) -> None:
        self._connected = False
        self._link.closed = True
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_exception(ConnectionError("the engine refused or closed the connection"))
        if not self._stopping:
            self.dead = self.dead or "the inference engine process exited"
            log.error("lost the engine: %s", self.dead)
        pending, self._pending = self._pending, {}
        self._waiting.clear()
        for item in pending.values():
            if not item.future.done():
                item.future.set_exception(Unavailable("the inference engine stopped; this replica is restarting, "
                                                      "retry on another", retry_after_s=5))


class _Protocol(asyncio.Protocol):
    def __init__(self, owner: RemoteBatcher) -> None:
        self.owner = owner

    def connection_made(self, transport) -> None:
        self.owner._link.transport = transport

    def data_received(self, data: bytes) -> None:
        self.owner._received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._lost(exc)


# ------------------------------------------------------------------ metrics of every process


# How the processes' values of a gauge become what a scrape shows (the engine's pid is known):
# "engine": the engine's series (no pid label, as one process shows it); "min"/"sum": one series
# over the front ends; "min_all": over the engine too. Any other gauge (e.g. a routing window,
# which each front end keeps for the traffic it served): one series per front end, a pid label.
GAUGES = {
    "softmoe_queue_depth": "engine", "softmoe_queue_capacity": "engine", "softmoe_backend_info": "engine",
    "softmoe_worker_alive": "min_all", "softmoe_model_ready": "min_all", "softmoe_server_ready": "min",
    "softmoe_requests_in_flight": "sum", "softmoe_requests_in_flight_bytes": "sum", "softmoe_connections_open": "sum",
    # the export cache, as the engine process (which reads and writes it) last measured it
    "softmoe_cache_bytes": "engine", "softmoe_cache_max_bytes": "engine", "softmoe_cache_free_bytes": "engine",
    "softmoe_cache_free_floor_bytes": "engine",
}


class _Merged:
    """Every process's metric files (multiprocess mode), read at each scrape: counters and
    histograms summed; gauges as ``GAUGES`` says."""

    def __init__(self, path: str, engine_pid: int) -> None:
        self.path, self.engine = path, str(engine_pid)

    def collect(self):
        for _ in range(3):  # a dead process's gauge file can vanish between the glob and the read
            try:
                merged = list(MultiProcessCollector.merge(glob.glob(os.path.join(self.path, "*.db")), accumulate=True))
                break
            except FileNotFoundError:
                continue
        else:
            return []
        for metric in merged:
            if metric.type == "gauge":
                metric.samples = self._gauge(metric.name, metric.samples)
        return merged

    def _gauge(self, name: str, samples: list) -> list:
        how = GAUGES.get(name)
        groups: dict[tuple, list] = {}
        for s in samples:
            pid = s.labels.get("pid")
            if how is None:
                if pid != self.engine:
                    groups[(s.name, tuple(sorted(s.labels.items())))] = [s]
                continue
            if (how == "engine") != (pid == self.engine) and how != "min_all":
                continue
            labels = {k: v for k, v in s.labels.items() if k != "pid"}
            groups.setdefault((s.name, tuple(sorted(labels.items()))), []).append(s._replace(labels=labels))
        out = []
        for group in groups.values():
            values = [s.value for s in group]
            value = sum(values) if how == "sum" else min(values)
            out.append(group[0]._replace(value=value))
        return out


def merge_process_metrics(metrics, path: str, engine_pid: int) -> None:
    """Make ``metrics.registry`` expose the merged metrics of every process writing to ``path``
    (this process's own metric objects write there too, in multiprocess mode) instead of this
    process's alone; the process and platform collectors stay (this front end's)."""
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            with contextlib.suppress(KeyError):
                metrics.registry.unregister(value)
    metrics.registry.register(_Merged(path, engine_pid))


def forget_process_metrics(pid: int, path: str) -> None:
    """A dead process's gauges leave the merged view (its counters stay: totals never go back)."""
    mark_process_dead(pid, path)
    for name in os.listdir(path):
        if name.startswith("gauge_") and name.endswith(f"_{pid}.db"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, name))
