"""The datasets ``softmoe eval`` and ``softmoe embed`` read: an image-folder tree, a CSV or JSONL
manifest, or WebDataset tar shards. Each is a list of :class:`Unit` (the unit of output and of
resumption: a WebDataset shard, or a fixed run of files), each unit an iterator of :class:`Sample`.

Nothing is skipped silently: every file of a class folder, every manifest row and every sample of a
shard is a sample; what cannot be one (a file outside any class folder, a manifest row without a
path, a sample with no image entry, an entry over the size limit, a shard that cannot be read) is a
sample with its ``error`` set, counted and reported by the job with its path or key.

Memory: folders and manifests are listed up front (paths only, sorted); shards are streamed, one
sample's entries at a time, and an entry over ``max_bytes`` is never read.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # WebDataset image entries, in order of preference
MANIFEST_EXTS = (".csv", ".jsonl")
FILES_PER_UNIT = 4096  # folder and manifest datasets: files per output shard


class DataError(Exception):
    """The dataset as a whole cannot be read (one line for the user): nothing found, a bad manifest."""


@dataclass
class Sample:
    key: str  # the path relative to DATA (folders, manifests) or the WebDataset key
    label: str | None = None
    text: str | None = None
    path: str | None = None  # a file to read (folders, manifests)
    data: bytes | None = None  # the image's bytes (WebDataset entries)
    error: str | None = None  # why it cannot be scored, known before decoding
    size: int = 0  # bytes of the image, where known before reading it


@dataclass
class Unit:
    name: str  # the output shard's name (no extension)
    source: str  # what it reads: a shard's path, or the dataset
    samples: Callable[[], Iterator[Sample]]  # a fresh iterator each call
    count: int | None = None  # samples, where known without reading


@dataclass
class Dataset:
    kind: str  # folder | manifest | webdataset
    root: str
    units: list[Unit]
    classes: list[str] | None = None  # class names from the folders (sorted), where the layout gives them

    @property
    def count(self) -> int | None:
        counts = [u.count for u in self.units]
        return None if any(c is None for c in counts) else sum(counts)


def open_dataset(spec: str, max_bytes: int) -> Dataset:
    """The dataset at ``spec``: a directory (image folders), a .csv/.jsonl manifest, or WebDataset
    shards (a .tar file, a glob, or a brace range such as ``shards-{000..099}.tar``).

    Args:
        spec: the DATA argument.
        max_bytes: the largest image file read (larger ones are errors, never read).

    Raises:
        DataError: nothing to read, or a manifest without a path column.
    """
    path = Path(spec)
    if path.is_dir():
        return _folder(path, max_bytes)
    if path.suffix.lower() in MANIFEST_EXTS and path.is_file():
        return _manifest(path, max_bytes)
    shards = expand_shards(spec)
    if not shards:
        raise DataError(f"{spec}: no such directory, manifest (.csv, .jsonl) or WebDataset shard (.tar)")
    root = os.path.commonpath([str(Path(s).parent) for s in shards]) if len(shards) > 1 else str(Path(shards[0]).parent)
    names = _unit_names(shards)
    units = [Unit(name, s, (lambda s=s: _shard_samples(s, max_bytes))) for name, s in zip(names, shards)]
    return Dataset("webdataset", root, units)


# ------------------------------------------------------------------ WebDataset


def expand_braces(pattern: str) -> list[str]:
    """``a-{000..003}.tar`` -> a-000.tar ... a-003.tar (zero padding kept); ``{x,y}`` lists too."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, tail, body = pattern[: m.start()], pattern[m.end():], m.group(1)
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = int(rng[1]), int(rng[2])
        width = len(rng[1]) if rng[1].startswith("0") else 0
        parts = [str(i).zfill(width) for i in range(lo, hi + 1)]
    else:
        parts = body.split(",")
    return [s for p in parts for s in expand_braces(head + p + tail)]


def expand_shards(spec: str) -> list[str]:
    """The shard files of ``spec``, in order. A brace range names its shards whether or not they
    exist (a missing one is reported as unreadable); a glob lists those that exist."""
    out: list[str] = []
    for name in expand_braces(spec):
        if glob.has_magic(name):
            out.extend(sorted(glob.glob(name)))
        elif name.endswith(".tar") or Path(name).is_file():
            out.append(name)
    seen: set[str] = set()
    return [s for s in out if not (s in seen or seen.add(s))]


def _unit_names(shards: list[str]) -> list[str]:
    """Output names of the shards: their file names less .tar, made unique with their folders."""
    stems = [Path(s).name.removesuffix(".tar") for s in shards]
    if len(set(stems)) == len(stems):
        return stems
    root = os.path.commonpath([os.path.abspath(s) for s in shards])
    return [os.path.relpath(os.path.abspath(s), root).removesuffix(".tar").replace(os.sep, "__") for s in shards]


