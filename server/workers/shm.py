"""The shared memory of ``--frontend-workers N`` (layout and protocol: ``engine.py``'s docstring):
the admission table every process reserves and submits against, and the per-front-end arenas
that carry input rows to the engine."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from server.errors import Unavailable

log = logging.getLogger("softmoe.engine")

ARENA_BYTES = 64 << 20  # per front end; slots = ARENA_BYTES // slot size, within SLOTS
SLOTS = (16, 1024)
ALIGN = 64
LOCK_WAIT_S = 5.0  # a lock held this long belongs to a process that died inside its section


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class AdmissionTable:
    """Queue places of every model queue, shared by the engine and the front ends (see the module
    docstring); every read-modify-write happens under ``hold()``."""

    def __init__(self, shm: shared_memory.SharedMemory, lock, queues: int, frontends: int, *, engine: bool) -> None:
        self.shm, self.lock, self.engine = shm, lock, engine
        cells = np.ndarray((1 + queues + 2 * queues * frontends,), dtype=np.int64, buffer=shm.buf)
        self.cells = cells
        self.queued = cells[1:1 + queues]
        self.reserved = cells[1 + queues:1 + queues + queues * frontends].reshape(queues, frontends)
        self.sent = cells[1 + queues + queues * frontends:].reshape(queues, frontends)

    @classmethod
    def create(cls, lock, queues: int, frontends: int, name: str | None = None) -> AdmissionTable:
        shm = shared_memory.SharedMemory(name=name, create=True, size=8 * (1 + queues + 2 * queues * frontends))
        table = cls(shm, lock, queues, frontends, engine=True)
        table.cells[:] = 0
        return table

    @classmethod
    def attach(cls, name: str, lock, queues: int, frontends: int) -> AdmissionTable:
        return cls(shared_memory.SharedMemory(name=name), lock, queues, frontends, engine=False)

    def taken(self, q: int) -> int:
        return int(self.queued[q] + self.reserved[q].sum() + self.sent[q].sum())

    def coming(self, q: int) -> int:
        """Items of queue ``q`` the front ends reserved or sent that the engine has not queued yet."""
        if self.reserved is None:  # closed
            return 0
        return int(self.reserved[q].sum() + self.sent[q].sum())

    @contextlib.contextmanager
    def hold(self):
        """The lock, for a section of a few microseconds. A front end that waits past
        ``LOCK_WAIT_S`` gets 503; the engine takes over a lock whose holder died inside its section."""
        start = time.monotonic()
        while not self.lock.acquire(timeout=0.25):
            owner = int(self.cells[0])
            stuck = time.monotonic() - start > LOCK_WAIT_S
            if self.engine and ((owner and not _alive(owner)) or (not owner and stuck)):
                log.warning("the admission lock was held by a process that died (pid %s); taking it over", owner or "?")
                break
            if stuck and not self.engine:
                raise Unavailable("the admission table is locked; retry shortly", retry_after_s=2)
        self.cells[0] = os.getpid()
        try:
            yield
        finally:
            self.cells[0] = 0
            self.lock.release()

    def forget(self, index: int) -> None:
        """Give back every place a front end held (it disconnected)."""
        with self.hold():
            self.reserved[:, index] = 0
            self.sent[:, index] = 0

    def close(self, unlink: bool = False) -> None:
        self.cells = self.queued = self.reserved = self.sent = None  # no view may outlive the mapping
        with contextlib.suppress(BufferError):  # a view still held somewhere: the mapping goes with the process
            self.shm.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


@dataclass(frozen=True)
class Field:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int


def layouts(queues: list[dict]) -> tuple[list[list[Field]], int]:
    """Per queue, where each input of a row sits in a slot; and the slot size (the largest row)."""
    out, size = [], ALIGN
    for q in queues:
        fields, at = [], 0
        for name, shape, dtype in q["inputs"]:
            dtype = np.dtype(dtype)
            fields.append(Field(name, tuple(shape), dtype, at))
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            at += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        out.append(fields)
        size = max(size, at)
    return out, size


class Arena:
    """One front end's input slots: row i of queue q lives at ``i * slot_bytes + field.offset``."""

    def __init__(self, shm: shared_memory.SharedMemory, queues: list[dict], slots: int) -> None:
        self.shm, self.slots = shm, slots
        fields, self.slot_bytes = layouts(queues)
        # One strided view per (queue, input) over every slot: row i is view[i].
        self.views: list[list[tuple[Field, np.ndarray]]] = [
            [(f, np.ndarray((slots, *f.shape), dtype=f.dtype, buffer=shm.buf, offset=f.offset,
                            strides=(self.slot_bytes, *_strides(f.shape, f.dtype.itemsize)))) for f in q]
            for q in fields
        ]

    @staticmethod
    def size_for(queues: list[dict]) -> tuple[int, int]:
        """(slots, bytes) of an arena for these queues."""
        _, slot_bytes = layouts(queues)
        slots = min(SLOTS[1], max(SLOTS[0], ARENA_BYTES // slot_bytes))
        return slots, slots * slot_bytes

    def write(self, slot: int, q: int, row: dict[str, np.ndarray]) -> bool:
        """Copy a row into a slot; False when it does not match the queue's inputs (sent inline then)."""
        views = self.views[q]
        if len(row) != len(views):
            return False
        for f, view in views:
            arr = row.get(f.name)
            if not isinstance(arr, np.ndarray) or arr.shape != f.shape or arr.dtype != f.dtype:
                return False
        for f, view in views:
            view[slot] = row[f.name]
        return True

    def read(self, slot: int, q: int) -> dict[str, np.ndarray]:
        return {f.name: view[slot].copy() for f, view in self.views[q]}

    def close(self, unlink: bool = False) -> None:
        self.views = []
        with contextlib.suppress(BufferError):
            self.shm.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


def _strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out, step = [], itemsize
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))
