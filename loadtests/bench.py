"""`make bench`: every performance claim as a ratio measured side by side in one run.

    python -m loadtests.bench [--quick | --smoke] [--skip LIST] [--peers-python PY] [--peers-model NAME]
        [--peers-ours-variant loose|concurrent2|spinoff] [--peers-session ort-defaults|softmoe]
        [--peers-rounds N] [--peers-seconds S]

Sections, in the order they run (each prints its table; the last line of the run is one JSON
object with every ratio):
  decode     decode+preprocess of 640x480 JPEGs to 224x224 with and without JPEG draft mode.
  zeroshot   /v1/zero-shot on the default digits-lit model with the label-embedding cache vs without.
  serving    A paper-shaped Soft MoE (soft-s16-e128, 224x224, 922M params) behind `softmoe serve`
             (its default backend), in pairs of servers alive together (two fit in memory): dynamic
             batching vs max batch size 1; end-to-end /v1/classify with real 640x480 JPEGs vs the
             raw backend at the same batch; strict determinism (smallest proven padded shape) vs
             loose at saturation and at concurrency 1; strict with full padding vs loose at
             concurrency 1.
  frontend   The server's own cost: the whole front end with a backend that does no model work
             (loadtests/noop_server.py), requests/s and images/s per process and per CPU-second,
             1 process vs N independent processes (N = the CPUs, at least 2); frontend_scaling
             counts N only up to the cores (frontend_room: where one process keeps more than
             cores / N busy, fewer fit).
  peers      The same exported ONNX graph with the same batching limits, decode and threads behind
             `softmoe serve --backend onnxruntime` (and a second ours: --no-strict-determinism, or
             another --peers-ours-variant), LitServe and Ray Serve (loadtests/peers/; the section is
             loadtests/peers_bench.py): throughput at saturation, p50/p99 at concurrency 1 and
             CPU-ms per request at saturation (every process of a server), as ratios to ours, and
             round by round: ours ahead or behind a peer only where a sign test over the rounds
             says so (p < 0.05; 8 rounds by default, --peers-rounds), else a tie (the verdict
             keys). A peer whose package does not import under --peers-python is skipped
             (its keys are absent). Servers start one at a time; one whose expected footprint
             does not fit the memory left is not started (peers_skipped_memory names it). In
             each window the other servers are frozen (SIGSTOP): idle LitServe polls its queues
             and Ray heartbeats, which took CPU from whichever server was measured.
  decode_nice  `--decode-nice 10` vs 0 on digits (loadtests/decode_nice_bench.py; a heavy model:
             its --package DIR): images/s at saturation and p50 at concurrency 1.
  protocol   The HTTP protocol's own CPU per request, bounded request heads (server.http.connection) vs
             uvicorn's httptools, without network or model (loadtests/protocol_cost.py).
  grpc       OIP v2 over gRPC (tritonclient.grpc, raw tensors) vs over HTTP with JSON data and with
             binary tensors (tritonclient.http), one server, the same held-out digits one and eight
             rows per request, 8 client threads, the three transports in shuffled windows each round;
             every answer bitwise the same on every transport, else the section fails
             (loadtests/grpc_bench.py).
  oip_encode The OIP answer's encoding (the postprocess stage, server.api.oip_codec) per request on
             digits, HTTP JSON, HTTP binary and gRPC answers of 1 and 32 rows, from the server's
             stage histogram, with the client's round trip (loadtests/oip_encode_bench.py).
  attack     Legitimate requests/s with and without 200 slow clients (trickled bodies and heads, idle
             connections) reconnecting as soon as they are cut off (loadtests/attack_bench.py).
  concurrent `--concurrent-batches 2` vs 1 on soft-s16-e128 at max batch 8: throughput at saturation
             and p50 at concurrency 1 (loadtests/concurrent_bench.py).
  spinning   `--ort-spinning run` (the default) vs off on soft-s16-e128 at max batch 8: the backend
             alone at batch 1 and 8, then serving at saturation and at concurrency 1
             (loadtests/spin_bench.py).
  memory     Resident memory of every server process over the weights' bytes, soft-s16-e128 with
             defaults, a first start (exporting) and a cached one (loadtests/memory_bench.py).
  sparse     Sparse V-MoE beside Soft MoE at the same size: soft-s16-e128 vs tc-s16-e128-k1 and -k2
             (Tokens Choice K=1, K=2) and ec-s16-e128 (Experts Choice), each at capacity factors 4.0
             and 1.05, behind `softmoe serve` with defaults, images/s at saturation and p50 at
             concurrency 1 as sparse over soft (every server alive together where the memory holds
             them, else one at a time); the expert rows each computes per image and MoE block; then
             Tokens Choice's routed form vs its capacity form, ONNX Runtime alone at batch 8 and 1
             (loadtests/sparse_bench.py).
  embed      `softmoe embed` over 640x480 JPEGs vs the raw backend on the same model, soft-s16-e128 with
             defaults: images/s of the whole job (read, decode in its process pool, batcher, Parquet)
             over the backend alone at a full batch (loadtests/embed_bench.py).
  swap       soft-s16-e128 in a model repository, served at 70% of its saturated throughput while it is
             reloaded 3 times (POST /v2/repository/models/a/load): non-200 answers, p99 while a reload
             runs over p99 steady; then a second copy loaded and unloaded: resident memory after over
             before, as growth in weight bytes (loadtests/swap_bench.py).
  coldstart  soft-s16-e128: a fresh server to ready with nothing cached, `softmoe prepare`, a fresh server
             on the prepared cache (over the seconds to read its weights once), a package of other weights
             loaded into a server idle and under 8 clients, package + cache bytes over the weights; digits'
             other-weights load under 8 clients (loadtests/coldstart_bench.py).
  layers     Soft MoE S/16 layer stacks (3 blocks; batch 1/8/32): reference einsum vs fused, PyTorch
             eager vs ONNX Runtime (export.bench; B/16: python -m export.bench --layers 1 --width B).
  gpu        Soft MoE B/16 vs ViT-B/16 on CUDA (only where a GPU is present; this CI has none).

--quick: fewer rounds and sizes. --smoke: every section on tiny models (the shipped digits
packages, a tiny Soft MoE stack, the no-op front end) with windows of a fraction of a second:
proves the bench runs and emits every key (tests/loadtests/test_bench_smoke.py); its figures
mean nothing.

Method: the alternatives run in alternating windows (shuffled each round) on one machine in one
run; throughput is a closed loop of concurrent clients; the figure is the median over windows.
Servers are separate processes on loopback; the load generator is this process, a minimal
HTTP/1.1 keep-alive client (the same bytes to every server), so it costs the servers little CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from loadtests.harness import (ERRORS, Child, Load, b64, interleave, jpeg, jpeg_request, json_request,
                               load, median, pick, proven_line, rounded, serve_many)
from loadtests.raw_backend import RawBackend, warm_cache
from loadtests.run import ServerProcess, free_port, wait_ready

# ------------------------------------------------------------------ sections


def section_decode(mode: str) -> dict[str, float]:
    """JPEG draft mode (opt-in per model, ``--jpeg-draft NAME``): its decode speed-up on 640x480
    JPEGs to 224x224, and its accuracy cost on the digits model's held-out images served as
    640x480 JPEGs (top-1 accuracy with and without it, agreement, largest pixel difference)."""
    from server.pipeline.decode import decode
    from softmoe_models.preprocess import PreprocessConfig, preprocess_image

    cfg = PreprocessConfig(image_size=224)
    images = [jpeg(640, 480, i) for i in range(pick(mode, 32, 32, 4))]

    def rate(draft: bool) -> float:
        t0 = time.perf_counter()
        for data in images:
            preprocess_image(decode(data, cfg.image_size, draft=draft), cfg)
        return len(images) / (time.perf_counter() - t0)

    res = interleave({"draft": lambda: rate(True), "full": lambda: rate(False)}, pick(mode, 11, 5, 1))
    med = {k: median(v) for k, v in res.items()}
    print(f"\ndecode+preprocess 640x480 JPEG -> 224x224, img/s (one thread): draft {med['draft']:.0f}, full {med['full']:.0f}")
    from loadtests.decode_cost import draft_accuracy_cost

    cost = draft_accuracy_cost(pick(mode, None, None, 24))
    print(f"draft mode on {cost['n']} held-out digits as 640x480 JPEGs: top-1 {cost['acc_alt']:.4f} (draft) vs "
          f"{cost['acc_full']:.4f} (full decode), agreement {cost['agree']:.4f}, max |pixel diff| {cost['max_px']:.3f}")
    return {"draft_decode_speedup": round(med["draft"] / med["full"], 3),
            "img_per_s_decode_draft": round(med["draft"], 1), "img_per_s_decode_full": round(med["full"], 1),
            "draft_top1_full": round(cost["acc_full"], 4), "draft_top1_draft": round(cost["acc_alt"], 4),
            "draft_top1_agreement": round(cost["agree"], 4), "draft_max_pixel_diff": round(cost["max_px"], 4)}


def section_zeroshot(mode: str) -> dict[str, float]:
    from sklearn.datasets import load_digits

    from softmoe_models.demo.data import WORDS, digit_png

    blobs = [digit_png(v) for v in load_digits().data[:64]]
    requests = [(json_request("/v1/zero-shot", {"model": "digits-lit", "images": [b64(b)], "labels": WORDS}), 1)
                for b in blobs]
    servers = serve_many({"cache": [], "no_cache": ["--label-cache-size", "0"]})
    try:
        window = pick(mode, 3.0, 2.0, 0.3)
        res = interleave({n: (lambda s=s: load([s.port], requests, window, 4, label="zero-shot").rps)
                          for n, s in servers.items()}, pick(mode, 3, 2, 1))
        med = {k: median(v) for k, v in res.items()}
        print(f"\nzero-shot digits-lit, 10 labels x 4 prompts, req/s: cache {med['cache']:.1f}, no cache {med['no_cache']:.1f}")
        return {"zero_shot_cache_speedup": round(med["cache"] / med["no_cache"], 3),
                "req_per_s_zero_shot_cache": round(med["cache"], 1), "req_per_s_zero_shot_no_cache": round(med["no_cache"], 1)}
    finally:
        for s in servers.values():
            s.stop()


@contextlib.contextmanager
def _tiny_stacks():
    """export.bench's stack shrunk to a smoke size: d=32, 2 heads, 8 experts of width 64, 16 tokens."""
    from unittest import mock

    import export.bench as layer_bench

    with mock.patch.object(layer_bench, "EXPERTS", 8), mock.patch.object(layer_bench, "TOKENS", 16), \
            mock.patch.dict(layer_bench.WIDTHS, {"T": (32, 2, 64)}):
        yield


