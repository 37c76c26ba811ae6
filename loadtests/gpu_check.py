"""`make gpu-check`: everything that needs a GPU, in one command that ends with one JSON line.

    python -m loadtests.gpu_check [--wheels DIR] [--budget-s 540]

Without a CUDA device it prints one line saying so and exits 77 (the "skipped" status of
automake-style harnesses). With one:

1. ``--wheels DIR``: installs every wheel in DIR with ``pip --no-index --find-links DIR`` (nothing
   from the network; an onnxruntime-gpu wheel replaces the CPU onnxruntime), then restarts itself.
2. Parity: every available backend (torch; onnxruntime with the CUDA EP; TensorRT) at fp32, fp16
   and bf16 against fp32 PyTorch on the CPU, on the built-in digits model's 360 held-out images:
   top-1 agreement and max abs error (tolerances as ``export.onnx.tolerance``).
3. Determinism: the same image at every slot of the fixed batch shape among different batch-mates
   gives bitwise-identical outputs (torch eager, torch CUDA graph, ONNX Runtime CUDA, and a random
   224x224 Soft MoE S/16 with 128 experts on torch); a second process computes the same bytes; CUDA
   graph replay equals eager; pinned staging equals pageable copies; uint8 pixel transfer
   (``--pixel-transfer uint8``) equals float32.
4. GPU JPEG decode (``--decode-device cuda``, nvJPEG via torchvision; skipped without it) against
   Pillow on the held-out digits as 640x480 JPEGs: top-1 agreement and max pixel difference.
5. ``pytest tests/gpu``.
6. Timings (``loadtests.gpu_bench``): Soft MoE-B/16 vs ViT-B/16, random weights, at batch 8 and at
   the largest batch that fits; eager vs CUDA graph, pinned vs pageable, uint8 vs float32 transfer,
   side by side in one run.

``SOFTMOE_GPU_CHECK_DEVICE=cpu`` runs the same code on the CPU (a dry run that checks nothing
about a GPU: the test suite uses it so this script cannot rot between the days a GPU is lent).

Exit status: 0 when every check that ran passed (timings never fail it), 1 otherwise, 77 without
CUDA, 2 when torch is not importable. The whole run stays inside ``--budget-s`` (default 540 s: the
target is 10 minutes on one H100); sections that no longer fit are reported as skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "server" / "default_models" / "digits"
EXIT_SKIP = 77
CACHE_ENV = "SOFTMOE_GPU_CHECK_CACHE"  # tests/gpu reuse gpu-check's export cache through this
BATCH = 8  # the server's default max_batch_size: the fixed shape of strict determinism
# cpu: a dry run of this check's own code on the CPU (tests/loadtests/test_gpu_check.py), so it
# cannot rot between the rare days a GPU is lent; it checks nothing about a GPU. Read from the
# environment so the second-process check's child runs the same way.
DRY_RUN_ENV = "SOFTMOE_GPU_CHECK_DEVICE"
DEVICE = os.environ.get(DRY_RUN_ENV, "cuda")
PRECISIONS = ("fp32", "fp16", "bf16")


# ------------------------------------------------------------------ environment


def cuda_missing_reason() -> str | None:
    """None when torch sees a CUDA device; else why not, in a few words."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"no CUDA device (torch {torch.__version__} is a CPU-only build)"
    return f"no CUDA device (torch.cuda.is_available() is False; torch {torch.__version__}, CUDA {torch.version.cuda})"


def _nvidia_device_present() -> bool:
    gpus = Path("/proc/driver/nvidia/gpus")
    return Path("/dev/nvidiactl").exists() or (gpus.is_dir() and any(gpus.iterdir()))


def install_wheels(directory: Path, log) -> None:
    """Every wheel in ``directory``, offline; an onnxruntime-gpu wheel replaces onnxruntime."""
    from importlib import metadata

    wheels = sorted(str(p) for p in directory.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gpu-check: no wheels in {directory}")
    if any(Path(w).name.startswith("onnxruntime_gpu-") for w in wheels):
        try:
            metadata.distribution("onnxruntime")
            log("gpu-check: removing the CPU onnxruntime (onnxruntime-gpu replaces it)")
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "onnxruntime"], check=True)
        except metadata.PackageNotFoundError:
            pass
    log(f"gpu-check: installing {len(wheels)} wheel(s) from {directory}, offline")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(directory), *wheels],
                   check=True)


