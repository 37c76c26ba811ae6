"""The export cache's room on its volume: a cap on its bytes, a floor of free space, and the least
recently used entries that nothing uses removed to keep both (``export.cache`` asks before and
after it writes an entry; ``softmoe cache prune`` asks by hand).

The bound. A cache lives on a volume that is either its own (a claim mounted for it) or shared
(the node's disk, ``~/.cache``). By default its entries may take 80% of the volume (``DEFAULT_CAP``),
and the volume is kept 10% free (``FLOOR``): on a volume of its own the cap binds first and leaves
a fifth of it for the entry being written beside the ones in use; on a shared disk the floor binds
first, at the kubelet's own default eviction threshold (``nodefs.available<10%``), so the cache
never takes a node into disk pressure by itself. Both are fractions of the volume, so the default
needs no tuning from a 24 MB claim to a 2 TB disk. One setting overrides them:
``SOFTMOE_CACHE_MAX_SIZE`` (``softmoe serve --cache-max-size``; ``set_limit``), a size (``20G``,
``512Mi``, bytes) or a share of the volume (``50%``): it is the cap, and the floor becomes the
smaller of 10% and what the cap leaves of the volume (``100%``: no bound).

The cap is a limit: an entry that cannot fit under it once every unused entry is gone is not
written (``export.cache.CacheFull``). The floor is a target: the cache removes unused entries to
keep it, but where what is left is in use or is not the cache's, it still writes an entry the
volume can hold (refusing would stop a load the disk can take); ``softmoe_cache_free_bytes``
under ``softmoe_cache_free_floor_bytes`` says so, and an alert fires when it lasts.

Who uses an entry. A loaded model holds a shared ``flock`` on its entry's ``manifest.json`` for as
long as it serves it (``export.cache.hold``), and a lookup holds one while it reads the entry; a
build or replacement holds the exclusive lock of ``ROOT/<key>.lock``. Removal takes both
exclusively without waiting (``LOCK_NB``) and skips an entry it cannot lock, so an entry in use,
being read or being built is never removed, whichever process or replica on the volume uses it. The
use lock is the manifest's, not the ``.lock`` file's: replacing a corrupt entry must not wait for
the processes still serving their copy (their open files outlive the rename), and the lock goes
with the entry it guards. A removal unlinks the key's ``.lock`` file under its lock; whoever waited
on it then finds another file at the path and locks that one (``lock_exclusive``).

Last use is the entry directory's mtime, set when a lookup or build returns the entry (a load or a
start), never per batch; a read-only cache is never written, its mtimes included.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.]*")  # a plain file name without "-" (temp dir names split on it)
# The cache's roots under its directory, and the kind of entry each holds.
KINDS = {"onnx": "graph", "onnx-structure": "structure", "proofs": "proofs", "engines": "engine"}
ENV = "SOFTMOE_CACHE_MAX_SIZE"
DEFAULT_CAP = 0.80  # of the volume: a fifth left for an entry being written beside those in use
FLOOR = 0.10  # of the volume kept free: the kubelet's default hard eviction threshold
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)
_setting: str | None = None  # set_limit's; None: $SOFTMOE_CACHE_MAX_SIZE
_watchers: list[weakref.WeakMethod | Callable] = []


@dataclass(frozen=True)
class Limit:
    """The bound of one cache, in bytes."""

    cap: int  # the most its entries (and builds under way) may take
    floor: int  # the free space removal keeps on the volume
    volume: int  # the volume's size


@dataclass(frozen=True)
class Item:
    """One published entry, as ``softmoe cache`` lists it."""

    kind: str  # graph, structure, proofs, engine (KINDS), or the root's name
    key: str
    path: Path
    bytes: int
    last_use: float  # seconds since the epoch (the entry directory's mtime)
    model: str  # the model that made it, "" where unknown
    package: str  # the package it was made from, "" where unknown
    in_use: bool = False  # a loaded model or a reader holds it (only where asked)


@dataclass
class Usage:
    """What a cache takes, and what one pass of removal did: what the metrics show."""

    home: Path
    bytes: dict[str, int]  # kind -> bytes of its entries (builds under way: "build")
    free: int  # bytes free on the volume
    limit: Limit
    evicted: dict[str, int] = field(default_factory=dict)  # kind -> entries removed by this pass

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


# ------------------------------------------------------------------ the bound


def parse_size(text: str) -> tuple[int | None, float | None]:
    """``(bytes, None)`` for a size (``20G``, ``512Mi``, ``1000000``: K/M/G/T decimal, Ki/Mi/Gi/Ti
    binary, as ccache's), ``(None, share)`` for a share of the volume (``50%``); ``(None, None)``
    for "" (the default). ValueError names what is accepted."""
    text = (text or "").strip()
    if not text:
        return None, None
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise ValueError(f"cache size {text!r}: a share of the volume is over 0% and at most 100%")
        return None, share / 100
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"cache size {text!r}: give bytes, a size with K, M, G, T (or Ki, Mi, Gi, Ti), or a share "
                         "of the volume such as 50%")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]), None


def set_limit(setting: str | None) -> None:
    """The cap of every cache this process writes (``parse_size``'s forms); None or "": the
    default, or ``$SOFTMOE_CACHE_MAX_SIZE`` where set. The server calls it with its setting."""
    parse_size(setting or "")  # refused here, not at the first write
    global _setting
    _setting = setting or None


def limit(home: Path, setting: str | None = None) -> Limit:
    """The bound of the cache at ``home``: ``setting``, else ``set_limit``'s, else the environment's,
    else the default, over the size of the volume ``home`` is on."""
    chosen = setting if setting is not None else _setting if _setting is not None else os.environ.get(ENV, "")
    size, share = parse_size(chosen)
    volume = _statvfs(home)[0]
    cap = size if size is not None else int(volume * (share if share is not None else DEFAULT_CAP))
    return Limit(cap=cap, floor=max(0, min(int(volume * FLOOR), volume - cap)), volume=volume)


def _statvfs(path: Path) -> tuple[int, int]:
    """(size, free bytes for an unprivileged writer) of the volume ``path`` (or its nearest parent) is on."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def free_bytes(home: Path) -> int:
    return _statvfs(home)[1]


# ------------------------------------------------------------------ what is there


def home_of(root: Path) -> Path:
    """The cache directory a root belongs to: its parent for one of ``KINDS``, else the root itself."""
    return root.parent if root.name in KINDS else root


def roots(home: Path, root: Path | None = None) -> list[Path]:
    """The roots whose entries share ``home``'s bound: every one of ``KINDS`` (or ``root`` alone
    where it is none of them)."""
    if root is not None and root.name not in KINDS:
        return [root]
    return [home / name for name in KINDS]


def items(home: Path, root: Path | None = None, in_use: bool = False) -> list[Item]:
    """Every published entry of the cache at ``home``, least recently used first; ``in_use``:
    also whether something holds it (a lock tried and let go at once)."""
    out = []
    for where in roots(home, root):
        for path in _entry_dirs(where):
            try:
                last = path.stat().st_mtime
            except OSError:
                continue  # removed meanwhile
            model, package = _origin(path)
            busy = in_use and _held(path)
            out.append(Item(KINDS.get(where.name, where.name), path.name, path, dir_bytes(path), last, model,
                            package, busy))
    return sorted(out, key=lambda i: (i.last_use, i.key))


def _entry_dirs(root: Path) -> Iterator[Path]:
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if KEY.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
            yield path


def _origin(path: Path) -> tuple[str, str]:
    """The model and package that made an entry (its manifest's ``origin``; a proofs entry's meta
    names the model)."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return "", ""
    if not isinstance(manifest, dict):
        return "", ""
    origin = manifest.get("origin") if isinstance(manifest.get("origin"), dict) else {}
    meta = manifest.get("meta") if isinstance(manifest.get("meta"), dict) else {}
    return str(origin.get("model") or meta.get("model") or ""), str(origin.get("package") or meta.get("package") or "")


def dir_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (0 where it is gone)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def usage(home: Path, root: Path | None = None) -> Usage:
    """The bytes of each kind of entry at ``home`` (and of builds under way, as ``build``), the
    volume's free bytes and the bound."""
    by_kind: dict[str, int] = {KINDS.get(r.name, r.name): 0 for r in roots(home, root)}
    for item in items(home, root):
        by_kind[item.kind] = by_kind.get(item.kind, 0) + item.bytes
    building = sum(dir_bytes(p) for r in roots(home, root) if r.is_dir() for p in r.glob(".tmp-*"))
    if building:
        by_kind["build"] = building
    return Usage(home, by_kind, free_bytes(home), limit(home))


# ------------------------------------------------------------------ locks


def lock_exclusive(lock_file: Path, wait: Callable[[], None] | None = None) -> int | None:
    """A descriptor holding the exclusive ``flock`` of ``lock_file`` (created if missing), or None
    where another holds it and ``wait`` is None; with ``wait``, it is called once and the lock
    waited for. The lock is the file at the path when it is taken: one removed meanwhile (an
    eviction unlinks it) is let go and the new one locked. OSError where it cannot be opened."""
    while True:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if wait is None:
                    os.close(fd)
                    return None
                wait()
                wait = _quiet
                fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, lock_file):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _quiet() -> None:
    pass


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)