def section_layers(mode: str) -> dict[str, float]:
    from export.bench import run

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="softmoe-bench-") as tmp:
        if mode == "smoke":
            with _tiny_stacks():
                out.update(run(1, [1, 8], 1, Path(tmp), "T"))
            return out
        # S/16 only: B/16 (python -m export.bench --layers 1 --width B) adds minutes of export.
        out.update(run(3, [1, 8] if mode == "quick" else [1, 8, 32], 5 if mode == "quick" else 6, Path(tmp), "S"))
    return out


def section_serving(mode: str, workdir: Path) -> dict[str, float]:
    """Four comparisons, each between two servers alive together (a third soft-s16-e128 server
    does not fit in memory beside the raw backend): strict vs max batch 1; end to end vs the raw
    backend; strict vs loose at saturation and at concurrency 1; strict with full padding vs loose
    at concurrency 1."""
    from server.engine.defaults import SHIPPED
    from server.settings import Settings
    from softmoe_models.package import read_package

    if mode == "smoke":
        name, pkg = "digits", SHIPPED / "digits"
    else:
        name, pkg = "soft-s16-e128", workdir / "soft-s16-e128"
        subprocess.run([sys.executable, "-m", "softmoe_models.cli", "init", "soft-s16-e128", "--out", str(pkg)],
                       check=True, stdout=subprocess.DEVNULL)
    size = read_package(pkg).preprocess.image_size
    n_images = pick(mode, 64, 64, 8)
    small = [(jpeg_request("/v1/classify", jpeg(224, 224, i)), 1) for i in range(n_images)]
    large = [(jpeg_request("/v1/classify", jpeg(640, 480, i)), 1) for i in range(n_images)]
    # The Soft MoE layers stream their expert weights: per-image cost keeps falling past 8.
    batch = pick(mode, 32, 32, 8)
    window, rounds, conc = pick(mode, (8.0, 3, 64), (6.0, 2, 64), (0.3, 1, 16))  # 2x the batch: always a full one queued
    c1_window, c1_rounds, c1_min = pick(mode, (5.0, 3, 3), (4.0, 2, 2), (0.3, 1, 1))
    delay = pick(mode, "100", "100", "5")  # ~4% of a full soft-s16-e128 call: lets a batch refill
    parallel = mode == "smoke"
    common = ["--model", f"{name}={pkg}", "--max-delay-ms", delay]
    full = [*common, "--max-batch-size", str(batch)]
    servers: dict[str, ServerProcess] = {}

    def sat(n: str, requests=small) -> Callable[[], float]:
        return lambda: load([servers[n].port], requests, window, conc, label="serving").items_per_s

    def c1(n: str) -> Callable[[], float]:
        return lambda: load([servers[n].port], small, c1_window, 1, min_requests=c1_min, label="serving").ms(50)

    def show(title: str, res: dict[str, list[float]], unit: str, digits: int = 2) -> dict[str, float]:
        med = {k: median(v) for k, v in res.items()}
        print(f"\n{title}, {unit}, median of windows:")
        for k, v in res.items():
            print(f"  {k:28} {med[k]:8.{digits}f}   windows {rounded(v, digits)}")
        return med

    settings = Settings(max_batch_size=batch)  # what the servers below resolve their defaults to
    head = f"serving {name} ({size}x{size} input, {settings.backend} backend, max batch {batch}, max delay {delay} ms)"
    if mode != "smoke":
        warm_cache(f"{name}={pkg}", max_batch_size=batch)
    try:
        servers.update(serve_many({"dynamic_strict": [*full, "--log-level", "info"],  # info: its proven shapes are logged
                                   # one image per call, one call at a time: what batching is measured against
                                   "b1": [*common, "--max-batch-size", "1", "--concurrent-batches", "1"]}, parallel))
        med = show(f"{head}: dynamic batching vs max batch 1, strict determinism, 224x224 JPEGs, {conc} clients",
                   interleave({"dynamic_strict": sat("dynamic_strict"), "b1": sat("b1")}, rounds), "img/s")
        out: dict[str, float] = {
            "batching_vs_b1": round(med["dynamic_strict"] / med["b1"], 3),
            "img_per_s_dynamic": round(med["dynamic_strict"], 2),
            "img_per_s_b1": round(med["b1"], 2),
            "serving_max_batch": batch,
        }
        servers.pop("b1").stop()

        raw = RawBackend(f"{name}={pkg}", batch, size, max_batch_size=batch)
        try:
            med = show(f"{head}: end to end (640x480 JPEGs, strict) vs the raw backend at batch {batch}, "
                       f"{raw.callers} call(s) at once as the server runs full batches",
                       interleave({"raw_backend": lambda: raw.window(window), "e2e_classify_640x480_jpeg":
                                   sat("dynamic_strict", large)}, rounds, seed=1), "img/s")
        finally:
            raw.close()
        ratio = round(med["e2e_classify_640x480_jpeg"] / med["raw_backend"], 3)
        out["e2e_vs_raw"] = out["e2e_over_raw"] = ratio
        out["img_per_s_raw"] = round(med["raw_backend"], 2)
        out["img_per_s_e2e_640x480"] = round(med["e2e_classify_640x480_jpeg"], 2)

        servers.update(serve_many({"dynamic_loose": [*full, "--no-strict-determinism"]}, parallel))
        res = interleave({"strict_saturation": sat("dynamic_strict"), "loose_saturation": sat("dynamic_loose"),
                          "strict_c1_p50_ms": c1("dynamic_strict"), "loose_c1_p50_ms": c1("dynamic_loose")}, rounds, seed=2)
        proven = proven_line(servers["dynamic_strict"])
        med = show(f"{head}: strict determinism vs loose; saturation ({conc} clients, img/s) and concurrency 1 "
                   f"(one client, p50 ms); strict: {proven}", res, "img/s | ms")
        out.update({
            "strict_determinism_cost": round(1 - med["strict_saturation"] / med["loose_saturation"], 3),
            "strict_saturation_ratio": round(med["strict_saturation"] / med["loose_saturation"], 3),
            "img_per_s_loose": round(med["loose_saturation"], 2),
            "strict_c1_p50_ratio": round(med["strict_c1_p50_ms"] / med["loose_c1_p50_ms"], 3),
            "c1_p50_ms_strict": round(med["strict_c1_p50_ms"], 2),
            "c1_p50_ms_loose": round(med["loose_c1_p50_ms"], 2),
        })
        servers.pop("dynamic_strict").stop()

        servers.update(serve_many({"strict_fullpad": [*full, "--no-proven-shapes"]}, parallel))
        med = show(f"{head}: strict with full padding (--no-proven-shapes) vs loose at concurrency 1",
                   interleave({"strict_fullpad": c1("strict_fullpad"), "dynamic_loose": c1("dynamic_loose")}, c1_rounds,
                              seed=3), "p50 ms", 1)
        out["strict_fullpad_c1_p50_ratio"] = round(med["strict_fullpad"] / med["dynamic_loose"], 3)
        out["c1_p50_ms_strict_fullpad"] = round(med["strict_fullpad"], 2)
        return out
    finally:
        for s in servers.values():
            s.stop()


