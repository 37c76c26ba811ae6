"""Datasets of real files for the dataset jobs' tests (``softmoe eval`` / ``softmoe embed``).

The same samples laid out three ways: an image-folder tree (one folder per class), a CSV manifest
and WebDataset tar shards. Good samples are the held-out digits as PNG files, some re-encoded as
JPEG at 4x, and scikit-learn's two sample photographs (real 427x640 JPEGs); bad ones are a
truncated PNG, a text file, an empty file, a file over the size limit and a JPEG header with no
image after it. Each bad sample is listed with the key a job must report it under.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from softmoe_models.demo.data import WORDS, load_splits

MAX_BYTES = 200_000  # SOFTMOE_MAX_BODY_BYTES for the jobs and the server of these tests
ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "server" / "default_models" / "digits")
LIT = str(ROOT / "server" / "default_models" / "digits-lit")


@dataclass
class Item:
    label: str
    name: str  # file name inside its class folder
    data: bytes
    good: bool
    text: str | None = None


@dataclass
class Layouts:
    items: list[Item]
    folder: Path
    manifest: Path
    shards: str  # a brace range
    shard_paths: list[Path] = field(default_factory=list)

    def folder_key(self, it: Item) -> str:
        return f"{it.label}/{it.name}"

    def manifest_key(self, it: Item) -> str:
        return f"images/{it.label}/{it.name}"

    @staticmethod
    def shard_key(it: Item) -> str:
        return f"{it.label}_{it.name.split('.')[0]}"

    def bad(self, layout: str) -> set[str]:
        key = {"folder": self.folder_key, "manifest": self.manifest_key, "webdataset": self.shard_key}[layout]
        return {key(it) for it in self.items if not it.good}


def _jpeg(arr: np.ndarray, quality: int = 92) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def build(root: Path, n: int = 60, shards: int = 3) -> Layouts:
    """``n`` held-out digits, the two sample photographs and the bad files, in three layouts."""
    from sklearn.datasets import load_sample_image

    _, held = load_splits()
    items: list[Item] = []
    for i in range(n):
        digit = int(held.targets[i])
        data = held.pngs[i]
        name = f"d{i:03d}.png"
        if i % 4 == 1:  # a real JPEG at 4x: the resize and the JPEG decoder
            rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB").resize((32, 32), Image.NEAREST))
            data, name = _jpeg(rgb), f"d{i:03d}.jpg"
        items.append(Item(str(digit), name, data, True, f"the digit {WORDS[digit]}"))
    for k, photo in enumerate(("china.jpg", "flower.jpg")):
        items.append(Item(str(8 + k), f"photo-{photo}", _jpeg(load_sample_image(photo)), True, f"a photo {k}"))
    noise = np.random.default_rng(0).integers(0, 256, (300, 300, 3), dtype=np.uint8)
    items += [
        Item("3", "truncated.png", held.pngs[0][: len(held.pngs[0]) // 2], False, "x"),
        Item("4", "notes.png", b"these are my notes, not an image\n" * 4, False, "y"),
        Item("5", "empty.png", b"", False, "z"),
        Item("6", "huge.png", _png(noise), False, "w"),
        Item("7", "header-only.jpg", _jpeg(noise[:64, :64])[:200], False, "v"),
    ]
    assert len(items[-2].data) > MAX_BYTES

    folder = root / "folder"
    for it in items:
        (folder / it.label).mkdir(parents=True, exist_ok=True)
        (folder / it.label / it.name).write_bytes(it.data)

    images = root / "manifest" / "images"
    rows = []
    for it in items:
        (images / it.label).mkdir(parents=True, exist_ok=True)
        (images / it.label / it.name).write_bytes(it.data)
        rows.append(f"images/{it.label}/{it.name},{it.label},{it.text}")
    manifest = root / "manifest" / "data.csv"
    manifest.write_text("path,label,text\n" + "\n".join(rows) + "\n")

    wds = root / "wds"
    wds.mkdir()
    paths = []
    for s in range(shards):
        path = wds / f"train-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for it in items[s::shards]:
                ext = it.name.rsplit(".", 1)[1]
                entries = [(ext, it.data), ("cls", it.label.encode()), ("txt", (it.text or "").encode()),
                           ("json", json.dumps({"source": it.name}).encode())]
                for e, data in entries:
                    info = tarfile.TarInfo(f"{Layouts.shard_key(it)}.{e}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return Layouts(items, folder, manifest, str(wds / f"train-{{000..{shards - 1:03d}}}.tar"), paths)


def env(monkeypatch) -> None:
    """The limits these datasets are built around, for the jobs (the server takes them as settings)."""
    monkeypatch.setenv("SOFTMOE_MAX_BODY_BYTES", str(MAX_BYTES))
    os.environ.pop("SOFTMOE_MODELS", None)


def softmoe(*argv) -> None:
    """``softmoe ARGV...`` in this process."""
    from server.main import main

    main([str(a) for a in argv])


def table(out: Path):
    """Every Parquet shard in ``out`` as one table, sorted by key."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted(out.glob("*.parquet"))
    assert files, f"no Parquet shard in {out}"
    return pa.concat_tables([pq.read_table(f) for f in files]).sort_by("key")
