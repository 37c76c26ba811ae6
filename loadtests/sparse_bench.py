"""Sparse V-MoE served beside Soft MoE at the same size, and the fused sparse export against
vmoe's einsum form.

    python -m loadtests.sparse_bench [--rounds 3] [--seconds 8] [--c1-seconds 5] [--clients 32]
        [--tc-variant tc-s16-e128-k1] [--calls 3] [--work DIR] [--smoke]

Serving: ``softmoe init`` packages of soft-s16-e128 and the paper's sparse baselines at its size
(Tokens Choice ``--tc-variant``, Experts Choice ec-s16-e128: the same backbone, 128 experts in the
same 6 blocks, capacity factor 4.0), each behind `softmoe serve` with its defaults (the auto
backend: ONNX Runtime on CPU; strict determinism; max batch 8), 224x224 JPEGs posted to
/v1/classify. Images/s at saturation (a closed loop of ``--clients``) and p50 latency at
concurrency 1, in interleaved windows: every server alive together when the free memory holds
them all (each is about 1.15x its weights' bytes), else one server at a time, started from a
shared export cache for each window of each round. Ratios are sparse over soft:
``sparse_tc_over_soft_img_s``, ``sparse_ec_over_soft_img_s`` (above 1: sparse serves more),
``sparse_tc_over_soft_c1_p50``, ``sparse_ec_over_soft_c1_p50`` (above 1: sparse answers slower).

Export: each sparse model's fused graph (what the server runs: the export cache's file) and
vmoe's einsum form (``export_onnx(sparse_dispatch="einsum")``, one-hot (G, S, E, C) dispatch and
combine tensors and Einsum nodes), two ONNX Runtime sessions on the CPUs, the same 8 images,
``--calls`` timed calls per round after a warm one, the two forms in a shuffled order each
round: ``sparse_tc_fused_over_einsum``, ``sparse_ec_fused_over_einsum`` (images/s fused over
einsum at batch 8), and the largest difference between the two forms' logits (the export
tolerance is 1e-4; both forms are verified against PyTorch when exported).

--smoke: tiny random models of the three routers (32x32 images, 4 experts), windows of a moment:
proves the script runs and emits every key; its figures mean nothing.
"""

from __future__ import annotations

import argparse
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

KINDS = ("soft", "tc", "ec")
SPARSE = ("tc", "ec")
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


def tiny_packages(work: Path) -> dict[str, Path]:
    """Smoke: random 2-block models of the three routers (32x32 images, patch 8, 4 experts in block 1)."""
    import torch

    from softmoe_models.config import EncoderConfig, MoEConfig, ViTConfig
    from softmoe_models.models import build_model
    from softmoe_models.package import save_package

    routing = {"soft": {}, "tc": dict(router="tokens-choice", experts_per_token=1),
               "ec": dict(router="experts-choice", capacity_rounding="round", capacity_multiple_of=1)}
    out = {}
    for kind, extra in routing.items():
        cfg = ViTConfig(EncoderConfig(64, 2, 4, 128, moe=MoEConfig(layers=(1,), num_experts=4, **extra)),
                        image_size=32, patch_size=8, num_classes=10)
        torch.manual_seed(0)
        out[kind] = save_package(build_model(cfg).eval(), cfg, work / f"tiny-{kind}",
                                 labels=[str(i) for i in range(10)], variant=f"tiny-{kind}")
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


_EINSUM_CHILD = """
import json, sys
from export.onnx import export_onnx
a = json.loads(sys.argv[1])
(f,) = export_onnx(a["package"], a["out"], sparse_dispatch="einsum", log=lambda *x: None)
print(json.dumps({"path": str(f.path), "ops": f.ops, "max_err": max(v.max_abs_err for v in f.verification)}))
"""


