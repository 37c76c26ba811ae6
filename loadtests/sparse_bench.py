"""Sparse V-MoE served beside Soft MoE at the same size, at vmoe's evaluation capacity factor and
at 1.05; the expert rows each computes; and the routed Tokens Choice form against the capacity form.

    python -m loadtests.sparse_bench [--rounds 3] [--seconds 8] [--c1-seconds 5] [--clients 32]
        [--kinds tc,tc_k2,ec,tc_cf105,tc_k2_cf105,ec_cf105] [--calls 3] [--work DIR] [--smoke]

Serving: ``softmoe init`` packages of soft-s16-e128 and the paper's sparse baselines at its size
(the same backbone, 128 experts in the same 6 blocks): Tokens Choice K=1 (``tc``, tc-s16-e128-k1)
and K=2 (``tc_k2``), Experts Choice (``ec``, ec-s16-e128), each at capacity factor 4.0 and, as
``*_cf105``, 1.05 (the same weights, config.json's capacity factor rewritten). Each behind `softmoe
serve` with its defaults (the auto backend: ONNX Runtime on CPU; strict determinism; max batch 8),
224x224 JPEGs posted to /v1/classify. Images/s at saturation (a closed loop of ``--clients``) and
p50 latency at concurrency 1, in interleaved windows: every server alive together when the free
memory holds them all (each is about 1.15x its weights' bytes), else one server at a time, started
from a shared export cache for each window of each round. Ratios are sparse over soft:
``sparse_<kind>_over_soft_img_s`` (above 1: sparse serves more) and
``sparse_<kind>_over_soft_c1_p50`` (above 1: sparse answers slower).

Rows: ``sparse_<kind>_rows_per_image``, the expert rows computed per image and MoE block by the
served form (the export's: each expert over exactly the claims it kept), counted by the PyTorch
model in that form on the first 8 of the bench's images (``SparseMoE.rows_computed``); the routed
count is the floor (196 for K=1 without drops). ``sparse_soft_rows_per_image``: Soft MoE's slots;
``sparse_tc_capacity_rows_per_image``: Tokens Choice's capacity form (every expert over its whole
capacity buffer, the fused form before issue 39: 128 x C=8).

Forms: tc's served graph (the export cache's file) against the same package exported in the
capacity form (``export_onnx(sparse_dispatch="capacity")``), two ONNX Runtime sessions on the
CPUs, the same 8 images, ``--calls`` timed calls per round after a warm one at batch 8 and at
batch 1, the two forms in a shuffled order each round: ``sparse_tc_routed_over_capacity_img_s``
(images/s at batch 8, above 1: routed serves more), ``sparse_tc_routed_over_capacity_b1`` (a
batch of 1's time, below 1: routed answers faster) and the largest difference between the two
forms' logits (the export tolerance is 1e-4; both are verified against PyTorch when exported).

--smoke: tiny random models of the three routers (32x32 images, 4 experts), windows of a moment:
proves the script runs and emits every key; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.harness import (ROOT, interleave, jpeg, jpeg_request, load, median, report, saturation_and_c1,
                               serve_many)

# kind -> (variant, capacity factor); "soft" is the reference every sparse kind is divided by
KINDS: dict[str, tuple[str, float]] = {
    "soft": ("soft-s16-e128", 0.0),
    "tc": ("tc-s16-e128-k1", 4.0),
    "tc_k2": ("tc-s16-e128-k2", 4.0),
    "ec": ("ec-s16-e128", 4.0),
    "tc_cf105": ("tc-s16-e128-k1", 1.05),
    "tc_k2_cf105": ("tc-s16-e128-k2", 1.05),
    "ec_cf105": ("ec-s16-e128", 1.05),
}
SPARSE = tuple(k for k in KINDS if k != "soft")
FOOTPRINT = 1.35  # a served model's resident memory over its weights' bytes, at most (memory_bench: 1.15)


def mem_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def weight_bytes(package: Path) -> int:
    return sum(f.stat().st_size for f in package.glob("*.safetensors"))


def init_package(variant: str, work: Path) -> Path:
    """``softmoe init VARIANT`` in ``work`` (reused when it is there)."""
    package = work / variant
    if not (package / "config.json").exists():
        subprocess.run([sys.executable, "-m", "softmoe_models.cli", "init", variant, "--out", str(package)],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return package


def with_capacity(package: Path, cf: float, work: Path) -> Path:
    """``package`` at capacity factor ``cf``: its files linked, config.json's factor rewritten."""
    out = work / f"{package.name}-cf{cf:g}"
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in package.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((package / "config.json").read_text())
    moe = (config["model"].get("image", config["model"]) if "encoder" not in config["model"] else config["model"])
    moe["encoder"]["moe"]["capacity_factor"] = cf
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def tiny_packages(work: Path, kinds: list[str]) -> dict[str, Path]:
    """Smoke: random 2-block models of the kinds (32x32 images, patch 8, 4 experts in block 1)."""
    import torch

    from softmoe_models.config import EncoderConfig, MoEConfig, ViTConfig
    from softmoe_models.models import build_model
    from softmoe_models.package import save_package

    routing = {"soft": {}, "tc": dict(router="tokens-choice", experts_per_token=1),
               "tc_k2": dict(router="tokens-choice", experts_per_token=2),
               "ec": dict(router="experts-choice", capacity_rounding="round", capacity_multiple_of=1)}
    out = {}
    for kind in kinds:
        base = kind.removesuffix("_cf105")
        extra = dict(routing[base], **({"capacity_factor": 1.05} if kind.endswith("_cf105") else {}))
        cfg = ViTConfig(EncoderConfig(64, 2, 4, 128, moe=MoEConfig(layers=(1,), num_experts=4, **extra)),
                        image_size=32, patch_size=8, num_classes=10)
        torch.manual_seed(0)
        out[kind] = save_package(build_model(cfg).eval(), cfg, work / f"tiny-{kind}",
                                 labels=[str(i) for i in range(10)], variant=f"tiny-{kind}")
    return out


