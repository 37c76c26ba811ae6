"""Dynamic batching: one batcher per device, with one worker thread (or ``workers`` of them, each
running a batch at once: ``--concurrent-batches``). Knows nothing about HTTP.

``Batcher.submit(queue, row)`` returns an asyncio future for one item (one image or one text).
A free worker collects items of one queue (one model function) until ``max_batch_size``
or ``max_delay_ms`` after the oldest, drops those whose future was cancelled (the client left)
or whose deadline passed (they never reach the model), runs the backend, and resolves every
future with its own row or its own exception.

Strict determinism: every backend call runs at a fixed padded shape (zero padding), so the
kernels, their tiling and their reduction order never depend on how many items were waiting;
Soft MoE routes each sequence on its own, so an item's outputs are bitwise identical whatever its
batch-mates are. The shapes are ``max_batch_size`` and the smaller ones proven at start-up, on
this machine and backend, to give per-row outputs bitwise equal to it (``ModelQueue.shapes``);
a call runs at the smallest proven shape that holds its items, so a lone request at low load
does not pay for a full padded batch. Without it, calls have as many rows as items. Since a padded call
costs a full batch, strict queues open their ``max_delay`` window when the worker becomes free
(not when the oldest item arrived), so clients answered by one call can fill the next.
Eager queues (``--eager-batching``, the server's default) wait only while more items are known to
be on their way: when no admitted request is still decoding for the queue, an idle worker runs
what is queued at once, so a lone request pays no ``max_delay`` (TEI and vLLM never wait idle);
a burst of requests admitted together still shares one call.

Failure classes (``server.backends.failures``): a transient failure (out of memory) fails its
batch with 503 + Retry-After and is not retried; a deterministic failure is bisected at the same
padded shape, deadlines rechecked before every retry, until the failing item is alone: it gets
500, its batch-mates their results (log2(n) extra calls for one poisoned item, not n). A fatal
failure (``FatalBackendError``, a sticky CUDA error) stops the worker and marks the device dead:
every waiting item gets 503 and liveness and readiness fail so the orchestrator restarts the
process; so does a worker thread that dies for any other reason. Exception texts are logged with
the request id of every item concerned; clients get a message without them.

Concurrent batches (``workers`` > 1): every worker takes batches from the same queues, under the
same lock and admission, and calls the same backend (ONNX Runtime sessions and torch modules on
CPU may be run from several threads at once); the intra-op threads are divided among the workers
by the caller. A call's rows do not depend on which worker runs it or on what runs beside it:
start-up checks that concurrent calls give outputs bitwise equal to a call alone
(``proofs.check_concurrent_batches``).

Wide lone calls (``--wide-lone-batches``, onnxruntime on CPU): a queue may have a ``plan`` that
decides, when a worker takes its batch, whether the call runs beside other calls or alone. The
worker tells it whether running beside is worth it: for a full batch, while another call runs or
another full batch waits. Beside a running call, a queue with a plan starts only a full batch (a
short one waits to fill, or for the running calls to end). A call that runs alone is exclusive: it
starts once the running calls end, and no call starts while it runs, so it may use every intra-op
thread (a second session of the model with all of them), while calls beside each other share the
cores (a session with a share of the threads each). The queue's ``fn`` is called either way, on
the worker that asked the plan, and reads the plan's decision there
(``server.engine.models.RoutingState.lanes``). A lone request then gets every core; at saturation, each core
runs its own batch.

Admission is a reservation: ``reserve(queue, n)`` takes ``n`` places before a request decodes its
images, and its ``submit`` calls fill them, so a request admitted at the door is never refused
later for room that others took meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from server.backends.failures import FatalBackendError, classify
from server.errors import BackendFailure, DeadlineExceeded, InferenceFailed, QueueFull, Unavailable
from server.metrics import Metrics

Rows = dict[str, np.ndarray]
log = logging.getLogger("softmoe.batcher")


class Call(Protocol):
    """What a queue runs, once per batch: its function of a served model (``engine.models.BackendCall``).
    ``rows`` holds every input by name, batch axis first (padding rows included under strict
    determinism); the answer holds every output by name, with the same first axis. What it raises
    fails the batch by its class (``server.backends.failures``)."""

    def __call__(self, rows: Rows) -> Rows: ...


@dataclass
class Item:
    row: Rows  # one item's tensors, no batch axis
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float  # perf_counter at submit
    deadline: float  # perf_counter after which it must not be computed
    timings: dict[str, float] = field(default_factory=dict)
    tag: str = "-"  # the request id, for the logs


@dataclass
class Result:
    outputs: Rows
    # seconds: queue, inference; started (the call's perf_counter start), batch_id (the backend call's
    # number in this batcher) and batch_size (its real items), which traces use
    timings: dict[str, float]


class ModelQueue:
    """The waiting items of one model function (e.g. ``digits-lit/text``)."""

    def __init__(
        self, name: str, label: str, fn: Call, *, max_batch_size: int,
        max_delay_s: float, max_queue: int, pad: bool, metrics: Metrics | None = None, eager: bool = False,
        group: str | None = None,
    ) -> None:
        self.name, self.label, self.fn = name, label, fn
        # The queues of one loaded model version (its functions); two versions of a model share the
        # label (its metrics) while the old one drains, not the group.
        self.group = group or label
        self.running = 0  # calls of this queue in progress (a retiring version waits for them)
        self.max_batch_size, self.max_delay_s, self.max_queue, self.pad = max_batch_size, max_delay_s, max_queue, pad
        # Eager (--eager-batching): an idle worker does not wait for more items when none is known
        # to be coming (``coming()`` is 0: no admitted request is still decoding for this queue).
        self.eager = eager
        self.metrics = metrics
        self.items: deque[Item] = deque()
        # Strict mode: the padded batch shapes this queue may run, ascending, each proven at start-up
        # to give per-row outputs bitwise equal to the maximal shape (proofs.prove_shapes).
        self.shapes: tuple[int, ...] = (max_batch_size,)
        self.reserved = 0  # places taken by admitted requests still decoding (see Batcher.reserve)
        # Wide lone calls: plan(beside worth it) -> whether the call runs beside other calls (else
        # alone); called once per call, under the batcher's lock, on the worker that then calls
        # ``fn``. None: beside.
        self.plan: Callable[[bool], bool] | None = None

    def coming(self) -> int:
        """Items admitted requests will still submit to this queue (the engine process replaces
        this with its front ends' reservations and items in transit)."""
        return self.reserved

    def shape_for(self, n: int) -> int:
        """Rows of the backend call that carries ``n`` items: the smallest proven shape that holds
        them (strict), or ``n`` itself (loose)."""
        if not self.pad:
            return n
        return next((s for s in self.shapes if s >= n), self.max_batch_size)

    def _gauge(self) -> None:
        if self.metrics:  # one model's functions (e.g. image and text) share its label: their sum
            siblings = getattr(self, "siblings", None) or [self]
            self.metrics.queue_depth.labels(self.label).set(sum(len(q.items) for q in siblings))


class Batcher:
    """The worker threads owning one device, serving every model queue on it."""

    def __init__(self, device: str = "cpu", metrics: Metrics | None = None, workers: int = 1) -> None:
        """
        Args:
            device: the device's name (threads, messages).
            metrics: where batch sizes and refusals are counted.
            workers: batches run at once (each by its own worker thread, on the same backend).
        """
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.device = device
        self.metrics = metrics
        self.queues: list[ModelQueue] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.dead: str | None = None  # set when a fatal error stopped the workers
        self.before_call: Callable[[ModelQueue, list[Item]], None] | None = None  # test/fault hook
        self._threads = [threading.Thread(target=self._run, name=f"softmoe-worker-{device}-{i}", daemon=True)
                         for i in range(workers)]
        self.calls = 0
        self._batch_ids = itertools.count(1)  # the backend calls' numbers (next() is atomic under the GIL)
        self._free_at = 0.0  # when a worker last finished a call
        self._running = 0  # calls in progress
        self._alone = False  # a call that runs alone is running or waiting for the others to end
        self.alone_calls = 0  # calls that ran alone (ModelQueue.plan)

    def add_queue(self, queue: ModelQueue) -> ModelQueue:
        """Serve ``queue`` too (before or while the workers run)."""
        with self._cond:
            self.queues.append(queue)
            siblings = [q for q in self.queues if q.group == queue.group]
            for q in siblings:
                q.siblings = siblings
        if self.metrics:
            self.metrics.queue_capacity.labels(queue.label).set(sum(q.max_queue for q in siblings))
        return queue

    def remove_queues(self, queues) -> None:
        """Stop serving ``queues`` (a model version retired): an item still in one (none, once its
        requests are done) gets 503. Their calls in progress finish; ``idle`` says when."""
        gone = set(map(id, queues))
        with self._cond:
            left = [item for q in self.queues if id(q) in gone for item in q.items]
            self.queues = [q for q in self.queues if id(q) not in gone]
            for q in queues:
                q.items.clear()
            self._cond.notify_all()
        for item in left:
            self._resolve(item, Unavailable("the model version this request was queued on was unloaded; retry",
                                            retry_after_s=1))

    def idle(self, queues) -> bool:
        """No item waits in ``queues``, none is reserved, and no call of theirs runs."""
        with self._cond:
            return all(not q.items and not q.reserved and not q.running for q in queues)

    def between(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the calling thread with no call running beside it: it waits for the calls
        in progress to end, and none starts until it returns. A new version's warm-up calls take
        their turn between the served batches this way instead of sharing the cores with them."""
        with self._cond:
            while self._alone:
                self._cond.wait()
            self._alone = True
            while self._running > 0:
                self._cond.wait()
        try:
            return fn()
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()

    def served_within(self, seconds: float) -> bool:
        """A call runs now, or one ended less than ``seconds`` ago."""
        with self._cond:
            return self._running > 0 or (self._free_at > 0 and time.perf_counter() - self._free_at < seconds)

    @property
    def workers(self) -> int:
        return len(self._threads)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what is queued, then stop the workers."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        end = time.monotonic() + timeout
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.0, end - time.monotonic()))

    @property
    def alive(self) -> bool:
        """The workers can take work: started, every one running, not dead."""
        return self.dead is None and all(t.is_alive() for t in self._threads)

    def depth(self, queue: ModelQueue | None = None) -> int:
        with self._cond:
            return sum(len(q.items) for q in self.queues if queue is None or q is queue)

    # ------------------------------------------------------------------ event-loop side

    def reserve(self, queue: ModelQueue, n: int) -> None:
        """Take ``n`` places in ``queue`` for items about to be submitted (429 when they do not fit)."""
        if self.dead:
            raise Unavailable("the device worker stopped after a fatal error", retry_after_s=5)
        with self._cond:
            if self._stopping:
                raise Unavailable("the server is shutting down", retry_after_s=2)
            taken = len(queue.items) + queue.reserved
            if taken + n > queue.max_queue:
                if self.metrics:
                    self.metrics.rejected.labels(queue.label, "queue_full").inc()
                raise QueueFull(f"model {queue.label!r} cannot queue {n} more items: {taken} of "
                                f"{queue.max_queue} places taken")
            queue.reserved += n

    def release(self, queue: ModelQueue, n: int) -> None:
        """Give back places reserved and not used (the request failed before submitting)."""
        if n > 0:
            with self._cond:
                queue.reserved = max(0, queue.reserved - n)
                self._cond.notify()  # an eager queue may have waited for these items

    def submit(self, queue: ModelQueue, row: Rows, timeout_s: float, *, deadline: float | None = None,
               reserved: bool = False, tag: str = "-") -> asyncio.Future:
        """Queue one item; the returned future resolves to a ``Result`` or raises a ServiceError.

        Args:
            queue: the model function's queue.
            row: the item's tensors, no batch axis.
            timeout_s: seconds from now after which the item is not computed (504).
            deadline: an earlier perf_counter deadline (the request's own), if any.
            reserved: the item fills a place taken by ``reserve`` (never refused for room).
            tag: the request id, for the logs.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self.dead:
            raise Unavailable("the device worker stopped after a fatal error", retry_after_s=5)
        now = time.perf_counter()
        due = now + timeout_s if deadline is None else min(deadline, now + timeout_s)
        with self._cond:
            if self._stopping:
                raise Unavailable("the server is shutting down", retry_after_s=2)
            if reserved and queue.reserved > 0:
                queue.reserved -= 1
            elif len(queue.items) + queue.reserved >= queue.max_queue:
                if self.metrics:
                    self.metrics.rejected.labels(queue.label, "queue_full").inc()
                raise QueueFull(f"model {queue.label!r} has {len(queue.items)} items queued (limit {queue.max_queue})")
            queue.items.append(Item(row, fut, loop, now, due, tag=tag))
            queue._gauge()
            self._cond.notify()
        return fut

    # ------------------------------------------------------------------ worker side

    def _next_batch(self) -> tuple[ModelQueue, list[Item], bool] | None:
        """The next batch, and whether it runs alone (then the other calls have ended; ``_done``
        ends it). Counts the call as running."""
        with self._cond:
            while True:
                if self._alone:  # no call starts beside one that runs alone
                    self._cond.wait()
                    continue
                waiting = [q for q in self.queues if q.items]
                if not waiting:
                    if self._stopping:
                        return None
                    self._cond.wait()
                    continue
                queue = min(waiting, key=lambda q: q.items[0].enqueued)  # oldest head first
                opened = queue.items[0].enqueued
                if queue.pad:
                    # A padded call costs a full batch whatever it carries: after a call, give the
                    # clients it answered max_delay to send their next items before running short.
                    opened = max(opened, self._free_at)
                ready_at = opened + queue.max_delay_s
                now = time.perf_counter()
                full = len(queue.items) >= queue.max_batch_size
                if not full and now < ready_at and not self._stopping and not (queue.eager and queue.coming() == 0):
                    self._cond.wait(ready_at - now)
                    continue
                if queue.plan is not None and self._running > 0 and not full and not self._stopping:
                    # Beside a running call only a full batch starts: a short one waits to fill, or
                    # for the device, rather than take a share of the cores for a few items.
                    self._cond.wait()
                    continue
                batch = [queue.items.popleft() for _ in range(min(queue.max_batch_size, len(queue.items)))]
                queue._gauge()
                more = any(q.items for q in self.queues)
                beside = True
                if queue.plan is not None:  # beside pays for full batches, with another running or waiting
                    beside = queue.plan(len(self._threads) > 1 and len(batch) == queue.max_batch_size and (
                        self._running > 0 or len(queue.items) >= queue.max_batch_size))
                if not beside:
                    self._alone = True
                    self.alone_calls += 1
                    while self._running > 0:
                        self._cond.wait()
                elif len(self._threads) > 1 and more:
                    self._cond.notify()  # what is left is for another free worker
                self._running += 1
                queue.running += 1
                return queue, batch, not beside

    def _done(self, queue: ModelQueue, alone: bool, called: bool) -> None:
        with self._cond:
            self._running -= 1
            queue.running -= 1
            if called:
                self._free_at = time.perf_counter()
            if alone:
                self._alone = False
            self._cond.notify_all()

    def _run(self) -> None:
        live: list[Item] = []
        try:
            while True:
                live = []
                got = self._next_batch()
                if got is None:
                    return
                queue, batch, alone = got
                try:
                    live = self._admit(queue, batch)
                    if live:
                        self._call(queue, live)
                finally:
                    self._done(queue, alone, bool(live))
        except FatalBackendError as e:
            log.error("fatal backend error on %s (requests %s): %s", self.device, _tags(live), e)
            self._die(str(e), live)
        except BaseException as e:  # noqa: BLE001 - a dead worker must not leave futures or readiness behind
            log.exception("the %s worker crashed (requests %s)", self.device, _tags(live))
            self._die(f"worker crashed: {type(e).__name__}", live)

    def _admit(self, queue: ModelQueue, batch: list[Item]) -> list[Item]:
        """Drop cancelled items and those past their deadline (they never reach the model)."""
        now = time.perf_counter()
        live = []
        for item in batch:
            if item.future.cancelled() or item.future.done():
                if self.metrics:
                    self.metrics.rejected.labels(queue.label, "cancelled").inc()
            elif now > item.deadline:
                if self.metrics:
                    self.metrics.rejected.labels(queue.label, "deadline").inc()
                self._resolve(item, DeadlineExceeded(f"the request waited {now - item.enqueued:.2f}s in the queue, past its deadline"))
            else:
                live.append(item)
        return live

    def _call(self, queue: ModelQueue, items: list[Item]) -> None:
        start = time.perf_counter()
        try:
            if self.before_call is not None:
                self.before_call(queue, items)
            outputs = self._infer(queue, items)
            short = [k for k, v in outputs.items() if len(v) < len(items)]
            if short:
                raise RuntimeError(f"backend returned fewer rows than items for {short}")
            results = [Result({k: v[i] for k, v in outputs.items()}, {}) for i in range(len(items))]
        except Exception as e:  # noqa: BLE001 - a failing batch fails its own requests only
            kind = classify(e)
            if kind == "fatal":
                raise FatalBackendError(f"{type(e).__name__}: {e}"[:500]) from e
            if kind == "transient":
                log.warning("transient backend failure on %s (requests %s): %s: %s", queue.name, _tags(items),
                            type(e).__name__, e)
                for item in items:
                    self._resolve(item, BackendFailure(f"model {queue.label!r} is temporarily out of resources; "
                                                       "retry shortly", retry_after_s=2))
                return
            if len(items) == 1:
                log.error("inference failed on %s for request %s: %s: %s", queue.name, items[0].tag,
                          type(e).__name__, e)
                self._resolve(items[0], InferenceFailed(
                    f"model {queue.label!r} failed on this input; the same input fails again (request id "
                    f"{items[0].tag} in the server log)"))
                return
            # Bisect at the same padded shape: deterministic answers for the batch-mates, log2(n)
            # calls to isolate one poisoned item. Deadlines and cancellations are rechecked first.
            live = self._admit(queue, items)
            half = len(live) // 2
            for part in (live[:half], live[half:]):
                if part:
                    self._call(queue, part)
            return
        elapsed = time.perf_counter() - start
        batch = next(self._batch_ids)
        for item, result in zip(items, results):
            result.timings.update(queue=start - item.enqueued, inference=elapsed, started=start, batch_id=batch,
                                  batch_size=len(items))
            self._resolve(item, result)

    def _infer(self, queue: ModelQueue, items: list[Item]) -> Rows:
        n = len(items)
        rows = queue.shape_for(n)
        stacked: Rows = {}
        for name in items[0].row:
            first = items[0].row[name]
            arr = np.zeros((rows, *first.shape), dtype=first.dtype)
            for i, item in enumerate(items):
                arr[i] = item.row[name]
            stacked[name] = arr
        outputs = queue.fn(stacked)
        with self._cond:
            self.calls += 1
        if self.metrics:
            self.metrics.batch_size.labels(queue.label).observe(n)
            self.metrics.batch_padding_ratio.labels(queue.label).observe((rows - n) / rows)
            self.metrics.batches.labels(queue.label).inc()
        return outputs

    def _die(self, reason: str, current: list[Item]) -> None:
        with self._cond:
            self.dead = reason[:300]
            self._stopping = True
            pending = current + [item for q in self.queues for item in q.items]
            for q in self.queues:
                q.items.clear()
                q._gauge()
            self._cond.notify_all()
        for item in pending:
            self._resolve(item, Unavailable(f"the {self.device} device failed; this replica is restarting, "
                                            "retry on another", retry_after_s=5))

    @staticmethod
    def _resolve(item: Item, value: Any) -> None:
        def settle() -> None:
            if item.future.done():
                return
            if isinstance(value, BaseException):
                item.future.set_exception(value)
            else:
                item.future.set_result(value)

        try:
            item.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed (shutdown): nobody is waiting any more
            pass


def _tags(items: list[Item]) -> str:
    return ",".join(sorted({i.tag for i in items})) or "-"
