"""`softmoe serve --frontend-workers 2`: two front-end processes on one port feeding one engine
process through shared memory, as real subprocesses on the shipped default models (digits and
digits-lit, torch backend).

Three servers start together: ``split`` and ``single`` (the same flags, one process; both run two
batches at once) for the answers, determinism and shutdown; ``slow`` (a 2 s batching window that items always wait out, 4 places per queue) for
admission, a killed front end and a killed engine. Tests that end a server come last for it.
Which front end holds a connection is read from the kernel (psutil), so the cross-process cases
are deterministic rather than left to the kernel's choice of front end.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers.images import b64, png
from helpers.live import free_port

psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[2]


class Server:
    """`softmoe serve` on a free port, its log (stdout and stderr) in a file."""

    def __init__(self, workdir: Path, name: str, *flags: str) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--port", str(self.port), "--backend", "torch",
             "--grpc-port", str(self.grpc_port), "--cache-dir", str(workdir / "cache"), "--drain-seconds", "1",
             *flags],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_listening(self, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while "listening on" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start (exit {self.proc.poll()}):\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def engine_pid(self) -> int:
        return int(re.search(r"engine pid (\d+)", self.log())[1])

    def frontend_pids(self) -> dict[int, int]:
        """The live front end of each index (the latest to connect)."""
        out = {int(i): int(pid) for i, pid in re.findall(r"front end (\d+) \(pid (\d+)\) connected", self.log())}
        return {i: pid for i, pid in out.items() if psutil.pid_exists(pid)}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("frontends")
    # A 1 s window every batch waits out (--no-eager-batching): requests are still queued when a
    # test looks (SIGTERM with requests in flight). Eager batching's engine side: test_batcher.py.
    # Two batches at once (--concurrent-batches 2): the engine's batcher runs two workers.
    common = ("--max-queue", "16", "--max-delay-ms", "1000", "--no-eager-batching", "--concurrent-batches", "2")
    started = {
        "split": Server(workdir, "split", "--frontend-workers", "2", *common),
        "single": Server(workdir, "single", *common),
        "slow": Server(workdir, "slow", "--frontend-workers", "2", "--max-queue", "4", "--max-delay-ms", "2000",
                       "--no-eager-batching"),
    }
    # A start-up failure, checked by test_startup_error_is_one_line (started now: it overlaps the others).
    started_bad = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--port", str(free_port()), "--frontend-workers", "2",
         "--model", str(workdir / "missing")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for s in started.values():
            s.wait_listening()
        yield {**started, "bad": started_bad}
    finally:
        for s in started.values():
            s.stop()
        if started_bad.poll() is None:
            started_bad.kill()
        started_bad.communicate()


def _images(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [b64(png(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))) for _ in range(n)]


def _post(url: str, path: str, body: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def _gauge(url: str, name: str, labels: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}{{{labels}}}"):
            return float(line.split()[-1])
    return 0.0


def _wait(predicate, timeout: float = 20, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _connections(server: Server) -> dict[int, http.client.HTTPConnection]:
    """One open connection to each front-end process (pid -> connection)."""
    pids = set(server.frontend_pids().values())
    out: dict[int, http.client.HTTPConnection] = {}
    for _ in range(100):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.connect()
        port = conn.sock.getsockname()[1]
        owner = None
        for _ in range(40):  # until a front end has accepted it
            owner = next((pid for pid in pids if any(c.raddr and c.raddr.port == port
                                                     for c in psutil.Process(pid).net_connections("tcp"))), None)
            if owner is not None:
                break
            time.sleep(0.025)
        if owner is None or owner in out:
            conn.close()
        else:
            out[owner] = conn
        if len(out) == len(pids):
            return out
    raise AssertionError(f"could not reach every front end {pids}")


def _send(conn: http.client.HTTPConnection, path: str, body: dict) -> tuple[int, dict]:
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def _in_thread(fn, *args):
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn(*args)))
    thread.start()
    return thread, out


# ------------------------------------------------------------------ the parts, in process


def test_service_errors_cross_the_boundary():
    """Every ServiceError class comes back as itself: status, type, message, param, headers."""
    import pickle

    from server import errors
    from server.workers.process import pack_error, unpack_error

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.ServiceError)]
    assert len(classes) >= 10
    for cls in classes:
        exc = cls("it failed", retry_after_s=3) if "retry_after_s" in cls.__init__.__code__.co_varnames else \
            cls("it failed", param="images[1]", headers={"x-extra": "1"})
        exc.param = exc.param or "texts[0]"
        back = unpack_error(pickle.loads(pickle.dumps(pack_error(exc))))
        assert type(back) is cls
        assert (back.status, back.type, back.message, back.param, back.headers) == \
            (exc.status, exc.type, exc.message, exc.param, exc.headers)
        assert back.body() == exc.body()
    other = unpack_error(("SomethingNew", 418, "teapot", "short and stout", None, {}))
    assert isinstance(other, errors.ServiceError) and (other.status, other.type) == (418, "teapot")
    assert pack_error(RuntimeError("secret text"))[1:4] == (500, "internal_error",
                                                             "the inference engine failed on this request")


def test_arena_slots_hold_rows_of_every_queue():
    from multiprocessing import shared_memory

    from server.workers.shm import Arena

    queues = [{"inputs": [("pixel_values", (3, 8, 8), "<f4")]}, {"inputs": [("input_ids", (16,), "<i8")]}]
    slots, size = Arena.size_for(queues)
    shm = shared_memory.SharedMemory(create=True, size=size)
    try:
        writer, reader = Arena(shm, queues, slots), Arena(shared_memory.SharedMemory(name=shm.name), queues, slots)
        rng = np.random.default_rng(0)
        pixels = rng.uniform(-1, 1, (3, 8, 8)).astype(np.float32)
        ids = rng.integers(0, 100, 16).astype(np.int64)
        assert writer.write(slots - 1, 0, {"pixel_values": pixels}) and writer.write(0, 1, {"input_ids": ids})
        got = reader.read(slots - 1, 0)["pixel_values"]
        assert np.array_equal(got, pixels) and got.dtype == np.float32
        assert np.array_equal(reader.read(0, 1)["input_ids"], ids)
        writer.write(slots - 1, 0, {"pixel_values": pixels * 0})
        assert np.array_equal(got, pixels)  # a copy: the slot is free once read
        assert not writer.write(1, 1, {"input_ids": ids.astype(np.int32)})  # not the layout: sent in the frame
        assert not writer.write(1, 0, {"pixel_values": pixels[:2]})
        reader.close()
        writer.close(unlink=True)
    finally:
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


# ------------------------------------------------------------------ split vs one process


def test_startup_error_is_one_line(servers):
    _, err = servers["bad"].communicate(timeout=60)
    assert servers["bad"].returncode == 2
    assert err.splitlines() == [f"error: model path not found: {err.split('not found: ')[1].strip()}"]


def test_answers_equal_one_process(servers):
    """classify, zero-shot, embed and OIP infer: the same bytes as the one-process server."""
    images = _images(4, seed=1)
    pixels = np.random.default_rng(2).uniform(-1, 1, (2, 3, 8, 8)).astype(np.float32)
    calls = [
        ("/v1/classify", {"images": images[:3], "top_k": 5}),
        ("/v1/zero-shot", {"model": "digits-lit", "images": images[2:], "labels": ["zero", "one", "two", "three"]}),
        ("/v1/embed", {"model": "digits-lit", "texts": ["a photo of a one", "seven"]}),
        ("/v2/models/digits/infer", {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [2, 3, 8, 8],
                                                 "data": pixels.reshape(-1).tolist()}]}),
    ]
    with ThreadPoolExecutor(8) as pool:
        jobs = [(servers[s].url, *c) for s in ("split", "single") for c in calls]
        answers = list(pool.map(lambda job: _post(*job), jobs))
    split, single = answers[:len(calls)], answers[len(calls):]
    for (path, _), a, b in zip(calls, split, single):
        assert a.status_code == b.status_code == 200, (path, a.text, b.text)
        assert a.content == b.content, path
    meta = [httpx.get(f"{s.url}/v2/models/digits", timeout=10).json() for s in (servers["split"], servers["single"])]
    assert meta[0]["parameters"]["batch_shapes"] == meta[1]["parameters"]["batch_shapes"]


def test_every_front_end_serves_grpc(servers):
    """gRPC on the shared port (SO_REUSEPORT in every front end): each of several connections gets
    the one-process server's logits, bit for bit, and the front ends' health checks say SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from server.grpc_api.service import M

    pixels = np.random.default_rng(5).uniform(-1, 1, (2, 3, 8, 8)).astype(np.float32)
    request = M["ModelInferRequest"](model_name="digits")
    request.inputs.add(name="pixel_values", datatype="FP32", shape=list(pixels.shape))
    request.raw_input_contents.append(pixels.tobytes())
    got = {}
    for name in ("split", "single"):
        for i in range(4 if name == "split" else 1):  # new channels: the kernel spreads them over front ends
            with grpc.insecure_channel(f"127.0.0.1:{servers[name].grpc_port}",
                                       options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                    health_pb2.HealthCheckResponse.SERVING
                call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                           request_serializer=lambda m: m.SerializeToString(),
                                           response_deserializer=M["ModelInferResponse"].FromString)
                reply = call(request, timeout=30)
                got.setdefault(name, set()).add(reply.raw_output_contents[0])
    assert len(got["split"]) == 1 and got["split"] == got["single"]


