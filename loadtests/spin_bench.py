"""What `--ort-spinning run` (the default) does against `off`: ONNX Runtime's intra-op threads
spinning between the parallel steps of a batch and sleeping after it, or sleeping whenever they
wait.

    python -m loadtests.spin_bench [--package DIR] [--rounds 4] [--seconds 8] [--clients 32]
        [--max-batch-size 8]

Two measurements, each side by side in one run:

- the backend alone: two sessions on the same exported graph in one child process (the server's
  ``export.runtime.ort_session``, the CPUs available as threads), called in alternation at batch 1
  and at ``--max-batch-size`` on the same random pixels; their outputs are compared bit for bit.
  The child exits before the servers start, so its weights are gone (a heavy model's two
  sessions and two servers would not fit in memory together);
- serving: two `softmoe serve --backend onnxruntime` servers alive together, the same package,
  the same 640x480 JPEGs posted to /v1/classify, images/s at saturation (a closed loop of
  ``--clients``) and p50 at concurrency 1, in interleaved windows.

Printed, as one JSON line: ``spin_backend_b1_speedup`` and ``spin_backend_bmax_speedup`` (ms per
call with off over run: above 1, spinning is faster), ``spin_saturation_ratio`` (images/s with run
over off) and ``spin_c1_p50_ratio`` (p50 with run over off: below 1, spinning is faster), the
medians, ``spin_outputs_bitwise_equal``, and ``errors``. A Soft MoE layer exported per expert is
hundreds of small MatMuls per batch, each a parallel step whose worker would otherwise be woken
from sleep: it pays most for a lone request on a heavy model (`softmoe init soft-s16-e128 --out DIR`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.harness import ab_parser, b64, heavy_package, jpeg, json_request, median, report, saturation_and_c1


def backend_alone(package: Path, *, batches: tuple[int, ...], rounds: int, log=print) -> dict[str, Any]:
    """Median ms per call of the two spin policies' sessions, alternating, at each batch size."""
    from export.onnx import read_metadata
    from export.runtime import ort_session
    from server.backends.onnxruntime_backend import exported_files

    files = exported_files(package, "", "fp32", log=lambda m: None)  # the cache `softmoe serve` reuses
    onnx, meta = next((f, m) for f in files if (m := read_metadata(f)).get("graph") == "classifier")
    sessions = {spin: ort_session(onnx, spin=spin, weights=package / "model.safetensors") for spin in ("off", "run")}
    name = sessions["off"].get_inputs()[0].name
    size = meta["preprocess"]["image_size"]
    rng = np.random.default_rng(3)
    out: dict[str, Any] = {}
    equal = True
    for batch in batches:
        x = rng.standard_normal((batch, 3, size, size)).astype(np.float32)
        results = {spin: s.run(None, {name: x}) for spin, s in sessions.items()}  # warm; and the bits
        equal &= all(a.tobytes() == b.tobytes() for a, b in zip(results["off"], results["run"]))
        times: dict[str, list[float]] = {spin: [] for spin in sessions}
        for _ in range(rounds):
            for spin, s in sessions.items():
                t0 = time.perf_counter()
                s.run(None, {name: x})
                times[spin].append(1000 * (time.perf_counter() - t0))
        key = "b1" if batch == 1 else "bmax"
        out[f"spin_backend_{key}_speedup"] = round(median(times["off"]) / median(times["run"]), 3)
        for spin in sessions:
            out[f"spin_backend_{key}_{spin}_ms"] = round(median(times[spin]), 2)
        log(f"  backend alone, batch {batch:3d}: off {median(times['off']):8.2f} ms  run {median(times['run']):8.2f} ms"
            f"  (off/run {median(times['off']) / median(times['run']):.3f}; {rounds} calls each, alternating)")
    out["spin_outputs_bitwise_equal"] = equal
    return out


def _backend_alone_child(package: Path, max_batch_size: int, rounds: int) -> dict[str, Any]:
    """``backend_alone`` in a child process (its lines on stderr, its result as the last stdout line)."""
    r = subprocess.run([sys.executable, "-m", "loadtests.spin_bench", "--package", str(package), "--max-batch-size",
                        str(max_batch_size), "--rounds", str(rounds), "--backend-alone"],
                       stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(package: str | None, *, rounds: int, seconds: float, clients: int, max_batch_size: int,
        log=print) -> dict[str, Any]:
    from server.engine.defaults import SHIPPED

    pkg = Path(package) if package else SHIPPED / "digits"
    out = _backend_alone_child(pkg, max_batch_size, max(3, 2 * rounds))
    common = ["--backend", "onnxruntime", "--model", f"m={pkg}", "--max-batch-size", str(max_batch_size)]
    requests = [(json_request("/v1/classify", {"images": [b64(jpeg(640, 480, i))]}), 1) for i in range(16)]
    sat, c1 = saturation_and_c1({"off": [*common, "--ort-spinning", "off"], "run": [*common, "--ort-spinning", "run"]},
                                requests, rounds=rounds, seconds=seconds, c1_seconds=max(0.3, seconds / 2),
                                clients=clients, label="spin", seed=11)
    out["spin_saturation_ratio"] = round(median(sat["run"]) / median(sat["off"]), 3)
    out["spin_c1_p50_ratio"] = round(median(c1["run"]) / median(c1["off"]), 3)
    for n in ("off", "run"):
        out[f"spin_{n}_img_per_s"] = round(median(sat[n]), 2)
        out[f"spin_{n}_c1_p50_ms"] = round(median(c1[n]), 2)
        log(f"  serving, --ort-spinning {n:3}  img/s {median(sat[n]):8.2f}  windows {[round(v, 1) for v in sat[n]]}   "
            f"c1 p50 ms {median(c1[n]):8.2f}  windows {[round(v, 1) for v in c1[n]]}")
    return out


def section(mode: str, workdir: Path) -> dict[str, Any]:
    """`make bench`'s spinning section: soft-s16-e128 at max batch 8 (the peers' limits), digits in
    --smoke."""
    rounds, seconds = {"full": (4, 8.0), "quick": (2, 5.0), "smoke": (1, 0.3)}[mode]
    package = heavy_package(mode, workdir)
    name = "digits" if package is None else "soft-s16-e128"
    print(f"\n--ort-spinning run vs off, {name}, max batch 8, 32 clients, {rounds} rounds x {seconds:g} s, "
          "640x480 JPEGs:")
    return run(package and str(package), rounds=rounds, seconds=seconds, clients=32, max_batch_size=8)


def main(argv: list[str] | None = None) -> int:
    parser = ab_parser(__doc__.splitlines()[0], seconds=8.0, clients=32, max_batch_size=8)
    parser.add_argument("--backend-alone", action="store_true", help="only the backend part, --rounds calls each "
                        "(the bench runs it as a child process)")
    args = parser.parse_args(argv)
    if args.backend_alone:
        from server.engine.defaults import SHIPPED

        pkg = Path(args.package) if args.package else SHIPPED / "digits"
        print(json.dumps(backend_alone(pkg, batches=(1, args.max_batch_size), rounds=args.rounds,
                                       log=lambda m: print(m, file=sys.stderr, flush=True))))
        return 0
    result = run(args.package, rounds=args.rounds, seconds=args.seconds, clients=args.clients,
                 max_batch_size=args.max_batch_size, log=lambda m: print(m, file=sys.stderr, flush=True))
    report(result, "loadtests.spin_bench", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
