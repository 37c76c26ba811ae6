"""The engine process of ``--frontend-workers N``: the engine (server.engine: the one Batcher and
the backends of a device), fed by N front-end processes through shared memory. Knows nothing
about HTTP.

Process layout (``Supervisor``, run by ``server.run.serve``; spawn context, each child in its own
process group so a terminal's Ctrl-C reaches only the parent, which coordinates the shutdown)::

    parent (supervisor: binds the port, forwards signals, respawns a front end that dies)
      engine   models loaded once, warm-up and proven shapes as in one process, Batcher + worker
      front end 0..N-1   uvicorn on the parent's listening socket, a RemoteBatcher (remote.py)

Transport: one Unix stream socket per front end (in a 0700 temporary directory), length-prefixed
frames. The first frame is raw bytes (a random token from the parent, the front end's index and
pid); only an authenticated peer's frames are unpickled after it.

Shared memory (``multiprocessing.shared_memory``, created and unlinked by the engine; ``shm.py``):

* the admission table, int64 cells under one cross-process lock (``AdmissionTable``):
  ``owner pid | queued[Q] | reserved[Q, N] | sent[Q, N]`` for the Q model queues: ``queued`` is
  the engine queue's length (the engine writes it whenever its items change), ``reserved`` the
  places each front end's requests hold before decoding, ``sent`` rows on their way to the
  engine. A front end reserves and submits against ``queued + reserved + sent <= max_queue``
  without a round trip, so ``Batcher.reserve`` stays synchronous and admission stays global;
* one arena per front end (``Arena``): ``slots`` fixed-size slots, each holding one row of any
  queue, its inputs at fixed offsets computed from the model's input specs. A submit frame
  carries the slot index; the engine copies the row out at once and frees the slot (``FREED``
  frames, one per read); outputs are small and come back in the result frame.

Every waiting item gets its result or its exception: a ``ServiceError`` crosses the boundary as
(class, status, type, message, param, headers). A front end that disconnects (it died) has its
reservations and in-flight rows released and its queued items cancelled (dropped before compute);
if it died holding the admission lock, the engine takes the lock over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import itertools
import logging
import multiprocessing
import os
import pickle
import secrets
import signal
import struct
import threading
from multiprocessing import shared_memory
from typing import Any, Callable

import numpy as np
import uvicorn

from server import errors
from server.errors import ServiceError
from server.batching.batcher import ModelQueue
from server.engine.core import Engine
from server.engine.startup import StartupError, check_backend, describe, load_models
from server.observability import logs
from server.metrics import Metrics
from server.workers.shm import AdmissionTable, Arena

log = logging.getLogger("softmoe.engine")

# Frame kinds. Front end -> engine: SUBMIT, CANCEL. Engine -> front end: the rest.
WELCOME, SUBMIT, CANCEL, RESULT, ERROR, FREED, STATE = range(7)
HELLO = struct.Struct("<16sii")  # token, front-end index, pid: the one frame that is not pickled
TOKEN_BYTES = 16


def frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(4, "little") + data


class Link:
    """Length-prefixed frames over an asyncio transport; sends are coalesced per loop turn."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._out: list[bytes] = []
        self.closed = False

    def send(self, message: Any) -> None:
        if self.closed or self.transport is None:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(frame(message))

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and not self.closed and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def feed(self, data: bytes) -> list[Any]:
        """The complete frames received so far."""
        self._buf += data
        messages, at, end = [], 0, len(self._buf)
        while end - at >= 4:
            n = int.from_bytes(self._buf[at:at + 4], "little")
            if end - at - 4 < n:
                break
            messages.append(pickle.loads(self._buf[at + 4:at + 4 + n]))
            at += 4 + n
        del self._buf[:at]
        return messages


# ------------------------------------------------------------------ errors across the boundary

_ERROR_CLASSES: dict[tuple[str, int, str], type[ServiceError]] = {}


def pack_error(exc: BaseException) -> tuple:
    if not isinstance(exc, ServiceError):  # the batcher resolves with ServiceErrors only; never a text leak
        exc = errors.ServiceError("the inference engine failed on this request")
    return (type(exc).__name__, exc.status, exc.type, exc.message, exc.param, dict(exc.headers))


