"""The datasets ``softmoe eval`` and ``softmoe embed`` read: an image-folder tree, a CSV or JSONL
manifest, or WebDataset tar shards. Each is a list of :class:`Unit` (the unit of output and of
resumption: a WebDataset shard, or a run of 4,096 files), each unit an iterator of :class:`Sample`.

Nothing is skipped silently: every file of a class folder, every manifest row and every sample of a
shard is a sample; what cannot be one (a file outside any class folder, a manifest row without a
path, a sample with no image entry, an entry over the size limit, a shard that cannot be read) is a
sample with its ``error`` set, counted and reported by the job with its path or key.

Memory is bounded whatever the dataset's size: a unit is a byte range of a file (a manifest, or the
index of a folder's files that opening it writes, sorted, into the job's directory) or a shard, read
when the job reaches it; shards stream one sample's entries at a time, and an entry over
``max_bytes`` is never read. Each unit carries a fingerprint of what it reads (its index lines, or
its shard's size and time), so a finished output is reused only for the same input.
"""

from __future__ import annotations

import csv
import glob
import hashlib
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
    source: str  # what it reads: a shard's path, or the manifest or folder index
    samples: Callable[[], Iterator[Sample]]  # a fresh iterator each call
    count: int | None = None  # samples, where known without reading
    fingerprint: str = ""  # what it reads: the sha256 of its index lines, or its shard's size and mtime


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


def open_dataset(spec: str, max_bytes: int, workdir: Path) -> Dataset:
    """The dataset at ``spec``: a directory (image folders), a .csv/.jsonl manifest, or WebDataset
    shards (a .tar file, a glob, or a brace range such as ``shards-{000..099}.tar``).

    Args:
        spec: the DATA argument.
        max_bytes: the largest image file read (larger ones are errors, never read).
        workdir: where a folder's index is written (the job's output directory).

    Raises:
        DataError: nothing to read, or a manifest without a path column.
    """
    path = Path(spec)
    if path.is_dir():
        return _folder(path, workdir)
    if path.suffix.lower() in MANIFEST_EXTS and path.is_file():
        return _manifest(path)
    shards = expand_shards(spec)
    if not shards:
        raise DataError(f"{spec}: no such directory, manifest (.csv, .jsonl) or WebDataset shard (.tar)")
    root = os.path.commonpath([str(Path(s).parent) for s in shards]) if len(shards) > 1 else str(Path(shards[0]).parent)
    names = _unit_names(shards)
    units = [Unit(name, s, (lambda s=s: _shard_samples(s, max_bytes)), fingerprint=_stat(s))
             for name, s in zip(names, shards)]
    return Dataset("webdataset", root, units)


