"""``--ray auto|ADDRESS``: the same job on a Ray cluster, with Ray Data.

    units -> read (CPU tasks: a shard's or a file run's samples)
          -> decode and preprocess (CPU tasks: server.pipeline.prepare, the server's budgets)
          -> the model (an actor pool: each actor is a JobModel, the server's loading, proofs and
             deterministic batcher; one actor per GPU with --device cuda, else one per node)
          -> the driver, in order: the same sinks as a local run (Parquet shards, or the metrics)

Order is preserved (``preserve_order``), so the driver writes each unit's shard as a local run does
and a rerun skips the finished ones. The driver gets the embeddings, not the images. The package
and the data paths must be readable at the same paths on every node (a shared volume, or baked into
the image: docs/deploy.md's RayJob).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from server.settings import Settings
from server.jobs.data import Dataset, Sample, Unit
from server.jobs.embed import sink_for
from server.jobs.evaluate import EvalSink
from server.jobs.report import finish_embed, finish_eval, pending_units, precheck_labels
from server.jobs.runner import JobError, JobModel, Outcome, Progress, Tally, limits_of, prepare_chunk


def _ray():
    try:  # heavy, an optional extra: Ray only for --ray
        import ray.data
    except ImportError:
        raise JobError("--ray needs Ray Data: pip install 'softmoe-serve[ray]'") from None
    return ray


def connect(address: str) -> Any:
    """Join the cluster at ``address``; ``auto``: the running cluster (RAY_ADDRESS, or one started
    with ``ray start`` on this machine), else a new local one."""
    ray = _ray()
    if ray.is_initialized():
        return ray
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    if address == "auto":
        try:
            ray.init(address="auto", **quiet)
        except (ConnectionError, RuntimeError, ValueError):
            ray.init(include_dashboard=False, **quiet)
    else:
        try:
            ray.init(address=address, **quiet)
        except Exception as e:  # noqa: BLE001 - unreachable, refused, a bad address: one line
            raise JobError(f"--ray {address}: cannot join the Ray cluster: {type(e).__name__}: {e}"[:300]) from None
    return ray


def _settings_dict(settings) -> dict:
    return settings.model_dump(mode="json")


def _job(package: str, settings: dict) -> JobModel:
    return JobModel.load(package, Settings(**settings), say=lambda line: None)


class ModelActor:
    """A Ray Data actor: the model as the server serves it; batches of decoded rows in, the outputs
    the sinks need out (``outputs``: names of the image function's outputs to return)."""

    def __init__(self, package: str, settings: dict, outputs: list[str], texts: bool) -> None:
        self.job = _job(package, settings)
        self.outputs, self.texts = outputs, texts and self.job.texts

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return asyncio.run(self._run(batch))

    async def _run(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        metas = [json.loads(m) for m in batch["meta"]]
        n = len(metas)
        ok = [i for i, m in enumerate(metas) if m[4] is None]
        pixels = batch["pixels"]
        name = "pixels" if self.job.uint8 else "pixel_values"
        dims = self.job.dims[self.job.image_fn]
        result = {k: np.zeros((n, dims[k]), dtype=np.float32) for k in self.outputs}
        text_dim = self.job.dims["text"]["text_embeds"] if self.texts else 1
        text_out = np.zeros((n, text_dim), dtype=np.float32)
        has_text = np.zeros(n, dtype=bool)
        with_text = []
        for i, out in zip(ok, await self.job.run(self.job.image_fn, [{name: pixels[i]} for i in ok])):
            if isinstance(out, Exception):
                metas[i][4] = getattr(out, "message", str(out))
                continue
            for k in self.outputs:
                result[k][i] = out[k].astype(np.float32).reshape(-1)
            text = metas[i][2]
            if self.texts and text is not None:
                metas[i][4] = self.job.check_text(text)
                if metas[i][4] is None:
                    with_text.append(i)
        for i, out in zip(with_text, await self.job.embed_texts([metas[i][2] for i in with_text])):
            if isinstance(out, Exception):
                metas[i][4] = getattr(out, "message", str(out))
            else:
                text_out[i], has_text[i] = out["text_embeds"].astype(np.float32).reshape(-1), True
        return {"unit": batch["unit"], "meta": np.array([json.dumps(m) for m in metas]),
                **{f"out_{k}": v for k, v in result.items()}, "text_embeds": text_out, "has_text": has_text}


class FactsActor:
    """The model's facts for the driver's sinks, and the zero-shot prompts' text embeddings, from the
    same numerics as the actor pool (the driver loads no model)."""

    def __init__(self, package: str, settings: dict) -> None:
        self.job = _job(package, settings)

    def facts(self):
        return self.job.facts()

    def embed_texts(self, texts: list[str]) -> list:
        return asyncio.run(self.job.embed_texts(texts))

    def close(self) -> None:
        self.job.close()


def _read(units_ref, row: dict) -> list[dict]:
    unit: Unit = _ray().get(units_ref)[int(row["unit"])]
    return [{"unit": int(row["unit"]), "meta": json.dumps([s.key, s.label, s.text, s.path, s.error]),
             "data": s.data or b""} for s in unit.samples()]


def _decode(cfg, uint8: bool, limits: tuple):
    """Ray Data's CPU tasks: every sample's row, or its error in its ``meta``."""
    def fn(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        metas = [json.loads(m) for m in batch["meta"]]
        todo = [i for i, m in enumerate(metas) if m[4] is None]
        prepared = prepare_chunk(cfg, uint8, limits, [(metas[i][3], bytes(batch["data"][i]) if metas[i][3] is None else None)
                                                      for i in todo])
        shape = (cfg.image_size, cfg.image_size, 3) if uint8 else (3, cfg.image_size, cfg.image_size)
        pixels = np.zeros((len(metas), *shape), dtype=np.uint8 if uint8 else np.float32)
        for i, (row, why) in zip(todo, prepared):
            if why is not None:
                metas[i][4] = why
            else:
                pixels[i] = next(iter(row.values()))
        return {"unit": batch["unit"], "meta": np.array([json.dumps(m) for m in metas]), "pixels": pixels}
    return fn


def _pipeline(ray, args, settings, units: list[Unit], facts, outputs: list[str], texts: bool):
    """The dataset of model outputs of ``units``, in order."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ref = ray.put(units)
    s = settings
    limits = limits_of(s)
    cfg = facts.preprocess
    batch = s.max_batch_size
    if s.device == "cuda":
        actors = int(ray.cluster_resources().get("GPU", 0))
        if actors < 1:
            raise JobError("--device cuda: the Ray cluster has no GPU")
        gpus = 1
    else:
        actors, gpus = max(1, sum(1 for n in ray.nodes() if n.get("Alive"))), 0
    ds = ray.data.from_items([{"unit": i} for i in range(len(units))], override_num_blocks=max(1, len(units)))
    ds = ds.flat_map(lambda row: _read(ref, row))
    ds = ds.map_batches(_decode(cfg, facts.uint8, limits), batch_size=batch, batch_format="numpy", num_cpus=1)
    # The model's actors reserve less than a CPU (their threads use the node's cores; the GPU is
    # their resource), which also keeps Ray from fusing the decode tasks into them.
    ds = ds.map_batches(ModelActor, fn_constructor_args=(args.package, _settings_dict(s), outputs, texts),
                        batch_size=batch * 4, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=actors),
                        num_gpus=gpus, num_cpus=0.5)
    return ds


def _stream(ds, units: list[Unit], sink, tally: Tally) -> None:
    """Hand the outputs to ``sink`` unit by unit, in order; units with no sample get an empty shard."""
    current = -1

    def advance(to: int) -> None:
        nonlocal current
        if current >= 0:
            sink.end(units[current])
        for j in range(current + 1, to):
            sink.begin(units[j])
            sink.end(units[j])
        if to < len(units):
            sink.begin(units[to])
        current = to

    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        n = len(batch["meta"])
        start = 0
        while start < n:
            u = int(batch["unit"][start])
            stop = start
            while stop < n and int(batch["unit"][stop]) == u:
                stop += 1
            if u != current:
                advance(u)
            outcomes = []
            for i in range(start, stop):
                key, label, text, path, error = json.loads(batch["meta"][i])
                sample = Sample(key=key, label=label, text=text, path=path)
                if error is not None:
                    outcomes.append(Outcome(sample, error=error))
                    continue
                image = {k[4:]: batch[k][i] for k in batch if k.startswith("out_")}
                outcomes.append(Outcome(sample, image=image,
                                        text={"text_embeds": batch["text_embeds"][i]} if batch["has_text"][i] else None))
            tally.add(sink, units[u], outcomes)
            start = stop
    advance(len(units))


def _facts(ray, args, settings):
    actor = ray.remote(num_gpus=1 if settings.device == "cuda" else 0, num_cpus=0)(FactsActor).remote(
        args.package, _settings_dict(settings))
    try:
        facts = ray.get(actor.facts.remote())
    except Exception as e:  # noqa: BLE001 - the model cannot load on the cluster: the actor's one line
        raise JobError(f"the model does not load on the Ray cluster: {_cause(e)}") from None
    return actor, facts


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None) or e
    return str(getattr(cause, "args", [cause])[0] if getattr(cause, "args", None) else cause).splitlines()[0][:300]


def run_embed(args, settings, dataset: Dataset, digest: str, out: Path) -> None:
    ray = connect(args.ray)
    t0 = time.perf_counter()
    actor, facts = _facts(ray, args, settings)
    with contextlib.suppress(Exception):
        ray.kill(actor)
    sink = sink_for(out, facts, dataset, args.data, digest)
    pending = pending_units(sink, dataset, out)
    outputs = ["image_embeds"] if facts.image_fn == "image" else ["pre_logits"]
    rate = 0.0
    if pending:
        progress = Progress("embed", None if any(u.count is None for u in pending) else sum(u.count for u in pending))
        try:
            _stream(_pipeline(ray, args, settings, pending, facts, outputs, facts.texts), pending, sink,
                    Tally(progress, args.max_errors))
        except BaseException:
            sink.abort()
            raise
        finally:
            progress.close()
        rate = progress.rate
    finish_embed(args, facts, sink, dataset, digest, out, time.perf_counter() - t0, rate)


def run_eval(args, settings, dataset: Dataset, digest: str, out: Path, classnames, templates) -> None:
    ray = connect(args.ray)
    t0 = time.perf_counter()
    actor, facts = _facts(ray, args, settings)
    with contextlib.suppress(Exception):  # its GPU goes to the actor pool
        ray.kill(actor)
    precheck_labels(facts, dataset)
    sink = EvalSink(facts, texts=facts.texts)
    progress = Progress("eval", dataset.count)
    tally = Tally(progress, args.max_errors)
    outputs = ["image_embeds"] if facts.image_fn == "image" else ["logits"]
    try:
        _stream(_pipeline(ray, args, settings, dataset.units, facts, outputs, facts.texts), dataset.units, sink, tally)
    finally:
        progress.close()

    def run_texts(texts: list[str]) -> list:
        """The zero-shot prompts, on an actor of the same settings (the pool is gone by now)."""
        actor, _ = _facts(ray, args, settings)
        try:
            return ray.get(actor.embed_texts.remote(texts))
        finally:
            with contextlib.suppress(Exception):
                ray.kill(actor)

    finish_eval(args, facts, sink, tally.error_list, digest, classnames, templates, time.perf_counter() - t0,
                progress.rate, run_texts)