def unpack_error(packed: tuple) -> ServiceError:
    """The same class (or one with the same status and type), message, param and headers."""
    name, status, kind, message, param, headers = packed
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ServiceError) and cls.status == status and cls.type == kind):
        cls = _ERROR_CLASSES.setdefault((name, status, kind),
                                        type(name, (ServiceError,), {"status": status, "type": kind}))
    exc = cls.__new__(cls)
    ServiceError.__init__(exc, message, param=param, headers=dict(headers))
    return exc


# ------------------------------------------------------------------ the engine


def describe_model(model) -> dict:
    """What a front end needs of a loaded ServedModel, picklable: no weights, no backend."""
    tokenizer = model.tokenizer.sp.serialized_model_proto() if model.tokenizer is not None else None
    routing = getattr(model, "routing", None)  # its sampling decisions stay in the engine; its window per process
    if routing is not None:  # its metric children stay here (they hold locks); the copy binds its own
        fresh = {"series": {}, "calls": 0}
        routing = dataclasses.replace(routing, **{f.name: fresh[f.name] for f in dataclasses.fields(routing)
                                                  if f.name in fresh})
    return {
        "name": model.name, "kind": model.kind, "source": model.source, "backend": model.backend.name,
        "functions": dict(model.backend.functions), "info": model.backend.describe(),
        "max_batch_size": model.backend.max_batch_size, "preprocess": model.preprocess, "labels": model.labels,
        "head_activation": model.head_activation, "text_contract": model.text_contract, "tokenizer": tokenizer,
        "logit_scale": model.logit_scale, "logit_bias": model.logit_bias, "templates": list(model.templates),
        "vocab_size": model.vocab_size, "proven_shapes": dict(model.proven_shapes),
        "routing": routing, "routing_spec": getattr(model.backend, "routing", None),
    }


def function_spec(backend, fn: str):
    """The FunctionSpec of a queue's function (the routing function is not in ``functions``)."""
    spec = backend.functions.get(fn)
    return spec if spec is not None else getattr(backend, "routing", None)


class EngineServer:
    """The engine (server.engine.core) serving front ends: its model queues in the admission table,
    and the front ends' links."""

    def __init__(self, settings, models: list, frontends: int, lock, metrics, prefix: str | None = None) -> None:
        self.settings, self.models, self.frontends, self.metrics = settings, models, frontends, metrics
        self.engine = Engine(settings, metrics)
        # attached, warmed and proven; the batcher starts in ``serve``, once front ends can connect
        self.engine.bring_up(models, serve=False)
        self.batcher = self.engine.batcher
        # Queue i of the table, with its function's inputs (the arena's slot layout).
        self.queues: list[ModelQueue] = [q for m in models for q in m.queues.values()]
        self.specs = [function_spec(m.backend, fn) for m in models for fn in m.queues]
        # Shared memory names start with ``prefix``: the supervisor unlinks them if this process dies.
        self.prefix, self._arenas = prefix, itertools.count()
        self.table = AdmissionTable.create(lock, len(self.queues), frontends, f"{prefix}_t" if prefix else None)
        for i, q in enumerate(self.queues):
            q._gauge = _Publish(q, self.table, i)  # the queue's length, into the table at every change
            q.coming = functools.partial(self.table.coming, i)  # what the front ends will still send
        self.links: dict[int, EngineLink] = {}
        self.dead_sent: str | None = None
        self.orphaned = False

    def description(self) -> dict:
        queues = [{"name": q.name, "label": q.label, "max_batch_size": q.max_batch_size, "max_queue": q.max_queue,
                   "pad": q.pad, "shapes": tuple(q.shapes),
                   "inputs": [(s.name, s.shape, np.dtype(s.dtype).str) for s in spec.inputs]}
                  for q, spec in zip(self.queues, self.specs)]
        return {"device": self.settings.device, "pid": os.getpid(), "frontends": self.frontends,
                "table": self.table.shm.name, "queues": queues, "models": [describe_model(m) for m in self.models]}

    async def serve(self, path: str, token: bytes, ready: Callable[[], None]) -> None:
        """Accept front ends on ``path`` until SIGTERM (or the parent is gone and so are they); then
        finish what is queued, answer it, and release the shared memory."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        description = self.description()
        server = await loop.create_unix_server(lambda: EngineLink(self, token, description), path)
        os.chmod(path, 0o600)
        self.engine.start()
        ready()
        watcher = loop.create_task(self._watch(stop))
        try:
            await stop.wait()
        finally:
            watcher.cancel()
            server.close()
            await asyncio.to_thread(self.batcher.stop)  # queued items finish; their results go out
            await asyncio.sleep(0.05)
            for link in list(self.links.values()):
                link.drop()
            self.metrics.worker_alive.set(0)
            self.table.close(unlink=True)
            await asyncio.to_thread(self.engine.close)

    async def _watch(self, stop: asyncio.Event) -> None:
        """Tell the front ends when the device worker dies; stop once orphaned and alone."""
        while True:
            await asyncio.sleep(0.1)
            if not self.batcher.alive and self.dead_sent is None:
                self.dead_sent = self.batcher.dead or "the device worker stopped"
                self.metrics.worker_alive.set(0)
                for link in self.links.values():
                    link.send((STATE, self.dead_sent))
            if self.orphaned and not self.links:
                stop.set()

    def attach(self, link: EngineLink) -> None:
        old = self.links.pop(link.index, None)
        if old is not None:  # the same index reconnecting: its predecessor is gone
            old.drop()
        self.links[link.index] = link

    def detach(self, link: EngineLink) -> None:
        if self.links.get(link.index) is link:
            del self.links[link.index]


class _Publish:
    """``ModelQueue._gauge`` of an engine queue: the metric, and the queue's length into the table.
    Called under the batcher's condition at every change of its items (submit, batch, death)."""

    def __init__(self, queue: ModelQueue, table: AdmissionTable, index: int) -> None:
        self.gauge, self.table, self.index, self.queue = queue._gauge, table, index, queue

    def __call__(self) -> None:
        if self.table.queued is not None:
            self.table.queued[self.index] = len(self.queue.items)
        self.gauge()


