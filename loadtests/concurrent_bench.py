"""What `--concurrent-batches 2` does to serving: two servers alive together, one running one batch
at a time on all the intra-op threads, the other two batches at once on half the threads each,
measured in interleaved windows.

    python -m loadtests.concurrent_bench [--package DIR] [--rounds 4] [--seconds 8]
        [--clients 64] [--max-batch-size 32]

Both servers are `softmoe serve` with their defaults otherwise (ONNX Runtime on CPU, strict
determinism, the CPUs available as intra-op threads), the same package, the same 224x224 JPEGs
posted to /v1/classify. Saturation: a closed loop of ``--clients``; concurrency 1: one client.
Printed, as one JSON line: ``concurrent_batches_throughput_ratio`` (images/s with 2 over 1) and
``concurrent_batches_c1_p50_ratio`` (p50 with 2 over 1), the medians, and ``errors`` (non-200
answers while measuring). It pays where a model's threads scale poorly on a batch (a heavy Soft
MoE on a few cores: `softmoe init soft-s16-e128 --out DIR`). With `--wide-lone-batches` (the
default) a lone request still runs on every thread, and full batches run beside each other only
where start-up measured that it pays (`--wide-lone-beside auto`); without it a lone request runs
on fewer threads and takes longer.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from loadtests.harness import ab_parser, heavy_package, jpeg, jpeg_request, median, report, saturation_and_c1


def run(package: str | None, *, rounds: int, seconds: float, clients: int, max_batch_size: int,
        log=print) -> dict[str, Any]:
    common = ["--model", f"m={package}"] if package else []
    common += ["--max-batch-size", str(max_batch_size), "--max-delay-ms", str(100 if package else 5)]
    requests = [(jpeg_request("/v1/classify", jpeg(224, 224, i)), 1) for i in range(32)]
    sat, c1 = saturation_and_c1({"one": [*common, "--concurrent-batches", "1"],
                                 "two": [*common, "--concurrent-batches", "2"]}, requests, rounds=rounds,
                                seconds=seconds, c1_seconds=max(0.3, seconds / 2), clients=clients,
                                label="concurrent", seed=7)
    out: dict[str, Any] = {
        "concurrent_batches_throughput_ratio": round(median(sat["two"]) / median(sat["one"]), 3),
        "concurrent_batches_c1_p50_ratio": round(median(c1["two"]) / median(c1["one"]), 3),
    }
    for n, k in (("one", 1), ("two", 2)):
        out[f"concurrent_batches_{k}_img_per_s"] = round(median(sat[n]), 2)
        out[f"concurrent_batches_{k}_c1_p50_ms"] = round(median(c1[n]), 2)
        log(f"  --concurrent-batches {k}  img/s {median(sat[n]):8.2f}  windows {[round(v, 1) for v in sat[n]]}   "
            f"c1 p50 ms {median(c1[n]):8.2f}  windows {[round(v, 1) for v in c1[n]]}")
    return out


def section(mode: str, workdir: Path) -> dict[str, Any]:
    """`make bench`'s concurrent section: soft-s16-e128 at max batch 8 (the peers' limits; a heavy
    model on few cores, where it pays), digits in --smoke."""
    rounds, seconds = {"full": (4, 10.0), "quick": (2, 6.0), "smoke": (1, 0.3)}[mode]
    package = heavy_package(mode, workdir)
    name = "digits" if package is None else "soft-s16-e128"
    print(f"\n--concurrent-batches 2 vs 1, {name}, max batch 8, 32 clients, {rounds} rounds x {seconds:g} s, "
          "224x224 JPEGs:")
    return run(package and str(package), rounds=rounds, seconds=seconds, clients=32, max_batch_size=8)


def main(argv: list[str] | None = None) -> int:
    parser = ab_parser(__doc__.splitlines()[0], seconds=8.0, clients=64, max_batch_size=32)
    args = parser.parse_args(argv)
    result = run(args.package, rounds=args.rounds, seconds=args.seconds, clients=args.clients,
                 max_batch_size=args.max_batch_size, log=lambda m: print(m, file=sys.stderr, flush=True))
    report(result, "loadtests.concurrent_bench", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