def test_an_image_alone_and_among_others_is_byte_identical(servers):
    url = servers["split"].url
    mine, others = _images(1, seed=7), _images(12, seed=8)
    alone = _post(url, "/v1/classify", {"images": mine})
    bodies = [{"images": mine} if i % 3 == 0 else {"images": [others[i]] + (mine if i % 3 == 1 else [])}
              for i in range(12)]
    with ThreadPoolExecutor(12) as pool:  # the connections spread over both front ends
        loaded = list(pool.map(lambda b: _post(url, "/v1/classify", b), bodies))
    assert alone.status_code == 200 and all(r.status_code == 200 for r in loaded)
    expected = alone.json()["results"][0]
    checked = 0
    for body, r in zip(bodies, loaded):
        if mine[0] in body["images"]:
            assert r.json()["results"][body["images"].index(mine[0])] == expected
            checked += 1
    assert checked == 8


# ------------------------------------------------------------------ admission, a dead front end, a dead engine


def test_admission_is_global_across_frontends(servers):
    """3 of the 4 places held through one front end: the other front end refuses 2 more (429)."""
    server = servers["slow"]
    (a, conn_a), (b, conn_b) = list(_connections(server).items())[:2]
    holder, result = _in_thread(_send, conn_a, "/v1/classify", {"images": _images(3, seed=3)})
    _wait(lambda: _gauge(server.url, "softmoe_queue_depth", 'model="digits"') == 3, what="3 queued items")
    status, body = _send(conn_b, "/v1/classify", {"images": _images(2, seed=4)})
    assert status == 429 and body["error"]["type"] == "overloaded", body
    assert "3 of 4 places taken" in body["error"]["message"]
    holder.join(30)
    assert result["value"][0] == 200
    conn_a.close()
    conn_b.close()
    status, _ = _send(http.client.HTTPConnection("127.0.0.1", server.port, timeout=30), "/v1/classify",
                      {"images": _images(4, seed=5)})
    assert status == 200


