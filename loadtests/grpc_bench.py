"""OIP v2 over gRPC against OIP over HTTP with JSON data and with binary tensors: the same server,
the same images, the official clients, side by side in one run.

    python -m loadtests.grpc_bench [--rounds 5] [--seconds 5] [--clients 8] [--images 16]
        [--server-args "--backend torch"]

One `softmoe serve` (the built-in models, its default backend; `--server-args` adds flags) with
`--grpc-port`. The images are real held-out digits (``load_digits``, the bench's fixed set),
preprocessed client-side by the model's own contract (``server.pipeline.decode`` +
``softmoe_models.preprocess``) into FP32 ``pixel_values`` rows, sent to ``digits`` one image per
request (b1) and eight rows per request (b8), every output the model has asked for by name. Three
transports, each through the client a Triton user would write:

- ``grpc``: ``tritonclient.grpc``, raw tensor contents (``raw_input_contents``);
- ``http_json``: ``tritonclient.http``, inputs and outputs as JSON ``data``;
- ``http_binary``: ``tritonclient.http`` with ``binary_data=True`` (Triton's binary tensor
  extension, ``Inference-Header-Content-Length``) for inputs and outputs.

``--clients`` threads, each with its own client of every transport, built in its thread and kept
for the whole run (keep-alive HTTP connections; each gRPC client on its own channel and TCP
connection: ``grpc.use_local_subchannel_pool``, else gRPC shares one connection among every
channel of a process), run a closed loop on one transport at one batch for a window; the six
windows (3 transports x 2 batches) of a round run in a shuffled order, so the drift of a shared
2-core machine falls on all three alike. Each client reads every output of every answer
(``as_numpy``), as a real client does, and compares its bits with the reference.

Before measuring, every client sends every request once on every transport (also the warm-up);
the outputs must be bitwise equal across transports and clients, and every answer while measuring
must be bitwise that reference: otherwise the run fails. Printed, as one JSON line:
``grpc_over_http_json`` and ``grpc_over_http_binary`` (images/s of gRPC over HTTP/JSON and over
binary HTTP, one image per request; ``_b8``: eight rows per request), images/s per transport and
batch (``oip_<transport>_img_per_s_b<n>``), server and client CPU-ms per image
(``oip_<transport>_server_cpu_ms_per_img_b<n>``, ``_client_cpu_ms_per_img_b<n>``: the client is
this process, its gRPC threads included), ``grpc_outputs_bitwise_equal`` and ``errors``. The client
shares the machine's CPUs with the server, so a transport whose client costs more CPU is slower
here for that too; the server CPU-ms per image do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import queue
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from loadtests.harness import ERRORS, interleave, median, pick, report, serve
from loadtests.procs import cpu_seconds, descendants

MODEL = "digits"
INPUT = "pixel_values"
TRANSPORTS = ("grpc", "http_json", "http_binary")
BATCHES = (1, 8)
TIMEOUT_S = 60.0


def pixel_rows(n: int) -> np.ndarray:
    """``n`` held-out digits (the locust corpus' fixed set) as the digits model's ``pixel_values``
    rows, ``(n, 3, S, S)`` float32, preprocessed by the model's own contract."""
    from loadtests.images import digit_images
    from server.engine.defaults import SHIPPED
    from server.pipeline.decode import decode
    from softmoe_models.package import read_package
    from softmoe_models.preprocess import preprocess_image

    cfg = read_package(SHIPPED / MODEL).preprocess
    images = digit_images(n)
    if len(images) < n:
        raise ValueError(f"--images: at most {len(images)} held-out digits, asked for {n}")
    return np.stack([preprocess_image(decode(img.data, cfg.image_size), cfg) for img in images]).astype(np.float32)


def requests_by_batch(rows: np.ndarray) -> dict[int, list[np.ndarray]]:
    """The fixed requests: one row each (b1), and consecutive rows eight at a time (b8)."""
    out = {b: [np.ascontiguousarray(rows[i:i + b]) for i in range(0, len(rows) - b + 1, b)] for b in BATCHES}
    if not all(out.values()):
        raise ValueError(f"need at least {max(BATCHES)} images for the batch of {max(BATCHES)}, got {len(rows)}")
    return out


def make_client(transport: str, http_port: int, grpc_port: int, outputs: list[str]
                ) -> tuple[Callable[[np.ndarray], list[np.ndarray]], Callable[[], None]]:
    """One client of ``transport``: ``infer(x)`` sends ``x`` to the model and returns every output
    in ``outputs`` as numpy; ``close()``. Build it in the thread that uses it (tritonclient.http's
    connection belongs to the thread that made it)."""
    if transport == "grpc":
        import tritonclient.grpc as grpcclient

        keep = grpcclient.KeepAliveOptions()
        channel_args = [  # tritonclient's defaults, and a connection of its own (see the module doc)
            ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keep.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keep.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keep.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keep.http2_max_pings_without_data),
            ("grpc.use_local_subchannel_pool", 1),
        ]
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}", channel_args=channel_args)

        def infer(x: np.ndarray) -> list[np.ndarray]:
            tensor = grpcclient.InferInput(INPUT, list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            result = client.infer(MODEL, [tensor], outputs=[grpcclient.InferRequestedOutput(n) for n in outputs],
                                  client_timeout=TIMEOUT_S)
            return [result.as_numpy(n) for n in outputs]

        return infer, client.close

    import tritonclient.http as httpclient

    binary = {"http_json": False, "http_binary": True}[transport]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", connection_timeout=TIMEOUT_S,
                                              network_timeout=TIMEOUT_S)

    def infer(x: np.ndarray) -> list[np.ndarray]:
        tensor = httpclient.InferInput(INPUT, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        result = client.infer(MODEL, [tensor],
                              outputs=[httpclient.InferRequestedOutput(n, binary_data=binary) for n in outputs])
        return [result.as_numpy(n) for n in outputs]

    return infer, client.close


def same_bits(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                                    for x, y in zip(a, b))


@dataclass
class Tally:
    """One client's part of one window."""

    requests: int = 0
    images: int = 0
    errors: int = 0
    mismatches: int = 0
    first_problem: str = ""


class Worker(threading.Thread):
    """One client thread: a client of every transport, built here and kept across windows.

    Jobs arrive on ``jobs``: ``("check", None)`` sends every request once on every transport and
    returns the outputs ``{(transport, batch, i): [arrays]}``; ``("window", (transport, batch, stop,
    min_requests, reference))`` runs a closed loop until ``stop`` (and at least ``min_requests``)
    and returns a ``Tally``; None ends the thread. Answers (or the exception) go to ``done``."""

    def __init__(self, index: int, clients: int, http_port: int, grpc_port: int, outputs: list[str],
                 requests: dict[int, list[np.ndarray]]) -> None:
        super().__init__(name=f"oip-client-{index}", daemon=True)
        self.index, self.clients, self.requests = index, clients, requests
        self.ports, self.outputs = (http_port, grpc_port), outputs
        self.jobs: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()

    def run(self) -> None:
        try:
            clients = {t: make_client(t, *self.ports, self.outputs) for t in TRANSPORTS}
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.done.put(e)
            return
        try:
            while (job := self.jobs.get()) is not None:
                kind, arg = job
                try:
                    self.done.put(self._check(clients) if kind == "check" else self._window(clients, *arg))
                except BaseException as e:  # noqa: BLE001 - handed to the main thread
                    self.done.put(e)
        finally:
            for _, close in clients.values():
                close()

    def _check(self, clients) -> dict[tuple[str, int, int], list[np.ndarray]]:
        return {(t, b, i): clients[t][0](x) for t in TRANSPORTS for b, xs in self.requests.items()
                for i, x in enumerate(xs)}

    def _window(self, clients, transport: str, batch: int, stop: float, min_requests: int,
                reference: dict[tuple[int, int], list[np.ndarray]]) -> Tally:
        infer, xs, out = clients[transport][0], self.requests[batch], Tally()
        k = self.index
        while time.perf_counter() < stop or out.requests + out.errors < min_requests:
            i = k % len(xs)
            k += self.clients
            try:
                got = infer(xs[i])
            except Exception as e:  # noqa: BLE001 - counted, as the HTTP load generator counts non-200s
                out.errors += 1
                out.first_problem = out.first_problem or f"{transport} b{batch} request {i}: {e}"
                continue
            out.requests += 1
            out.images += batch
            if not same_bits(got, reference[(batch, i)]):
                out.mismatches += 1
                out.first_problem = out.first_problem or f"{transport} b{batch} request {i}: other bits"
        return out


@dataclass
class Window:
    """One transport at one batch for one window, all clients together."""

    seconds: float
    images: int
    requests: int
    errors: int
    mismatches: int
    server_cpu: float | None
    client_cpu: float
    problem: str

    @property
    def img_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def cpu_ms_per_img(self, cpu: float | None) -> float:
        return cpu / self.images * 1e3 if cpu is not None and self.images else float("nan")


class Clients:
    """``n`` client threads against one server (see ``Worker``)."""

    def __init__(self, n: int, http_port: int, grpc_port: int, outputs: list[str],
                 requests: dict[int, list[np.ndarray]]) -> None:
        self.workers = [Worker(i, n, http_port, grpc_port, outputs, requests) for i in range(n)]
        for w in self.workers:
            w.start()

    def _all(self, job, timeout: float) -> list:
        for w in self.workers:
            w.jobs.put(job)
        answers = [w.done.get(timeout=timeout) for w in self.workers]
        for a in answers:
            if isinstance(a, BaseException):
                raise RuntimeError(f"a client thread failed: {a!r}") from a
        return answers

    def check(self) -> list[dict[tuple[str, int, int], list[np.ndarray]]]:
        n = len(TRANSPORTS) * sum(map(len, self.workers[0].requests.values()))
        return self._all(("check", None), n * TIMEOUT_S)

    def window(self, transport: str, batch: int, seconds: float, min_requests: int,
               reference: dict[tuple[int, int], list[np.ndarray]], pids: list[int]) -> Window:
        server0, client0 = [cpu_seconds(p) for p in pids], time.process_time()
        t0 = time.perf_counter()
        tallies = self._all(("window", (transport, batch, t0 + seconds, min_requests, reference)),
                            seconds + (min_requests + 1) * TIMEOUT_S)
        elapsed = time.perf_counter() - t0
        client, server1 = time.process_time() - client0, [cpu_seconds(p) for p in pids]
        server = sum(b - a for a, b in zip(server0, server1)) if None not in server0 + server1 else None
        return Window(elapsed, sum(t.images for t in tallies), sum(t.requests for t in tallies),
                      sum(t.errors for t in tallies), sum(t.mismatches for t in tallies), server, client,
                      next((t.first_problem for t in tallies if t.first_problem), ""))

    def close(self) -> None:
        for w in self.workers:
            w.jobs.put(None)
        for w in self.workers:
            w.join(TIMEOUT_S)


def reference_outputs(checks: list[dict[tuple[str, int, int], list[np.ndarray]]]
                      ) -> dict[tuple[int, int], list[np.ndarray]]:
    """Every client's outputs on every transport, bitwise one set per request; raises naming the
    first request whose bits differ (transport, batch, request, client)."""
    reference = {(b, i): got for (t, b, i), got in checks[0].items() if t == TRANSPORTS[0]}
    for c, outputs in enumerate(checks):
        for (t, b, i), got in outputs.items():
            if not same_bits(got, reference[(b, i)]):
                raise RuntimeError(f"OIP outputs differ across transports: {t} b{b} request {i} (client {c}) "
                                   f"is not bitwise {TRANSPORTS[0]}'s")
    return reference


def run(*, rounds: int, seconds: float, clients: int, n_images: int, min_requests: int = 1,
        server_args: list[str] = (), log=print) -> dict[str, Any]:
    """One server, ``clients`` client threads, ``rounds`` rounds of the six windows; see the module doc.

    Args:
        rounds: windows per transport and batch (shuffled order each round); figures are medians.
        seconds: length of each window (a window also runs until each client sent ``min_requests``).
        clients: client threads, each with its own client of every transport.
        n_images: held-out digits sent (one per request, and eight rows per request).
        min_requests: requests each client sends in a window at the least.
        server_args: more `softmoe serve` flags.
        log: where the table goes.

    Returns:
        The keys of the module doc (no ``errors``: the run's ``ERRORS`` counts them under "grpc").
    """
    from loadtests.common import http_get

    if "--grpc-port" in server_args:
        raise ValueError("server_args: the bench picks the gRPC port itself (a free one); leave out --grpc-port")
    requests = requests_by_batch(pixel_rows(n_images))
    server = serve(list(server_args))
    pool = None
    try:
        status, body = http_get(f"{server.url}/v2/models/{MODEL}", timeout=10)
        if status != 200:
            raise RuntimeError(f"GET /v2/models/{MODEL}: {status}")
        meta = json.loads(body)
        outputs = [o["name"] for o in meta["outputs"]]
        backend = meta.get("parameters", {}).get("backend", "?")
        pids = descendants(server.proc.pid)
        pool = Clients(clients, server.port, server.grpc_port, outputs, requests)
        reference = reference_outputs(pool.check())
        windows = {(t, b): (lambda t=t, b=b: pool.window(t, b, seconds, min_requests, reference, pids))
                   for t in TRANSPORTS for b in BATCHES}
        res: dict[tuple[str, int], list[Window]] = interleave(windows, rounds, seed=11)
    finally:
        if pool is not None:
            pool.close()
        server.stop()

    errors = sum(w.errors for ws in res.values() for w in ws)
    if errors:
        ERRORS["grpc"] = ERRORS.get("grpc", 0) + errors
    mismatched = [w.problem for ws in res.values() for w in ws if w.mismatches]
    if mismatched:
        raise RuntimeError(f"OIP answers while measuring were not bitwise the reference: {mismatched[0]} "
                           f"({sum(w.mismatches for ws in res.values() for w in ws)} answers)")

    def med(key: tuple[str, int], f: Callable[[Window], float]) -> float:
        return median([f(w) for w in res[key]])

    log(f"\nOIP v2 transports: {MODEL} ({backend} backend), {len(requests[1])} held-out digits as FP32 "
        f"{INPUT} rows, {clients} client threads (one client of each transport each), {rounds} rounds x "
        f"{seconds:g} s, median of windows; outputs {', '.join(outputs)} bitwise equal on every transport")
    log(f"  {'transport':12} {'rows/req':>8} {'img/s':>9} {'req/s':>8} {'server CPU-ms/img':>18} "
        f"{'client CPU-ms/img':>18} {'errors':>6}   img/s windows")
    out: dict[str, Any] = {}
    for b in BATCHES:
        for t in TRANSPORTS:
            ws = res[(t, b)]
            img, srv = med((t, b), lambda w: w.img_per_s), med((t, b), lambda w: w.cpu_ms_per_img(w.server_cpu))
            cli = med((t, b), lambda w: w.cpu_ms_per_img(w.client_cpu))
            log(f"  {t:12} {b:8d} {img:9.1f} {img / b:8.1f} {srv:18.3f} {cli:18.3f} {sum(w.errors for w in ws):6d}   "
                f"{[round(w.img_per_s, 1) for w in ws]}")
            out[f"oip_{t}_img_per_s_b{b}"] = round(img, 1)
            out[f"oip_{t}_server_cpu_ms_per_img_b{b}"] = round(srv, 4)
            out[f"oip_{t}_client_cpu_ms_per_img_b{b}"] = round(cli, 4)
        for other in ("http_json", "http_binary"):
            per_round = [g.img_per_s / h.img_per_s if h.img_per_s else float("nan")
                         for g, h in zip(res[("grpc", b)], res[(other, b)])]
            base = med((other, b), lambda w: w.img_per_s)
            ratio = med(("grpc", b), lambda w: w.img_per_s) / base if base else float("nan")
            out[f"grpc_over_{other}" + ("" if b == 1 else f"_b{b}")] = round(ratio, 3)
            log(f"  grpc over {other}, {b} row(s) per request: {ratio:.3f} "
                f"(per round {[round(r, 2) for r in per_round]})")
    out.update({"grpc_outputs_bitwise_equal": True, "grpc_clients": clients, "grpc_rounds": rounds})
    return out


def section(mode: str) -> dict[str, Any]:
    """`make bench`'s grpc section: the module's run at the mode's size (the smoke: 2 clients, a
    few requests per window)."""
    rounds, seconds, clients, n_images, min_requests = pick(mode, (5, 5.0, 8, 16, 1), (3, 3.0, 8, 16, 1),
                                                            (1, 0.0, 2, 8, 2))
    argv = ["--rounds", str(rounds), "--seconds", f"{seconds:g}", "--clients", str(clients), "--images", str(n_images),
            *(["--min-requests", str(min_requests)] if min_requests != 1 else [])]
    print(f"\ngRPC vs HTTP/JSON vs binary HTTP (OIP v2), command: python -m loadtests.grpc_bench {shlex.join(argv)}")
    return run(rounds=rounds, seconds=seconds, clients=clients, n_images=n_images, min_requests=min_requests)


def main(argv: list[str] | None = None) -> int:
    from loadtests.images import N_DIGITS

    parser = argparse.ArgumentParser(prog="python -m loadtests.grpc_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="windows per transport and batch")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per window")
    parser.add_argument("--clients", type=int, default=8, help="client threads, each with its own clients")
    parser.add_argument("--images", type=int, default=16, help="held-out digits sent (at least 8, at most 20)")
    parser.add_argument("--min-requests", type=int, default=1,
                        help="requests each client sends per window at the least")
    parser.add_argument("--server-args", default="", help='more `softmoe serve` flags, e.g. "--backend torch"')
    args = parser.parse_args(argv)
    if min(args.rounds, args.clients, args.min_requests) < 1 or args.seconds < 0:
        parser.error("--rounds, --clients and --min-requests must be at least 1, --seconds at least 0")
    if not max(BATCHES) <= args.images <= N_DIGITS:
        parser.error(f"--images: from {max(BATCHES)} (a batch of {max(BATCHES)}) to {N_DIGITS} (the held-out digits)")
    result = run(rounds=args.rounds, seconds=args.seconds, clients=args.clients, n_images=args.images,
                 min_requests=args.min_requests, server_args=shlex.split(args.server_args))
    report(result, "loadtests.grpc_bench", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
