"""What `--decode-nice N` does to serving: two servers alive together, one with the decode threads
N steps nicer, measured in interleaved windows.

    python -m loadtests.decode_nice_bench [--package DIR] [--nice 10] [--rounds 4]
        [--seconds 25] [--clients 64] [--max-batch-size 32]

Both servers are `softmoe serve` with their defaults otherwise (ONNX Runtime on CPU, strict
determinism), the same package, the same 640x480 JPEGs posted to /v1/classify. Saturation: a closed
loop of ``--clients``; concurrency 1: one client. Printed, as one JSON line:
``decode_nice_throughput_ratio`` (images/s nice over plain) and ``decode_nice_c1_p50_ratio`` (p50
nice over plain), the medians, and ``errors`` (non-200 answers while measuring). A package DIR of
a heavy model (e.g. `softmoe init soft-s16-e128 --out DIR`) is where it helps; on digits decode is
the work and it costs.
"""

from __future__ import annotations

import sys
from typing import Any

from loadtests.harness import ab_parser, jpeg, jpeg_request, median, report, saturation_and_c1


def run(package: str | None, *, nice: int, rounds: int, seconds: float, clients: int, max_batch_size: int,
        log=print) -> dict[str, Any]:
    common = ["--model", f"m={package}"] if package else []
    common += ["--max-batch-size", str(max_batch_size), "--max-delay-ms", str(100 if package else 5)]
    requests = [(jpeg_request("/v1/classify", jpeg(640, 480, i)), 1) for i in range(16)]
    sat, c1 = saturation_and_c1({"plain": [*common, "--decode-nice", "0"],
                                 "nice": [*common, "--decode-nice", str(nice)]}, requests, rounds=rounds,
                                seconds=seconds, c1_seconds=max(0.3, seconds / 3), clients=clients,
                                label="decode_nice", seed=5)
    out: dict[str, Any] = {
        "decode_nice": nice,
        "decode_nice_throughput_ratio": round(median(sat["nice"]) / median(sat["plain"]), 3),
        "decode_nice_c1_p50_ratio": round(median(c1["nice"]) / median(c1["plain"]), 3),
    }
    for n in sat:
        out[f"decode_nice_img_per_s_{n}"] = round(median(sat[n]), 2)
        out[f"decode_nice_c1_p50_ms_{n}"] = round(median(c1[n]), 2)
        log(f"  {n:6} --decode-nice {0 if n == 'plain' else nice:<3} img/s {median(sat[n]):8.2f}  windows "
            f"{[round(v, 1) for v in sat[n]]}   c1 p50 ms {median(c1[n]):7.2f}  windows {[round(v, 1) for v in c1[n]]}")
    return out


def section(mode: str) -> dict[str, Any]:
    """`make bench`'s decode_nice section, on digits (a light model: the cost side). The heavy
    side needs a soft-s16-e128 package: python -m loadtests.decode_nice_bench --package DIR."""
    rounds, seconds = {"full": (6, 6.0), "quick": (3, 4.0), "smoke": (1, 0.3)}[mode]
    print(f"\n--decode-nice 10 vs 0, digits, 32 clients, {rounds} rounds x {seconds:g} s, 640x480 JPEGs:")
    return run(None, nice=10, rounds=rounds, seconds=seconds, clients=32, max_batch_size=8)


def main(argv: list[str] | None = None) -> int:
    parser = ab_parser(__doc__.splitlines()[0], seconds=25.0, clients=64, max_batch_size=32)
    parser.add_argument("--nice", type=int, default=10)
    args = parser.parse_args(argv)
    result = run(args.package, nice=args.nice, rounds=args.rounds, seconds=args.seconds, clients=args.clients,
                 max_batch_size=args.max_batch_size, log=lambda m: print(m, file=sys.stderr, flush=True))
    report(result, "loadtests.decode_nice_bench", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
