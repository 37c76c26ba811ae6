"""Content-addressed cache entries that replicas sharing one volume build once and never trust blind.

An entry is a directory of files produced from a set of inputs (weights, config, exporter and
runtime versions, precision, device, ...). Its key is the sha256 of a canonical JSON of those
inputs, so any change of input is a different entry, never an overwrite. Layout under a root::

    ROOT/<key>/              a published entry: the builder's files + manifest.json (written last,
                             every file's name, size and BLAKE3 digest, and its own sha256)
    ROOT/<key>.lock          flock'ed while the entry is built, replaced or removed
    ROOT/.tmp-<key>-XXXXXX/  a build in progress (removed on failure; stale ones removed under the lock)
    ROOT/.bad-<key>-XXXXXX/  a corrupt entry moved aside, then deleted

``build`` looks up first (without the build lock), and on a miss takes an exclusive ``fcntl.flock`` on
the key's lock file, looks up again (another replica may have just published it), moves a corrupt
entry aside, lets ``builder(tmpdir)`` write and verify its files in a temp dir in the same parent,
writes the manifest (every file's name, size, sha256), fsyncs, and publishes by ``os.rename`` of
the directory: readers see the whole entry or none of it.

Every lookup hashes every file in full: a stamp of (size, mtime, inode) would skip the read but
trusts a disk we cannot vouch for. The digest of files the cache checks (its entries' and the
packages' in a key) is BLAKE3 on every core, about as fast as reading the bytes from the page
cache, where sha256 takes several times that on one core (docs/benchmarks.md, Ready in seconds);
a cold disk read it does is one that ONNX Runtime's or TensorRT's load then finds in the page
cache. ``file_sha256`` stays for digests users compare with ``sha256sum`` (the jobs' outputs).

The cache is bounded (``export.cache_space``): before and after the builder writes an entry, the
least recently used entries nothing holds are removed to keep the cache under its cap and the
volume above its floor, and an entry that cannot fit under the cap is not published
(``CacheFull``, naming the bytes it needed and the bytes free). A loaded model holds its entry
(``hold``) for as long as it serves it, so no process sharing the volume removes it; a lookup
holds the entry while it reads it; and each lookup or build that returns an entry records its
use (the directory's mtime: once per load or start, never per batch).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import json
import os
import platform
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import blake3

from . import cache_space as space
from .errors import ExportError
from .phases import phase
from .runtime import at_low_priority

MANIFEST = space.MANIFEST
MANIFEST_FORMAT = "softmoe-cache/2"  # 2: BLAKE3 file digests
CHUNK = 1 << 20
_KEY = space.KEY
Builder = Callable[[Path], Any]
# The model and package a load is for (``made_by``), written into the manifests of the entries it builds.
_ORIGIN: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("softmoe_cache_origin", default=None)


class CacheError(ExportError):
    """A cache entry could not be built or published."""


class ReadOnlyCache(CacheError):
    """An entry is missing or unusable, and the cache cannot be written to build it (a read-only volume)."""


class CacheFull(CacheError):
    """An entry does not fit under the cache's cap, or on its volume, once every unused entry is removed."""


@dataclass(frozen=True)
class Entry:
    """A published, hash-checked cache entry."""

    path: Path  # ROOT/<key>
    files: dict[str, Path]  # manifest name -> path, sorted by name
    meta: Any  # what the builder returned (JSON), e.g. which file is which graph
    built: bool  # True when this call built it, False when it was found