class EngineLink(asyncio.Protocol):
    """One front end's connection: its arena, its items waiting in the batcher."""

    def __init__(self, engine: EngineServer, token: bytes, description: dict) -> None:
        self.engine, self.token, self.description = engine, token, description
        self.link = Link()
        self.index = -1
        self.pid = 0
        self.arena: Arena | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self._hello = b""

    def send(self, message: Any) -> None:
        self.link.send(message)

    def connection_made(self, transport) -> None:
        self.link.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.arena is None:
            self._hello += data
            if len(self._hello) < HELLO.size:
                return
            token, index, pid = HELLO.unpack_from(self._hello)
            rest, self._hello = self._hello[HELLO.size:], b""
            if not hmac.compare_digest(token, self.token) or not 0 <= index < self.engine.frontends:
                log.warning("refused a connection that did not present the engine's token")
                self.link.transport.close()
                return
            self.index, self.pid = index, pid
            self.engine.attach(self)
            slots, size = Arena.size_for(self.description["queues"])
            name = f"{self.engine.prefix}_a{next(self.engine._arenas)}" if self.engine.prefix else None
            shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            self.arena = Arena(shm, self.description["queues"], slots)
            self.send((WELCOME, {**self.description, "index": index, "arena": self.arena.shm.name, "slots": slots,
                                 "dead": self.engine.dead_sent}))
            log.info("front end %d (pid %d) connected", index, pid)
            data = rest
            if not data:
                return
        freed = []
        for message in self.link.feed(data):
            kind = message[0]
            if kind == SUBMIT:
                freed.append(self._submit(*message[1:]))
            elif kind == CANCEL:
                fut = self.pending.pop(message[1], None)
                if fut is not None:
                    fut.cancel()
        freed = [s for s in freed if s >= 0]
        if freed:
            self.send((FREED, freed))

    def _submit(self, item: int, q: int, slot: int, inline: dict | None, timeout_s: float, tag: str) -> int:
        engine = self.engine
        row = self.arena.read(slot, q) if slot >= 0 else inline
        try:
            with engine.table.hold():
                engine.table.sent[q, self.index] -= 1
                fut = engine.batcher.submit(engine.queues[q], row, timeout_s, tag=tag)
        except ServiceError as e:
            self.send((ERROR, item, pack_error(e)))
            return slot
        self.pending[item] = fut
        fut.add_done_callback(lambda f, item=item: self._settled(item, f))
        return slot

    def _settled(self, item: int, fut: asyncio.Future) -> None:
        self.pending.pop(item, None)
        if fut.cancelled() or self.link.closed:
            return
        exc = fut.exception()
        if exc is not None:
            self.send((ERROR, item, pack_error(exc)))
        else:
            result = fut.result()
            self.send((RESULT, item, result.outputs, result.timings))

    def connection_lost(self, exc: Exception | None) -> None:
        self.drop()

    def drop(self) -> None:
        """Close the link and release everything the front end held."""
        if self.link.closed:
            return
        self.link.closed = True
        if self.link.transport is not None:
            self.link.transport.close()
        if self.index < 0:
            return
        self.engine.detach(self)
        for fut in list(self.pending.values()):  # still queued: dropped before compute
            fut.cancel()
        self.pending.clear()
        if self.engine.table.cells is not None:
            self.engine.table.forget(self.index)
        if self.arena is not None:
            self.arena.close(unlink=True)
        log.info("front end %d (pid %d) disconnected; its places were released", self.index, self.pid)


