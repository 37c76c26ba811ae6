"""The fake backend function, rows and batcher fixture of the batcher's unit tests
(tests/server/test_batcher.py, test_eager_batching.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from server.batching.batcher import Batcher, ModelQueue
from server.errors import ServiceError
from server.metrics import Metrics

HANG = 5.0  # seconds: only to turn a hang into a failure
D = 3  # features per row


class FakeFn:
    """``{"y": x * 2}``, recording each call's rows; optionally held on a gate or failing."""

    def __init__(self, name: str = "fn", gate: threading.Event | None = None, fail=None, log: list | None = None,
                 barrier: threading.Barrier | None = None):
        self.name = name
        self.gate = gate
        self.fail = fail  # callable(rows) -> exception to raise, or None
        self.calls: list[dict[str, np.ndarray]] = []
        self.entered = threading.Event()
        self.log = log  # shared across fns: the order of calls between queues
        self.barrier = barrier  # every call waits until this many calls are inside at once

    def __call__(self, rows):
        self.calls.append({k: v.copy() for k, v in rows.items()})
        if self.log is not None:
            self.log.append(self.name)
        self.entered.set()
        if self.barrier is not None:
            self.barrier.wait(HANG)  # BrokenBarrierError unless enough calls run at once
        if self.gate is not None:
            assert self.gate.wait(HANG), "the test never released the gate"
        if self.fail is not None:
            exc = self.fail(rows)
            if exc is not None:
                raise exc
        return {"y": rows["x"] * 2}

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [c["x"].shape for c in self.calls]

    def seen(self) -> list[float]:
        """First feature of every row that reached the backend (padding included)."""
        return [float(v) for c in self.calls for v in c["x"][:, 0]]


def row(v: float) -> dict[str, np.ndarray]:
    return {"x": np.array([v, v + 0.25, v + 0.5], dtype=np.float32)}


@pytest.fixture
def make():
    """Build a batcher (+ queues); every batcher built is released and stopped at teardown."""
    made: list[tuple[Batcher, list[threading.Event]]] = []

    def build(*fns, max_batch_size=4, max_delay_s=0.01, max_queue=64, pad=False, metrics=None, labels=None, eager=False,
              workers=1):
        b = Batcher("cpu", metrics, workers=workers)
        queues = []
        for i, fn in enumerate(fns):
            label = labels[i] if labels else f"m{i}"
            queues.append(b.add_queue(ModelQueue(
                f"{label}/fn", label, fn, max_batch_size=max_batch_size, max_delay_s=max_delay_s,
                max_queue=max_queue, pad=pad, metrics=metrics, eager=eager,
            )))
        made.append((b, [f.gate for f in fns if getattr(f, "gate", None) is not None]))
        return (b, *queues)

    yield build
    for b, gates in made:
        for g in gates:
            g.set()
        b.stop(timeout=HANG)
        assert not any(t.is_alive() for t in b._threads), "a worker thread did not exit"


async def wait_event(ev: threading.Event, timeout: float = HANG) -> None:
    end = time.monotonic() + timeout
    while not ev.is_set():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting for the backend to be entered")
        await asyncio.sleep(0.001)


async def outcome(fut: asyncio.Future):
    """The future's Result, or the exception it raised."""
    try:
        return await asyncio.wait_for(fut, HANG)
    except ServiceError as e:
        return e


def gauge(metrics: Metrics, label: str) -> float:
    return metrics.queue_depth.labels(label)._value.get()


def counter(metrics: Metrics, label: str, reason: str) -> float:
    return metrics.rejected.labels(label, reason)._value.get()