def section_frontend(mode: str) -> dict[str, float]:
    cores = len(os.sched_getaffinity(0))
    n = max(2, cores)
    ports = [free_port() for _ in range(n)]
    servers = [Child([sys.executable, "-m", "loadtests.noop_server", "--port", str(p)], p) for p in ports]
    try:
        for s in servers:
            wait_ready(s.url, 120, s)
        photos = [jpeg(224, 224, i) for i in range(8)]
        one = [(jpeg_request("/v1/classify", p), 1) for p in photos]
        eight = [(json_request("/v1/classify", {"images": [b64(p) for p in photos]}), len(photos))]
        window, rounds, conc = pick(mode, (5.0, 3, 32), (3.0, 2, 32), (0.3, 1, 8))
        configs = {(k, kind): (ports[:k], [s.proc.pid for s in servers[:k]], reqs)
                   for k in (1, n) for kind, reqs in (("1img", one), ("8img", eight))}
        res = interleave({key: (lambda c=c: load(c[0], c[2], window, conc, pids=c[1], label="frontend"))
                          for key, c in configs.items()}, rounds, seed=3)

        def med(key, f) -> float:
            return median([f(w) for w in res[key]])

        def per_cpu(key, f) -> float:
            return med(key, lambda w: f(w) * w.seconds / w.server_cpu if w.server_cpu else float("nan"))

        print(f"\nfront end alone (loadtests/noop_server.py: `softmoe serve`'s app, a backend that returns zeros at "
              f"once; 224x224 JPEGs; {conc} clients), median of windows. N processes = N independent servers, "
              "one port each, the client's connections spread round-robin over them, each with its own no-op "
              "engine; a front end of several processes feeding ONE engine through shared memory is not what "
              f"this measures. The client shares the machine's {cores} CPUs.")
        print(f"  {'processes':>9} {'request':>8} {'req/s':>8} {'img/s':>8} {'per server CPU-s':>17} "
              f"{'server CPUs busy':>16} {'client CPUs busy':>16}")
        for (k, kind) in configs:
            busy = med((k, kind), lambda w: (w.server_cpu or float("nan")) / w.seconds)
            client = med((k, kind), lambda w: w.client_cpu / w.seconds)
            print(f"  {k:>9} {kind:>8} {med((k, kind), Load.rps.fget):8.1f} {med((k, kind), Load.items_per_s.fget):8.1f} "
                  f"{per_cpu((k, kind), Load.items_per_s.fget):17.1f} {busy:16.2f} {client:16.2f}")
        rps1, rpsn = med((1, "1img"), Load.rps.fget), med((n, "1img"), Load.rps.fget)
        img1, imgn = med((1, "8img"), Load.items_per_s.fget), med((n, "8img"), Load.items_per_s.fget)

        def room(kind: str) -> float:
            """How many one-process servers the cores can run at their measured load: N, or fewer
            where one process already keeps more than cores / N busy (its decode threads run
            beside its event loop); the cores are those the client leaves with N processes."""
            busy1 = med((1, kind), lambda w: (w.server_cpu or float("nan")) / w.seconds)
            free = cores - med((n, kind), lambda w: w.client_cpu / w.seconds)
            return min(n, free / busy1) if busy1 > 0 else float(n)

        rooms = {kind: room(kind) for kind in ("1img", "8img")}
        print(f"  scaling = N processes' req/s over one's x min(N, the cores the client leaves / the CPUs one "
              f"process keeps busy): {rpsn / (rooms['1img'] * rps1):.2f} (one image per request; that min: "
              f"{rooms['1img']:.2f}), {imgn / (rooms['8img'] * img1):.2f} (eight; {rooms['8img']:.2f}); "
              f"over one's x N: {rpsn / (n * rps1):.2f} and {imgn / (n * img1):.2f}")
        return {
            "frontend_rps_1": round(rps1, 1),
            "frontend_rps_n": round(rpsn, 1),
            "frontend_processes": n,
            "frontend_rps_per_core": round(per_cpu((1, "1img"), Load.rps.fget), 1),
            "frontend_scaling": round(rpsn / (rooms["1img"] * rps1), 3),
            "frontend_scaling_per_process": round(rpsn / (n * rps1), 3),
            "frontend_room": round(rooms["1img"], 2),
            "frontend_img_per_s_1": round(img1, 1),
            "frontend_img_per_s_n": round(imgn, 1),
            "frontend_img_per_s_per_core": round(per_cpu((1, "8img"), Load.items_per_s.fget), 1),
            "frontend_img_scaling": round(imgn / (rooms["8img"] * img1), 3),
            "frontend_img_scaling_per_process": round(imgn / (n * img1), 3),
        }
    finally:
        for s in servers:
            s.stop()