def default_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$SOFTMOE_CACHE_DIR``, else ``$XDG_CACHE_HOME/softmoe-serve`` or ``~/.cache/softmoe-serve``.

    Never a path inside the installed package: that is read-only in the images.
    """
    chosen = cache_dir or os.environ.get("SOFTMOE_CACHE_DIR")
    if chosen:
        return Path(chosen).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "softmoe-serve"


def cache_key(inputs: dict[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of ``inputs``: sorted keys, no whitespace."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def file_sha256(path: str | Path) -> str:
    with phase("hash"):
        return at_low_priority(_sha256, Path(path), False)


def file_digest(path: str | Path, load: bool = False) -> str:
    """The BLAKE3 digest (hex) of a file, hashed on every core at the lowest CPU priority (the
    hashing threads take the nice of the thread that first starts them, ``at_low_priority``'s);
    with ``load``, as load work beside served batches: on the one thread ``runtime.lower_for_load``
    lowers, where nice 19 would wait for CPU busy batches rarely leave (docs/benchmarks.md)."""
    with phase("hash"):
        if load:
            return at_low_priority(_blake3, Path(path), False, 1, load=True)
        return at_low_priority(_blake3, Path(path), False)


def _blake3(path: Path, fsync: bool, threads: int = 0) -> str:
    h = blake3.blake3(max_threads=threads or blake3.blake3.AUTO)
    if path.stat().st_size:
        h.update_mmap(path)
    if fsync:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    return h.hexdigest()


def _sha256(path: Path, fsync: bool) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def package_digests(package: str | Path, load: bool = False) -> dict[str, str]:
    """The digest (``file_digest``, hashed as load work with ``load``) of every file of a model
    package an export reads: config.json, the weights, and the labels and tokenizer files
    config.json names (both end up in the exported metadata)."""
    package = Path(package)
    config = package / "config.json"
    out = {"config.json": file_digest(config), "model.safetensors": file_digest(package / "model.safetensors", load)}
    try:
        meta = json.loads(config.read_text())
    except (OSError, ValueError):
        meta = {}
    for field in ("labels", "tokenizer"):
        name = meta.get(field) if isinstance(meta, dict) else None
        if isinstance(name, str) and name and (package / name).is_file():
            out[name] = file_digest(package / name)
    return out


# The fields of config.json that decide what an export computes; the rest (labels, tokenizer,
# preprocess, routing profile, templates, provenance) only go into a graph's metadata.
STRUCTURE_FIELDS = ("format", "format_version", "kind", "variant", "model")


def package_structure(package: str | Path) -> dict[str, Any]:
    """What of a model package decides the graphs an export writes, its weights' values aside:
    ``STRUCTURE_FIELDS`` of config.json (an unreadable config: its sha256, so nothing matches it)."""
    config = Path(package) / "config.json"
    try:
        meta = json.loads(config.read_text())
    except (OSError, ValueError):
        return {"config.json": file_digest(config) if config.is_file() else "missing"}
    if not isinstance(meta, dict):
        return {"config.json": file_digest(config)}
    return {k: meta.get(k) for k in STRUCTURE_FIELDS}


def versions(*distributions: str) -> dict[str, str]:
    """Installed versions of ``distributions`` ("missing" when not installed); no imports."""
    out = {}
    for name in distributions:
        try:
            out[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def cpu_identity() -> str:
    """The device an ONNX Runtime CPU verification ran on: ``cpu`` and the architecture."""
    return f"cpu-{platform.machine() or 'unknown'}"


def machine_identity() -> dict[str, Any]:
    """The kind of machine a measurement or a proof holds on: the CPU's model name, a digest of its
    feature flags (two CPUs of one name may differ in them, and the kernels chosen follow the
    flags), its architecture and the CPUs this process may use. Read from ``/proc/cpuinfo``; where
    that is missing, the architecture and ``platform.processor()``."""
    name, flags = platform.processor() or "unknown", ""
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        info = ""
    for line in info.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "cpu model") and name in ("unknown", platform.processor()):
            name = value.strip() or name
        elif key in ("flags", "Features") and not flags:
            flags = hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:16]
    return {"cpu": name, "flags": flags, "arch": platform.machine() or "unknown",
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1}


def cuda_identity() -> str:
    """``cuda-<GPU name>-<compute capability>`` of CUDA device 0 (``cuda-none`` without one)."""
    # torch: heavy; this module is read without it (export.tensorrt, export.cli)
    import torch

    if not torch.cuda.is_available():
        return "cuda-none"
    major, minor = torch.cuda.get_device_capability(0)
    return f"cuda-{torch.cuda.get_device_name(0)}-{major}.{minor}"


def lookup(root: str | Path, key: str, log=print) -> Entry | None:
    """The entry of ``key`` under ``root`` if it is complete and every file matches its hash.

    Lock-free against builders (it holds the entry's use lock while it reads, so no removal takes
    the entry from under it) and read-only but for the entry's last use: a missing, partial or
    corrupt entry is logged and answered with None; ``build`` replaces it.
    """
    entry, reason = _check(Path(root) / key, key)
    if reason:
        log(f"cache entry {Path(root) / key} is not usable ({reason})")
    if entry is not None:
        space.touch(entry.path)
    return entry


@contextlib.contextmanager
def made_by(model: str, package: str | Path) -> Iterator[None]:
    """Entries built inside the block record ``model`` and ``package`` in their manifest's
    ``origin`` (what ``softmoe cache`` lists): the engine says it around a load."""
    token = _ORIGIN.set({"model": model, "package": str(package)})
    try:
        yield
    finally:
        _ORIGIN.reset(token)


class Hold:
    """A loaded model's claim on a cache entry: a shared flock on its manifest, kept until
    ``release`` (or this object's end, or the process's), under which no process removes the entry."""

    def __init__(self, entry: str | Path) -> None:
        self.path = Path(entry)
        self._file = space.lock_shared(self.path)
        if self._file is None:
            raise CacheError(f"cache entry {self.path} was removed before it could be held")
        space.touch(self.path)

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def hold(files: list[Path]) -> list[Hold]:
    """A ``Hold`` on each cache entry that one of ``files`` lies in (files outside the cache: none).

    Raises:
        CacheError: an entry was removed meanwhile (the files are gone).
    """
    held: list[Hold] = []
    for entry in dict.fromkeys(Path(f).parent for f in files):
        if _KEY.fullmatch(entry.name) and (entry / MANIFEST).is_file():
            try:
                held.append(Hold(entry))
            except CacheError:
                for h in held:
                    h.release()
                raise
    return held


def build(root: str | Path, key: str, builder: Builder, *, inputs: dict[str, Any] | None = None, log=print) -> Entry:
    """The entry of ``key``: found and hash-checked, or built by ``builder`` and published.

    Args:
        root: the cache directory (created if missing); entries are its subdirectories.
        key: ``cache_key(inputs)``.
        builder: called as ``builder(tmpdir)`` under the key's lock; writes its files into
            ``tmpdir``, verifies them, raises if they are not right, and returns a JSON-able
            value kept in the manifest as ``Entry.meta``.
        inputs: what the key was computed from, kept in the manifest for humans.
        log: where progress lines go.

    Raises:
        CacheError: the builder wrote something that is not a regular file, or used the
            manifest's name. CacheFull: the entry does not fit under the cache's cap, or on its
            volume, once every unused entry is removed. Whatever the builder raises is raised
            unchanged; in every failure the temp dir is removed and nothing is published.
    """
    root = Path(root)
    if not _KEY.fullmatch(key):
        raise CacheError(f"cache key {key!r} is not a plain file name")
    found, reason = _check(root / key, key)  # the locked pass below reports the reason
    if found is not None:
        space.touch(found.path)
        space.report(space.usage(space.home_of(root), root))
        return found
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = space.lock_exclusive(root / f"{key}.lock", wait=lambda: log(f"waiting for another process building "
                                                                             f"{root / key}"))
    except OSError as e:
        raise ReadOnlyCache(f"the cache at {root} cannot be written ({e.strerror}) and its entry {key} is "
                            f"{reason or 'missing'}") from None
    try:
        _remove_stale(root, key, log)
        final = root / key
        found, reason = _check(final, key)
        if found is not None:  # another process published it while we waited
            space.touch(found.path)
            return found
        if final.exists():
            log(f"cache entry {final} is not usable ({reason}); rebuilding it")
            _discard(final, root, key)
        manifest = _publish(root, key, builder, inputs, log)
    finally:
        os.close(lock)  # closing the descriptor releases the lock
    files = {name: final / name for name in manifest["files"]}
    return Entry(final, files, json.loads(json.dumps(manifest["meta"])), built=True)  # as a later lookup reads it


def _publish(root: Path, key: str, builder: Builder, inputs: dict[str, Any] | None, log) -> dict[str, Any]:
    """Room made, ``builder`` run in a temp dir, the entry's room checked, the manifest written and
    the entry published by one rename (under the key's lock); the manifest. A builder that ran out
    of space runs once more after every unused entry is removed."""
    home = space.home_of(root)
    space.report(space.make_room(home, root, _expected_bytes(root), log=log))
    for attempt in (1, 2):
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        try:
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the entry from replicas running as another user
            try:
                meta = builder(tmp)
            except (OSError, ExportError) as e:
                if not _out_of_space(e):
                    raise
                written = space.dir_bytes(tmp)
                shutil.rmtree(tmp, ignore_errors=True)
                after = space.make_room(home, root, 1 << 62, log=log)  # every unused entry
                space.report(after)
                if attempt == 2 or not after.evicted:
                    raise CacheFull(_no_room(home, key, written, after, ran_out=True)) from None
                log(f"cache: {key} ran out of space after {written:,} bytes; trying again")
                continue
            size = space.dir_bytes(tmp)
            after = space.make_room(home, root, 0, log=log)
            if after.total > after.limit.cap:
                space.report(after)
                raise CacheFull(_no_room(home, key, size, after, ran_out=False))
            manifest = _write_manifest(tmp, key, inputs, meta)
            _fsync_dir(tmp)
            os.rename(tmp, root / key)  # atomic: the whole entry appears at once
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(root)  # the rename itself survives a power cut
        space.touch(root / key)
        published = space.usage(home, root)
        published.evicted = after.evicted
        space.report(published)
        return manifest
    raise AssertionError("unreachable")


def _expected_bytes(root: Path) -> int:
    """What the next entry of ``root`` will likely take: its largest entry's bytes (0: none yet)."""
    return max((item.bytes for item in space.items(space.home_of(root), root) if item.path.parent == root), default=0)


def _out_of_space(e: BaseException) -> bool:
    """An ENOSPC or EDQUOT, raised here or in an export child (whose message carries it)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(os.strerror(n) in str(e) for n in (errno.ENOSPC, errno.EDQUOT))


def _no_room(home: Path, key: str, needed: int, found: space.Usage, ran_out: bool) -> str:
    """The message of a ``CacheFull``: the bytes the entry needed and the bytes free."""
    room = max(0, found.limit.cap - (found.total - (0 if ran_out else needed)))
    what = f"at least {needed:,} bytes (the volume ran out)" if ran_out else f"{needed:,} bytes"
    return (f"no room in the cache at {home} for entry {key}: it needs {what}; {room:,} bytes are free under "
            f"the cache's cap of {found.limit.cap:,} once every unused entry is removed ({found.total:,} bytes "
            f"held by entries in use or being built), and {found.free:,} bytes are free on the volume; raise "
            f"--cache-max-size ({space.ENV}) or free the volume")


def _check(path: Path, key: str) -> tuple[Entry | None, str | None]:
    """(entry, None) when ``path`` is a complete entry whose files all match; else (None, why).
    Its use lock is held while it is read."""
    if not path.exists():
        return None, None
    reading = space.lock_shared(path)
    if reading is None:
        if not path.exists():
            return None, None  # removed while we waited
        return None, "unreadable manifest" if (path / MANIFEST).exists() else "no manifest: partial entry"
    with reading:
        try:
            manifest = json.loads(reading.read())
        except (OSError, ValueError) as e:
            return None, f"unreadable manifest: {e}"
        return _check_files(path, key, manifest)


def _check_files(path: Path, key: str, manifest: Any) -> tuple[Entry | None, str | None]:
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or manifest.get("key") != key:
        return None, "manifest of another format or key"
    if manifest.get("sha256") != _manifest_sha(manifest):
        return None, "the manifest does not match its own sha256"
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not listed:
        return None, "manifest lists no files"
    files = {}
    for name, want in listed.items():
        file = path / name
        if not _safe_name(name) or not isinstance(want, dict):
            return None, f"bad manifest entry {name!r}"
        try:
            if not file.is_file() or file.is_symlink():
                return None, f"{name} is missing"
            size = file.stat().st_size
            if size != want.get("size"):
                return None, f"{name} has {size} bytes, the manifest says {want.get('size')}"
            if file_digest(file) != want.get("blake3"):
                return None, f"{name} does not match its digest"
        except OSError as e:  # e.g. moved aside by a process replacing the entry meanwhile
            return None, f"{name} cannot be read ({e.strerror})"
        files[name] = file
    return Entry(path, files, manifest.get("meta"), built=False), None


def _safe_name(name: str) -> bool:
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts and name != MANIFEST


def _write_manifest(tmp: Path, key: str, inputs: dict[str, Any] | None, meta: Any) -> dict[str, Any]:
    """Hash and fsync every file the builder wrote, then write the manifest last."""
    if (tmp / MANIFEST).exists():
        raise CacheError(f"the builder wrote {MANIFEST}, a name the cache keeps for itself")
    files: dict[str, dict[str, Any]] = {}
    for file in sorted(tmp.rglob("*")):
        if file.is_dir() and not file.is_symlink():
            _fsync_dir(file)
            continue
        if not file.is_file() or file.is_symlink():
            raise CacheError(f"the builder left {file}, which is not a regular file")
        files[file.relative_to(tmp).as_posix()] = {"size": file.stat().st_size, "blake3": _hash_and_fsync(file)}
    if not files:
        raise CacheError(f"the builder wrote no files into {tmp}")
    manifest = {"format": MANIFEST_FORMAT, "key": key, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "inputs": inputs, "meta": meta, "files": files}
    if _ORIGIN.get() is not None:  # the model and package a load built it for (made_by)
        manifest["origin"] = _ORIGIN.get()
    manifest["sha256"] = _manifest_sha(manifest)  # the manifest is checked like the files it lists
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return manifest


def _manifest_sha(manifest: dict[str, Any]) -> str:
    return cache_key({k: v for k, v in manifest.items() if k != "sha256"})


def _hash_and_fsync(path: Path) -> str:
    with phase("hash"):
        return at_low_priority(_blake3, path, True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(root: Path, key: str, log) -> None:
    """Remove temp dirs of builds that died (SIGKILL, power loss) and half-deleted corrupt entries.

    Called under ``key``'s lock, so every ``.tmp-<key>-*`` and ``.bad-<key>-*`` is stale. One of
    another key is stale when that key's lock is free: a live build or discard holds it.
    """
    for path in sorted([*root.glob(".tmp-*"), *root.glob(".bad-*")]):
        other = path.name[len(".tmp-"):].rsplit("-", 1)[0]
        if not _KEY.fullmatch(other):
            continue  # not one of ours
        fd = None
        if other != key:
            try:
                fd = space.lock_exclusive(root / f"{other}.lock")
            except OSError:
                fd = None
            if fd is None:
                continue
        try:
            if path.name.startswith(".tmp-"):
                log(f"removing {path}, left by a build that did not finish")
            shutil.rmtree(path, ignore_errors=True)
        finally:
            if fd is not None:
                os.close(fd)


def _discard(final: Path, root: Path, key: str) -> None:
    """Move a bad entry out of the way in one rename, then delete it (under the key's lock)."""
    aside = root / f".bad-{key}-{secrets.token_hex(4)}"
    os.rename(final, aside)
    shutil.rmtree(aside, ignore_errors=True)
