"""What a dataset job leaves behind and says at its end, for local and Ray runs alike: the labels
checked up front, the pending shards, _summary.json and metrics.json, the one closing line."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from softmoe_models.cli import ARGV

from server.jobs.data import Dataset
from server.jobs.embed import ERRORS_FILE, SUMMARY_FILE
from server.jobs.evaluate import map_label, score, write_outputs
from server.jobs.runner import JobError


def command_line() -> str:
    return shlex.join(["softmoe", *ARGV])


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def pending_units(sink, dataset: Dataset, out: Path) -> list:
    pending = sink.prepare(dataset.units)
    done = len(dataset.units) - len(pending)
    if done:
        say(f"embed: {done} of {len(dataset.units)} shards already written in {out}; {len(pending)} to go")
    return pending


def finish_embed(args, facts, sink, dataset: Dataset, digest: str, out: Path, seconds: float, rate: float) -> None:
    """_summary.json, then the one line (or the error line: nothing embedded)."""
    summary = {"n": sink.rows, "errors": sink.errors, "shards": len(dataset.units), "model": facts.name,
               "package": str(Path(args.package).resolve()), "package_sha256": digest, "data": args.data,
               "command": command_line(), **facts.description, "seconds": round(seconds, 3),
               "images_per_second": round(rate, 2)}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    rows, errors = sink.rows, sink.errors
    if rows == 0 and errors == 0:
        raise JobError("the dataset is empty: no sample found")
    if rows == 0:
        raise JobError(f"no image could be embedded: all {errors} samples failed (see {out / ERRORS_FILE})")
    print(f"embedded {rows} images ({errors} failed, listed in {out / ERRORS_FILE}) -> {out}")


def precheck_labels(facts, dataset: Dataset) -> None:
    """A classifier's labels checked before any image is decoded, where the dataset lists them up front."""
    if facts.image_fn != "classify" or dataset.kind == "webdataset":
        return
    names = facts.labels or [str(i) for i in range(facts.dims["classify"].get("logits", 0))]
    index = {n: i for i, n in enumerate(names)}
    labels = {s.label for u in dataset.units for s in u.samples() if s.label is not None and s.error is None}
    if not labels:
        raise JobError("the dataset has no labels to score a classifier against (class folders, a label column)")
    bad = sorted(label for label in labels if map_label(label, index, len(names)) is None)
    if bad:
        shown = ", ".join(repr(b) for b in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise JobError(f"labels the model cannot map: {shown} (its classes: {', '.join(names[:5])}"
                       f"{', ...' if len(names) > 5 else ''})")


def finish_eval(args, facts, sink, errors: list[dict], digest: str, classnames, templates, seconds: float,
                rate: float, run_texts) -> None:
    out = Path(args.out)
    head = {"model": facts.name, "package": str(Path(args.package).resolve()), "package_sha256": digest,
            "data": args.data, "command": command_line(), **facts.description, "seconds": round(seconds, 3),
            "images_per_second": round(rate, 2)}
    if not sink.keys:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps({**head, "n": 0, "top1": None, "top5": None,
                                                       "errors": errors}, indent=1) + "\n")
        if not errors:
            raise JobError("the dataset is empty: no sample found")
        raise JobError(f"no sample could be scored: all {len(errors)} failed (listed in {out / 'metrics.json'})")
    metrics = score(sink, classnames=classnames, templates=templates, run_texts=run_texts)
    metrics = {**head, **metrics, "errors": errors}
    write_outputs(out, metrics, sink)
    parts = [f"n {metrics['n']}", f"errors {len(errors)}"]
    if metrics.get("top1") is not None:
        parts[:0] = [f"top1 {metrics['top1']:.4f}", f"top5 {metrics['top5']:.4f}"]
    if "recall" in metrics:
        r = metrics["recall"]
        parts.append(f"i2t R@1 {r['image_to_text']['R@1']:.4f} t2i R@1 {r['text_to_image']['R@1']:.4f}")
    print(f"{metrics['task']}: " + ", ".join(parts) + f" -> {out / 'metrics.json'}")
