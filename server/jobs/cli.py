"""``softmoe eval`` and ``softmoe embed``: a model over a dataset, with the server's numerics.

The model is loaded as ``softmoe serve`` loads it, from the same settings (these flags, then the
``SOFTMOE_*`` environment variables, then the defaults), so an image's embedding is bitwise
/v1/embed's and a prediction is /v1/classify's or /v1/zero-shot's for the same file.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from export.cache import file_sha256, package_digests
from softmoe_models.demo.evaluate import evaluate

from server.settings import Settings
from server.jobs.data import DataError, Dataset, open_dataset, read_lines
from server.jobs.embed import sink_for
from server.jobs.evaluate import EvalSink
from server.jobs.ray_job import run_embed, run_eval
from server.jobs.report import finish_embed, finish_eval, pending_units, precheck_labels, say
from server.jobs.runner import DecodePool, JobError, JobModel, Progress, Runner


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="score a package on a dataset (top-1/top-5, zero-shot, retrieval recall), or on the "
                     "built-in digits without DATA",
        description="Score a package on an image-folder tree, a CSV/JSONL manifest or WebDataset shards: "
                    "DIR/metrics.json, summary.md, predictions.jsonl, confusion.png. Without DATA: the held-out "
                    "digits of the built-in models.")
    p.add_argument("package")
    p.add_argument("data", nargs="?", help="a folder per class, a .csv/.jsonl manifest (path, label, text), or "
                                           "WebDataset shards (a .tar, a glob, or shards-{000..099}.tar)")
    p.add_argument("--out", help="output directory (required with DATA)")
    p.add_argument("--classnames", help="two-tower zero-shot: class names, a file (one per line, or a JSON list; "
                                        "line i names integer label i); default: the labels found")
    p.add_argument("--templates", nargs="+", metavar="T",
                   help="two-tower zero-shot: prompt templates with '{}', literal strings or files (one per line); "
                        "default: the package's")
    _common(p)
    p.add_argument("--json", action="store_true", help="without DATA: also print one JSON line")
    p.set_defaults(func=_interruptible(cmd_eval))

    p = sub.add_parser(
        "embed", help="image (and text) embeddings of a dataset as Parquet shards (resumable)",
        description="Embed an image-folder tree, a manifest or WebDataset shards: one Parquet file per shard in "
                    "DIR (key, image_embedding, label, text, text_embedding); a rerun skips finished shards.")
    p.add_argument("package")
    p.add_argument("data", help="a folder of images (or a folder per class), a .csv/.jsonl manifest, or "
                                "WebDataset shards (a .tar, a glob, or shards-{000..099}.tar)")
    p.add_argument("--out", required=True, help="output directory")
    _common(p)
    p.set_defaults(func=_interruptible(cmd_embed))


def _interruptible(cmd):
    """Ctrl-C ends a job with status 130 and no traceback (embed: the shard being written stays a
    temporary file, so a rerun starts it again)."""
    def run(args: argparse.Namespace) -> None:
        try:
            cmd(args)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise SystemExit(130) from None
    run.__name__ = cmd.__name__
    return run


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-errors", type=int, metavar="N",
                   help="stop when more than N samples fail (default: never; every failure is reported)")
    p.add_argument("--ray", metavar="auto|ADDRESS",
                   help="run on a Ray cluster (Ray Data; pip install 'softmoe-serve[ray]'): auto joins the running "
                        "cluster, or starts one on this machine")
    g = p.add_argument_group("the model's settings, as `softmoe serve` takes them (also SOFTMOE_* variables)")
    g.add_argument("--backend", choices=["auto", "torch", "onnxruntime", "tensorrt"])
    g.add_argument("--device", choices=["cpu", "cuda"])
    g.add_argument("--precision", choices=["auto", "fp32", "fp16", "bf16"])
    g.add_argument("--max-batch-size", type=int, metavar="N",
                   help="rows per backend call (default 8); the same value as the server's gives the same bits")


def user_errors() -> tuple[type[BaseException], ...]:
    return (JobError, DataError)


def job_settings(args: argparse.Namespace):
    given = {k: getattr(args, k) for k in ("backend", "device", "precision", "max_batch_size")
             if getattr(args, k, None) is not None}
    try:
        return Settings(models=[args.package], grpc_port=0, **given)
    except ValidationError as e:
        parts = [f"--{'-'.join(str(x) for x in err['loc'])}: {err['msg']}".replace("_", "-") for err in e.errors()]
        raise JobError("; ".join(parts)) from None


def package_sha256(package: str) -> str:
    """One hash of every file of a package an export reads (export.cache.package_digests), or of an .onnx file."""
    path = Path(package)
    if path.is_file():
        return file_sha256(path)
    if not (path / "config.json").is_file():
        raise JobError(f"{package}: not a model package (no config.json) nor an .onnx file")
    digests = package_digests(path)
    return hashlib.sha256("".join(f"{k}:{v}\n" for k, v in sorted(digests.items())).encode()).hexdigest()


def _open(args, settings) -> tuple[Dataset, str]:
    if args.max_errors is not None and args.max_errors < 0:
        raise JobError("--max-errors must be 0 or more")
    package = args.package
    digest = package_sha256(package)
    dataset = open_dataset(args.data, settings.max_body_bytes, Path(args.out))
    return dataset, digest


def _start(args, settings) -> tuple[DecodePool, JobModel]:
    """The decode processes, started first so they start while the model loads, then the model."""
    pool = DecodePool(settings)
    try:
        return pool, JobModel.load(args.package, settings, say)
    except BaseException:
        pool.close()
        raise


# ------------------------------------------------------------------ embed


def cmd_embed(args: argparse.Namespace) -> None:
    settings = job_settings(args)
    dataset, digest = _open(args, settings)
    out = Path(args.out)
    if args.ray:
        run_embed(args, settings, dataset, digest, out)
        return
    t0 = time.perf_counter()
    pool, job = _start(args, settings)
    try:
        facts = job.facts()
        sink = sink_for(out, facts, dataset, args.data, digest)
        pending = pending_units(sink, dataset, out)
        rate = 0.0
        if pending:
            progress = Progress("embed", None if any(u.count is None for u in pending) else sum(u.count for u in pending))
            runner = Runner(job, sink, texts=job.texts, max_errors=args.max_errors, progress=progress, pool=pool)
            try:
                runner.run(pending)
            except BaseException:
                sink.abort()
                raise
            rate = progress.rate
    finally:
        pool.close()
        job.close()
    finish_embed(args, facts, sink, dataset, digest, out, time.perf_counter() - t0, rate)


# ------------------------------------------------------------------ eval


def cmd_eval(args: argparse.Namespace) -> None:
    if args.data is None:
        return _eval_digits(args)
    if not args.out:
        raise JobError("softmoe eval PKG DATA needs --out DIR")
    settings = job_settings(args)
    dataset, digest = _open(args, settings)
    if args.classnames and not Path(args.classnames).is_file():
        raise JobError(f"--classnames {args.classnames}: no such file")
    classnames = read_lines(args.classnames) if args.classnames else None
    templates = [t for value in args.templates for t in read_lines(value)] if args.templates else None
    for t in templates or ():
        if t.count("{}") > 1:
            raise JobError(f"--templates: {t[:40]!r} has more than one '{{}}'")
    if args.ray:
        run_eval(args, settings, dataset, digest, Path(args.out), classnames, templates)
        return
    t0 = time.perf_counter()
    pool, job = _start(args, settings)
    try:
        precheck_labels(job.facts(), dataset)
        sink = EvalSink(job.facts(), texts=job.texts)
        runner = Runner(job, sink, texts=job.texts, max_errors=args.max_errors,
                        progress=Progress("eval", dataset.count), pool=pool)
        tally = runner.run(dataset.units)
        finish_eval(args, job.facts(), sink, tally.error_list, digest, classnames, templates,
                    time.perf_counter() - t0, runner.progress.rate,
                    lambda texts: asyncio.run(job.embed_texts(texts)))
    finally:
        pool.close()
        job.close()


def _eval_digits(args: argparse.Namespace) -> None:
    if args.out or args.ray:
        raise JobError("--out and --ray need DATA (without it, eval scores the built-in digits)")
    try:
        results = evaluate(args.package)
    except ValueError as e:
        raise JobError(str(e)) from None
    for key, value in results.items():
        print(f"{key}: {value:.4f}")
    if args.json:
        print(json.dumps(results))
