"""What answering an OIP inference costs the server after the model ran: the ``postprocess`` stage
(the answer's encoding, server.api.oip_codec) per request, for HTTP JSON, HTTP binary and gRPC
answers of 1 and 32 rows, measured side by side in one run.

    python -m loadtests.oip_encode_bench [--rounds 5] [--requests 100] [--server-args "--backend torch"]

One `softmoe serve` (the built-in models) with a gRPC port. Requests go to ``digits`` one after
the other (one client, so the stage is never shared with a batch-mate's encoding), each asking for
every output: held-out digits preprocessed by the model's own contract, repeated up to 32 rows.
A window sends ``--requests`` requests of one wire and one size; the six windows of a round run in
a shuffled order. Per window, the server's own ``softmoe_image_latency_seconds`` histogram (stage
``postprocess``, read from /metrics before and after) gives the stage's mean time per request, and
the client times each round trip. The figures are medians over rounds, in milliseconds:
``oip_encode_ms_<wire>_r<rows>`` (the stage) and ``oip_round_trip_ms_<wire>_r<rows>``, with
``<wire>`` ``http_json``, ``http_binary`` or ``grpc``. The last line is one JSON object. From
loadtests/bench.py: ``section(mode)``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from typing import Any, Callable

import grpc
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from loadtests.grpc_bench import MODEL, pixel_rows
from loadtests.harness import interleave, median, pick, report, serve
from loadtests.images import N_DIGITS
from server.grpc_api.service import M

WIRES = ("http_json", "http_binary", "grpc")
ROWS = (1, 32)
TIMEOUT_S = 60.0
STAGE = "softmoe_image_latency_seconds"


def stage_totals(url: str, client: httpx.Client) -> tuple[float, float]:
    """(sum of seconds, count) of the ``postprocess`` stage of ``digits`` on the server's /metrics."""
    text = client.get(f"{url}/metrics", timeout=TIMEOUT_S).text
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != STAGE:
            continue
        for s in family.samples:
            if s.labels.get("model") == MODEL and s.labels.get("stage") == "postprocess":
                if s.name.endswith("_sum"):
                    total = s.value
                elif s.name.endswith("_count"):
                    count = s.value
    return total, count


def http_sender(url: str, client: httpx.Client, x: np.ndarray, binary: bool) -> Callable[[], bytes]:
    """One request of ``x`` over HTTP, JSON or binary tensors both ways; returns the answer's bytes."""
    tensor = {"name": "pixel_values", "shape": list(x.shape), "datatype": "FP32"}
    if binary:
        head = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": x.nbytes}}],
                           "parameters": {"binary_data_output": True}}).encode()
        body, headers = head + x.tobytes(), {"inference-header-content-length": str(len(head)),
                                             "content-type": "application/octet-stream"}
    else:
        body = json.dumps({"inputs": [{**tensor, "data": x.reshape(-1).tolist()}]}).encode()
        headers = {"content-type": "application/json"}

    def send() -> bytes:
        r = client.post(f"{url}/v2/models/{MODEL}/infer", content=body, headers=headers, timeout=TIMEOUT_S)
        if r.status_code != 200:
            raise RuntimeError(f"OIP over HTTP answered {r.status_code}: {r.text[:200]}")
        return r.content

    return send


def grpc_sender(channel: grpc.Channel, x: np.ndarray) -> Callable[[], bytes]:
    """One ModelInfer call of ``x`` as raw contents; returns the answer's bytes."""
    request = M["ModelInferRequest"](model_name=MODEL)
    request.inputs.add(name="pixel_values", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    payload = request.SerializeToString()
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out

    def send() -> bytes:
        return call(payload, timeout=TIMEOUT_S)

    return send


def run(*, rounds: int, requests: int, server_args: list[str] = ()) -> dict[str, Any]:
    """One server, ``rounds`` rounds of the six windows of ``requests`` requests; see the module doc."""
    rows = pixel_rows(N_DIGITS)
    inputs = {n: np.ascontiguousarray(np.resize(rows, (n, *rows.shape[1:]))) for n in ROWS}
    server = serve(list(server_args))
    try:
        with httpx.Client() as client, grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            senders = {(w, n): (grpc_sender(channel, inputs[n]) if w == "grpc" else
                                http_sender(server.url, client, inputs[n], w == "http_binary"))
                       for w in WIRES for n in ROWS}
            for send in senders.values():  # warm-up
                send()

            def window(send: Callable[[], bytes]) -> tuple[float, float]:
                before = stage_totals(server.url, client)
                trips = []
                for _ in range(requests):
                    t0 = time.perf_counter()
                    send()
                    trips.append(time.perf_counter() - t0)
                after = stage_totals(server.url, client)
                seconds, count = after[0] - before[0], after[1] - before[1]
                return seconds / max(count, 1), median(trips)

            res = interleave({k: (lambda s=s: window(s)) for k, s in senders.items()}, rounds, seed=5)
    finally:
        server.stop()
    out: dict[str, Any] = {}
    for (w, n), windows in res.items():
        out[f"oip_encode_ms_{w}_r{n}"] = round(median(e for e, _ in windows) * 1e3, 4)
        out[f"oip_round_trip_ms_{w}_r{n}"] = round(median(t for _, t in windows) * 1e3, 3)
    return out


def section(mode: str) -> dict[str, Any]:
    """`make bench`'s oip_encode section: the module's run at the mode's size."""
    rounds, requests = pick(mode, (5, 100), (3, 50), (1, 2))
    argv = ["--rounds", str(rounds), "--requests", str(requests)]
    print(f"\nOIP answer encoding (postprocess stage), command: python -m loadtests.oip_encode_bench {shlex.join(argv)}")
    return run(rounds=rounds, requests=requests)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.oip_encode_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="windows per wire and size")
    parser.add_argument("--requests", type=int, default=100, help="requests per window")
    parser.add_argument("--server-args", default="", help='more `softmoe serve` flags, e.g. "--backend torch"')
    args = parser.parse_args(argv)
    if min(args.rounds, args.requests) < 1:
        parser.error("--rounds and --requests must be at least 1")
    report(run(rounds=args.rounds, requests=args.requests, server_args=shlex.split(args.server_args)),
           "loadtests.oip_encode_bench", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