def packages_for(kinds: list[str], work: Path) -> dict[str, Path]:
    """``softmoe init`` of each kind's variant (once per variant), at the kind's capacity factor."""
    out = {}
    for kind in kinds:
        variant, cf = KINDS[kind]
        package = init_package(variant, work)
        out[kind] = package if kind == "soft" or cf == 4.0 else with_capacity(package, cf, work)
    return out


def warm_exports(packages: dict[str, Path], cache: Path, log) -> dict[str, Path]:
    """Each package's fused graph through the server's export cache (an export runs in a child
    interpreter), so the servers start from the cache; returns each plain graph's file."""
    from server.backends.onnxruntime_backend import exported_files

    files = {}
    for kind, package in packages.items():
        t0 = time.perf_counter()
        files[kind] = exported_files(package, str(cache), "fp32", log=lambda m: None)[0]
        log(f"  {kind}: {package.name} exported to the cache ({time.perf_counter() - t0:.0f} s)")
    return files


def bench_images(size: int, n: int = 8) -> np.ndarray:
    """The first ``n`` of the served JPEGs, decoded and preprocessed as the server does: (n, 3, size, size)."""
    import io

    from PIL import Image

    x = np.stack([np.asarray(Image.open(io.BytesIO(jpeg(224, 224, i))).convert("RGB").resize((size, size),
                                                                                             Image.BILINEAR),
                             np.float32) for i in range(n)])
    return (x / 127.5 - 1).transpose(0, 3, 1, 2).astype(np.float32)


def rows_per_image(package: Path, x: np.ndarray, tokens_form: str = "routed") -> float:
    """Expert rows per image and MoE block the export's form of ``package`` computes on ``x``
    (PyTorch in that form: each expert one GEMM over exactly its rows; Soft MoE: its slots)."""
    import torch

    from softmoe_models.package import load_model
    from softmoe_models.sparse_moe import configure_sparse_routing, sparse_moe_layers

    model = load_model(package, fused=True)
    layers = sparse_moe_layers(model)
    if not layers:
        soft = [m for m in model.modules() if hasattr(m, "num_slots")]
        return float(soft[0].num_slots) if soft else 0.0
    configure_sparse_routing(model, row_block=0, tokens_form=tokens_form)
    with torch.no_grad():
        model(torch.from_numpy(x))
    return sum(layer.rows_computed for layer in layers) / (len(layers) * len(x))


