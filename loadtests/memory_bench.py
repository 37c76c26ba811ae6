"""Resident memory of a served model against the bytes of its weights: ``rss_over_weights``.

    python -m loadtests.memory_bench [--model soft-s16-e128] [--backend onnxruntime] [--work DIR] [--rounds 7]

The model is ``softmoe init VARIANT`` (random weights, made in ``--work``), or ``digits`` (the
shipped package). ``softmoe serve --model PKG`` runs with its defaults (and the backend given)
twice: a first start, on an empty export cache (onnxruntime exports the package and verifies it),
then a cached start on the same cache. Once a start is ready and has answered one classify
request, the resident memory (VmRSS) of every process of the server, the server and anything it
started, is summed and divided by the bytes of the package's ``*.safetensors``. One JSON line:

* ``rss_over_weights``: the larger of the two starts' ratios (the issue's bound: 1.35 for
  soft-s16-e128);
* ``rss_over_weights_first`` and ``rss_over_weights_cached``, ``rss_first_mb``, ``rss_cached_mb``,
  ``weights_mb`` and each start's seconds to ready;
* onnxruntime: what holding the weights once costs a call. The server runs the image function on
  the routing graph's session (its outputs and the routing ones); before, the plain graph had a
  session of its own. Both sessions on the exported files, every thread each, the same rows, the
  calls interleaved (``--rounds`` rounds, each call's order shuffled): ``one_session_cost_b1`` and
  ``one_session_cost_b8``, the median ms per call on the routing graph over the plain graph's.

On a tiny package (digits, 0.1 MB of weights) the ratio is the runtime's own size, not the
weights': the smoke runs it only to keep the script alive.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.procs import descendants
from loadtests.run import ServerProcess, wait_ready

ROOT = Path(__file__).resolve().parents[1]


def rss_bytes(pid: int) -> int:
    """VmRSS of ``pid`` and every process below it, in bytes (a process that is gone counts 0)."""
    total = 0
    for p in descendants(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total


def package_for(model: str, work: Path) -> Path:
    if model == "digits":
        from server.engine.defaults import SHIPPED

        return SHIPPED / "digits"
    package = work / model
    if not package.exists():
        subprocess.run([sys.executable, "-m", "softmoe_models.cli", "init", model, "--out", str(package)], check=True,
                       stdout=subprocess.DEVNULL)
    return package


def one_start(package: Path, backend: str, cache: Path, log) -> dict[str, float]:
    """Serve ``package`` with defaults on ``cache``; its summed RSS once ready and warm."""
    start = time.perf_counter()
    server = ServerProcess(f"--model {package} --backend {backend} --cache-dir {cache} --log-level info",
                           cache.parent / "server.log")
    try:
        wait_ready(server.url, 1800, server)
        ready_s = time.perf_counter() - start
        size = httpx.get(f"{server.url}/v2/models/{package.name}", timeout=30).json()["inputs"][0]["shape"]
        r = httpx.post(f"{server.url}/v2/models/{package.name}/infer", timeout=300, json={"inputs": [
            {"name": "pixel_values", "shape": [1, *size[1:]], "datatype": "FP32",
             "data": [0.0] * (size[1] * size[2] * size[3])}]})
        r.raise_for_status()
        time.sleep(1.0)  # let the allocator settle after the first request
        rss = rss_bytes(server.proc.pid)
        served = next((line.split(" softmoe.server: ", 1)[-1] for line in server.tail(200).splitlines()
                       if f" {package.name}: " in line), "")
    finally:
        server.stop()
    log(f"  {backend}: {rss / 2**20:,.0f} MB resident once ready ({ready_s:.0f} s to ready); {served}")
    return {"rss": rss, "ready_s": ready_s}


def one_session_cost(package: Path, cache: Path, rounds: int, log) -> dict[str, float]:
    """ms per call on the routing graph's session (the plain outputs taken) over the plain graph's
    own session, at batch 1 and 8, from the export ``cache`` a start left."""
    import random
    import statistics

    import numpy as np

    from export.runtime import ort_session
    from server.backends.onnxruntime_backend import exported_files, routing_sibling
    from softmoe_models.routing import OUTPUTS

    files = exported_files(package, str(cache), "fp32", log=lambda m: None)
    plain_file = next(f for f in files if routing_sibling(f) is not None)
    weights = package / "model.safetensors"  # what the cached graphs read their weights from
    sessions = {"plain": ort_session(plain_file, providers=["CPUExecutionProvider"], spin="run", weights=weights),
                "routing": ort_session(routing_sibling(plain_file), providers=["CPUExecutionProvider"], spin="run",
                                       weights=weights)}
    inp = sessions["plain"].get_inputs()[0]
    names = [o.name for o in sessions["routing"].get_outputs() if o.name not in OUTPUTS]
    rng, order = np.random.default_rng(0), random.Random(0)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        calls = [(k, b) for k in sessions for b in (1, 8)]
        order.shuffle(calls)
        for which, batch in calls:
            x = rng.uniform(-1, 1, (batch, *inp.shape[1:])).astype(np.float32)
            sessions[which].run(names, {inp.name: x})  # the same shape just before: warm
            t0 = time.perf_counter()
            sessions[which].run(names, {inp.name: x})
            times.setdefault((which, batch), []).append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {f"one_session_cost_b{b}": round(med[("routing", b)] / med[("plain", b)], 3) for b in (1, 8)}
    log("  one session: " + ", ".join(f"batch {b} {med[('routing', b)]:.1f} vs {med[('plain', b)]:.1f} ms "
                                      f"(routing graph vs plain graph: {out[f'one_session_cost_b{b}']:.3f}x)"
                                      for b in (1, 8)))
    return out


def run(model: str = "soft-s16-e128", backend: str = "onnxruntime", work: Path | None = None, rounds: int = 5,
        log=print) -> dict[str, Any]:
    owned = work is None
    work = Path(tempfile.mkdtemp(prefix="softmoe-memory-")) if work is None else work
    try:
        package = package_for(model, work)
        weights = sum(f.stat().st_size for f in package.glob("*.safetensors"))
        cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work)) / "cache"
        log(f"memory ({model}, {weights / 2**20:,.0f} MB of weights, --backend {backend}): a first start, then a "
            "cached one")
        first = one_start(package, backend, cache, log)
        cached = one_start(package, backend, cache, log)
        cost = one_session_cost(package, cache, rounds, log) if backend == "onnxruntime" else {}
        shutil.rmtree(cache.parent, ignore_errors=True)
    finally:
        if owned:
            shutil.rmtree(work, ignore_errors=True)
    out = {"memory_model": model, "memory_backend": backend, "weights_mb": round(weights / 2**20, 1),
           "rss_first_mb": round(first["rss"] / 2**20, 1), "rss_cached_mb": round(cached["rss"] / 2**20, 1),
           "rss_over_weights_first": round(first["rss"] / weights, 3),
           "rss_over_weights_cached": round(cached["rss"] / weights, 3),
           "memory_first_ready_s": round(first["ready_s"], 1), "memory_cached_ready_s": round(cached["ready_s"], 1)}
    out["rss_over_weights"] = max(out["rss_over_weights_first"], out["rss_over_weights_cached"])
    return {**out, **cost}


def section(mode: str, workdir: Path) -> dict[str, Any]:
    """`make bench`'s memory section: soft-s16-e128 (reusing the serving section's package), or
    digits in --smoke."""
    model, rounds = {"full": ("soft-s16-e128", 7), "quick": ("soft-s16-e128", 3), "smoke": ("digits", 1)}[mode]
    print()
    return run(model, "onnxruntime", workdir, rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="soft-s16-e128", help="a variant (random weights) or 'digits'")
    parser.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "torch"))
    parser.add_argument("--work", type=Path, default=None, help="where the package is made (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the one-session cost (onnxruntime)")
    args = parser.parse_args(argv)
    result = run(args.model, args.backend, args.work, args.rounds, log=lambda m: print(m, file=sys.stderr, flush=True))
    result["command"] = "python -m loadtests.memory_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