def _stat(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "missing"
    return f"{st.st_size}:{st.st_mtime_ns}"


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
            plain = tar.fileobj.__class__.__name__ != "_Stream" or getattr(tar.fileobj, "comptype", "tar") == "tar"
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
            end = tar.offset
        if plain:
            _check_end(shard, end)
    except (OSError, tarfile.TarError, EOFError) as e:
        if key is not None:
            yield _sample(key, entries, oversized, max_bytes)
        reason = "no such file" if isinstance(e, FileNotFoundError) else f"unreadable shard: {_describe(e)}"
        yield Sample(key=shard, error=reason)
        return
    if key is not None:
        yield _sample(key, entries, oversized, max_bytes)


def _check_end(shard: str, end: int) -> None:
    """A tar ends with two zero blocks after its last member; Python's tarfile stops quietly at a
    header cut short, so a shard truncated between members would lose its tail unnoticed.

    Raises:
        tarfile.ReadError: the end-of-archive marker is missing.
    """
    with open(shard, "rb") as f:
        f.seek(end)
        marker = f.read(1024)
    if len(marker) < 1024 or marker.count(0) != 1024:
        raise tarfile.ReadError(f"truncated after {end} bytes (no end-of-archive marker)")


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

INDEX_FILE = ".files.jsonl"  # a folder's samples, one JSON list per line: key, label, error


def _folder(root: Path, workdir: Path) -> Dataset:
    """One folder per class (every file under it, at any depth, is a sample of that class); a tree
    with no sub-folders is a set of unlabelled images. The files are listed, sorted, into an index
    in ``workdir`` one directory at a time, then read a unit at a time like a manifest."""
    subdirs = sorted(e.name for e in os.scandir(root) if e.is_dir())
    workdir.mkdir(parents=True, exist_ok=True)
    index = workdir / INDEX_FILE
    tmp = index.with_name(index.name + ".tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, root)
            for name in sorted(filenames):
                rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if not subdirs:
                    row = [rel, None, None]
                elif rel_dir == ".":
                    row = [rel, None, "a file outside any class folder"]
                else:
                    row = [rel, rel.split("/", 1)[0], None]
                f.write(json.dumps(row) + "\n")
                count += 1
    os.replace(tmp, index)
    if not count:
        raise DataError(f"{root}: the dataset is empty (no files)")
    base = str(root)

    def sample(line: bytes, number: int) -> Sample:
        key, label, error = json.loads(line)
        return Sample(key=key, label=label, path=os.path.join(base, key), error=error)

    return Dataset("folder", base, _line_units(index, 0, sample), classes=subdirs or None)


def _manifest(path: Path) -> Dataset:
    """A CSV (with a header row) or JSONL manifest: ``path``, ``label`` and ``text`` (both optional);
    relative paths are relative to the manifest's folder."""
    base = path.parent
    try:
        if path.suffix.lower() == ".csv":
            with open(path, "rb") as f:
                header_line = f.readline()
                start = f.tell()
            try:
                header = next(csv.reader([header_line.decode("utf-8-sig")]), [])
            except (UnicodeDecodeError, csv.Error):
                header = []
            if "path" not in header:
                raise DataError(f"{path}: a CSV manifest needs a header row with a 'path' column "
                                f"(found {header or 'no header'})")

            def parse(line: bytes, number: int) -> Sample:
                try:
                    values = next(csv.reader([line.decode("utf-8")]), [])
                except (UnicodeDecodeError, csv.Error) as e:
                    return Sample(key=f"{path.name}:{number}", error=f"line {number} cannot be read: {e}")
                return _row(dict(zip(header, values)), number, path, base)

            units = _line_units(path, start, parse, csv_rows=True, lines_before=1)
        else:
            def parse(line: bytes, number: int) -> Sample:
                try:
                    obj = json.loads(line)
                except (ValueError, UnicodeDecodeError):
                    return Sample(key=f"{path.name}:{number}", error=f"line {number} is not JSON")
                if not isinstance(obj, dict):
                    return Sample(key=f"{path.name}:{number}", error=f"line {number} is not a JSON object")
                return _row(obj, number, path, base)

            units = _line_units(path, 0, parse)
    except OSError as e:
        raise DataError(f"{path}: cannot read the manifest: {_describe(e)}") from None
    if not units:
        raise DataError(f"{path}: the manifest is empty")
    return Dataset("manifest", str(base), units)


def _row(row: dict, number: int, path: Path, base: Path) -> Sample:
    p, label, text = row.get("path"), row.get("label"), row.get("text")
    label = None if label in (None, "") else str(label)
    text = None if text in (None, "") else str(text)
    if not isinstance(p, str) or not p:
        return Sample(key=f"{path.name}:{number}", error=f"line {number} has no path")
    return Sample(key=p, label=label, text=text, path=str(base / p))


def _records(f, csv_rows: bool) -> Iterator[tuple[int, int, bytes]]:
    """``(first line, last line, record)`` of a binary file from its position (lines counted from 1
    there), blank lines skipped; a CSV record spans lines while a quoted field is open."""
    number = 0
    while True:
        line = f.readline()
        if not line:
            return
        number += 1
        first = number
        if csv_rows:
            while line.count(b'"') % 2 == 1:
                more = f.readline()
                if not more:
                    break
                number += 1
                line += more
        if line.strip():
            yield first, number, line


def _line_units(path: Path, start: int, parse: Callable[[bytes, int], Sample], *, csv_rows: bool = False,
                lines_before: int = 0) -> list[Unit]:
    """Units of ``per_unit`` records of ``path`` from byte ``start`` (after line ``lines_before``):
    each a byte offset, a count and the sha256 of its records, found in one streaming pass; its
    samples parsed (``parse(record, line number)``) when it is read."""
    units: list[Unit] = []
    per_unit = FILES_PER_UNIT
    with open(path, "rb") as f:
        f.seek(start)
        offset, before, n, h = start, lines_before, 0, hashlib.sha256()
        for _, last, record in _records(f, csv_rows):
            h.update(record)
            n += 1
            if n == per_unit:
                units.append(_unit(len(units), path, offset, n, before, h.hexdigest(), parse, csv_rows))
                offset, before, n, h = f.tell(), lines_before + last, 0, hashlib.sha256()
        if n:
            units.append(_unit(len(units), path, offset, n, before, h.hexdigest(), parse, csv_rows))
    return units


def _unit(k: int, path: Path, offset: int, count: int, before: int, digest: str, parse, csv_rows: bool) -> Unit:
    """Unit ``k``: ``count`` records from byte ``offset``, the first of them after line ``before``."""
    def samples() -> Iterator[Sample]:
        with open(path, "rb") as f:
            f.seek(offset)
            for i, (first, _, record) in enumerate(_records(f, csv_rows)):
                if i == count:
                    return
                yield parse(record, before + first)

    return Unit(f"part-{k:05d}", str(path), samples, count, digest)


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
