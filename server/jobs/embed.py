"""``softmoe embed PKG DATA --out DIR``: image (and text) embeddings as Parquet shards, resumable.

DIR holds one Parquet file per unit of the dataset (a WebDataset shard's name, or ``part-NNNNN``
for every 4,096 files of a folder or manifest), with the columns::

    key              string                      the path relative to DATA, or the WebDataset key
    image_embedding  fixed_size_list<float32>[D] /v1/embed's image embedding, bit for bit
    label            string (null when absent)   the class folder, the manifest's label, the cls entry
    text             string (null when absent)   the manifest's text, the txt entry
    text_embedding   fixed_size_list<float32>[D] two-tower models with a tokenizer, where a text exists

and the job's own files: ``_job.json`` (the model's package hash, the dataset, the backend: a rerun
with another model or dataset is refused rather than mixed in), ``_shards.jsonl`` (per finished
shard: its input's fingerprint, rows, errors and the file's sha256), ``_errors.jsonl`` and
``_summary.json``: every name that is not a shard starts with ``_`` or ``.``, which pyarrow's and
Ray's dataset readers skip, so ``pq.read_table(DIR)`` reads the shards alone.

A shard is written to ``.NAME.parquet.tmp``, in row groups (memory stays bounded whatever the
shard's size), then renamed and recorded with its hash. A rerun skips a shard only when its record
exists, the file's sha256 matches it and its input is unchanged (the same index lines, or the same
tar shard's size and mtime); a half-written, unrecorded, changed or stale one is written again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from server.pipeline.postprocess import l2_normalize
from server.jobs.data import Dataset, Unit
from server.jobs.runner import JobError, Outcome, error_entry

ROW_GROUP = 1024  # rows per Parquet row group: what a shard holds in memory
JOB_FILE, SHARDS_FILE, ERRORS_FILE, SUMMARY_FILE = "_job.json", "_shards.jsonl", "_errors.jsonl", "_summary.json"


def image_vector(image_fn: str, outputs: dict[str, np.ndarray]) -> np.ndarray:
    """/v1/embed's image embedding from the image function's outputs: a two-tower image tower's
    ``image_embeds``, or a classifier's ``pre_logits`` L2-normalised."""
    if image_fn == "image":
        return outputs["image_embeds"].astype(np.float32)
    return l2_normalize(outputs["pre_logits"].astype(np.float32))


def text_vector(outputs: dict[str, np.ndarray]) -> np.ndarray:
    return outputs["text_embeds"].astype(np.float32)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pyarrow():
    try:  # heavy, an optional extra (jobs): pyarrow only where embed writes Parquet
        import pyarrow.parquet
    except ImportError:
        raise JobError("softmoe embed writes Parquet with pyarrow: pip install 'softmoe-serve[jobs]'") from None
    return pyarrow, pyarrow.parquet