def device_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
                            "torch": torch.__version__, "cuda": torch.version.cuda,
                            "cudnn": torch.backends.cudnn.version()}
    try:
        import onnxruntime as ort

        info["onnxruntime"] = ort.__version__
        info["onnxruntime_providers"] = ort.get_available_providers()
    except ImportError:
        info["onnxruntime"] = None
    try:
        import tensorrt

        info["tensorrt"] = tensorrt.__version__
    except ImportError:
        info["tensorrt"] = None
    return info


# ------------------------------------------------------------------ data and models


def heldout() -> tuple[np.ndarray, np.ndarray]:
    """The digits model's held-out images (index % 5 == 0, never trained on) and their labels."""
    from softmoe_models.demo.data import load_splits

    _, held = load_splits()
    return held.pixels, held.targets


def midsize_model(device: str = DEVICE, precision: str = "auto", seed: int = 0):
    """A random Soft MoE S/16 at 224x224 (4 blocks, 128 experts in the last 2): real GEMM shapes,
    seconds to build. Initialised on the CPU from ``seed``, so every process builds the same bits."""
    import dataclasses

    import torch

    from server.backends.cuda import resolve_precision
    from softmoe_models.config import variant_config
    from softmoe_models.models import build_model

    cfg = variant_config("soft-s16-e128")
    enc = dataclasses.replace(cfg.encoder, num_layers=4, moe=dataclasses.replace(cfg.encoder.moe, layers=(2, 3)))
    cfg = dataclasses.replace(cfg, encoder=enc)
    torch.manual_seed(seed)
    model = build_model(cfg)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[resolve_precision("torch", device, precision)]
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    for m in model.modules():
        if hasattr(m, "fold"):
            m.fold()
    return model


def torch_backend(source, precision: str = "auto", device: str = DEVICE, **kwargs):
    from server.backends.torch_backend import TorchBackend

    return TorchBackend(source, device=device, precision=precision, max_batch_size=kwargs.pop("max_batch_size", BATCH), **kwargs)


def ort_backend(precision: str, cache_dir: str, **kwargs):
    """ONNX Runtime on the CUDA EP for the digits model (exported into ``cache_dir``)."""
    from server.backends.onnxruntime_backend import OnnxRuntimeBackend, exported_files

    files = exported_files(DIGITS, cache_dir, precision, log=lambda *a, **k: None)
    return OnnxRuntimeBackend(files, device="cuda", max_batch_size=BATCH, weights=DIGITS / "model.safetensors", **kwargs)


def ort_cuda_available() -> bool:
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


# ------------------------------------------------------------------ checks (shared with tests/gpu)


def run_fixed(backend, x: np.ndarray, batch: int = BATCH, fn: str = "classify") -> dict[str, np.ndarray]:
    """All rows of ``x`` through ``backend`` in zero-padded batches of exactly ``batch`` (the server's
    strict mode); outputs concatenated."""
    name = backend.functions[fn].inputs[0].name
    parts: dict[str, list[np.ndarray]] = {}
    for i in range(0, len(x), batch):
        chunk = x[i:i + batch]
        n = len(chunk)
        if n < batch:
            chunk = np.concatenate([chunk, np.zeros((batch - n, *chunk.shape[1:]), chunk.dtype)])
        for k, v in backend.run(fn, {name: chunk}).items():
            parts.setdefault(k, []).append(v[:n])
    return {k: np.concatenate(v) for k, v in parts.items()}


def parity(got: dict[str, np.ndarray], ref: dict[str, np.ndarray], precision: str) -> dict[str, Any]:
    """Top-1 agreement of the logits and max abs error of every output vs the fp32 CPU reference."""
    from export.onnx import tolerance

    out: dict[str, Any] = {"n": int(len(ref["logits"]))}
    out["top1_agreement"] = float((got["logits"].argmax(-1) == ref["logits"].argmax(-1)).mean())
    ok = out["top1_agreement"] >= 0.999
    for k in ref:
        err = float(np.abs(got[k].astype(np.float64) - ref[k]).max())
        tol = tolerance(precision, float(np.abs(ref[k]).max()))
        out[f"max_abs_err_{k}"] = err
        out[f"tol_{k}"] = tol
        ok = ok and err <= tol
    out["ok"] = bool(ok)
    return out


