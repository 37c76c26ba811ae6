"""A read-only volume as a pod gets one: a bind mount remounted read-only in a mount namespace of
the process's own (``unshare``), since a process as root writes anything a file mode allows."""

from __future__ import annotations

import subprocess
from pathlib import Path


def read_only_ok() -> bool:
    """Whether this machine lets an unprivileged process make a mount namespace of its own."""
    try:
        return subprocess.run(["unshare", "--mount", "--map-root-user", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def read_only(directory: Path, argv: list[str]) -> list[str]:
    """``argv`` run where ``directory`` is a read-only bind mount of itself."""
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && shift && exec "$@"'
    return ["unshare", "--mount", "--map-root-user", "sh", "-c", script, "sh", str(directory), *argv]
