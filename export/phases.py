"""Where a model's load time goes: the phases a load passes through, timed where the work is done.

A load (``server.engine``) opens a ``Phases`` record with ``recording()``; the code that does the
work marks it with ``phase(name)``, wherever it sits (the cache's hashing here in ``export``, the
sessions in a backend, the proofs in the engine). Phases nest, and each second is counted once,
in the innermost phase open at that moment: the hashing inside an export's cache lookup is
``hash``, the rest of the export ``export``. Outside a recording ``phase`` does nothing, so the
exporter's own command line pays nothing for it.

The record lives in a ``contextvars.ContextVar``: the thread that loads sees its own record, and a
thread it starts (``runtime.at_low_priority``) sees none, so a phase is entered on the caller's
side of such a hand-over. Another thread may read ``Phases.now()`` while the load runs (the
repository index shows the phase a load is in).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator

# The phases a load reports, in the order they happen; a phase not in this list is reported after them.
ORDER = ("hash", "export", "bind", "session", "proofs", "warm-up")

_current: contextvars.ContextVar[Phases | None] = contextvars.ContextVar("softmoe_load_phases", default=None)


class Phases:
    """Seconds spent in each phase of one load, each second counted once (in the innermost phase)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: list[list] = []  # [name, when it last started counting], innermost last
        self._lock = threading.Lock()
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:
            now = time.perf_counter()
            if self._open:
                self._count(self._open[-1], now)
            self._open.append([name, now])
        try:
            yield
        finally:
            with self._lock:
                now = time.perf_counter()
                self._count(self._open.pop(), now)
                if self._open:
                    self._open[-1][1] = now

    def _count(self, frame: list, now: float) -> None:
        self.seconds[frame[0]] = self.seconds.get(frame[0], 0.0) + now - frame[1]
        frame[1] = now

    def now(self) -> tuple[str, float] | None:
        """The innermost phase open now and the seconds it has taken so far in this load, or None."""
        with self._lock:
            if not self._open:
                return None
            name, since = self._open[-1]
            return name, self.seconds.get(name, 0.0) + time.perf_counter() - since

    def ordered(self) -> list[tuple[str, float]]:
        """(phase, seconds) for every phase this load passed through, in ``ORDER``."""
        with self._lock:
            known = [(n, self.seconds[n]) for n in ORDER if n in self.seconds]
            return known + sorted((n, s) for n, s in self.seconds.items() if n not in ORDER)

    def summary(self) -> str:
        """``hash 0.4 s, bind 1.2 s, session 0.9 s, ...`` (empty when no phase ran)."""
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.ordered())


@contextlib.contextmanager
def recording(phases: Phases | None = None) -> Iterator[Phases]:
    """Count the phases marked in this thread into ``phases`` (a new record by default) until the block ends."""
    record = phases if phases is not None else Phases()
    token = _current.set(record)
    try:
        yield record
    finally:
        _current.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the block's time as ``name`` in this thread's recording, if one is open."""
    record = _current.get()
    if record is None:
        yield
        return
    with record.phase(name):
        yield


def current() -> Phases | None:
    """This thread's open recording, if any."""
    return _current.get()
