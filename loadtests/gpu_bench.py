"""GPU timings: Soft MoE-B/16 vs ViT-B/16 through the torch backend, ratios measured side by side.

    python -m loadtests.gpu_bench [--quick] [--budget-s 300]

Used by `make bench` (its gpu section) and `make gpu-check`. Both models get random weights (time
does not depend on their values), built straight on the GPU in the serving precision (``auto``:
bf16 on GPUs with native bf16, else fp16), 224x224 inputs, 1000 classes. Every figure is a call of
``TorchBackend.run``, the server's path: numpy in (float32 pixel values, or uint8 RGB), host-to-device
copy, forward, device-to-host copy, numpy out. The same images feed every configuration.

Measured, each set in one run with the alternatives in shuffled alternating windows (median of
the windows):
  * batch 8: Soft MoE-B/16 vs ViT-B/16, time per image and images/s; eager vs CUDA graph for each;
    pinned vs pageable staging and uint8 vs float32 pixel transfer (Soft MoE, CUDA graph; uint8:
    resized RGB bytes in, mapped to the value range on the device);
  * the largest batch (power of two, 16..1024) at which both models run: the same comparisons.
A configuration that does not fit in GPU memory is reported as such, never retried smaller.
Needs a CUDA device; without one ``run`` returns ``{"gpu": "not available"}``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

CANDIDATE_BATCHES = (1024, 512, 256, 128, 64, 32, 16)
MODELS = {"softmoe": "soft-b16-e128", "vit": "vit-b16"}


def random_model(variant: str, dtype, device: str = "cuda", seed: int = 0):
    """``variant`` with N(0, 0.02) matrices, unit scales and zero biases, allocated on ``device`` in ``dtype``."""
    import torch

    from softmoe_models.config import variant_config
    from softmoe_models.models import build_model

    model = build_model(variant_config(variant), device="meta").to(dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            elif name.endswith("bias"):
                p.zero_()
            else:  # LayerNorm scales, the Soft MoE scale
                p.fill_(1.0)
    for m in model.modules():
        if hasattr(m, "fold"):
            m.fold()
    return model.eval().requires_grad_(False)


def per_image(backend, images: np.ndarray, seconds: float) -> float:
    """Seconds per image of ``backend.run`` on ``images`` ((N, S, S, 3) uint8, passed as the
    backend's input: uint8 as they are, else mapped to float32 pixel values on the host first, as
    the server's preprocessing does), calls repeated for ``seconds`` (at least 2)."""
    spec = backend.functions["classify"].inputs[0]
    rows = {spec.name: images if spec.dtype == np.uint8 else pixel_values(images)}
    n, t0 = 0, time.perf_counter()
    while True:
        backend.run("classify", rows)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and n >= 2:
            return elapsed / (n * len(images))


def pixel_values(images: np.ndarray, value_range: tuple[float, float] = (-1.0, 1.0)) -> np.ndarray:
    from softmoe_models.preprocess import PreprocessConfig, to_pixel_values

    cfg = PreprocessConfig(image_size=images.shape[1], value_range=value_range)
    return np.stack([to_pixel_values(im, cfg) for im in images])


def interleave(windows: dict[str, Callable[[], float]], rounds: int, seed: int = 0) -> dict[str, float]:
    """Each measurement once per round in a shuffled order; the median per name."""
    rng = random.Random(seed)
    values: dict[str, list[float]] = {k: [] for k in windows}
    for _ in range(rounds):
        order = list(windows)
        rng.shuffle(order)
        for name in order:
            values[name].append(windows[name]())
    return {k: statistics.median(v) for k, v in values.items()}


def _backend(model, precision: str, batch: int, graphs: bool, pinned: bool, uint8: bool = False,
             device: str = "cuda"):
    from server.backends.torch_backend import TorchBackend

    b = TorchBackend(model, device=device, precision=precision, max_batch_size=batch, cuda_graphs=graphs,
                     pinned_staging=pinned, pixel_transfer="uint8" if uint8 else "float32", value_range=(-1.0, 1.0))
    b.warmup([batch])
    return b


def _fits(model, precision: str, batch: int) -> bool:
    import torch

    try:
        b = _backend(model, precision, batch, graphs=False, pinned=False)
        b.close()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def largest_batch(models: dict[str, Any], precision: str, log=print) -> int | None:
    """The largest of ``CANDIDATE_BATCHES`` at which every model runs eagerly."""
    for batch in CANDIDATE_BATCHES:
        if all(_fits(m, precision, batch) for m in models.values()):
            return batch
        log(f"gpu bench: batch {batch} does not fit")
    return None


def compare(models: dict[str, Any], precision: str, batch: int, window: float, rounds: int, log=print,
            device: str = "cuda", size: int = 224) -> dict[str, float | str]:
    """Soft MoE vs ViT at ``batch``: CUDA graph vs eager, pinned vs pageable, uint8 vs float32
    transfer, side by side. (``device="cpu"`` and small models: the smoke test of this code.)"""
    import torch

    configs = {f"{m}_graph": (m, True, True, False) for m in models}
    configs.update({f"{m}_eager": (m, False, True, False) for m in models})
    configs["softmoe_graph_pageable"] = ("softmoe", True, False, False)
    configs["softmoe_graph_uint8"] = ("softmoe", True, True, True)
    backends, out = {}, {}
    for name, (m, graphs, pinned, uint8) in configs.items():
        try:
            backends[name] = _backend(models[m], precision, batch, graphs, pinned, uint8, device)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            out[f"gpu_{name}_b{batch}"] = "out of memory"
    images = np.random.default_rng(0).integers(0, 256, (batch, size, size, 3)).astype(np.uint8)

    def window_of(b) -> float:
        try:
            return per_image(b, images, window)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return float("inf")

    med = interleave({k: (lambda b=b: window_of(b)) for k, b in backends.items()}, rounds)
    for k in [k for k, v in med.items() if v == float("inf")]:
        out[f"gpu_{k}_b{batch}"] = "out of memory"
        del med[k]
    for b in backends.values():
        b.close()
    backends.clear()
    torch.cuda.empty_cache()
    log(f"gpu bench batch {batch}: " + ", ".join(f"{k} {v * 1e3:.3f} ms/img" for k, v in med.items()))
    sfx = f"_b{batch}"
    for k, v in med.items():
        out[f"gpu_ms_per_img_{k}{sfx}"] = round(v * 1e3, 4)
        out[f"gpu_img_per_s_{k}{sfx}"] = round(1 / v, 1)

    def ratio(key: str, a: str, b: str) -> None:
        if a in med and b in med:
            out[key + sfx] = round(med[a] / med[b], 3)

    ratio("gpu_softmoe_vs_vit", "softmoe_graph", "vit_graph")  # time per image, Soft MoE / ViT
    ratio("gpu_softmoe_vs_vit_eager", "softmoe_eager", "vit_eager")
    ratio("gpu_graph_speedup_softmoe", "softmoe_eager", "softmoe_graph")
    ratio("gpu_graph_speedup_vit", "vit_eager", "vit_graph")
    ratio("gpu_pinned_speedup_softmoe", "softmoe_graph_pageable", "softmoe_graph")
    ratio("gpu_uint8_speedup_softmoe", "softmoe_graph", "softmoe_graph_uint8")  # float32 / uint8 transfer
    return out


def run(quick: bool = False, budget_s: float = 300.0, log=print) -> dict[str, float | str]:
    """Every GPU timing that fits in ``budget_s``; a flat dict (``make bench`` merges it into its JSON)."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu": "not available"}
    from server.backends.cuda import configure_torch_determinism, resolve_precision

    end = time.perf_counter() + budget_s
    configure_torch_determinism()
    precision = resolve_precision("torch", "cuda", "auto")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    window, rounds = (0.5, 3) if quick else (1.0, 5)
    out: dict[str, float | str] = {"gpu_name": torch.cuda.get_device_name(0), "gpu_precision": precision}
    models = {k: random_model(v, dtype) for k, v in MODELS.items()}
    out.update(compare(models, precision, 8, window, rounds, log))
    if end - time.perf_counter() < 120:
        out["gpu_max_batch"] = "skipped: time budget"
        return out
    batch = largest_batch(models, precision, log)
    out["gpu_max_batch"] = batch if batch is not None else "none fits"
    if batch is not None and end - time.perf_counter() > 60:
        out.update(compare(models, precision, batch, window, rounds, log))
    out["gpu_bench_command"] = "python -m loadtests.gpu_bench" + (" --quick" if quick else "")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Soft MoE-B/16 vs ViT-B/16 on CUDA (one JSON line)")
    parser.add_argument("--quick", action="store_true", help="shorter windows, fewer rounds")
    parser.add_argument("--budget-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    result = run(args.quick, args.budget_s, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