def serving(packages: dict[str, Path], cache: Path, *, rounds: int, seconds: float, c1_seconds: float,
            clients: int, together: bool, log) -> dict[str, dict[str, list[float]]]:
    """img/s at saturation and p50 ms at concurrency 1 per kind, windows by kind."""
    requests = [(jpeg_request("/v1/classify", jpeg(224, 224, i)), 1) for i in range(32)]
    flags = {k: ["--model", f"{k}={p}", "--cache-dir", str(cache)] for k, p in packages.items()}
    if together:
        sat, c1 = saturation_and_c1(flags, requests, rounds=rounds, seconds=seconds, c1_seconds=c1_seconds,
                                    clients=clients, label="sparse", seed=11)
        return {"sat": sat, "c1": c1}
    out: dict[str, dict[str, list[float]]] = {"sat": {k: [] for k in flags}, "c1": {k: [] for k in flags}}
    rng = random.Random(11)
    for r in range(rounds):
        order = list(flags)
        rng.shuffle(order)
        for kind in order:
            server = serve_many({kind: flags[kind]}, parallel=False)[kind]
            try:
                load([server.port], requests, min(3.0, seconds), clients)  # warm: connections, first batches
                out["sat"][kind].append(load([server.port], requests, seconds, clients, label="sparse").items_per_s)
                out["c1"][kind].append(load([server.port], requests, c1_seconds, 1, min_requests=3,
                                            label="sparse").ms(50))
            finally:
                server.stop()
        log(f"  round {r + 1}/{rounds} done (one server at a time)")
    return out


_CAPACITY_CHILD = """
import json, sys
from export.onnx import export_onnx
a = json.loads(sys.argv[1])
(f,) = export_onnx(a["package"], a["out"], sparse_dispatch="capacity", log=lambda *x: None)
print(json.dumps({"path": str(f.path), "ops": f.ops, "max_err": max(v.max_abs_err for v in f.verification)}))
"""


