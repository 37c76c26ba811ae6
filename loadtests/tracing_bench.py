"""What `--otlp-endpoint` costs: two servers alive together, one tracing (OTLP/HTTP to a local sink,
10% of requests sampled) and one not, measured in interleaved windows.

    python -m loadtests.tracing_bench [--package DIR] [--ratio 0.1] [--rounds 4]
        [--seconds 10] [--clients 32] [--max-batch-size 8]

Both servers are `softmoe serve` with their defaults otherwise, the same package (digits by default:
a light model, where a request's fixed costs weigh most), the same small JPEGs posted to
/v1/classify. The sink is an HTTP server in this process that answers every export 200, so the
exporter's work is all there is to pay. Printed, as one JSON line: ``tracing_overhead`` (images/s
at saturation, tracing over not), ``tracing_c1_p50_ratio`` (p50 at concurrency 1, tracing over
not), the medians, and ``errors`` (non-200 answers while measuring).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from loadtests.harness import ab_parser, jpeg, jpeg_request, median, report, saturation_and_c1


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that takes every export (an empty body is an empty ExportTraceServiceResponse)."""

    exports = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).exports += 1
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def sink():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run(package: str | None, *, ratio: float, rounds: int, seconds: float, clients: int, max_batch_size: int,
        log=print) -> dict[str, Any]:
    common = ["--model", f"m={package}"] if package else []
    common += ["--max-batch-size", str(max_batch_size), "--grpc-port", "0"]
    requests = [(jpeg_request("/v1/classify", jpeg(64, 64, i)), 1) for i in range(16)]
    with sink() as url:
        sat, c1 = saturation_and_c1({"off": common, "on": [*common, "--otlp-endpoint", url, "--trace-sample-ratio",
                                                           str(ratio)]}, requests, rounds=rounds, seconds=seconds,
                                    c1_seconds=max(0.3, seconds / 3), clients=clients, label="tracing", seed=38)
    out: dict[str, Any] = {
        "tracing_sample_ratio": ratio,
        "tracing_overhead": round(median(sat["on"]) / median(sat["off"]), 3),
        "tracing_c1_p50_ratio": round(median(c1["on"]) / median(c1["off"]), 3),
        "tracing_exports": _Sink.exports,
    }
    for n in sat:
        out[f"tracing_img_per_s_{n}"] = round(median(sat[n]), 2)
        out[f"tracing_c1_p50_ms_{n}"] = round(median(c1[n]), 2)
        log(f"  tracing {n:3}  img/s {median(sat[n]):8.2f}  windows {[round(v, 1) for v in sat[n]]}   "
            f"c1 p50 ms {median(c1[n]):7.2f}  windows {[round(v, 2) for v in c1[n]]}")
    return out


def section(mode: str) -> dict[str, Any]:
    """`make bench`'s tracing section: digits, tracing at 10% sampling vs off."""
    rounds, seconds = {"full": (6, 6.0), "quick": (3, 4.0), "smoke": (1, 0.3)}[mode]
    print(f"\n--otlp-endpoint (10% sampled) vs off, digits, 32 clients, {rounds} rounds x {seconds:g} s, 64x64 JPEGs:")
    return run(None, ratio=0.1, rounds=rounds, seconds=seconds, clients=32, max_batch_size=8)


def main(argv: list[str] | None = None) -> int:
    parser = ab_parser(__doc__.splitlines()[0], seconds=10.0, clients=32, max_batch_size=8)
    parser.add_argument("--ratio", type=float, default=0.1)
    args = parser.parse_args(argv)
    result = run(args.package, ratio=args.ratio, rounds=args.rounds, seconds=args.seconds, clients=args.clients,
                 max_batch_size=args.max_batch_size, log=lambda m: print(m, file=sys.stderr, flush=True))
    report(result, "loadtests.tracing_bench", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