def export_einsum(package: Path, out: Path, child: bool) -> dict[str, Any]:
    """vmoe's einsum form of ``package``, verified; in a child interpreter (an S/16 export peaks
    at about 3x the weights) unless ``child`` is False."""
    import json

    if not child:
        from export.onnx import export_onnx

        (f,) = export_onnx(package, out, sparse_dispatch="einsum", log=lambda *x: None)
        return {"path": str(f.path), "ops": f.ops, "max_err": max(v.max_abs_err for v in f.verification)}
    r = subprocess.run([sys.executable, "-c", _EINSUM_CHILD, json.dumps({"package": str(package), "out": str(out)})],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def fused_vs_einsum(fused: Path, einsum: Path, size: int, *, rounds: int, calls: int, batch: int = 8
                    ) -> dict[str, float]:
    """Two ONNX Runtime sessions (every CPU each), the same ``batch`` images: median images/s of
    each form and the largest difference between their outputs."""
    from export.runtime import ort_session

    sessions = {"fused": ort_session(fused), "einsum": ort_session(einsum)}
    x = np.random.default_rng(0).uniform(-1, 1, (batch, 3, size, size)).astype(np.float32)
    outs = {k: s.run(["logits"], {"pixel_values": x})[0] for k, s in sessions.items()}
    diff = float(np.abs(outs["fused"].astype(np.float64) - outs["einsum"]).max())

    def rate(form: str) -> float:
        s = sessions[form]
        s.run(["logits"], {"pixel_values": x})  # warm, this shape
        t0 = time.perf_counter()
        for _ in range(calls):
            s.run(["logits"], {"pixel_values": x})
        return batch * calls / (time.perf_counter() - t0)

    res = interleave({form: (lambda f=form: rate(f)) for form in sessions}, rounds, seed=13)
    return {"fused": median(res["fused"]), "einsum": median(res["einsum"]), "diff": diff,
            "fused_windows": res["fused"], "einsum_windows": res["einsum"]}


def run(*, smoke: bool = False, rounds: int = 3, seconds: float = 8.0, c1_seconds: float = 5.0, clients: int = 32,
        tc_variant: str = "tc-s16-e128-k1", calls: int = 3, work: Path | None = None, log=print) -> dict[str, Any]:
    owned = work is None
    work = Path(tempfile.mkdtemp(prefix="softmoe-sparse-")) if work is None else work
    try:
        return _run(smoke, rounds, seconds, c1_seconds, clients, tc_variant, calls, work, log)
    finally:
        if owned:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def _run(smoke: bool, rounds: int, seconds: float, c1_seconds: float, clients: int, tc_variant: str, calls: int,
         work: Path, log) -> dict[str, Any]:
    from softmoe_models.package import read_package

    variants = {"soft": "soft-s16-e128", "tc": tc_variant, "ec": "ec-s16-e128"}
    if smoke:
        packages = tiny_packages(work)
        variants = {k: p.name for k, p in packages.items()}
    else:
        log(f"sparse: softmoe init {', '.join(variants.values())} in {work}")
        packages = {k: init_package(v, work) for k, v in variants.items()}
    size = read_package(packages["soft"]).preprocess.image_size
    cache = work / "cache"
    if smoke:  # tiny graphs: exported in this process, not in a child interpreter each
        from unittest import mock

        from server.backends import onnxruntime_backend

        with mock.patch.object(onnxruntime_backend, "EXPORT_IN_CHILD_BYTES", 1 << 62):
            plain = warm_exports(packages, cache, log)
    else:
        plain = warm_exports(packages, cache, log)
    weights = {k: weight_bytes(p) for k, p in packages.items()}
    need = sum(FOOTPRINT * w for w in weights.values()) + (2 << 30)
    free = mem_available()
    together = need < free
    log(f"serving {', '.join(variants.values())} ({size}x{size} input, defaults: auto backend, max batch 8), "
        f"{clients} clients at saturation and 1 at concurrency 1, {rounds} rounds x {seconds:g} s / {c1_seconds:g} s; "
        f"{'all servers alive together' if together else 'one server at a time'} "
        f"({need / 2**30:.1f} GiB needed for all, {free / 2**30:.1f} GiB free)")
    res = serving(packages, cache, rounds=rounds, seconds=seconds, c1_seconds=c1_seconds, clients=clients,
                  together=together, log=log)
    med = {m: {k: median(v) for k, v in res[m].items()} for m in res}
    out: dict[str, Any] = {"sparse_serving": "together" if together else "one at a time",
                           "sparse_tc_variant": variants["tc"], "sparse_rounds": rounds}
    for k in KINDS:
        out[f"sparse_{k}_img_s"] = round(med["sat"][k], 2)
        out[f"sparse_{k}_c1_p50_ms"] = round(med["c1"][k], 2)
        log(f"  {variants[k]:16} img/s {med['sat'][k]:8.2f}  windows {[round(v, 2) for v in res['sat'][k]]}   "
            f"c1 p50 ms {med['c1'][k]:8.1f}  windows {[round(v, 1) for v in res['c1'][k]]}")
    for k in SPARSE:
        out[f"sparse_{k}_over_soft_img_s"] = round(med["sat"][k] / med["sat"]["soft"], 3)
        out[f"sparse_{k}_over_soft_c1_p50"] = round(med["c1"][k] / med["c1"]["soft"], 3)
    log("  sparse over soft: " + ", ".join(
        f"{k} img/s {out[f'sparse_{k}_over_soft_img_s']:.3f}x, c1 p50 {out[f'sparse_{k}_over_soft_c1_p50']:.3f}x"
        for k in SPARSE))

    log(f"fused vs einsum sparse dispatch, ONNX Runtime alone at batch 8, {rounds} rounds x {calls} calls:")
    for k in SPARSE:
        t0 = time.perf_counter()
        einsum = export_einsum(packages[k], work / f"{k}.einsum.onnx", child=not smoke)
        log(f"  {variants[k]}: einsum form exported and verified in {time.perf_counter() - t0:.0f} s "
            f"({einsum['ops'].get('Einsum', 0)} Einsum nodes, max err vs PyTorch {einsum['max_err']:.1e})")
        r = fused_vs_einsum(plain[k], Path(einsum["path"]), size, rounds=rounds, calls=calls)
        out[f"sparse_{k}_fused_over_einsum"] = round(r["fused"] / r["einsum"], 3)
        out[f"sparse_{k}_fused_img_s"] = round(r["fused"], 2)
        out[f"sparse_{k}_einsum_img_s"] = round(r["einsum"], 2)
        out[f"sparse_{k}_forms_max_abs_diff"] = float(f"{r['diff']:.3g}")
        log(f"  {variants[k]:16} fused {r['fused']:7.2f} img/s  windows {[round(v, 2) for v in r['fused_windows']]}   "
            f"einsum {r['einsum']:7.2f} img/s  windows {[round(v, 2) for v in r['einsum_windows']]}   "
            f"fused/einsum {out[f'sparse_{k}_fused_over_einsum']:.3f}x; logits differ by at most {r['diff']:.1e}")
        Path(einsum["path"]).unlink(missing_ok=True)
        Path(einsum["path"] + ".data").unlink(missing_ok=True)
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
    parser.add_argument("--tc-variant", default="tc-s16-e128-k1", choices=("tc-s16-e128-k1", "tc-s16-e128-k2"))
    parser.add_argument("--calls", type=int, default=3, help="timed ONNX Runtime calls per round and form")
    parser.add_argument("--work", type=Path, default=None, help="where the packages and the export cache go "
                        "(kept; default: a temp dir, removed)")
    parser.add_argument("--smoke", action="store_true", help="tiny models, windows of a moment")
    args = parser.parse_args(argv)
    if args.smoke:  # the section's smoke windows, whatever else was given
        args.rounds, args.seconds, args.c1_seconds, args.calls = 1, 0.3, 0.3, 1
    result = run(smoke=args.smoke, rounds=args.rounds, seconds=args.seconds, c1_seconds=args.c1_seconds,
                 clients=args.clients, tc_variant=args.tc_variant, calls=args.calls, work=args.work,
                 log=lambda m: print(m, file=sys.stderr, flush=True))
    report(result, "loadtests.sparse_bench", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
