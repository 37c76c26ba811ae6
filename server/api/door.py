"""Admission every protocol shares (HTTP in server.http, gRPC in server.grpc_api): the door's places
for requests in flight and the body bytes they hold, and the request ids both give out."""

from __future__ import annotations

import os
import random
import threading
from typing import Callable

from server.errors import QueueFull, ServiceError
from server.metrics import Metrics
from server.settings import Settings

# Request ids (uuid4's format, 32 hex digits) from a PRNG seeded by the OS, reseeded in forked children:
# uuid.uuid4() reads os.urandom, a system call that gives up the GIL on the event loop's thread on
# every request. The ids name requests in logs and traces; they are not secrets.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def new_request_id() -> str:
    """A fresh request id: 32 hex digits, uuid4's length."""
    return f"{_ids.getrandbits(128):032x}"


def new_request_id_bytes() -> bytes:
    return b"%032x" % _ids.getrandbits(128)


CONTROL = "/v2/repository"  # model control requests: they use no model, so a swap never waits for them


class Door:
    """The admission every protocol shares (HTTP in server.http, gRPC in server.grpc_api): places for
    requests in flight and the body bytes they hold, against ``max_in_flight`` and
    ``max_in_flight_bytes``. One event loop: a check and its take, with no await between them, are
    atomic.

    Epochs, for the engine's swaps: a request that may use a model ``enter``s the current epoch when
    admitted and ``leave``s it when answered. ``checkpoint`` starts a new epoch and returns a test
    that is true once every request admitted before it has been answered: taken after a new
    version replaced the old in the engine, it says when no request can still reach the old one
    (a request picks its model after admission). The counts are read from the engine's threads,
    hence the lock.
    """

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings, self.metrics = settings, metrics
        self.in_flight = 0
        self.in_flight_bytes = 0
        self._epoch = 0
        self._open: dict[int, int] = {}  # epoch -> requests of it not yet answered
        self._lock = threading.Lock()

    def enter(self) -> int:
        with self._lock:
            epoch = self._epoch
            self._open[epoch] = self._open.get(epoch, 0) + 1
            return epoch

    def leave(self, epoch: int) -> None:
        with self._lock:
            left = self._open[epoch] - 1
            if left:
                self._open[epoch] = left
            else:
                del self._open[epoch]

    def checkpoint(self) -> Callable[[], bool]:
        with self._lock:
            before = self._epoch
            self._epoch += 1

        def answered() -> bool:
            with self._lock:
                return all(epoch > before for epoch in self._open)

        return answered

    def refusal(self, nbytes: int, place: bool = True) -> tuple[ServiceError, str] | None:
        """Why a request of ``nbytes`` body bytes cannot come in now (the error, the reject reason), or
        None; ``place=False``: its place is taken already, only the bytes are asked for."""
        settings = self.settings
        if place and self.in_flight >= settings.max_in_flight:
            return QueueFull(f"{settings.max_in_flight} requests in flight; try again shortly"), "too_many_requests"
        if self.in_flight_bytes + nbytes > settings.max_in_flight_bytes:
            return QueueFull(f"the requests in flight hold {self.in_flight_bytes} body bytes; this one needs {nbytes} "
                             f"more (max_in_flight_bytes {settings.max_in_flight_bytes}); try again shortly"), "body_budget"
        return None

    def take(self, requests: int, nbytes: int) -> None:
        self.in_flight += requests
        self.in_flight_bytes += nbytes
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.in_flight_bytes.set(self.in_flight_bytes)