def export_capacity(package: Path, out: Path, child: bool) -> dict[str, Any]:
    """The capacity form of ``package``, verified; in a child interpreter (an S/16 export peaks at
    about 3x the weights) unless ``child`` is False."""
    if not child:
        from export.onnx import export_onnx

        (f,) = export_onnx(package, out, sparse_dispatch="capacity", log=lambda *x: None)
        return {"path": str(f.path), "ops": f.ops, "max_err": max(v.max_abs_err for v in f.verification)}
    r = subprocess.run([sys.executable, "-c", _CAPACITY_CHILD, json.dumps({"package": str(package), "out": str(out)})],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def routed_vs_capacity(routed: Path, capacity: Path, size: int, *, rounds: int, calls: int, batch: int = 8,
                       weights: Path | None = None) -> dict[str, Any]:
    """Two ONNX Runtime sessions (every CPU each), the same ``batch`` images: median images/s of
    each form at ``batch``, median seconds of a batch of 1, and the largest difference between
    their outputs. ``weights``: the package's file the cached (``routed``) graph reads from."""
    from export.runtime import ort_session

    sessions = {"routed": ort_session(routed, weights=weights), "capacity": ort_session(capacity)}
    x = np.random.default_rng(0).uniform(-1, 1, (batch, 3, size, size)).astype(np.float32)
    outs = {k: s.run(["logits"], {"pixel_values": x})[0] for k, s in sessions.items()}
    diff = float(np.abs(outs["routed"].astype(np.float64) - outs["capacity"]).max())

    def timed(form: str, rows: np.ndarray) -> float:
        s = sessions[form]
        s.run(["logits"], {"pixel_values": rows})  # warm, this shape
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            s.run(["logits"], {"pixel_values": rows})
            times.append(time.perf_counter() - t0)
        return median(times)

    b8 = interleave({form: (lambda f=form: batch / timed(f, x)) for form in sessions}, rounds, seed=13)
    b1 = interleave({form: (lambda f=form: timed(f, x[:1])) for form in sessions}, rounds, seed=14)
    return {"img_s": {k: median(v) for k, v in b8.items()}, "b1_s": {k: median(v) for k, v in b1.items()},
            "windows": {"img_s": b8, "b1_s": b1}, "diff": diff}


def run(*, smoke: bool = False, rounds: int = 3, seconds: float = 8.0, c1_seconds: float = 5.0, clients: int = 32,
        kinds: list[str] | None = None, calls: int = 3, work: Path | None = None, log=print) -> dict[str, Any]:
    owned = work is None
    work = Path(tempfile.mkdtemp(prefix="softmoe-sparse-")) if work is None else work
    kinds = list(SPARSE) if kinds is None else kinds
    unknown = set(kinds) - set(SPARSE)
    if unknown:
        raise ValueError(f"unknown sparse kinds {sorted(unknown)}: use {', '.join(SPARSE)}")
    try:
        return _run(smoke, rounds, seconds, c1_seconds, clients, ["soft", *kinds], calls, work, log)
    finally:
        if owned:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def _run(smoke: bool, rounds: int, seconds: float, c1_seconds: float, clients: int, kinds: list[str], calls: int,
         work: Path, log) -> dict[str, Any]:
    from softmoe_models.package import read_package

    if smoke:
        packages = tiny_packages(work, kinds)
    else:
        log(f"sparse: softmoe init {', '.join(sorted({KINDS[k][0] for k in kinds}))} in {work}")
        packages = packages_for(kinds, work)
    names = {k: f"{p.name}" for k, p in packages.items()}
    size = read_package(packages["soft"]).preprocess.image_size
    cache = work / "cache"
    if smoke:  # tiny graphs: exported in this process, not in a child interpreter each
        from unittest import mock

        from server.backends import onnxruntime_backend

        with mock.patch.object(onnxruntime_backend, "EXPORT_IN_CHILD_BYTES", 1 << 62):
            plain = warm_exports(packages, cache, log)
    else:
        plain = warm_exports(packages, cache, log)
    out: dict[str, Any] = {"sparse_kinds": ",".join(f"{k}={names[k]}" for k in kinds), "sparse_rounds": rounds}

    x = bench_images(size)
    for k in kinds:
        out[f"sparse_{k}_rows_per_image"] = round(rows_per_image(packages[k], x), 1)
    if "tc" in kinds:
        out["sparse_tc_capacity_rows_per_image"] = round(rows_per_image(packages["tc"], x, "capacity"), 1)
    log("expert rows per image and MoE block (served form; the first 8 images): " + ", ".join(
        f"{k} {out[f'sparse_{k}_rows_per_image']:g}" for k in kinds)
        + (f"; tc's capacity form {out['sparse_tc_capacity_rows_per_image']:g}" if "tc" in kinds else ""))

    weights = {k: weight_bytes(p) for k, p in packages.items()}
    need = sum(FOOTPRINT * w for w in weights.values()) + (2 << 30)
    free = mem_available()
    together = need < free
    log(f"serving {', '.join(names.values())} ({size}x{size} input, defaults: auto backend, max batch 8), "
        f"{clients} clients at saturation and 1 at concurrency 1, {rounds} rounds x {seconds:g} s / {c1_seconds:g} s; "
        f"{'all servers alive together' if together else 'one server at a time'} "
        f"({need / 2**30:.1f} GiB needed for all, {free / 2**30:.1f} GiB free)")
    res = serving(packages, cache, rounds=rounds, seconds=seconds, c1_seconds=c1_seconds, clients=clients,
                  together=together, log=log)
    med = {m: {k: median(v) for k, v in res[m].items()} for m in res}
    out["sparse_serving"] = "together" if together else "one at a time"
    for k in kinds:
        out[f"sparse_{k}_img_s"] = round(med["sat"][k], 2)
        out[f"sparse_{k}_c1_p50_ms"] = round(med["c1"][k], 2)
        log(f"  {k:12} {names[k]:24} img/s {med['sat'][k]:8.2f}  windows {[round(v, 2) for v in res['sat'][k]]}   "
            f"c1 p50 ms {med['c1'][k]:8.1f}  windows {[round(v, 1) for v in res['c1'][k]]}")
    sparse = [k for k in kinds if k != "soft"]
    for k in sparse:
        out[f"sparse_{k}_over_soft_img_s"] = round(med["sat"][k] / med["sat"]["soft"], 3)
        out[f"sparse_{k}_over_soft_c1_p50"] = round(med["c1"][k] / med["c1"]["soft"], 3)
    log("  sparse over soft: " + ", ".join(
        f"{k} img/s {out[f'sparse_{k}_over_soft_img_s']:.3f}x, c1 p50 {out[f'sparse_{k}_over_soft_c1_p50']:.3f}x"
        for k in sparse))

    if "tc" in kinds:
        log(f"tc's routed form vs its capacity form, ONNX Runtime alone at batch 8 and 1, {rounds} rounds x {calls} calls:")
        t0 = time.perf_counter()
        capacity = export_capacity(packages["tc"], work / "tc.capacity.onnx", child=not smoke)
        log(f"  capacity form exported and verified in {time.perf_counter() - t0:.0f} s "
            f"(max err vs PyTorch {capacity['max_err']:.1e})")
        r = routed_vs_capacity(plain["tc"], Path(capacity["path"]), size, rounds=rounds, calls=calls,
                               weights=packages["tc"] / "model.safetensors")
        out["sparse_tc_routed_over_capacity_img_s"] = round(r["img_s"]["routed"] / r["img_s"]["capacity"], 3)
        out["sparse_tc_routed_over_capacity_b1"] = round(r["b1_s"]["routed"] / r["b1_s"]["capacity"], 3)
        out["sparse_tc_routed_img_s"] = round(r["img_s"]["routed"], 2)
        out["sparse_tc_capacity_img_s"] = round(r["img_s"]["capacity"], 2)
        out["sparse_tc_routed_b1_ms"] = round(1000 * r["b1_s"]["routed"], 1)
        out["sparse_tc_capacity_b1_ms"] = round(1000 * r["b1_s"]["capacity"], 1)
        out["sparse_tc_forms_max_abs_diff"] = float(f"{r['diff']:.3g}")
        log(f"  batch 8: routed {r['img_s']['routed']:.2f} img/s (windows {[round(v, 2) for v in r['windows']['img_s']['routed']]}), "
            f"capacity {r['img_s']['capacity']:.2f} (windows {[round(v, 2) for v in r['windows']['img_s']['capacity']]}): "
            f"{out['sparse_tc_routed_over_capacity_img_s']:.3f}x; batch 1: routed {1000 * r['b1_s']['routed']:.1f} ms, "
            f"capacity {1000 * r['b1_s']['capacity']:.1f} ms: {out['sparse_tc_routed_over_capacity_b1']:.3f}x; "
            f"logits differ by at most {r['diff']:.1e}")
        Path(capacity["path"]).unlink(missing_ok=True)
        Path(capacity["path"] + ".data").unlink(missing_ok=True)
    return out


def section(mode: str, workdir: Path) -> dict[str, Any]:
    """`make bench`'s sparse section (soft-s16-e128 reused from the serving section's work dir)."""
    rounds, seconds, c1_seconds, calls = {"full": (3, 8.0, 5.0, 3), "quick": (2, 6.0, 4.0, 2),
                                          "smoke": (1, 0.3, 0.3, 1)}[mode]
    print()
    work = workdir / "sparse"
    work.mkdir(exist_ok=True)
    made = workdir / "soft-s16-e128"  # the serving section's package, when it ran
    if mode != "smoke" and (made / "config.json").exists() and not (work / "soft-s16-e128").exists():
        (work / "soft-s16-e128").symlink_to(made)
    return run(smoke=mode == "smoke", rounds=rounds, seconds=seconds, c1_seconds=c1_seconds, clients=32,
               calls=calls, work=work)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="each saturation window")
    parser.add_argument("--c1-seconds", type=float, default=5.0, help="each concurrency-1 window")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--kinds", default=",".join(SPARSE),
                        help=f"comma list of sparse kinds served beside soft (default all: {','.join(SPARSE)})")
    parser.add_argument("--calls", type=int, default=3, help="timed ONNX Runtime calls per round, form and batch")
    parser.add_argument("--work", type=Path, default=None, help="where the packages and the export cache go "
                        "(kept; default: a temp dir, removed)")
    parser.add_argument("--smoke", action="store_true", help="tiny models, windows of a moment")
    args = parser.parse_args(argv)
    if args.smoke:  # the section's smoke windows, whatever else was given
        args.rounds, args.seconds, args.c1_seconds, args.calls = 1, 0.3, 0.3, 1
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(SPARSE):
        parser.error(f"--kinds: unknown {sorted(set(kinds) - set(SPARSE))}; known: {','.join(SPARSE)}")
    result = run(smoke=args.smoke, rounds=args.rounds, seconds=args.seconds, c1_seconds=args.c1_seconds,
                 clients=args.clients, kinds=kinds, calls=args.calls, work=args.work,
                 log=lambda m: print(m, file=sys.stderr, flush=True))
    report(result, "loadtests.sparse_bench", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