def test_killed_frontend_gives_back_its_places(servers):
    """A front end killed while its zero-shot request holds 2 image places (its text row waits in
    the queue): the engine releases them, a 4-image request fits again, a new front end starts."""
    server = servers["slow"]
    conns = _connections(server)
    victim, conn = next(iter(conns.items()))
    body = {"model": "digits-lit", "images": _images(2, seed=11), "labels": ["nine"], "templates": ["{}"]}
    index = next(i for i, pid in server.frontend_pids().items() if pid == victim)

    def send() -> str:
        try:
            return str(_send(conn, "/v1/zero-shot", body))
        except (OSError, http.client.HTTPException) as e:  # its front end died: the connection with it
            return type(e).__name__

    sender, outcome = _in_thread(send)
    _wait(lambda: _gauge(server.url, "softmoe_queue_depth", 'model="digits-lit"') == 1, what="the text row queued")
    os.kill(victim, signal.SIGKILL)
    sender.join(30)
    assert outcome["value"] in ("RemoteDisconnected", "ConnectionResetError"), outcome
    _wait(lambda: f"front end {index} (pid {victim}) disconnected; its places were released" in server.log(),
          what="the engine to release the places")
    r = _post(server.url, "/v1/embed", {"model": "digits-lit", "images": _images(4, seed=12)})
    assert r.status_code == 200, r.text
    _wait(lambda: len(server.frontend_pids()) == 2 and victim not in server.frontend_pids().values(), timeout=60,
          what="a new front end")
    for c in conns.values():
        c.close()