def slot_invariance(backend, target: np.ndarray, pool: np.ndarray, batch: int = BATCH, fn: str = "classify",
                    seed: int = 0) -> dict[str, Any]:
    """``target`` at every slot of a ``batch``-row call, each time among different batch-mates drawn
    from ``pool``, plus once alone among zero padding: are its output rows bitwise identical?"""
    name = backend.functions[fn].inputs[0].name
    rng = np.random.default_rng(seed)
    rows: list[dict[str, np.ndarray]] = []
    for pos in range(batch):
        mates = pool[rng.choice(len(pool), batch - 1, replace=False)]
        x = np.concatenate([mates[:pos], target[None], mates[pos:]]).astype(np.float32)
        rows.append({k: v[pos] for k, v in backend.run(fn, {name: x}).items()})
    alone = np.zeros((batch, *target.shape), np.float32)
    alone[0] = target
    rows.append({k: v[0] for k, v in backend.run(fn, {name: alone}).items()})
    first = rows[0]
    bitwise = all(r[k].tobytes() == first[k].tobytes() for r in rows for k in first)
    diff = max(float(np.abs(r[k].astype(np.float64) - first[k]).max()) for r in rows for k in first)
    return {"bitwise": bool(bitwise), "positions": batch, "max_abs_diff": diff}


def uint8_equals_float32(source, images: np.ndarray, device: str = DEVICE, **kwargs) -> dict[str, Any]:
    """``--pixel-transfer uint8`` against float32 on the same images ((N, S, S, 3) uint8): the torch
    backend's outputs must be bitwise equal (the device maps bytes to pixel values by table lookup)."""
    from loadtests.gpu_bench import pixel_values

    plain = torch_backend(source, device=device, **kwargs)
    uint8 = torch_backend(source, device=device, pixel_transfer="uint8", value_range=(-1.0, 1.0), **kwargs)
    for b in (plain, uint8):
        b.warmup([BATCH])
    return {"bitwise": outputs_equal(run_fixed(plain, pixel_values(images)), run_fixed(uint8, images)),
            "images": int(len(images))}


def outputs_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def midsize_inputs(n: int = BATCH, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, 3, 224, 224)).astype(np.float32)


def second_process_digest(cuda_graphs: bool = True) -> str:
    """sha256 of the midsize model's outputs on fixed inputs (torch, auto precision)."""
    backend = torch_backend(midsize_model(), cuda_graphs=cuda_graphs)
    backend.warmup([BATCH])
    out = run_fixed(backend, midsize_inputs())
    h = hashlib.sha256()
    for k in sorted(out):
        h.update(k.encode())
        h.update(out[k].tobytes())
    return h.hexdigest()


def digest_in_subprocess(cuda_graphs: bool = True, timeout: float = 300) -> str:
    code = f"from loadtests.gpu_check import second_process_digest as d; print(d(cuda_graphs={cuda_graphs!r}))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"second process failed: {r.stderr.strip().splitlines()[-1:]}")
    return r.stdout.strip().splitlines()[-1]


# ------------------------------------------------------------------ sections


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def section_parity(cache_dir: str, budget: Budget, log) -> list[dict[str, Any]]:
    x, y = heldout()
    ref = run_fixed(torch_backend(DIGITS, precision="fp32", device="cpu"), x)
    rows = []
    for precision in PRECISIONS:
        row = {"backend": "torch", "precision": precision}
        try:
            b = torch_backend(DIGITS, precision=precision)
            b.warmup([BATCH])
            got = run_fixed(b, x)
            row.update(parity(got, ref, precision), device=b.describe()["device"],
                       accuracy=float((got["logits"].argmax(-1) == y).mean()))
        except Exception as e:  # noqa: BLE001 - a failing row is reported, the others still run
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
        log(f"parity {row}")
    for backend_name, make in (("onnxruntime", _make_ort), ("tensorrt", _make_trt)):
        for precision in PRECISIONS:
            row = {"backend": backend_name, "precision": precision}
            if budget.left() < 200:
                row.update(skipped="time budget")
                rows.append(row)
                continue
            try:
                b = make(precision, cache_dir)
                if b is None:
                    row.update(skipped=_why_unavailable(backend_name))
                else:
                    b.warmup([BATCH])
                    got = run_fixed(b, x)
                    row.update(parity(got, ref, precision), device=b.describe().get("device"))
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"[:300]
                if backend_name == "onnxruntime" and precision == "bf16":
                    # The CUDA EP's bf16 kernel coverage is partial (auto picks fp16 for ORT): a graph
                    # it cannot run is reported, not failed; a graph it runs must agree.
                    row.update(skipped=f"unsupported: {error}")
                else:
                    row.update(ok=False, error=error)
            rows.append(row)
            log(f"parity {row}")
    return rows


