"""--pixel-transfer uint8: image rows cross to the backend as resized RGB bytes and are mapped to
the model's value range inside the torch backend (on its device) by a table lookup.

The claim tested: every output is bitwise the float32 path's, at every batch shape, through every
endpoint, in one process and split across front-end processes; the OIP contract says what the
model takes; a backend that cannot do it refuses to start.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers.images import b64, golden_pngs, random_pngs
from helpers.live import free_port, live_server, stop_process, wait_until
from server.http.app import create_app
from server.backends.torch_backend import TorchBackend
from server.settings import Settings
from softmoe_models.package import read_package
from softmoe_models.preprocess import pixel_table, to_pixel_values

ROOT = Path(__file__).resolve().parents[2]


def _rows(pkg: Path, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    cfg = read_package(pkg).preprocess
    u8 = np.random.default_rng(seed).integers(0, 256, (n, cfg.image_size, cfg.image_size, 3)).astype(np.uint8)
    return u8, np.stack([to_pixel_values(x, cfg) for x in u8])


def test_table_is_the_vmoe_value_range_map():
    # vmoe's value_range(-1, 1): lo + (hi - lo) * (u8 / 255) in float32, written out independently.
    u = np.arange(256, dtype=np.float32)
    assert np.array_equal(pixel_table((-1.0, 1.0)), np.float32(-1) + np.float32(2) * (u / np.float32(255)))
    assert np.array_equal(pixel_table((0.0, 1.0)), u / np.float32(255))


@pytest.mark.parametrize("name, fn", [("golden", "classify"), ("golden", "routing"), ("tt", "image")])
def test_backend_uint8_is_bitwise_the_float_path_at_every_shape(packages, name, fn):
    plain = TorchBackend(packages[name], max_batch_size=8)
    uint8 = TorchBackend(packages[name], max_batch_size=8, pixel_transfer="uint8")
    spec = (uint8.routing if fn == "routing" else uint8.functions[fn]).inputs[0]
    assert (spec.name, spec.dtype) == ("pixels", np.dtype(np.uint8))
    u8, f32 = _rows(packages[name], 8, seed=3)
    for b in (1, 2, 3, 8):
        want = plain.run(fn, {"pixel_values": f32[:b]})
        got = uint8.run(fn, {"pixels": u8[:b]})
        assert want.keys() == got.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), (b, k)
    assert uint8.describe()["pixel_transfer"] == "uint8" and plain.describe()["pixel_transfer"] == "float32"
    assert uint8.functions.get("text") == plain.functions.get("text")  # texts are not images


def test_module_needs_its_value_range(packages):
    from softmoe_models.package import load_model

    with pytest.raises(ValueError, match="value_range"):
        TorchBackend(load_model(packages["golden"]), pixel_transfer="uint8")
    with pytest.raises(ValueError, match="pixel_transfer"):
        TorchBackend(packages["golden"], pixel_transfer="uint16")


@pytest.fixture(scope="module")
def urls(packages, tmp_path_factory):
    models = [f"golden={packages['golden']}", f"lit={packages['tt-tok']}"]
    common = dict(models=models, backend="torch", max_batch_size=8, max_delay_ms=20,
                  cache_dir=str(tmp_path_factory.getbasetemp() / "cache"))
    with live_server(create_app(Settings(**common))) as plain, \
            live_server(create_app(Settings(**common, pixel_transfer="uint8"))) as uint8:
        yield plain, uint8


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


@pytest.mark.parametrize("path, body", [
    ("/v1/classify", {"model": "golden", "top_k": 10}),
    ("/v1/embed", {"model": "golden"}),
    ("/v1/embed", {"model": "lit"}),
    ("/v1/zero-shot", {"model": "lit", "labels": ["a", "b", "c"]}),
    ("/v1/routing", {"model": "golden"}),
])
def test_endpoints_answer_byte_identically(urls, path, body):
    plain, uint8 = urls
    images = [b64(b) for b in golden_pngs()[:3] + random_pngs(2, seed=11)]
    want = _post(plain, path, {**body, "images": images})
    got = _post(uint8, path, {**body, "images": images})
    assert want.status_code == 200, want.text
    assert got.status_code == 200 and got.content == want.content  # bitwise-equal floats


def test_routing_png_renders_from_uint8_rows(urls):
    plain, uint8 = urls
    body = {"model": "golden", "images": [b64(golden_pngs()[0])], "format": "png"}
    want, got = _post(plain, "/v1/routing", body), _post(uint8, "/v1/routing", body)
    assert got.status_code == 200 and got.headers["content-type"] == "image/png"
    assert got.content == want.content


def test_oip_contract_names_the_uint8_input(urls, packages):
    plain, uint8 = urls
    meta = httpx.get(f"{uint8}/v2/models/golden").json()
    assert meta["inputs"] == [{"name": "pixels", "datatype": "UINT8", "shape": [-1, 32, 32, 3]}]
    assert meta["parameters"]["pixel_transfer"] == "uint8"
    assert httpx.get(f"{plain}/v2/models/golden").json()["inputs"][0]["name"] == "pixel_values"
    lit = httpx.get(f"{uint8}/v2/models/lit").json()
    assert {i["name"]: i["datatype"] for i in lit["inputs"]} == {"pixels": "UINT8", "input_ids": "INT64", "text": "BYTES"}

    image = np.random.default_rng(5).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    x = np.stack([to_pixel_values(im, read_package(packages["golden"]).preprocess) for im in image])
    want = _post(plain, "/v2/models/golden/infer", {"inputs": [
        {"name": "pixel_values", "shape": [2, 3, 32, 32], "datatype": "FP32", "data": x.reshape(-1).tolist()}]})
    got = _post(uint8, "/v2/models/golden/infer", {"inputs": [
        {"name": "pixels", "shape": [2, 32, 32, 3], "datatype": "UINT8", "data": image.reshape(-1).tolist()}]})
    assert want.status_code == 200 and got.status_code == 200, got.text
    assert got.json()["outputs"] == want.json()["outputs"]

    # What the other contract sends is refused with a 400 naming what this model takes.
    r = _post(uint8, "/v2/models/golden/infer", {"inputs": [
        {"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": x[:1].reshape(-1).tolist()}]})
    assert r.status_code == 400 and "'pixels'" in r.json()["error"], r.text
    r = _post(plain, "/v2/models/golden/infer", {"inputs": [
        {"name": "pixels", "shape": [1, 32, 32, 3], "datatype": "UINT8", "data": image[:1].reshape(-1).tolist()}]})
    assert r.status_code == 400 and "'pixel_values'" in r.json()["error"], r.text


@pytest.mark.parametrize("data, datatype", [([300] + [0] * 3071, "UINT8"), ([-1] + [0] * 3071, "UINT8"),
                                            ([1.5] + [0] * 3071, "UINT8"), ([0] * 3072, "FP32")])
def test_oip_uint8_values_must_be_bytes(urls, data, datatype):
    _, uint8 = urls
    r = _post(uint8, "/v2/models/golden/infer", {"inputs": [
        {"name": "pixels", "shape": [1, 32, 32, 3], "datatype": datatype, "data": data}]})
    assert r.status_code == 400, r.text
    assert "pixels" in r.json()["error"]


def test_proven_shapes_with_uint8_rows(urls):
    _, uint8 = urls
    """The start-up proof runs on uint8 rows (every byte value) and lists what it proved; which
    smaller shapes hold depends on the CPU's kernels (tests/models/test_batch_invariance.py)."""
    shapes = httpx.get(f"{uint8}/v2/models/golden").json()["parameters"]["batch_shapes"]
    assert "classify" in shapes, shapes
    for fn, proven in shapes.items():
        assert proven[-1] == 8 and proven == sorted(set(proven)) and set(proven) <= {1, 2, 4, 8}, (fn, shapes)


