"""Hostile and odd inputs against the real server (uvicorn on loopback, default settings):
body limits, pixel bombs, corrupt data, refused formats, EXIF, the mode zoo, animations,
multipart abuse, request limits, and no URL fetching. Cases 1-11 of the reliability issue."""

from __future__ import annotations

import io
import socket
import struct
import threading
import zlib
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from PIL import Image

from helpers.images import b64, png
from helpers.live import live_server
from server.http.app import create_app
from server.settings import Settings

LIMIT = Settings().max_body_bytes


@pytest.fixture(scope="module")
def url():
    with live_server(create_app(Settings())) as u:  # default settings, built-in models
        yield u


def _json_body_of_size(size: int) -> bytes:
    """A valid classify request of exactly ``size`` bytes (JSON whitespace padding)."""
    head = b'{"images": ["' + b64(_digit_png()).encode() + b'"], "top_k": 1'
    return head + b" " * (size - len(head) - 1) + b"}"


def _digit_png(seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return png(rng.integers(0, 256, (8, 8), dtype=np.uint8))


def _embed(url: str, data: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/embed", json={"model": "digits", "images": [b64(data)], "normalize": False}, timeout=30)


def _raw_request(url: str, head: bytes, body: bytes = b"", read_timeout: float = 10.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                return data
            data += chunk
        head_part, _, rest = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head_part.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return head_part + b"\r\n\r\n" + rest


# 1 -------------------------------------------------------------------------- body limits


def test_content_length_over_limit_is_413_before_the_body(url):
    head = (b"POST /v1/classify HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (LIMIT + 1))
    reply = _raw_request(url, head)  # the body is never sent: the answer must not wait for it
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"exceeds the limit" in _raw_request(url, head)


def test_one_byte_under_the_limit_is_accepted(url):
    r = httpx.post(f"{url}/v1/classify", content=_json_body_of_size(LIMIT - 1),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    r = httpx.post(f"{url}/v1/classify", content=_json_body_of_size(LIMIT + 1),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


# 2 -------------------------------------------------------------------------- chunked, lying length


def _rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_chunked_body_over_limit_is_413_and_memory_stays_flat():
    small = Settings(max_body_bytes=1 << 20)
    with live_server(create_app(small)) as u:
        chunk = b"x" * 65536
        sent = [0]

        def gen():
            for _ in range(800):  # 50 MiB offered, 1 MiB allowed
                sent[0] += len(chunk)
                yield chunk

        before = _rss()
        try:
            r = httpx.post(f"{u}/v1/classify", content=gen(), headers={"content-type": "application/json"}, timeout=60)
            status = r.status_code
        except httpx.HTTPError:
            status = None  # the server may close the stream once it has answered
        grown = _rss() - before
        if status is not None:
            assert status == 413
        assert grown < 24 << 20, f"server+client RSS grew by {grown / 2**20:.0f} MiB for a 1 MiB limit"
        assert httpx.get(f"{u}/v2/health/live").status_code == 200


def test_lying_content_length_is_a_client_error(url):
    body = _json_body_of_size(4000)
    head = (b"POST /v1/classify HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    reply = _raw_request(url, head, body)
    assert reply.split(b" ")[1][:1] == b"4", reply[:200]  # 400: the first 100 bytes are not JSON


# 3 -------------------------------------------------------------------------- pixel bombs


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_pixel_bomb_is_refused_from_the_header(url):
    bomb = _png_header_only(50_000, 50_000)
    assert len(bomb) < 200
    r = httpx.post(f"{url}/v1/classify", content=bomb, headers={"content-type": "image/png"}, timeout=30)
    assert r.status_code in (413, 422) and "pixels" in r.json()["error"]["message"]


# 4 -------------------------------------------------------------------------- corrupt inputs


def _sample_jpeg() -> bytes:
    from sklearn.datasets import load_sample_image

    buf = io.BytesIO()
    Image.fromarray(load_sample_image("flower.jpg")).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.mark.parametrize("name,kwargs,needle", [
    ("truncated jpeg", dict(content=_sample_jpeg()[:5000], headers={"content-type": "image/jpeg"}), "truncated"),
    ("random bytes", dict(content=np.random.default_rng(0).bytes(3000), headers={"content-type": "image/png"}), "not a recognised image"),
    ("empty body", dict(content=b"", headers={"content-type": "image/png"}), "empty"),
    ("bad base64", dict(json={"images": ["@@@@"]}), "base64"),
    ("bad data uri", dict(json={"images": ["data:image/png,abc"]}), "data URI"),
    ("empty json", dict(content=b"", headers={"content-type": "application/json"}), "empty"),
])
def test_corrupt_inputs_are_400_with_a_clear_message(url, name, kwargs, needle):
    r = httpx.post(f"{url}/v1/classify", timeout=30, **kwargs)
    assert r.status_code == 400, (name, r.text)
    err = r.json()["error"]
    assert needle in err["message"]
    assert "Traceback" not in r.text and "File \"" not in r.text and "/work/" not in r.text


# 5 -------------------------------------------------------------------------- refused formats


REFUSED = {
    "PSD": b"8BPS\x00\x01" + b"\0" * 40,
    "PDF": b"%PDF-1.7\n1 0 obj\n<<>>\nendobj\n",
    "EPS": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n",
    "TIFF": b"II*\x00\x08\x00\x00\x00" + b"\0" * 32,
    "SVG": b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>',
}


@pytest.mark.parametrize("fmt", list(REFUSED))
def test_formats_outside_the_allowlist_are_415_without_decoding(url, fmt, monkeypatch):
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(1) or real_open(*a, **k))
    r = httpx.post(f"{url}/v1/classify", json={"images": [b64(REFUSED[fmt])]}, timeout=30)
    assert r.status_code == 415 and fmt in r.json()["error"]["message"]
    assert opened == []  # no decoder ran


# 6 -------------------------------------------------------------------------- EXIF orientation


INVERSE = {1: None, 2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
           4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90,
           7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_270}


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_gives_the_pre_rotated_result(url, orientation):
    upright = Image.fromarray(np.random.default_rng(5).integers(0, 256, (12, 8, 3), dtype=np.uint8))
    stored = upright if INVERSE[orientation] is None else upright.transpose(INVERSE[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    stored.save(buf, "PNG", exif=exif.tobytes())
    a = _embed(url, buf.getvalue())
    b = _embed(url, png(np.asarray(upright)))
    assert a.status_code == b.status_code == 200
    assert a.json() == b.json()


# 7 -------------------------------------------------------------------------- mode zoo


def _encode(im: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def _zoo() -> dict[str, bytes]:
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    pal = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pal.info["transparency"] = 0
    return {
        "CMYK jpeg": _encode(Image.fromarray(rgb).convert("CMYK"), "JPEG"),
        "16-bit gray": _encode(Image.fromarray(rng.integers(0, 65535, (16, 16), dtype=np.uint16))),
        "palette+transparency": _encode(pal),
        "RGBA": _encode(Image.fromarray(np.dstack([rgb, rng.integers(0, 256, (16, 16), dtype=np.uint8)]), "RGBA")),
        "LA": _encode(Image.fromarray(rgb[..., 0]).convert("LA")),
        "1-bit": _encode(Image.fromarray(rgb[..., 0] > 128)),
        "grayscale": _encode(Image.fromarray(rgb[..., 0], "L")),
        "1x1": _encode(Image.fromarray(rgb[:1, :1])),
        "BMP": _encode(Image.fromarray(rgb), "BMP"),
        "WEBP": _encode(Image.fromarray(rgb), "WEBP"),
        "GIF": _encode(Image.fromarray(rgb).convert("P"), "GIF"),
    }


@pytest.mark.parametrize("mode", list(_zoo()))
def test_mode_zoo_is_accepted(url, mode):
    r = httpx.post(f"{url}/v1/classify", json={"images": [b64(_zoo()[mode])]}, timeout=30)
    assert r.status_code == 200, (mode, r.text)


def test_alpha_is_composited_on_white(url):
    transparent = Image.new("RGBA", (8, 8), (10, 200, 30, 0))
    white = Image.new("RGB", (8, 8), (255, 255, 255))
    assert _embed(url, _encode(transparent)).json() == _embed(url, _encode(white)).json()


# 8 -------------------------------------------------------------------------- animations


def test_animated_gif_with_thousands_of_frames_uses_the_first(url):
    rng = np.random.default_rng(2)
    frames = [Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).convert("P") for _ in range(3000)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=10, loop=0)
    first = _encode(frames[0], "GIF")
    a, b = _embed(url, buf.getvalue()), _embed(url, first)
    assert a.status_code == 200 and a.json() == b.json()


def test_animated_webp_uses_the_first_frame(url):
    rng = np.random.default_rng(3)
    frames = [Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(500)]
    buf = io.BytesIO()
    try:
        frames[0].save(buf, "WEBP", save_all=True, append_images=frames[1:], lossless=True, duration=10)
    except (OSError, ValueError):
        pytest.skip("this Pillow build cannot write animated WebP")
    single = io.BytesIO()
    frames[0].save(single, "WEBP", lossless=True)
    first = single.getvalue()
    a = _embed(url, buf.getvalue())
    assert a.status_code == 200
    # Lossless WebP: the animation's first frame decodes to the same pixels as the frame alone.
    assert a.json() == _embed(url, first).json()


# 9 -------------------------------------------------------------------------- multipart abuse


def test_thousands_of_parts_are_refused_and_health_stays_responsive(url):
    boundary = "b0undary"
    parts = "".join(f'--{boundary}\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nx\r\n' for i in range(5000))
    body = (parts + f"--{boundary}--\r\n").encode()
    health: list[int] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            health.append(httpx.get(f"{url}/v2/health/live", timeout=5).status_code)

    t = threading.Thread(target=poll)
    t.start()
    try:
        r = httpx.post(f"{url}/v1/classify", content=body, timeout=30,
                       headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    finally:
        stop.set()
        t.join()
    assert r.status_code in (400, 413, 422), r.text[:300]
    assert health and set(health) == {200}


def test_huge_preamble_is_bounded(url):
    boundary = "zz"
    body = (b"P" * (4 << 20) + f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"images\"; "
            f"filename=\"a.png\"\r\nContent-Type: image/png\r\n\r\n".encode() + _digit_png() + f"\r\n--{boundary}--\r\n".encode())
    r = httpx.post(f"{url}/v1/classify", content=body, timeout=30,
                   headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code in (200, 400, 413), r.text[:300]


# 10 ------------------------------------------------------------------------- request limits


def test_request_limits_are_422_and_named(url):
    s = Settings()
    img = b64(_digit_png())
    r = httpx.post(f"{url}/v1/classify", json={"images": [img] * (s.max_images_per_request + 1)}, timeout=30)
    assert r.status_code == 422 and str(s.max_images_per_request) in r.json()["error"]["message"]
    labels = [f"label {i}" for i in range(s.max_texts_per_request + 1)]
    r = httpx.post(f"{url}/v1/zero-shot", json={"images": [img], "labels": labels}, timeout=30)
    assert r.status_code == 422 and str(s.max_texts_per_request) in r.json()["error"]["message"]
    long = "x" * (s.max_text_chars + 1)
    r = httpx.post(f"{url}/v1/zero-shot", json={"images": [img], "labels": ["one", long]}, timeout=30)
    assert r.status_code == 422 and str(s.max_text_chars) in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/embed", json={"texts": [long]}, timeout=30)
    assert r.status_code == 422 and str(s.max_text_chars) in r.json()["error"]["message"]


# 11 ------------------------------------------------------------------------- no URL fetching


@contextmanager
def _outbound_connections():
    attempts: list[tuple] = []
    real = socket.socket.connect

    def connect(self, address):
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise OSError("outbound connection blocked by the test")
        return real(self, address)

    socket.socket.connect = connect
    try:
        yield attempts
    finally:
        socket.socket.connect = real


@pytest.mark.parametrize("ref", ["http://10.1.2.3/cat.jpg", "https://example.com/a.png", "file:///etc/passwd",
                                 "//example.com/a.png", "ftp://example.com/a.png"])
def test_urls_are_rejected_and_never_fetched(url, ref):
    with _outbound_connections() as attempts:
        r = httpx.post(f"{url}/v1/classify", json={"images": [ref]}, timeout=30)
        r2 = httpx.post(f"{url}/v1/embeddings", json={"model": "digits-lit", "input": [ref]}, timeout=30)
    assert r.status_code == 422 and "not fetched" in r.json()["error"]["message"]
    assert r2.status_code in (200, 422)  # a non-data-URI string is text for /v1/embeddings, never a URL
    assert attempts == []


@pytest.mark.parametrize("how", ["query twice", "form twice", "query and form", "query and JSON"])
def test_a_field_given_twice_is_422_not_one_of_them_silently(url, how):
    """``top_k`` (or ``model``) given two ways or twice: refused, naming the field; before, the
    last value (or the JSON body's) won without a word."""
    image = _digit_png()
    files = [("images", ("a.png", image, "image/png"))]
    if how == "query twice":
        r = httpx.post(f"{url}/v1/classify?top_k=1&top_k=2", content=image, headers={"content-type": "image/png"},
                       timeout=30)
    elif how == "form twice":
        r = httpx.post(f"{url}/v1/classify", files=files, data={"top_k": ["1", "2"]}, timeout=30)
    elif how == "query and form":
        r = httpx.post(f"{url}/v1/classify?top_k=1", files=files, data={"top_k": "2"}, timeout=30)
    else:
        r = httpx.post(f"{url}/v1/classify?model=digits", json={"model": "digits-lit", "images": [b64(image)]},
                       timeout=30)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] in ("top_k", "model") and err["param"] in err["message"], err
    # Given once, each way works.
    assert httpx.post(f"{url}/v1/classify?top_k=2", files=files, timeout=30).json()["results"][0]["predictions"][1]
    assert httpx.post(f"{url}/v1/classify?model=digits", json={"images": [b64(image)]}, timeout=30).status_code == 200


@pytest.mark.parametrize("path", ["/v1/classify", "/v1/embeddings", "/v2/models/digits/infer"])
def test_a_json_key_given_twice_is_400_naming_it(url, path):
    image = b64(_digit_png())
    body = {
        "/v1/classify": f'{{"images": ["{image}"], "top_k": 1, "top_k": 3}}',
        "/v1/embeddings": '{"model": "digits-lit", "input": "seven", "model": "digits"}',
        "/v2/models/digits/infer": '{"inputs": [{"name": "pixel_values", "name": "x", "shape": [1, 3, 8, 8], '
                                   '"datatype": "FP32", "data": [' + ", ".join(["0.0"] * 192) + ']}]}',
    }[path]
    r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    message = err if isinstance(err, str) else err["message"]
    assert "twice" in message and ("top_k" in message or "model" in message or "name" in message), message


LONE = "a\\ud800b"  # a JSON escape of a lone surrogate: valid JSON, not Unicode


@pytest.mark.parametrize("path, body, field", [
    ("/v1/classify", '{"model": "%s", "images": ["x"]}', "model"),
    ("/v1/zero-shot", '{"images": ["%%s"], "labels": ["cat", "%s"]}', "labels.1"),
    ("/v1/zero-shot", '{"images": ["%%s"], "labels": ["cat"], "templates": ["%s {}"]}', "templates.0"),
    ("/v1/zero-shot", '{"model": "%s", "images": ["%%s"], "labels": ["cat"]}', "model"),
    ("/v1/embed", '{"model": "digits-lit", "texts": ["ok", "%s"]}', "texts.1"),
    ("/v1/embeddings", '{"model": "digits-lit", "input": "%s"}', "input"),
    ("/v1/embeddings", '{"model": "digits-lit", "input": ["ok", "%s"]}', "input.1"),
    ("/v1/embeddings", '{"model": "%s", "input": "ok"}', "model"),
    ("/v1/embeddings", '{"model": "digits-lit", "input": "ok", "user": "%s"}', "user"),
    ("/v2/models/digits/infer", '{"id": "%s", "inputs": []}', "id"),
    ("/v2/models/digits/infer", '{"inputs": [{"name": "%s", "shape": [1], "datatype": "FP32", "data": [0]}]}',
     "inputs.0.name"),
    ("/v2/models/digits/infer", '{"inputs": [{"name": "x", "shape": [1], "datatype": "%s", "data": [0]}]}',
     "inputs.0.datatype"),
    ("/v2/models/digits/infer", '{"inputs": [], "outputs": [{"name": "%s"}]}', "outputs.0.name"),
    ("/v2/models/digits-lit/infer", '{"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["ok", "%s"]}]}',
     "inputs.0.data.1"),
])
def test_a_lone_surrogate_in_a_text_field_is_400_naming_it(url, path, body, field):
    """JSON may carry ``"a\\ud800b"``; it is no Unicode text, and no tokenizer or encoder takes it."""
    text = (body % LONE).replace("%s", b64(_digit_png())) if "%%s" in body else body % LONE
    r = httpx.post(url + path, content=text.encode(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert message.startswith(f"{field}: ") and "nicode" in message, message
    if not isinstance(error, str):
        assert error["param"] == field


@pytest.mark.parametrize("how", ["form", "query"])
def test_text_that_is_not_utf8_in_a_form_field_or_query_is_400_naming_it(url, how):
    image = _digit_png()
    if how == "form":
        body = (b'--B\r\nContent-Disposition: form-data; name="labels"\r\n\r\nx\xed\xa0\x80y\r\n--B\r\n'
                b'Content-Disposition: form-data; name="image"; filename="a.png"\r\nContent-Type: image/png\r\n\r\n'
                + image + b"\r\n--B--\r\n")
        r = httpx.post(f"{url}/v1/zero-shot", content=body, headers={"content-type": "multipart/form-data; boundary=B"},
                       timeout=30)
    else:
        r = httpx.post(f"{url}/v1/zero-shot?labels=cat&labels=%ED%A0%80", content=image,
                       headers={"content-type": "image/png"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "labels" and "UTF-8" in r.json()["error"]["message"]