# ------------------------------------------------------------------ processes


def tell(report, message: tuple) -> None:
    """A message to the supervisor, which may no longer listen (a front end started again)."""
    with contextlib.suppress(OSError):
        report.send(message)


def child_setup(log_level: str, on_parent_exit: Callable[[], None], log_format: str = "text") -> None:
    """A child of the supervisor: its own process group, the server's logging (text, or JSON lines:
    server.observability.logs), and a watch on the parent (a SIGKILLed supervisor must not leave its
    children serving)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    logs.configure(uvicorn.config.LOG_LEVELS[log_level.lower()], log_format)
    parent = multiprocessing.parent_process()
    if parent is not None:
        def watch() -> None:
            parent.join()
            log.warning("the supervisor process exited; shutting down")
            on_parent_exit()

        threading.Thread(target=watch, name="softmoe-parent-watch", daemon=True).start()


def engine_main(settings, frontends: int, lock, path: str, token: bytes, report, prefix: str | None = None) -> None:
    """The engine process: load every model, warm up, then serve the front ends until SIGTERM.

    Args:
        settings: the server's Settings.
        frontends: how many front-end processes connect (indices 0..frontends-1).
        lock: the admission table's cross-process lock (from the supervisor's spawn context).
        path: the Unix socket to listen on.
        token: the bytes a front end must present first.
        report: a Connection to the supervisor: ``("ready", pid)`` or ``("error", one line)``.
        prefix: the names of the shared memory segments begin with it (see ``unlink_segments``).
    """

    state: dict[str, Any] = {}

    def orphaned() -> None:
        engine = state.get("engine")
        if engine is None:
            os._exit(1)
        engine.orphaned = True

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor says when: after the front ends
    child_setup(settings.log_level, orphaned, settings.log_format)
    try:
        check_backend(settings)
        models = load_models(settings)
        try:
            engine = state["engine"] = EngineServer(settings, models, frontends, lock, Metrics(), prefix)
        except Exception as e:
            log.debug("start-up failed", exc_info=True)
            for m in models:
                with contextlib.suppress(Exception):
                    m.backend.close()
            raise StartupError(f"start-up failed: {describe(e)}") from None
    except StartupError as e:
        tell(report, ("error", str(e)))
        raise SystemExit(2) from None
    started = []

    def ready() -> None:
        tell(report, ("ready", os.getpid()))
        started.append(True)

    try:
        asyncio.run(engine.serve(path, token, ready))
    except Exception as e:  # noqa: BLE001 - one line for the supervisor, the traceback in the log
        if not started:
            log.debug("start-up failed", exc_info=True)
            tell(report, ("error", f"start-up failed: {describe(e)}"))
            raise SystemExit(2) from None
        log.exception("the engine failed")
        raise SystemExit(1) from None
    log.info("engine stopped")


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def unlink_segments(prefix: str) -> int:
    """Unlink the shared memory an engine that died left behind (Linux: ``/dev/shm``); how many."""
    count = 0
    with contextlib.suppress(OSError):
        for name in os.listdir("/dev/shm"):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    shm = shared_memory.SharedMemory(name=name)
                    shm.close()
                    shm.unlink()
                    count += 1
    return count