def _make_ort(precision: str, cache_dir: str):
    return ort_backend(precision, cache_dir) if ort_cuda_available() else None


def _make_trt(precision: str, cache_dir: str):
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return None
    from server.backends.tensorrt_backend import TensorRTBackend

    return TensorRTBackend(DIGITS, precision=precision, max_batch_size=BATCH, cache_dir=cache_dir)


def _why_unavailable(backend: str) -> str:
    if backend == "onnxruntime":
        return "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu, or pass --wheels)"
    return "tensorrt is not installed"


def section_determinism(cache_dir: str, log) -> dict[str, Any]:
    x, _ = heldout()
    target, pool = x[0], x[1:]
    out: dict[str, Any] = {}

    def record(key: str, fn) -> None:
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001
            out[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
        log(f"determinism {key}: {out[key]}")

    for graphs in (False, True):
        name = "torch_cuda_graph" if graphs else "torch_eager"

        def digits(graphs=graphs):
            b = torch_backend(DIGITS, cuda_graphs=graphs)
            b.warmup([BATCH])
            return slot_invariance(b, target, pool)

        record(f"slot_invariance_digits_{name}", digits)
    if ort_cuda_available():
        for graph in (False, True):
            def ort(graph=graph):
                b = ort_backend("fp32", cache_dir, cuda_graph=graph)
                b.warmup([BATCH])
                return slot_invariance(b, target, pool)

            record(f"slot_invariance_digits_onnxruntime_cuda{'_graph' if graph else ''}", ort)
    else:
        out["slot_invariance_digits_onnxruntime_cuda"] = {"skipped": _why_unavailable("onnxruntime")}

    model = midsize_model()
    mx = midsize_inputs(24)
    backends = {}

    def mid(graphs: bool, pinned: bool = True):
        key = (graphs, pinned)
        if key not in backends:
            backends[key] = torch_backend(model, cuda_graphs=graphs, pinned_staging=pinned)
            backends[key].warmup([BATCH])
        return backends[key]

    record("slot_invariance_softmoe_s16_torch_eager", lambda: slot_invariance(mid(False), mx[0], mx[1:]))
    record("slot_invariance_softmoe_s16_torch_cuda_graph", lambda: slot_invariance(mid(True), mx[0], mx[1:]))
    record("cuda_graph_equals_eager", lambda: {"bitwise": outputs_equal(run_fixed(mid(True), mx), run_fixed(mid(False), mx))})
    record("pinned_equals_pageable", lambda: {"bitwise": outputs_equal(run_fixed(mid(True), mx), run_fixed(mid(True, False), mx))})
    backends.clear()
    images = np.random.default_rng(2).integers(0, 256, (20, 224, 224, 3)).astype(np.uint8)
    record("uint8_transfer_equals_float32", lambda: uint8_equals_float32(model, images))
    model = None  # freed before the second process (the closures above have run)
    record("second_process_identical", lambda: {"bitwise": second_process_digest() == digest_in_subprocess()})
    return out


def section_pytest(timeout: float, cache_dir: str, log) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
        env = {**os.environ, CACHE_ENV: cache_dir}  # reuse the ONNX exports made for the parity table
        try:
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"rc": None, "error": f"timed out after {timeout:.0f}s"}
        tail = r.stdout.strip().splitlines()[-1:] if r.stdout.strip() else []
        log(f"pytest tests/gpu: rc {r.returncode} {tail}")
        out: dict[str, Any] = {"rc": r.returncode, "summary": tail[0] if tail else ""}
        if xml.is_file():
            results = {}
            for case in ET.parse(xml).getroot().iter("testcase"):
                status = "passed"
                for child in case:
                    if child.tag in ("failure", "error", "skipped"):
                        status = child.tag
                results[f"{case.get('classname')}::{case.get('name')}"] = status
            out["results"] = results
        return out