def section_routing(mode: str) -> dict[str, float]:
    """Serving with routing statistics on (sampled, the default) vs off, and on every call
    (loadtests.routing_bench: separate servers, interleaved windows)."""
    from loadtests import routing_bench

    r = routing_bench.section(mode)
    if r.get("errors"):
        ERRORS["routing"] = ERRORS.get("routing", 0) + int(r["errors"])
    return {"routing_stats_on_vs_off": r["ratio_default_vs_off"],
            "routing_stats_on_vs_off_paired": r["paired_ratio_default_vs_off"],
            "routing_stats_every_call_vs_off": r["ratio_every_call_vs_off"]}


def section_gpu(mode: str) -> dict[str, float | str]:
    import torch

    if not torch.cuda.is_available():
        print("\ngpu: no CUDA device on this machine; GPU ratios not measured")
        return {"gpu": "not available"}
    if mode == "smoke":
        print("\ngpu: skipped in --smoke (run `make gpu-check` or the bench without --smoke)")
        return {"gpu": "skipped (--smoke)"}
    from loadtests.gpu_bench import run as gpu_run  # pragma: no cover - GPU machines only

    return gpu_run(quick=mode == "quick", budget_s=150.0 if mode == "quick" else 300.0)


GOALS = {  # key: (comparison, target); the last four are issue 14's
    "fused_vs_reference_ort_b8": (">=", 2.0),
    "batching_vs_b1": (">=", 3.0),
    "strict_determinism_cost": ("<=", 0.15),
    "routing_stats_on_vs_off": (">=", 0.98),
    "strict_c1_p50_ratio": ("<=", 1.2),
    "strict_saturation_ratio": (">=", 0.95),
    "e2e_over_raw": (">=", 0.95),
    "frontend_scaling": (">=", 0.8),
    "rss_over_weights": ("<=", 1.35),
    "embed_over_raw": (">=", 0.9),
    "sparse_tc_over_soft_img_s": (">=", 0.85),  # issue 39: Tokens Choice K=1 at cf 4.0 beside Soft MoE
    "sparse_tc_over_soft_c1_p50": ("<=", 1.2),
    "sparse_tc_rows_per_image": ("<=", 1.1 * 196),
    "sparse_ec_over_soft_img_s": (">=", 0.45),
    "swap_failures": ("<=", 0),
    "swap_p99_over_steady": ("<=", 2.0),
    "swap_rss_growth_over_weights": ("<=", 0.25),
    "tracing_overhead": (">=", 0.97),  # issue 38: --otlp-endpoint at 10% sampling over off, digits
    "coldstart_prepared_s": ("<=", 10.0),  # issue 43: soft-s16-e128 from a prepared cache
    "coldstart_prepared_over_read": ("<=", 3.0),
    "coldstart_first_s": ("<=", 120.0),
    "reload_new_weights_s": ("<=", 20.0),
    "reload_new_weights_loaded_s": ("<=", 60.0),
    "reload_new_weights_failures": ("<=", 0),
    "reload_new_weights_digits_s": ("<=", 2.0),
    "disk_over_weights": ("<=", 1.1),
}
SECTIONS = ("decode", "zeroshot", "serving", "frontend", "routing", "peers", "invariance", "decode_nice", "protocol",
            "grpc", "oip_encode", "attack", "concurrent", "spinning", "memory", "sparse", "embed", "swap", "tracing", "coldstart", "layers", "gpu")