def split_entry(name: str) -> tuple[str, str]:
    """A tar member's ``(key, extension)``, WebDataset's way: the key is the path up to the first dot
    of the file name, the extension the rest, lower-cased."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower() if dot else ""


def _shard_samples(shard: str, max_bytes: int) -> Iterator[Sample]:
    """The samples of one shard, in order; a shard that cannot be read (missing, not a tar, truncated)
    ends with one sample whose key is the shard's path and whose error says why."""
    key, entries, oversized = None, {}, {}
    try:
        with tarfile.open(shard, mode="r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                k, ext = split_entry(member.name)
                if k != key:
                    if key is not None:
                        yield _sample(key, entries, oversized, max_bytes)
                    key, entries, oversized = k, {}, {}
                if member.size > max_bytes:
                    oversized[ext] = member.size
                    continue
                f = tar.extractfile(member)
                entries[ext] = f.read() if f is not None else b""
    except (OSError, tarfile.TarError, EOFError) as e:
        if key is not None:
            yield _sample(key, entries, oversized, max_bytes)
        reason = "no such file" if isinstance(e, FileNotFoundError) else f"unreadable shard: {_describe(e)}"
        yield Sample(key=shard, error=reason)
        return
    if key is not None:
        yield _sample(key, entries, oversized, max_bytes)


def _sample(key: str, entries: dict[str, bytes], oversized: dict[str, int], max_bytes: int) -> Sample:
    label = text = None
    meta: dict = {}
    if "json" in entries:
        try:
            meta = json.loads(entries["json"])
        except (ValueError, UnicodeDecodeError):
            return Sample(key=key, error="json entry is not valid JSON")
        if not isinstance(meta, dict):
            meta = {}
    if "cls" in entries:
        label = entries["cls"].decode("utf-8", "replace").strip()
    elif meta.get("label") is not None:
        label = str(meta["label"])
    if "txt" in entries:
        text = entries["txt"].decode("utf-8", "replace").strip()
    elif isinstance(meta.get("caption") or meta.get("text"), str):
        text = meta.get("caption") or meta.get("text")
    ext = next((e for e in IMAGE_EXTS if e in entries or e in oversized), None)
    if ext is None:
        found = ", ".join(sorted(entries)) or "none"
        return Sample(key=key, label=label, text=text, error=f"no image entry (jpg, png or webp); entries: {found}")
    if ext in oversized:
        return Sample(key=key, label=label, text=text,
                      error=f"{ext} entry of {oversized[ext]} bytes exceeds the limit of {max_bytes} bytes")
    return Sample(key=key, label=label, text=text, data=entries[ext], size=len(entries[ext]))


# ------------------------------------------------------------------ folders and manifests


def _folder(root: Path, max_bytes: int) -> Dataset:
    """One folder per class (every file under it, at any depth, is a sample of that class); a tree
    with no sub-folders is a set of unlabelled images."""
    subdirs = sorted(p.name for p in root.iterdir() if p.is_dir())
    samples: list[Sample] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            full = os.path.join(dirpath, name)
            if not subdirs:
                samples.append(Sample(key=rel, path=full))
            elif rel_dir == ".":
                samples.append(Sample(key=rel, path=full, error="a file outside any class folder"))
            else:
                samples.append(Sample(key=rel, path=full, label=rel.split("/", 1)[0]))
    if not samples:
        raise DataError(f"{root}: the dataset is empty (no files)")
    return Dataset("folder", str(root), _file_units(samples), classes=subdirs or None)


def _manifest(path: Path, max_bytes: int) -> Dataset:
    """A CSV (with a header row) or JSONL manifest: ``path``, ``label`` and ``text`` (both optional);
    relative paths are relative to the manifest's folder."""
    base = path.parent
    rows: list[dict] = []
    try:
        if path.suffix.lower() == ".csv":
            with open(path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                if not reader.fieldnames or "path" not in reader.fieldnames:
                    raise DataError(f"{path}: a CSV manifest needs a header row with a 'path' column "
                                    f"(found {reader.fieldnames or 'no header'})")
                rows = list(reader)
        else:
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        obj = {"__error__": f"line {i} is not JSON"}
                    rows.append(obj if isinstance(obj, dict) else {"__error__": f"line {i} is not a JSON object"})
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read the manifest: {_describe(e)}") from None
    samples = []
    for i, row in enumerate(rows, 1):
        p = row.get("path")
        label = row.get("label")
        text = row.get("text")
        label = None if label in (None, "") else str(label)
        text = None if text in (None, "") else str(text)
        if "__error__" in row or not isinstance(p, str) or not p:
            samples.append(Sample(key=f"{path.name}:{i}", error=row.get("__error__") or f"row {i} has no path"))
            continue
        samples.append(Sample(key=p, label=label, text=text, path=str(base / p)))
    if not samples:
        raise DataError(f"{path}: the manifest is empty")
    return Dataset("manifest", str(base), _file_units(samples))


def _file_units(samples: list[Sample]) -> list[Unit]:
    units = []
    for start in range(0, len(samples), FILES_PER_UNIT):
        part = samples[start: start + FILES_PER_UNIT]
        units.append(Unit(f"part-{start // FILES_PER_UNIT:05d}", "files", (lambda part=part: iter(part)), len(part)))
    return units


def read_file(sample: Sample, max_bytes: int) -> bytes:
    """A folder or manifest sample's bytes, the size checked before reading.

    Raises:
        ValueError: the reason, for the report.
    """
    try:
        size = os.stat(sample.path).st_size
        if size > max_bytes:
            raise ValueError(f"file of {size} bytes exceeds the limit of {max_bytes} bytes")
        with open(sample.path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise ValueError("no such file") from None
    except IsADirectoryError:
        raise ValueError("a directory, not an image file") from None
    except OSError as e:
        raise ValueError(f"cannot read: {_describe(e)}") from None
    if len(data) > max_bytes:
        raise ValueError(f"file grew past the limit of {max_bytes} bytes while read")
    if not data:
        raise ValueError("empty file")
    return data


def _describe(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def read_lines(value: str) -> list[str]:
    """A file with one entry per line (or a JSON list), else the value itself as one entry."""
    p = Path(value)
    if p.is_file():
        text = p.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):
            try:
                items = json.loads(text)
            except ValueError:
                raise DataError(f"{value}: not a JSON list") from None
            return [str(x) for x in items]
        return [line.strip() for line in io.StringIO(text) if line.strip()]
    return [value]