def lock_shared(entry: Path) -> Any | None:
    """The entry's manifest, open, with a shared ``flock`` on it (waiting for a removal under way):
    the mark of a reader or a user. None where the entry has no manifest or was removed meanwhile.
    A file system without flock (an NFS mount without locking) gives the file unlocked: a
    read-only cache is never pruned, and a writable one without locks cannot tell users apart."""
    manifest = entry / MANIFEST
    try:
        f = open(manifest, "rb")  # noqa: SIM115 - held for as long as the entry is used
    except OSError:
        return None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL):
            f.close()
            raise
    if not _same_file(f.fileno(), manifest):
        f.close()
        return None
    return f


def _held(entry: Path) -> bool:
    """Whether something holds ``entry``'s manifest (tried without waiting, let go at once)."""
    try:
        with open(entry / MANIFEST, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


# ------------------------------------------------------------------ removal


def watch(method: Callable[[Usage], None]) -> None:
    """Call ``method(usage)`` after each write and each removal pass of a cache in this process
    (the server's metrics). A bound method is held weakly: it goes with its object."""
    _watchers.append(weakref.WeakMethod(method) if hasattr(method, "__self__") else method)


def report(found: Usage) -> None:
    for ref in list(_watchers):
        method = ref() if isinstance(ref, weakref.WeakMethod) else ref
        if method is None:
            _watchers.remove(ref)
        else:
            method(found)


def evict(root: Path, key: str) -> int | None:
    """Remove the entry ``key`` of ``root`` if nothing uses, reads or builds it: its bytes, or None
    where it is held (left as it is)."""
    lock = lock_exclusive(root / f"{key}.lock")
    if lock is None:
        return None  # being built or replaced
    path, use = root / key, None
    try:
        try:
            use = open(path / MANIFEST, "rb")  # noqa: SIM115
            fcntl.flock(use.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a loaded model or a reader holds it
        except FileNotFoundError:
            pass  # a partial entry: nobody can use it
        if not path.is_dir():
            return None
        size = dir_bytes(path)
        aside = root / f".bad-{key}-{secrets.token_hex(4)}"  # a crash mid-way leaves what a build removes
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
        os.unlink(root / f"{key}.lock")  # whoever waits on it locks a new one (lock_exclusive)
        return size
    finally:
        if use is not None:
            use.close()
        os.close(lock)


def make_room(home: Path, root: Path | None, need: int, keep: frozenset[Path] = frozenset(),
              log: Callable[[str], None] = print) -> Usage:
    """Remove the least recently used entries nothing holds until ``need`` more bytes fit under the
    cap and leave the floor free (or none is left to remove); the usage after it, with what it
    removed. ``keep``: entries not to remove (the one being written)."""
    found = usage(home, root)
    for item in items(home, root):
        if found.total + need <= found.limit.cap and found.free - need >= found.limit.floor:
            break
        if item.path in keep:
            continue
        freed = evict(item.path.parent, item.key)
        if freed is None:
            continue
        log(f"cache: removed {item.path} ({item.kind}, {freed:,} bytes, last used "
            f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(item.last_use))}) to stay within its bound")
        found.bytes[item.kind] -= freed
        found.evicted[item.kind] = found.evicted.get(item.kind, 0) + 1
        found.free = free_bytes(home)
    return found


