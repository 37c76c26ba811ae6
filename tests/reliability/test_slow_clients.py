"""Slow and oversized clients, on raw sockets against a real server (the protocol ``softmoe serve``
runs: server.http.connection on uvicorn's httptools).

A client that opens a connection and sends nothing, half a head, a body that never ends, a head
without end, or never reads its response, must not hold a socket, an admission place or memory
for longer than the configured bounds. No assertion is on time: each case waits for the
server's answer (or its closing the connection), then checks what came and the counters.
"""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import numpy as np
import pytest

from helpers.images import b64, png
from helpers.live import live_server
from server.http.app import create_app
from server.settings import Settings

NORMAL = png(np.random.default_rng(1).integers(0, 256, (8, 8), dtype=np.uint8))
HEADER_TIMEOUT_S = 0.5
REQUEST_TIMEOUT_S = 4.0
GIVE_UP_S = 60.0  # a socket read this long means the server did not enforce its bound: the test fails


@pytest.fixture(scope="module")
def url():
    settings = Settings(header_timeout_s=HEADER_TIMEOUT_S, request_timeout_s=REQUEST_TIMEOUT_S,
                        max_images_per_request=1024, max_queue=2048, max_body_bytes=16 << 20)
    with live_server(create_app(settings)) as u:
        yield u


