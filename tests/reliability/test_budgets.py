"""Budgets, the one error path and failure classes, against a real server on loopback.

Every hostile case checks the same contract: a 4xx (429/503 only for overload) with a JSON error
naming the problem, no exception text, an x-request-id, the refusal counted, and the server
answering a normal request correctly afterwards. No test asserts on time: "before the work is
done" is proven by counting calls of the decoder and the backend.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import re
import socket
import threading

import httpx
import numpy as np
import pytest
from PIL import Image

from helpers.images import b64, png
from helpers.live import live_server
from server.http.app import create_app
from server.settings import Settings

NORMAL = png(np.random.default_rng(0).integers(0, 256, (8, 8), dtype=np.uint8))


def _metric(url: str, name: str, **labels) -> float | None:
    """The sum of the matching series, or None when no series matches."""
    found = None
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.match(rf"{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            found = (found or 0.0) + float(m.group(2))
    return found


def _normal_still_works(url: str) -> None:
    r = httpx.post(f"{url}/v1/classify", json={"images": [b64(NORMAL)], "top_k": 1}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["predictions"][0]["label"] in [str(i) for i in range(10)]


def _refused(r: httpx.Response, status: int | tuple[int, ...], needle: str, *secrets: str) -> dict:
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (r.status_code, r.text[:300])
    assert r.headers.get("x-request-id"), "every response carries x-request-id"
    body = r.json()
    message = body["error"] if isinstance(body["error"], str) else body["error"]["message"]
    assert needle.lower() in message.lower(), message
    for s in ("Traceback", "File \"", *secrets):
        assert s not in r.text, f"{s!r} leaked into the response: {r.text[:300]}"
    return body


@pytest.fixture(scope="module")
def url():
    with live_server(create_app(Settings())) as u:  # default settings, built-in models
        yield u


@pytest.fixture
def served():
    app = create_app(Settings(max_batch_size=8, max_delay_ms=2, request_timeout_s=10))
    with live_server(app) as u:
        yield app, u


@pytest.fixture(scope="module")
def bomb_png() -> bytes:
    """A real PNG of 6000x6000 constant pixels: ~100 KB on the wire, 36 MP to decode."""
    buf = io.BytesIO()
    Image.new("L", (6000, 6000), 7).save(buf, "PNG", optimize=False, compress_level=9)
    return buf.getvalue()


# ------------------------------------------------------------------------------- decode budget


def test_64_pixel_bombs_are_refused_before_any_decoding(url, bomb_png, monkeypatch):
    import server.pipeline.prepare as prepare  # every image path decodes through it

    calls = []
    real = prepare.decode
    monkeypatch.setattr(prepare, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert len(bomb_png) < 200_000
    r = httpx.post(f"{url}/v1/classify", json={"images": [b64(bomb_png)] * 64}, timeout=60)
    body = _refused(r, 413, "6000x6000")
    assert body["error"]["param"] == "images[0]"
    assert calls == []  # refused from the headers: no image of the request was decoded
    _normal_still_works(url)


def test_request_pixel_budget_counts_all_images_together(served, monkeypatch):
    app, url = served
    import server.pipeline.prepare as prepare  # every image path decodes through it

    calls = []
    real = prepare.decode
    monkeypatch.setattr(prepare, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    # Each image is within the per-image limit; together they are not.
    s = app.state.settings
    side = int((s.max_image_pixels) ** 0.5)
    buf = io.BytesIO()
    Image.new("L", (side, side), 3).save(buf, "PNG")
    n = s.max_request_pixels // (side * side) + 1
    r = httpx.post(f"{url}/v1/classify", json={"images": [b64(buf.getvalue())] * n}, timeout=60)
    _refused(r, 413, "max_request_pixels")
    assert calls == []
    assert _metric(url, "softmoe_requests_rejected_total", reason="over_budget") >= 1
    _normal_still_works(url)


# ------------------------------------------------------------------------------- bodies


def test_gzip_bomb_stops_at_the_body_limit(url):
    inflated = b'{"images": ["' + b"A" * (Settings().max_body_bytes + 10) + b'"]}'
    r = httpx.post(f"{url}/v1/classify", content=gzip.compress(inflated, 9), timeout=30,
                   headers={"content-type": "application/json", "content-encoding": "gzip"})
    _refused(r, 413, "decompressed")
    _normal_still_works(url)


def test_gzip_json_body_is_accepted(url):
    body = gzip.compress(json.dumps({"images": [b64(NORMAL)], "top_k": 1}).encode())
    r = httpx.post(f"{url}/v1/classify", content=body, timeout=30,
                   headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, needle", [
    (b"[" * 200_000, "nests"),
    (b'{"images": [], "top_k": ' + b"9" * 5000 + b"}", "json"),
    (b'{"images": "' + b"\xff\xfe" * 10 + b'"}', "json"),
])
def test_hostile_json_is_400(url, body, needle):
    r = httpx.post(f"{url}/v1/classify", content=body, headers={"content-type": "application/json"}, timeout=30)
    _refused(r, 400, needle)


def test_chunked_multipart_one_byte_over_the_limit_is_413():
    limit = 64 * 1024
    with live_server(create_app(Settings(max_body_bytes=limit))) as u:
        boundary = "bb"
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"images\"; filename=\"a.png\"\r\n"
                "Content-Type: image/png\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        body = head + b"x" * (limit + 1 - len(head) - len(tail)) + tail
        assert len(body) == limit + 1

        def chunks():
            for i in range(0, len(body), 4096):
                yield body[i:i + 4096]

        r = httpx.post(f"{u}/v1/classify", content=chunks(), timeout=30,
                       headers={"content-type": f"multipart/form-data; boundary={boundary}"})
        _refused(r, 413, "limit")
        _normal_still_works(u)


def test_multipart_at_the_limit_is_parsed_in_memory(url, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "SpooledTemporaryFile", None)  # nothing spools to disk
    files = [("images", (f"{i}.png", NORMAL, "image/png")) for i in range(3)]
    r = httpx.post(f"{url}/v1/classify", files=files, data={"top_k": "2"}, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 3


# ------------------------------------------------------------------------------- admission


def test_in_flight_byte_budget_is_a_reservation_at_the_door():
    settings = Settings(max_in_flight_bytes=256 * 1024, max_body_bytes=200 * 1024, min_body_rate=0)  # the slow client stays
    app = create_app(settings)
    with live_server(app) as u:
        host, port = u.removeprefix("http://").split(":")
        # A slow client declares 150 KiB and sends nothing yet: its bytes are reserved at once.
        slow = socket.create_connection((host, int(port)))
        try:
            slow.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 153600\r\n\r\n{")
            for _ in range(100):
                if _metric(u, "softmoe_requests_in_flight_bytes") == 153600:
                    break
                threading.Event().wait(0.05)
            assert _metric(u, "softmoe_requests_in_flight_bytes") == 153600
            big = json.dumps({"images": [b64(NORMAL)], "top_k": 1}).encode() + b" " * (150 * 1024)
            r = httpx.post(f"{u}/v1/classify", content=big, headers={"content-type": "application/json"}, timeout=30)
            _refused(r, 429, "max_in_flight_bytes")
            assert "retry-after" in r.headers
            assert _metric(u, "softmoe_requests_rejected_total", model="none", reason="body_budget") == 1
            _normal_still_works(u)  # small requests still fit
        finally:
            slow.close()
        for _ in range(100):
            if _metric(u, "softmoe_requests_in_flight_bytes") == 0:
                break
            threading.Event().wait(0.05)
        assert _metric(u, "softmoe_requests_in_flight_bytes") == 0  # released when the client left


def test_queue_places_are_reserved_before_decoding(served):
    """A request admitted at the door keeps its places while it decodes: others get 429 meanwhile."""
    app, url = served
    queue = app.state.models["digits"].queues["classify"]
    svc = app.state.service
    held = svc.reserve(app.state.models["digits"], "classify", queue.max_queue - 1)
    try:
        r = httpx.post(f"{url}/v1/classify", json={"images": [b64(NORMAL)] * 2}, timeout=30)
        _refused(r, 429, "places taken")
        assert "retry-after" in r.headers
        assert httpx.post(f"{url}/v1/classify", json={"images": [b64(NORMAL)]}, timeout=30).status_code == 200
    finally:
        held.close()
    assert queue.reserved == 0
    assert httpx.post(f"{url}/v1/classify", json={"images": [b64(NORMAL)] * 2}, timeout=30).status_code == 200


# ------------------------------------------------------------------------------- one error path


def test_unexpected_exception_is_json_500_with_request_id_and_counted(served, monkeypatch):
    app, url = served
    secret = "secret-internal-detail-42"

    async def boom(*a, **k):
        raise KeyError(secret)

    monkeypatch.setattr(app.state.service, "classify", boom)
    r = httpx.post(f"{url}/v1/classify", json={"images": [b64(NORMAL)]}, timeout=30,
                   headers={"x-request-id": "trace-me-1"})
    body = _refused(r, 500, "internal error", secret, "KeyError")
    assert r.headers["x-request-id"] == "trace-me-1"
    assert "trace-me-1" in body["error"]["message"]
    assert _metric(url, "softmoe_responses_total", status="500") == 1
    assert _metric(url, "softmoe_errors_total", type="internal_error") == 1
    assert _metric(url, "softmoe_request_duration_seconds_count", endpoint="/v1/classify", status_class="5xx") == 1
    monkeypatch.undo()
    _normal_still_works(url)


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/nowhere", 404), ("DELETE", "/v1/classify", 405), ("GET", "/v2/models/nope", 404),
    ("POST", "/v2/models/digits/infer", 400),
])
def test_every_error_carries_a_request_id_and_json(url, method, path, status):
    r = httpx.request(method, f"{url}{path}", timeout=30, content=b"{}" if method == "POST" else None)
    assert r.status_code == status, r.text
    assert r.headers.get("x-request-id")
    assert "error" in r.json()


def test_every_rejection_reason_is_a_series_from_a_fresh_start(url):
    from server.metrics import REJECT_REASONS

    for model in ("none", "digits", "digits-lit"):
        for reason in REJECT_REASONS:
            assert _metric(url, "softmoe_requests_rejected_total", model=model, reason=reason) is not None, (model, reason)
    assert _metric(url, "softmoe_images_total", model="digits", endpoint="classify") is not None
    assert _metric(url, "softmoe_backend_info", model="digits", backend="onnxruntime", device="cpu",
                   provider="CPUExecutionProvider") == 1  # auto: onnxruntime on cpu
    assert _metric(url, "softmoe_worker_alive") == 1


# ------------------------------------------------------------------------------- failure classes


def _count_calls(app, model="digits", fn="classify"):
    queue = app.state.models[model].queues[fn]
    real, shapes = queue.fn, []

    def counted(rows):
        shapes.append(rows["pixel_values"].shape[0])
        return real(rows)

    queue.fn = counted
    return queue, shapes


def test_transient_failure_is_503_retry_after_and_not_retried(served):
    import torch

    app, url = served
    queue, shapes = _count_calls(app)
    inner = queue.fn

    def oom(rows):
        inner(rows)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (secret-oom-detail)")

    queue.fn = oom
    r = httpx.post(f"{url}/v1/classify", json={"images": [b64(NORMAL)] * 4}, timeout=30)
    _refused(r, 503, "temporarily out of resources", "secret-oom-detail", "OutOfMemoryError")
    assert "retry-after" in r.headers
    assert len(shapes) == 1  # one call: an OOM is not retried item by item
    assert httpx.get(f"{url}/v2/health/ready").status_code == 200


def test_deterministic_failure_is_bisected_and_fails_its_item_only(served):
    app, url = served
    queue = app.state.models["digits"].queues["classify"]
    backend = app.state.models["digits"].backend
    queue.max_delay_s = 0.3  # let the eight requests share one batch
    shapes = []

    def poisoned(rows):
        shapes.append(rows["pixel_values"].shape[0])
        if (rows["pixel_values"][:, 0, 0, 0] == 1.0).any():  # a white top-left pixel is the poison
            raise ValueError("poisoned item (secret-value-detail)")
        return backend.run("classify", rows)

    queue.fn = poisoned
    rng = np.random.default_rng(5)
    goods = [rng.integers(0, 200, (8, 8), dtype=np.uint8) for _ in range(8)]
    bad = goods[5].copy()
    bad[0, 0] = 255
    images = goods[:5] + [bad] + goods[6:]

    async def together():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            return await asyncio.gather(*(client.post("/v1/classify", json={"images": [b64(png(im))]})
                                          for im in images))

    rs = asyncio.run(together())
    assert [r.status_code for r in rs].count(200) == 7
    _refused(rs[5], 500, "fails again", "secret-value-detail", "ValueError")
    assert "retry-after" not in rs[5].headers  # the same input fails the same way: no retry advice
    assert set(shapes) <= set(queue.shapes)  # strict: every retry at a proven padded shape
    # One poisoned item among n: bisection takes at most 1 + 2 * log2(n) calls, not 1 + n.
    assert len(shapes) <= 7, shapes
    alone = httpx.post(f"{url}/v1/classify", json={"images": [b64(png(goods[1]))]}, timeout=30)
    assert alone.json() == rs[1].json()  # batch-mates got their own, bitwise stable, results


def test_deadline_is_rechecked_before_each_retry():
    from server.batching.batcher import Batcher, ModelQueue

    calls = []

    def fn(rows):
        calls.append(len(rows["x"]))
        import time as _t

        _t.sleep(0.3)  # the first call outlives every item's deadline
        raise ValueError("deterministic")

    b = Batcher()
    q = b.add_queue(ModelQueue("m/f", "m", fn, max_batch_size=4, max_delay_s=0.05, max_queue=8, pad=True))

    async def main():
        futs = [b.submit(q, {"x": np.zeros(2, np.float32)}, 0.2) for _ in range(4)]
        b.start()
        return await asyncio.gather(*futs, return_exceptions=True)

    got = asyncio.run(main())
    b.stop()
    assert calls == [4]  # no retry ran: every item was past its deadline when bisection began
    assert all(getattr(e, "status", None) == 504 for e in got)


def test_sticky_cuda_error_fails_liveness_and_readiness(served):
    app, url = served
    queue = app.state.models["digits"].queues["classify"]

    def sticky(rows):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be ...")

    queue.fn = sticky
    r = httpx.post(f"{url}/v1/classify", json={"images": [b64(NORMAL)]}, timeout=30)
    _refused(r, 503, "restarting", "illegal memory access")
    assert httpx.get(f"{url}/v2/health/live").status_code == 503
    assert httpx.get(f"{url}/v2/health/ready").status_code == 503
    assert _metric(url, "softmoe_worker_alive") == 0
    again = httpx.post(f"{url}/v1/classify", json={"images": [b64(NORMAL)]}, timeout=30)
    assert again.status_code == 503 and "retry-after" in again.headers


def test_a_dead_worker_thread_fails_readiness(served):
    app, url = served
    batcher = app.state.batcher

    def crash(queue, items):
        raise SystemExit("the worker thread is gone")  # not an Exception: escapes the batch handling

    batcher.before_call = crash
    r = httpx.post(f"{url}/v1/classify", json={"images": [b64(NORMAL)]}, timeout=30)
    assert r.status_code == 503
    assert httpx.get(f"{url}/v2/health/ready").status_code == 503
    assert httpx.get(f"{url}/v2/health/live").status_code == 503


def test_real_backend_errors_map_to_their_classes(tmp_path):
    import onnxruntime as ort
    import torch

    from server.backends.failures import classify
    from server.batching.batcher import FatalBackendError

    x = torch.nn.Linear(4, 2)
    path = tmp_path / "lin.onnx"
    torch.onnx.export(x, (torch.zeros(1, 4),), str(path), input_names=["x"], output_names=["y"], dynamo=False)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception) as bad_shape:
        sess.run(None, {"x": np.zeros((1, 5), np.float32)})
    assert classify(bad_shape.value) == "deterministic"
    with pytest.raises(Exception) as torch_shape:
        x(torch.zeros(1, 5))
    assert classify(torch_shape.value) == "deterministic"
    assert classify(torch.cuda.OutOfMemoryError("CUDA out of memory")) == "transient"
    assert classify(MemoryError()) == "transient"
    assert classify(RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory")) == "transient"
    assert classify(RuntimeError("CUDA error: device-side assert triggered")) == "fatal"
    assert classify(RuntimeError("CUDA failure 700: an illegal memory access was encountered")) == "fatal"
    assert classify(FatalBackendError("x")) == "fatal"


# ------------------------------------------------------------------------------- OIP v2


def _oip(url: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v2/models/digits/infer", content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


def _pixels(shape=(1, 3, 8, 8), **params) -> dict:
    t = {"name": "pixel_values", "datatype": "FP32", "shape": list(shape)}
    if params:
        t["parameters"] = params
    return t


@pytest.mark.parametrize("body, field", [
    ({"inputs": [_pixels(binary_data_size="abc")]}, "binary_data_size"),
    ({"inputs": [_pixels(binary_data_size=True)]}, "binary_data_size"),
    ({"inputs": [_pixels(binary_data_size=-5)]}, "binary_data_size"),
    ({"inputs": [_pixels(shape=(2**62, 4))]}, "shape"),
    ({"inputs": [_pixels(shape=(2**62, 3, 8, 8))]}, "shape"),
    ({"inputs": [_pixels(shape=[1] * 9)]}, "shape"),
    ({"inputs": [_pixels(shape=("a", 3, 8, 8))]}, "shape"),
    ({"inputs": [{**_pixels(), "data": [0.0] * 192}], "parameters": {"binary_data_output": "yes"}}, "binary_data_output"),
    ({"inputs": [{**_pixels(), "data": [0.0] * 192}], "outputs": [{"name": "logits", "parameters": {"classification": "x"}}]},
     "classification"),
    ({"inputs": [{**_pixels(), "data": [0.0] * 192}], "outputs": [{"name": "logits", "parameters": {"binary_data": 1}}]},
     "binary_data"),
    ({"inputs": [{**_pixels(), "data": [1e30] * 192}]}, "finite"),
    ({"inputs": "nope"}, "inputs"),
])
def test_oip_parameters_and_shapes_are_type_checked(url, body, field):
    _refused(_oip(url, body), 400, field)


def test_oip_row_count_is_checked_before_any_allocation(url):
    _refused(_oip(url, {"inputs": [_pixels(shape=(2**30, 3, 8, 8), binary_data_size=0)]}), 422, "the limit is 64")


def test_oip_nan_input_is_400(url):
    raw = b'{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 8, 8], "data": [NaN' + \
          b", 0.0" * 191 + b"]}]}"
    _refused(_oip(url, raw), 400, "finite")


@pytest.mark.parametrize("header", ["abc", "-1", "99999999999999999999999", "1e3"])
def test_oip_binary_header_is_checked(url, header):
    _refused(_oip(url, b'{"inputs": []}', {"inference-header-content-length": header}), 400,
             "inference-header-content-length")


def test_oip_still_answers_after_abuse(url):
    data = np.zeros((1, 3, 8, 8), np.float32).reshape(-1).tolist()
    r = _oip(url, {"inputs": [{**_pixels(), "data": data}]})
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["shape"] == [1, 10]


# ------------------------------------------------------------------------------- zero-shot


def test_zero_shot_text_rows_budget_before_any_tower(served):
    app, url = served
    model = app.state.models["digits-lit"]
    calls = []
    for fn in ("text", "image"):
        q = model.queues[fn]
        real = q.fn
        q.fn = (lambda real: lambda rows: calls.append(1) or real(rows))(real)
    labels = [f"label {i}" for i in range(256)]
    templates = [f"template {j} of {{}}" for j in range(32)]
    r = httpx.post(f"{url}/v1/zero-shot", json={"images": [b64(NORMAL)], "labels": labels, "templates": templates},
                   timeout=30)
    _refused(r, 422, "max_text_rows_per_request")
    assert "8192" in r.json()["error"]["message"]
    assert calls == []


def test_zero_shot_validates_images_before_the_text_tower(served):
    app, url = served
    model = app.state.models["digits-lit"]
    calls = []
    q = model.queues["text"]
    real = q.fn
    q.fn = lambda rows: calls.append(1) or real(rows)
    r = httpx.post(f"{url}/v1/zero-shot", json={"images": [b64(NORMAL), b64(b"not an image at all")],
                                                "labels": ["zero", "one"]}, timeout=30)
    body = _refused(r, 400, "not a recognised image")
    assert body["error"]["param"] == "images[1]"
    assert calls == []


def test_zero_shot_over_long_prompt_names_the_right_label(url):
    limit = Settings().max_text_chars
    labels = ["short", "x" * (limit - 5), "other"]  # fits alone, not inside a template
    r = httpx.post(f"{url}/v1/zero-shot", json={"images": [b64(NORMAL)], "labels": labels,
                                                "templates": ["a photo of the number {}."]}, timeout=30)
    body = _refused(r, 422, "characters")
    assert body["error"]["param"] == "labels[1]"
    ok = httpx.post(f"{url}/v1/zero-shot", json={"images": [b64(NORMAL)], "labels": ["zero", "one"]}, timeout=30)
    assert ok.status_code == 200
