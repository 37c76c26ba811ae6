"""`make bench`: every performance claim as a ratio measured side by side in one run.

    python -m loadtests.bench [--quick] [--skip LIST]

Sections (each prints its table; the last line of the run is one JSON object with every ratio):
  layers     Soft MoE layer stacks, S/16 (3 blocks; batch 1/8/32) and B/16 (1 block; batch 1/8):
             reference einsum vs fused, PyTorch eager vs ONNX Runtime (export.bench).
  serving    A paper-shaped Soft MoE (soft-s16-e128, 224x224, 922M params) behind `softmoe serve`:
             dynamic batching vs max batch size 1, strict determinism vs the loosest setting, and
             end-to-end /v1/classify with real 640x480 JPEGs vs the raw backend at the same batch.
  decode     decode+preprocess of 640x480 JPEGs to 224x224 with and without JPEG draft mode.
  zeroshot   /v1/zero-shot on the default digits-lit model with the label-embedding cache vs without.
  gpu        Soft MoE B/16 vs ViT-B/16 on CUDA (only where a GPU is present; this CI has none).

Method: the alternatives run in alternating windows (shuffled each round) on one machine in one
run; throughput is a closed loop of concurrent clients; the figure is the median over windows.
Servers are separate processes on loopback; the load generator is this process.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from loadtests.run import ServerProcess, wait_ready

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ helpers


def serve(args: list[str]) -> ServerProcess:
    """`softmoe serve` (loadtests.run's child process on a free loopback port), ready for traffic."""
    server = ServerProcess(shlex.join(args), Path(tempfile.mkdtemp(prefix="softmoe-bench-")) / "server.log")
    try:
        wait_ready(server.url, 600, server)
    except BaseException:
        server.stop()
        raise
    return server


async def _closed_loop(url: str, path: str, make_request, seconds: float, concurrency: int) -> tuple[int, int]:
    """(items completed, errors) of a closed loop of ``concurrency`` clients for ``seconds``."""
    done = errors = 0
    stop = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def worker(i: int) -> None:
            nonlocal done, errors
            k = i
            while time.perf_counter() < stop:
                kwargs, items = make_request(k)
                k += concurrency
                r = await client.post(path, **kwargs)
                if r.status_code == 200:
                    done += items
                else:
                    errors += 1
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return done, errors


ERRORS: dict[str, int] = {}


def throughput(url: str, path: str, make_request, seconds: float, concurrency: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    done, errors = asyncio.run(_closed_loop(url, path, make_request, seconds, concurrency))
    if errors:
        ERRORS[path] = ERRORS.get(path, 0) + errors
    return done / (time.perf_counter() - t0), errors


def interleave(windows: dict[str, callable], rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """Run each named measurement once per round, in a shuffled order; collect the values."""
    rng = random.Random(seed)
    out: dict[str, list[float]] = {k: [] for k in windows}
    for _ in range(rounds):
        order = list(windows)
        rng.shuffle(order)
        for name in order:
            out[name].append(windows[name]())
    return out


def jpeg(width: int, height: int, seed: int) -> bytes:
    from PIL import Image
    from sklearn.datasets import load_sample_image

    photo = Image.fromarray(load_sample_image(["china.jpg", "flower.jpg"][seed % 2]))
    photo = photo.resize((width, height), Image.Resampling.LANCZOS)
    arr = np.asarray(photo).copy()
    arr[: 4 + seed % 7, : 4 + seed % 5] = seed % 255  # distinct images
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    return buf.getvalue()


# ------------------------------------------------------------------ sections


def section_layers(quick: bool) -> dict[str, float]:
    from export.bench import run

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="softmoe-bench-") as tmp:
        out.update(run(3, [1, 8] if quick else [1, 8, 32], 5 if quick else 10, Path(tmp), "S"))
    if not quick:
        with tempfile.TemporaryDirectory(prefix="softmoe-bench-") as tmp:
            out.update(run(1, [1, 8], 6, Path(tmp), "B", suffix="_B"))
    return out


def section_serving(quick: bool, workdir: Path) -> dict[str, float]:
    from server.backends.torch_backend import TorchBackend

    pkg = workdir / "soft-s16-e128"
    subprocess.run([sys.executable, "-m", "softmoe_models.cli", "init", "soft-s16-e128", "--out", str(pkg)], check=True,
                   stdout=subprocess.DEVNULL)
    small = [jpeg(224, 224, i) for i in range(64)]
    large = [jpeg(640, 480, i) for i in range(64)]
    batch = 32  # the Soft MoE layers stream their expert weights: per-image cost keeps falling past 8
    window, rounds, conc = (8.0, 2, 64) if quick else (12.0, 4, 64)  # 2x the batch: always a full one queued
    common = ["--model", f"s16={pkg}", "--max-delay-ms", "100"]  # ~4% of a full call: lets a batch refill
    servers = {
        "dynamic_strict": serve([*common, "--max-batch-size", str(batch)]),
        "b1": serve([*common, "--max-batch-size", "1"]),
        "dynamic_loose": serve([*common, "--max-batch-size", str(batch), "--no-strict-determinism"]),
    }
    try:

        def req(images):
            return lambda k: (dict(content=images[k % len(images)], headers={"content-type": "image/jpeg"}), 1)

        windows = {name: (lambda s=s: throughput(s.url, "/v1/classify", req(small), window, conc)[0]) for name, s in servers.items()}
        res = interleave(windows, rounds)
        med = {k: statistics.median(v) for k, v in res.items()}
        print(f"\nserving soft-s16-e128 (224x224 JPEG, /v1/classify, {conc} concurrent clients, max batch {batch} vs 1), "
              "img/s median of windows:")
        for k, v in res.items():
            print(f"  {k:20} {med[k]:7.2f}   windows {[round(x, 2) for x in v]}")
        out = {
            "batching_vs_b1": round(med["dynamic_strict"] / med["b1"], 3),
            "strict_determinism_cost": round(1 - med["dynamic_strict"] / med["dynamic_loose"], 3),
            "img_per_s_dynamic": round(med["dynamic_strict"], 2),
            "img_per_s_b1": round(med["b1"], 2),
            "img_per_s_loose": round(med["dynamic_loose"], 2),
            "serving_max_batch": batch,
        }
        servers["b1"].stop()
        servers["dynamic_loose"].stop()

        backend = TorchBackend(pkg, max_batch_size=batch)
        pixels = {"pixel_values": np.random.default_rng(0).uniform(-1, 1, (batch, 3, 224, 224)).astype(np.float32)}
        backend.run("classify", pixels)

        def raw() -> float:
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < window:
                backend.run("classify", pixels)
                n += batch
            return n / (time.perf_counter() - t0)

        e2e = lambda: throughput(servers["dynamic_strict"].url, "/v1/classify", req(large), window, conc)[0]  # noqa: E731
        res2 = interleave({"raw_backend": raw, "e2e_classify_640x480_jpeg": e2e}, rounds, seed=1)
        med2 = {k: statistics.median(v) for k, v in res2.items()}
        print(f"\nend to end vs raw backend (batch {batch}), img/s median of windows:")
        for k, v in res2.items():
            print(f"  {k:28} {med2[k]:7.2f}   windows {[round(x, 2) for x in v]}")
        out["e2e_vs_raw"] = round(med2["e2e_classify_640x480_jpeg"] / med2["raw_backend"], 3)
        out["img_per_s_raw"] = round(med2["raw_backend"], 2)
        out["img_per_s_e2e_640x480"] = round(med2["e2e_classify_640x480_jpeg"], 2)
        return out
    finally:
        for s in servers.values():
            s.stop()


def section_decode(quick: bool) -> dict[str, float]:
    from server.pipeline.decode import decode
    from softmoe_models.preprocess import PreprocessConfig, preprocess_image

    cfg = PreprocessConfig(image_size=224)
    images = [jpeg(640, 480, i) for i in range(32)]

    def rate(draft: bool) -> float:
        t0 = time.perf_counter()
        for data in images:
            preprocess_image(decode(data, cfg.image_size if draft else None), cfg)
        return len(images) / (time.perf_counter() - t0)

    res = interleave({"draft": lambda: rate(True), "full": lambda: rate(False)}, 5 if quick else 11)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"\ndecode+preprocess 640x480 JPEG -> 224x224, img/s (one thread): draft {med['draft']:.0f}, full {med['full']:.0f}")
    return {"draft_decode_speedup": round(med["draft"] / med["full"], 3),
            "img_per_s_decode_draft": round(med["draft"], 1), "img_per_s_decode_full": round(med["full"], 1)}


def section_zeroshot(quick: bool) -> dict[str, float]:
    from softmoe_models.demo.data import WORDS, digit_png
    from sklearn.datasets import load_digits

    digits = load_digits()
    blobs = [digit_png(v) for v in digits.data[:64]]
    servers = {"cache": serve([]), "no_cache": serve(["--label-cache-size", "0"])}
    try:
        import base64

        def req(k):
            return dict(json={"model": "digits-lit", "images": [base64.b64encode(blobs[k % 64]).decode()], "labels": WORDS}), 1

        window = 3.0 if quick else 5.0
        res = interleave({n: (lambda s=s: throughput(s.url, "/v1/zero-shot", req, window, 4)[0]) for n, s in servers.items()},
                         3 if quick else 5)
        med = {k: statistics.median(v) for k, v in res.items()}
        print(f"\nzero-shot digits-lit, 10 labels x 4 prompts, req/s: cache {med['cache']:.1f}, no cache {med['no_cache']:.1f}")
        return {"zero_shot_cache_speedup": round(med["cache"] / med["no_cache"], 3),
                "req_per_s_zero_shot_cache": round(med["cache"], 1), "req_per_s_zero_shot_no_cache": round(med["no_cache"], 1)}
    finally:
        for s in servers.values():
            s.stop()


def section_gpu(quick: bool) -> dict[str, float | str]:
    import torch

    if not torch.cuda.is_available():
        print("\ngpu: no CUDA device on this machine; GPU ratios not measured")
        return {"gpu": "not available"}
    from loadtests.gpu_bench import run as gpu_run  # pragma: no cover - GPU machines only

    return gpu_run(quick=quick, budget_s=150.0 if quick else 300.0)


GOALS = {  # key: (comparison, target)
    "fused_vs_reference_ort_b8": (">=", 2.0),
    "batching_vs_b1": (">=", 3.0),
    "e2e_vs_raw": (">=", 0.85),
    "strict_determinism_cost": ("<=", 0.15),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="softmoe-serve benchmarks (ratios measured side by side)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and sizes (a smoke run, not for README)")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: layers,serving,decode,zeroshot,gpu")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    from export.bench import machine

    t0 = time.perf_counter()
    print(f"machine: {machine()}")
    results: dict[str, float | str] = {}
    with tempfile.TemporaryDirectory(prefix="softmoe-bench-") as tmp:
        if "decode" not in skip:
            results.update(section_decode(args.quick))
        if "zeroshot" not in skip:
            results.update(section_zeroshot(args.quick))
        if "layers" not in skip:
            results.update(section_layers(args.quick))
        if "serving" not in skip:
            results.update(section_serving(args.quick, Path(tmp)))
        if "gpu" not in skip:
            results.update(section_gpu(args.quick))
    print("\ngoals:")
    for key, (op, target) in GOALS.items():
        if key in results:
            v = results[key]
            ok = v >= target if op == ">=" else v <= target
            print(f"  {key:28} {v:8.3f}  goal {op} {target}  {'met' if ok else 'MISSED'}")
    results["errors"] = sum(ERRORS.values())
    if ERRORS:
        print(f"  non-200 responses during measurement: {ERRORS}")
    results["seconds"] = round(time.perf_counter() - t0, 1)
    results["command"] = "python -m loadtests.bench" + (" --quick" if args.quick else "") + (f" --skip {args.skip}" if skip else "")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