def test_split_front_ends_carry_uint8_rows(tmp_path):
    """Two front-end processes and the engine: the rows cross shared memory as uint8 and the
    answers are the one-process float32 server's."""
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--port", str(port), "--backend", "torch",
                             "--frontend-workers", "2", "--pixel-transfer", "uint8", "--drain-seconds", "0",
                             "--cache-dir", str(tmp_path / "cache")],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(f"{url}/v2/health/ready", 150, lambda: proc.poll() is None, "the split server")
        images = [b64(b) for b in random_pngs(4, size=40, seed=2)]
        with live_server(create_app(Settings(backend="torch", cache_dir=str(tmp_path / "cache")))) as plain:
            for path in ("/v1/classify", "/v1/embed"):
                want = _post(plain, path, {"images": images})
                got = _post(url, path, {"images": images})
                assert want.status_code == 200 and got.content == want.content, (path, got.text)
        assert httpx.get(f"{url}/v2/models/digits").json()["inputs"][0]["name"] == "pixels"
    finally:
        stop_process(proc)
        log.close()


def test_refused_where_the_backend_takes_float_rows(packages):
    from test_cli import one_error_line, softmoe

    r = softmoe("serve", "--backend", "onnxruntime", "--pixel-transfer", "uint8", "--port", "0")
    line = one_error_line(r)
    assert "--pixel-transfer uint8" in line and "onnxruntime" in line, line
    # The library path too (create_app loads models without the CLI's checks).
    from server.engine.models import ModelLoadError, load_served_model

    with pytest.raises(ModelLoadError, match="--pixel-transfer uint8"):
        load_served_model(str(packages["golden"]), Settings(backend="onnxruntime", pixel_transfer="uint8"))