def _metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.match(rf"{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    s.settimeout(GIVE_UP_S)
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _read_one_response(s: socket.socket) -> bytes:
    """One response with a Content-Length, from a connection that stays open."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += s.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head.lower()).group(1))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def _response(raw: bytes) -> tuple[int, dict, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def _still_serves(url: str) -> None:
    r = httpx.post(f"{url}/v1/classify", json={"images": [b64(NORMAL)], "top_k": 1}, timeout=30)
    assert r.status_code == 200, r.text


def _idle(url: str) -> None:
    """Wait until no request is in flight and no body byte is reserved."""
    for _ in range(200):
        if _metric(url, "softmoe_requests_in_flight") == 0 and _metric(url, "softmoe_requests_in_flight_bytes") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("a request stayed in flight")


def _head(path: str, length: int, extra: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n").encode() + extra + b"\r\n"


# ------------------------------------------------------------------------------------- bodies


def test_a_body_that_stops_gets_408_and_frees_its_place(url):
    before = _metric(url, "softmoe_requests_rejected_total", model="none", reason="slow_client")
    with _connect(url) as s:
        s.sendall(_head("/v1/classify", 1000) + b"{")
        status, headers, body = _response(_read_until_closed(s))
    assert status == 408
    assert headers["connection"] == "close" and headers.get("x-request-id")
    assert body["error"]["type"] == "request_timeout"
    assert "min_body_rate" in body["error"]["message"] and "1 bytes in" in body["error"]["message"]
    assert _metric(url, "softmoe_requests_rejected_total", model="none", reason="slow_client") == before + 1
    _idle(url)
    _still_serves(url)


def _trickle(url: str, declared: int, piece: bytes, every_s: float) -> bytes:
    """Send a head declaring ``declared`` bytes, then ``piece`` every ``every_s`` until the server answers."""
    with _connect(url) as s:
        s.sendall(_head("/v1/classify", declared) + b"{")
        s.settimeout(every_s)
        raw = b""
        for _ in range(int(GIVE_UP_S / every_s)):
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                try:
                    s.sendall(piece)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            raw += chunk
        else:
            pytest.fail("the server kept reading a trickled body")
    return raw


def test_a_trickled_body_under_min_body_rate_gets_408(url):
    """A byte every 0.1 s keeps every single read short; the body's average rate ends it."""
    status, _, body = _response(_trickle(url, 100_000, b" ", 0.1))
    assert status == 408 and body["error"]["type"] == "request_timeout", body
    assert "min_body_rate" in body["error"]["message"], body
    _idle(url)


def test_a_body_above_min_body_rate_is_still_bounded_by_the_deadline(url):
    """32 KiB every 0.05 s (about 640 KiB/s, ten times the 64 KiB/s minimum) of a declared 15 MiB
    body would take 24 s: the request's deadline ends it."""
    status, _, body = _response(_trickle(url, 15 << 20, b" " * 32768, 0.05))
    assert status == 408 and body["error"]["type"] == "request_timeout", body
    assert "request_timeout_s" in body["error"]["message"], body
    _idle(url)


def test_a_body_slower_than_the_head_timeout_but_inside_the_deadline_is_served(url):
    """The head timer stops once the head is complete: only the deadline bounds the body."""
    body = json.dumps({"images": [b64(NORMAL)], "top_k": 1}).encode()
    with _connect(url) as s:
        s.sendall(_head("/v1/classify", len(body), b"Connection: close\r\n"))
        time.sleep(HEADER_TIMEOUT_S * 2)  # past the head timeout; inside the body's grace and the deadline
        s.sendall(body)
        raw = _read_until_closed(s)
    status, _, out = _response(raw)
    assert status == 200, out
    assert out["results"][0]["predictions"][0]["label"] in [str(i) for i in range(10)]


def test_a_body_held_while_the_event_loop_is_busy_is_served():
    """A client is charged only for time the server spends waiting for its bytes. Its head is in and
    its handler waits for the body; another request then holds the event loop for longer than the
    body's grace (a handler that blocks, as a burst of work does), and meanwhile the whole body
    arrives. When the loop comes back, the body's timer and its bytes are due in the same turn: the
    body is taken and served (the timer winning gave 408 "arriving slower than 65536 bytes/s")."""
    from server.http.app import BODY_GRACE_S

    app = create_app(Settings())

    @app.post("/busy")
    async def busy() -> dict:
        time.sleep(BODY_GRACE_S + 1.5)  # on the event loop: nothing else runs meanwhile
        return {}

    body = json.dumps({"images": [b64(NORMAL)], "top_k": 1}).encode()
    with live_server(app) as u, _connect(u) as waiting, _connect(u) as blocker:
        waiting.sendall(_head("/v1/classify", len(body), b"Connection: close\r\n"))
        for _ in range(200):  # admitted: its handler is about to wait for the body
            if _metric(u, "softmoe_requests_in_flight") == 1:
                break
            time.sleep(0.02)
        time.sleep(0.2)
        blocker.sendall(b"POST /busy HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        time.sleep(0.5)  # the loop is inside busy() now
        waiting.sendall(body)
        status, _, out = _response(_read_until_closed(waiting))
        assert _response(_read_until_closed(blocker))[0] == 200
        assert _metric(u, "softmoe_requests_rejected_total", model="none", reason="slow_client") == 0
    assert status == 200, out
    assert out["results"][0]["predictions"][0]["label"] in [str(i) for i in range(10)]


# -------------------------------------------------------------------------------------- heads


def test_half_a_head_gets_408_and_the_connection_closes(url):
    before = _metric(url, "softmoe_responses_total", status="408")
    with _connect(url) as s:
        s.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: t\r\nX-Request-Id: half-head-1\r\nContent-Le")
        status, headers, body = _response(_read_until_closed(s))
    assert status == 408 and headers["connection"] == "close"
    assert headers["x-request-id"] == "half-head-1"  # the headers that did arrive
    assert body["error"]["type"] == "request_timeout" and "header_timeout_s" in body["error"]["message"]
    assert _metric(url, "softmoe_responses_total", status="408") == before + 1
    assert _metric(url, "softmoe_errors_total", type="request_timeout") >= 1
    _still_serves(url)


def test_a_connection_that_sends_nothing_is_closed_without_a_response(url):
    before = _metric(url, "softmoe_requests_rejected_total", model="none", reason="slow_client")
    with _connect(url) as s:
        assert _read_until_closed(s) == b""
    assert _metric(url, "softmoe_requests_rejected_total", model="none", reason="slow_client") == before


def test_the_head_timer_restarts_after_each_response_on_a_kept_alive_connection(url):
    """uvicorn's own keep-alive timer stops at the first byte of the next request; ours does not."""
    body = json.dumps({"images": [b64(NORMAL)], "top_k": 1}).encode()
    with _connect(url) as s:
        s.sendall(_head("/v1/classify", len(body)) + body)
        first = _read_one_response(s)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        s.sendall(b"POST /v1/classify HTTP/1.1\r\nHo")  # the second head stops
        status, _, out = _response(_read_until_closed(s))
    assert status == 408 and out["error"]["type"] == "request_timeout"


@pytest.mark.parametrize("shape", ["one long header", "many headers"])
def test_a_head_over_max_header_bytes_gets_431(url, shape):
    limit = Settings().max_header_bytes
    extra = (b"X-Long: " + b"a" * (limit + 1) + b"\r\n") if shape == "one long header" else b"X-Many: b\r\n" * (limit // 10)
    before = _metric(url, "softmoe_requests_rejected_total", model="none", reason="over_budget")
    with _connect(url) as s:
        try:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n" + extra + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may close while the rest is still on its way; the answer was sent first
        status, headers, body = _response(_read_until_closed(s))
    assert status == 431 and headers["connection"] == "close"
    assert body["error"]["type"] == "headers_too_large" and "max_header_bytes" in body["error"]["message"]
    assert _metric(url, "softmoe_requests_rejected_total", model="none", reason="over_budget") == before + 1
    _still_serves(url)


def test_pipelined_requests_are_answered_in_order_and_a_refused_head_comes_last(url):
    """HTTP/1.1 pipelining: the responses come in the order of the requests, and a refusal of a
    later head (431) comes after the responses owed to the earlier ones, never in their place."""
    body = json.dumps({"images": [b64(NORMAL)], "top_k": 1}).encode()
    one = _head("/v1/classify", len(body)) + body
    with _connect(url) as s:
        s.sendall(one + one + b"GET /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        raw = _read_until_closed(s)
    assert re.findall(rb"HTTP/1.1 (\d+)", raw) == [b"200", b"200", b"200"]
    limit = Settings().max_header_bytes
    with _connect(url) as s:
        try:
            s.sendall(one + b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Long: " + b"a" * (limit + 1) + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        raw = _read_until_closed(s)
    assert re.findall(rb"HTTP/1.1 (\d+)", raw) == [b"200", b"431"], raw[:300]
    first = raw.split(b"HTTP/1.1 431")[0]
    assert b'"predictions"' in first  # the first request's own answer, whole


def test_a_head_just_under_max_header_bytes_is_served(url):
    limit = Settings().max_header_bytes
    r = httpx.get(f"{url}/v1/models", headers={"x-pad": "a" * (limit - 1024)}, timeout=30)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------- responses


def test_a_client_that_never_reads_its_response_is_dropped(url):
    """A routing response bigger than the kernel's socket buffers stays in the server's memory
    until the client reads it; one left unread for request_timeout_s is dropped and counted."""
    images = 1024
    body = json.dumps({"images": [b64(NORMAL)] * images, "format": "json"}).encode()
    size = len(httpx.post(f"{url}/v1/routing", content=body, headers={"content-type": "application/json"},
                          timeout=120).content)
    assert size > 2 * 4194304, f"a {size}-byte response may fit in the kernel's buffers"  # tcp_wmem's default max
    before = _metric(url, "softmoe_errors_total", type="response_timeout")
    with _connect(url, rcvbuf=4096) as s:
        s.sendall(_head("/v1/routing", len(body)) + body)
        for _ in range(int(GIVE_UP_S / 0.2)):
            if _metric(url, "softmoe_errors_total", type="response_timeout") > before:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the unread response was never dropped")
        got = _read_until_closed(s)
    assert got.startswith(b"HTTP/1.1 200") and len(got) < size  # cut off, not delivered
    _idle(url)
    _still_serves(url)


# -------------------------------------------------------------------------------- connections


def test_connections_past_max_connections_get_503_at_once_and_the_rest_still_serve():
    """Counted in-process (the registry's own values), so no scrape opens a connection of its own."""
    limit = 4
    app = create_app(Settings(max_connections=limit, header_timeout_s=30))
    value = app.state.metrics.registry.get_sample_value

    def settle(expected: int) -> None:
        for _ in range(200):
            if value("softmoe_connections_open") == expected:
                return
            time.sleep(0.05)
        raise AssertionError(f"open connections never settled at {expected}: {value('softmoe_connections_open')}")

    refused = {"model": "none", "reason": "too_many_connections"}
    with live_server(app) as u:
        settle(0)
        before = value("softmoe_requests_rejected_total", refused)
        held = [_connect(u) for _ in range(limit)]
        try:
            settle(limit)
            with _connect(u) as extra:  # one over the limit: answered before it sends anything
                extra.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
                status, headers, body = _response(_read_until_closed(extra))
            assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
            assert body["error"]["type"] == "unavailable" and "max_connections" in body["error"]["message"]
            for s in held:  # the connections within the limit are served
                s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n")
                assert _read_one_response(s).startswith(b"HTTP/1.1 200")
        finally:
            for s in held:
                s.close()
        settle(0)
        assert value("softmoe_requests_rejected_total", refused) == before + 1
        _still_serves(u)
