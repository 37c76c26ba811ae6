"""What the benches read about and do to server processes, from Linux /proc: CPU seconds, state,
descendants, memory available; and freezing the servers not being measured.

Elsewhere the readers degrade (None, '', just the pid, a huge number) rather than fail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None if unreadable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process, all its threads; None where unreadable."""
    fields = stat_fields(pid)
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else None
    except (ValueError, IndexError):
        return None


def state(pid: int) -> str:
    """A process's state letter (R running, S sleeping, T stopped, ...); '' if gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else ""


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(int(stat.parent.name))
        if fields and len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (a large number where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


@contextlib.contextmanager
def frozen(servers):
    """Every process of ``servers`` (objects with a ``proc``: ``loadtests.run.ServerProcess``)
    stopped (SIGSTOP) inside the block, continued after it.

    Servers alive side by side are not idle alike: LitServe's idle API server and worker poll
    their queues, Ray's daemons heartbeat, ours sleep (docs/benchmarks.md, the peers). Measuring one
    server while the others are frozen keeps their idle cost out of its window."""
    pids = [p for s in servers if s.proc.poll() is None for p in descendants(s.proc.pid)]
    stopped = []
    try:
        for p in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGSTOP)
                stopped.append(p)
        # A signal is delivered asynchronously: the window starts once every process has stopped.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(state(p) not in ("T", "t", "Z", "X", "") for p in stopped):
            time.sleep(0.005)
        yield
    finally:
        for p in stopped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGCONT)
