"""loadtests.procs on real processes: freezing a server with its children, and /proc readers."""

import subprocess
import sys
import time
from pathlib import Path

from loadtests.procs import cpu_seconds, descendants, frozen, mem_available, state


def test_mem_available_reads_meminfo():
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))
    assert 0 < mem_available() <= total


def test_readers_on_this_process_and_on_one_that_is_gone():
    import os

    assert state(os.getpid()) == "R" and cpu_seconds(os.getpid()) > 0
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert state(gone.pid) == "" and cpu_seconds(gone.pid) is None


def test_frozen_stops_a_server_and_its_children_then_continues_them():
    # A parent with a child, both sleeping: what a peer server with its worker looks like.
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    try:
        for _ in range(100):
            pids = descendants(parent.pid)
            if len(pids) == 2:
                break
            time.sleep(0.05)
        assert len(pids) == 2, pids

        class Server:
            proc = parent

        with frozen([Server()]):  # returns once every process has stopped
            assert [state(p) for p in pids] == ["T", "T"]
        for _ in range(200):  # SIGCONT, like SIGSTOP, is delivered asynchronously
            if all(state(p) != "T" for p in pids):
                break
            time.sleep(0.01)
        assert all(state(p) not in ("T", "") for p in pids)
    finally:
        for p in reversed(descendants(parent.pid)):
            subprocess.run(["kill", "-9", str(p)], check=False)
        parent.wait()