def test_killed_engine_fails_waiting_requests_and_readiness(servers):
    server = servers["slow"]
    waiting, result = _in_thread(_post, server.url, "/v1/classify", {"images": _images(1, seed=21)})
    _wait(lambda: _gauge(server.url, "softmoe_queue_depth", 'model="digits"') == 1, what="a queued item")
    os.kill(server.engine_pid(), signal.SIGKILL)
    waiting.join(30)
    r = result["value"]
    assert r.status_code == 503 and "Retry-After" in r.headers, r.text
    _wait(lambda: "the engine" in server.log() and "exited" in server.log(), what="the supervisor to notice")
    for _ in range(6):  # new connections: both front ends
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code == 503
        live = httpx.get(f"{server.url}/v2/health/live", timeout=10)
        assert live.status_code == 503 and not live.json()["live"]
        late = _post(server.url, "/v1/classify", {"images": _images(1, seed=22)})
        assert late.status_code == 503 and late.json()["error"]["type"] == "unavailable"
    assert server.stop() == 1  # the replica failed: its supervisor says so


def test_metrics_merge_every_process(servers):
    """Counters summed over the front ends and the engine; queue depth from the engine alone."""
    text = httpx.get(f"{servers['split'].url}/metrics", timeout=10).text
    assert re.search(r'^softmoe_batches_total\{model="digits"\} [1-9]', text, re.M)  # the engine's counter
    assert re.search(r'^softmoe_queue_depth\{model="digits"\} 0', text, re.M)  # no pid label: the engine's
    assert re.search(r'^softmoe_requests_in_flight 0\.0', text, re.M)  # summed over the front ends (no pid)
    responses = float(re.search(r'^softmoe_responses_total\{status="200"\} (\S+)', text, re.M)[1])
    assert responses >= 17  # the earlier tests' requests to this server, whichever front end answered


# ------------------------------------------------------------------ shutdown


def test_sigterm_answers_in_flight_requests_and_exits_0(servers):
    server = servers["split"]
    answers: list[httpx.Response] = []
    images = _images(6, seed=31)
    threads = [threading.Thread(target=lambda i=i: answers.append(
        _post(server.url, "/v1/classify", {"images": [images[i]]}))) for i in range(6)]
    for t in threads:
        t.start()

    def all_six_admitted() -> bool:
        """Every request is past the door (in flight in a front end) or already answered: in flight
        is what SIGTERM must finish. Requests still connecting when it comes get 503 by design."""
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        in_flight = float(re.search(r"^softmoe_requests_in_flight (\S+)", text, re.M)[1])
        queued = float(re.search(r'^softmoe_queue_depth\{model="digits"\} (\S+)', text, re.M)[1])
        return in_flight + len(answers) >= 6 and queued >= 1

    _wait(all_six_admitted, what="six requests in flight, some queued")
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    ready = httpx.get(f"{server.url}/v2/health/ready", timeout=5)
    late = _post(server.url, "/v1/classify", {"images": images[:1]}, timeout=5)
    for t in threads:
        t.join(30)
    assert [r.status_code for r in answers] == [200] * 6, [r.text[:200] for r in answers]
    assert ready.status_code == 503
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    assert server.proc.wait(timeout=40) == 0
    assert "error" not in server.log().split("stopping:")[1].lower()