def section_gpu_decode(log) -> dict[str, Any]:
    """``--decode-device cuda`` (nvJPEG) against Pillow on the digits model's held-out images served
    as 640x480 JPEGs: top-1 agreement, both accuracies, the largest preprocessed-pixel difference.
    A measurement (the option is opt-in because the pixels differ), never a failure; a decoder that
    cannot open is reported as skipped."""
    from loadtests.decode_cost import decode_accuracy_cost
    from server.pipeline.gpu_decode import GpuDecodeUnavailable, open_decoder

    try:
        decoder = open_decoder()
    except GpuDecodeUnavailable as e:
        return {"skipped": str(e)}
    cost = decode_accuracy_cost(lambda data, size: decoder.decode(data))
    log(f"gpu-check: nvJPEG vs Pillow on {cost['n']} JPEGs: top-1 agreement {cost['agree']:.4f}, "
        f"max |pixel diff| {cost['max_px']:.4f}")
    return {"n": cost["n"], "top1_agreement": cost["agree"], "top1_pillow": cost["acc_full"],
            "top1_nvjpeg": cost["acc_alt"], "max_pixel_diff": cost["max_px"]}


def _failures(results: dict[str, Any]) -> list[str]:
    """Names of the failed checks (empty: everything that ran passed)."""
    failed = []
    for row in results.get("parity", []):
        if "skipped" not in row and not row.get("ok"):
            failed.append(f"parity {row['backend']} {row['precision']}")
    for key, v in results.get("determinism", {}).items():
        if isinstance(v, dict) and "skipped" not in v and not v.get("bitwise"):
            failed.append(key)
    tests = results.get("tests", {})
    if tests and tests.get("rc") != 0:
        failed.append("pytest tests/gpu")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GPU tests, parity, determinism and timings; one JSON line")
    parser.add_argument("--wheels", type=Path, help="install every wheel in DIR first, offline (pip --no-index --find-links DIR)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: parity,determinism,decode,tests,timings")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.wheels is not None and _nvidia_device_present():
        started = time.perf_counter()
        install_wheels(args.wheels, log)
        left = max(60.0, args.budget_s - (time.perf_counter() - started))  # the install counts against the budget
        rest = ["--budget-s", f"{left:.0f}", *(["--skip", args.skip] if args.skip else [])]
        os.execv(sys.executable, [sys.executable, "-m", "loadtests.gpu_check", *rest])  # fresh imports
    try:
        reason = None if DEVICE == "cpu" else cuda_missing_reason()
    except ImportError as e:
        print(f"gpu-check: torch is not importable by {sys.executable} ({e})")
        return 2
    if reason is not None:
        print(f"gpu-check: {reason}; nothing to check")
        return EXIT_SKIP

    t0 = time.perf_counter()
    budget = Budget(args.budget_s)
    info = {"dry_run": f"{DRY_RUN_ENV}=cpu: this check's code on the CPU, nothing about a GPU"} if DEVICE == "cpu" \
        else device_info()
    results: dict[str, Any] = {"gpu_check": None, **info}
    with tempfile.TemporaryDirectory(prefix="gpu-check-cache-") as cache_dir:
        if "parity" not in skip:
            results["parity"] = section_parity(cache_dir, budget, log)
        if "determinism" not in skip:
            results["determinism"] = section_determinism(cache_dir, log)
        if "decode" not in skip:
            results["gpu_decode"] = section_gpu_decode(log)
        if "tests" not in skip:  # what is left, keeping ~200 s for the timings
            results["tests"] = section_pytest(max(60.0, min(300.0, budget.left() - 200)), cache_dir, log)
    if "timings" not in skip:
        left = budget.left() - 15
        if left < 60:
            results["timings"] = {"skipped": f"time budget ({left:.0f}s left)"}
        else:
            from loadtests.gpu_bench import run as gpu_bench

            results["timings"] = gpu_bench(budget_s=left, log=log)
    failed = _failures(results)
    results["gpu_check"] = "failed" if failed else "passed"
    results["failed"] = failed
    results["seconds"] = round(time.perf_counter() - t0, 1)
    results["command"] = (f"{DRY_RUN_ENV}=cpu " if DEVICE == "cpu" else "") + "python -m loadtests.gpu_check" \
        + (f" --skip {args.skip}" if skip else "")
    print(json.dumps(results, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