def prune(home: Path, older_than: float | None = None, max_size: int | None = None) -> tuple[list[Item], list[Item]]:
    """``softmoe cache prune``: remove the unused entries last used more than ``older_than`` seconds
    ago, then the least recently used unused ones until the cache is at most ``max_size`` bytes;
    with neither, every unused entry. Returns (removed, held: those in use that stayed)."""
    removed, held = [], []
    listed = items(home)
    total = sum(i.bytes for i in listed)
    now = time.time()
    for item in listed:
        old = older_than is not None and now - item.last_use > older_than
        big = max_size is not None and total > max_size
        if (older_than is not None or max_size is not None) and not (old or big):
            continue
        freed = evict(item.path.parent, item.key)
        if freed is None:
            held.append(item)
            continue
        total -= item.bytes
        removed.append(item)
    after = usage(home)
    after.evicted = {kind: sum(1 for i in removed if i.kind == kind) for kind in {i.kind for i in removed}}
    report(after)
    return removed, held


def touch(entry: Path) -> None:
    """Record a use of ``entry`` (its mtime) where the cache can be written; never on a read-only one."""
    try:
        if os.access(entry, os.W_OK):
            os.utime(entry)
    except OSError:
        pass  # another user's entry, or a volume made read-only meanwhile: not worth a failed load