def _positive(kind):
    """An argparse type: a number of ``kind`` above zero."""
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def main(argv: list[str] | None = None) -> None:
    from loadtests import (attack_bench, coldstart_bench, concurrent_bench, decode_nice_bench, embed_bench, grpc_bench,
                           invariance_bench, memory_bench, oip_encode_bench, peers_bench, protocol_cost, sparse_bench,
                           spin_bench, swap_bench, tracing_bench)
    from loadtests.peers.common import SESSIONS

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description="softmoe-serve benchmarks (ratios measured side by side)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer rounds and sizes (not for README figures)")
    size.add_argument("--smoke", action="store_true", help="every section on tiny models for a moment: checks the "
                      "bench runs and prints every key (CI); the figures mean nothing")
    parser.add_argument("--skip", default="", help=f"comma list of sections to skip: {','.join(SECTIONS)}")
    parser.add_argument("--peers-python", default=os.environ.get("SOFTMOE_PEERS_PYTHON", sys.executable),
                        help="interpreter that runs the peer servers (needs litserve / ray[serve] besides this "
                        "project; default: $SOFTMOE_PEERS_PYTHON, else this one)")
    parser.add_argument("--peers-model", default="digits", help="model of the peers section: digits (the shipped "
                        "package) or a variant to `softmoe init`, e.g. vit-s16")
    parser.add_argument("--peers-ours-variant", default="loose", choices=sorted(peers_bench.OURS_VARIANTS),
                        help="our second server in the peers section: loose (--no-strict-determinism) or concurrent2 "
                        "(--concurrent-batches 2) or spinoff (--ort-spinning off)")
    parser.add_argument("--peers-rounds", type=_positive(int), default=None, help="interleaved rounds of the peers section "
                        "(default 8, where one disturbed round still leaves a verdict: 7 of 8; 5 is the fewest "
                        "that can give one)")
    parser.add_argument("--peers-seconds", type=_positive(float), default=None, help="each window of the peers section (default 5)")
    parser.add_argument("--peers-session", default="ort-defaults", choices=SESSIONS,
                        help="the peers' ONNX Runtime session: ort-defaults (what their users write: only the thread "
                        "count set) or softmoe (the session `softmoe serve` builds: only the front ends differ)")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if skip - set(SECTIONS):
        parser.error(f"--skip: unknown section(s) {sorted(skip - set(SECTIONS))}; known: {','.join(SECTIONS)}")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    from export.bench import machine

    t0 = time.perf_counter()
    print(f"machine: {machine()}")
    results: dict[str, float | str] = {"mode": mode}
    with tempfile.TemporaryDirectory(prefix="softmoe-bench-") as tmp:
        sections = {  # layers after the servers: its stacks leave the process ~8 GB larger
            "decode": lambda: section_decode(mode),
            "zeroshot": lambda: section_zeroshot(mode),
            "serving": lambda: section_serving(mode, Path(tmp)),
            "frontend": lambda: section_frontend(mode),
            "routing": lambda: section_routing(mode),
            "peers": lambda: peers_bench.section(mode, Path(tmp), args.peers_python, args.peers_model,
                                                 args.peers_ours_variant, args.peers_session, args.peers_rounds,
                                                 args.peers_seconds),
            "invariance": lambda: invariance_bench.section(mode),
            "decode_nice": lambda: decode_nice_bench.section(mode),
            "protocol": lambda: protocol_cost.section(mode),
            "grpc": lambda: grpc_bench.section(mode),
            "oip_encode": lambda: oip_encode_bench.section(mode),
            "attack": lambda: attack_bench.section(mode),
            "concurrent": lambda: concurrent_bench.section(mode, Path(tmp)),
            "spinning": lambda: spin_bench.section(mode, Path(tmp)),
            "memory": lambda: memory_bench.section(mode, Path(tmp)),
            "sparse": lambda: sparse_bench.section(mode, Path(tmp)),
            "embed": lambda: embed_bench.section(mode, Path(tmp)),
            "swap": lambda: swap_bench.section(mode, Path(tmp)),
            "tracing": lambda: tracing_bench.section(mode),
            "coldstart": lambda: coldstart_bench.section(mode, Path(tmp)),
            "layers": lambda: section_layers(mode),
            "gpu": lambda: section_gpu(mode),
        }
        for name, run in sections.items():
            if name not in skip:
                s0 = time.perf_counter()
                results.update(run())
                print(f"[{name}: {time.perf_counter() - s0:.1f}s]", flush=True)
    print("\ngoals:" + (" not judged in --smoke (tiny models, windows of a moment)" if mode == "smoke" else ""))
    for key, (op, target) in GOALS.items():
        if key in results and mode != "smoke":
            v = results[key]
            ok = v >= target if op == ">=" else v <= target
            print(f"  {key:28} {v:8.3f}  goal {op} {target}  {'met' if ok else 'MISSED'}")
    for key, v in results.items():  # issue 14: ahead of each peer, by a sign test over the rounds
        if key.startswith("peer_") and key.endswith("_verdict") and mode != "smoke":
            print(f"  {key:28} {v:>8}  goal ahead  {'met' if v == 'ahead' else 'MISSED'} ({results['peers_model']})")
    results["errors"] = sum(ERRORS.values())
    if ERRORS:
        print(f"  non-200 responses during measurement: {ERRORS}")
    results["seconds"] = round(time.perf_counter() - t0, 1)
    results["command"] = " ".join(["python -m loadtests.bench", *map(shlex.quote, argv)])
    print(json.dumps(results))


if __name__ == "__main__":
    main()