class ParquetSink:
    """Writes each unit's rows to its own Parquet shard; see the module's docstring."""

    def __init__(self, out: Path, *, identity: dict[str, Any], image_fn: str, image_dim: int,
                 text_dim: int | None) -> None:
        """``image_fn``, the dims: runner.ModelFacts' (``sink_for`` builds it from them)."""
        self.pa, self.pq = _pyarrow()
        pa = self.pa
        self.out, self.identity, self.image_fn = out, identity, image_fn
        fields = [pa.field("key", pa.string(), nullable=False),
                  pa.field("image_embedding", pa.list_(pa.float32(), image_dim), nullable=False),
                  pa.field("label", pa.string()), pa.field("text", pa.string())]
        if text_dim is not None:
            fields.append(pa.field("text_embedding", pa.list_(pa.float32(), text_dim)))
        self.schema = pa.schema(fields)
        self.text_dim, self.image_dim = text_dim, image_dim
        self.rows = self.errors = 0
        self._writer = None
        self._buf: dict[str, list] = {}
        self._unit_rows = 0
        self._unit_errors: list[dict] = []

    # ------------------------------------------------------------------ the job's state

    def prepare(self, units: list[Unit]) -> list[Unit]:
        """Check DIR against this job (``_job.json``) and return the units still to write."""
        self.out.mkdir(parents=True, exist_ok=True)
        job_file = self.out / JOB_FILE
        mine = dict(self.identity)
        if job_file.exists():
            try:
                theirs = json.loads(job_file.read_text())
            except ValueError:
                raise JobError(f"{job_file} is not JSON: remove DIR or choose another --out") from None
            for key in ("model_sha256", "data", "columns", "backend", "precision", "max_batch_size"):
                if theirs.get(key) != mine.get(key):
                    raise JobError(f"{self.out} holds an embedding job with another {key.replace('_', ' ')} "
                                   f"({str(theirs.get(key))[:80]!r}); use another --out, or remove it to start over")
        else:
            tmp = job_file.with_name(job_file.name + ".tmp")
            tmp.write_text(json.dumps(mine, indent=1))
            os.replace(tmp, job_file)
        done = self.finished()
        for stale in self.out.glob(".*.parquet.tmp"):
            stale.unlink()
        pending = []
        for u in units:
            rec = done.get(u.name)
            if rec is not None and rec.get("input") == u.fingerprint:
                self.rows += int(rec.get("rows", 0))
                self.errors += len(rec.get("errors", []))
            else:
                pending.append(u)
        return pending

    def finished(self) -> dict[str, dict]:
        """Recorded shards whose file is there with the recorded sha256."""
        records: dict[str, dict] = {}
        path = self.out / SHARDS_FILE
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    records[rec["shard"]] = rec
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line: that shard is written again
        good = {}
        for name, rec in records.items():
            f = self.out / f"{name}.parquet"
            if f.is_file() and file_sha256(f) == rec.get("sha256"):
                good[name] = rec
        return good

    # ------------------------------------------------------------------ the sink

    def begin(self, unit: Unit) -> None:
        self._tmp = self.out / f".{unit.name}.parquet.tmp"
        self._writer = self.pq.ParquetWriter(self._tmp, self.schema)
        self._buf = {name: [] for name in self.schema.names}
        self._unit_rows, self._unit_errors = 0, []

    def add(self, unit: Unit, o: Outcome) -> None:
        if o.error is not None:
            self._unit_errors.append(error_entry(unit, o))
            return
        b = self._buf
        b["key"].append(o.sample.key)
        b["image_embedding"].append(image_vector(self.image_fn, o.image))
        b["label"].append(o.sample.label)
        b["text"].append(o.sample.text)
        if self.text_dim is not None:
            b["text_embedding"].append(text_vector(o.text) if o.text is not None else None)
        if len(b["key"]) >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        pa, b = self.pa, self._buf
        n = len(b["key"])
        if not n:
            return
        cols = [pa.array(b["key"], pa.string()), _vectors(pa, b["image_embedding"], self.image_dim),
                pa.array(b["label"], pa.string()), pa.array(b["text"], pa.string())]
        if self.text_dim is not None:
            cols.append(_vectors(pa, b["text_embedding"], self.text_dim))
        self._writer.write_table(pa.Table.from_arrays(cols, schema=self.schema))
        self._unit_rows += n
        self._buf = {name: [] for name in self.schema.names}

    def end(self, unit: Unit) -> None:
        self._flush()
        self._writer.close()
        self._writer = None
        with open(self._tmp, "rb+") as f:
            os.fsync(f.fileno())
        final = self.out / f"{unit.name}.parquet"
        os.replace(self._tmp, final)
        record = {"shard": unit.name, "source": unit.source, "input": unit.fingerprint, "rows": self._unit_rows,
                  "sha256": file_sha256(final), "errors": self._unit_errors}
        for name, line in ((ERRORS_FILE, None), (SHARDS_FILE, json.dumps(record))):
            with open(self.out / name, "a") as f:
                if line is None:
                    for err in self._unit_errors:
                        f.write(json.dumps({**err, "shard": unit.name}) + "\n")
                else:
                    f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        self.rows += self._unit_rows
        self.errors += len(self._unit_errors)

    def abort(self) -> None:
        """A stopped job: the shard being written is left as a temporary file, never renamed."""
        if self._writer is not None:
            try:
                self._writer.close()
            finally:
                self._writer = None


def _vectors(pa, rows: list, dim: int):
    """A fixed-size-list column from float32 vectors (None: a null row)."""
    valid = [r is not None for r in rows]
    flat = np.zeros((len(rows), dim), dtype=np.float32)
    for i, r in enumerate(rows):
        if r is not None:
            flat[i] = r
    values = pa.array(flat.reshape(-1), pa.float32())
    mask = None if all(valid) else pa.array([not v for v in valid])
    return pa.FixedSizeListArray.from_arrays(values, dim, mask=mask)


def identity(facts, dataset: Dataset, data_spec: str, package_sha256: str) -> dict[str, Any]:
    """What a rerun into the same DIR must agree on (``facts``: runner.ModelFacts)."""
    d = facts.description
    columns = ["key", "image_embedding", "label", "text"] + (["text_embedding"] if facts.texts else [])
    return {"model_sha256": package_sha256, "data": os.path.abspath(data_spec), "columns": columns,
            "backend": d["backend"], "precision": d["precision"], "max_batch_size": d["max_batch_size"],
            "dataset_kind": dataset.kind}


def sink_for(out: Path, facts, dataset: Dataset, data_spec: str, package_sha256: str) -> ParquetSink:
    """The Parquet sink of a model (``facts``: runner.ModelFacts) and dataset."""
    image_key = "image_embeds" if facts.image_fn == "image" else "pre_logits"
    return ParquetSink(out, identity=identity(facts, dataset, data_spec, package_sha256), image_fn=facts.image_fn,
                       image_dim=facts.dims[facts.image_fn][image_key],
                       text_dim=facts.dims["text"]["text_embeds"] if facts.texts else None)
