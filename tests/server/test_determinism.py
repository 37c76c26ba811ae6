"""Per-sequence determinism as a guarantee, on a real server under concurrent load.

The same image sent alone, and sent while 31 other different images are in flight, must return
byte-identical outputs (strict determinism, both CPU backends). Batching must actually happen.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import numpy as np
import pytest
import torch

from helpers.images import b64, golden_pngs, random_pngs
from helpers.live import live_server
from server.http.app import create_app
from server.settings import Settings


@pytest.fixture(scope="module", params=[("torch", 1, "auto"), ("onnxruntime", 1, "auto"), ("torch", 2, "auto"),
                                        ("onnxruntime", 2, "auto"), ("onnxruntime", 2, "always")],
                ids=lambda p: f"{p[0]}-concurrent{p[1]}" + ("-beside" if p[2] == "always" else ""))
def served(request, packages, tmp_path_factory):
    """A live server per backend, running one batch at a time or two at once (--concurrent-batches).
    onnxruntime with two: --wide-lone-batches, so a lone batch runs alone on the routing graph's
    session (every thread); ``-beside``: batches at load also run beside each other on the
    classifier's own session (one thread each), which the tiny golden model is too light for with
    --wide-lone-beside auto: the same image must give the same bytes on both sessions."""
    backend, concurrent, beside = request.param
    settings = Settings(models=[f"golden={packages['golden']}", f"lit={packages['tt-tok']}"], backend=backend,
                        max_batch_size=8, max_delay_ms=20, cache_dir=str(tmp_path_factory.getbasetemp() / "cache"),
                        concurrent_batches=concurrent, threads=2, wide_lone_beside=beside)
    threads = torch.get_num_threads()
    try:
        with live_server(create_app(settings)) as u:
            yield u, concurrent, backend, beside
    finally:
        torch.set_num_threads(threads)  # the torch backend sets it for the whole process


@pytest.fixture(scope="module")
def url(served):
    return served[0]


def test_models_endpoint_says_how_many_batches_run_at_once(served):
    url, concurrent, backend, beside = served
    params = httpx.get(f"{url}/v2/models/golden", timeout=10).json()["parameters"]
    assert params["concurrent_batches"] == concurrent
    if backend == "onnxruntime" and concurrent == 2:  # proven at start-up; beside only when forced (light model)
        assert params["wide_lone_batches"] == {"proven": True, "beside": beside == "always"}
    else:
        assert "wide_lone_batches" not in params
    # onnxruntime on cpu says its threads' spin policy (the default: spinning within a batch)
    assert params.get("ort_spinning") == ("run" if backend == "onnxruntime" else None)
    listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    assert listed["lit"]["batching"]["concurrent_batches"] == concurrent


def _oip(image: np.ndarray) -> dict:
    x = (image.astype(np.float32) / 255 * 2 - 1).transpose(2, 0, 1)[None]
    return {"inputs": [{"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": x.reshape(-1).tolist()}]}


async def _burst(url: str, target: bytes, others: list[bytes]) -> tuple[bytes, list[int]]:
    """Send ``target`` in the middle of 31 other requests; return its raw body and all statuses."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def post(img: bytes) -> httpx.Response:
            return await client.post("/v1/embed", json={"model": "golden", "images": [b64(img)]})

        tasks = [asyncio.create_task(post(img)) for img in others[:16]]
        await asyncio.sleep(0)
        mine = asyncio.create_task(post(target))
        tasks += [asyncio.create_task(post(img)) for img in others[16:]]
        responses = await asyncio.gather(mine, *tasks)
    return responses[0].content, [r.status_code for r in responses]


def _batch_sizes(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for line in text.splitlines():
        m = re.match(r'softmoe_batch_size_bucket\{le="([^"]+)",model="golden"\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_bitwise_identical_alone_and_under_load(url):
    target = golden_pngs()[2]
    others = random_pngs(31, seed=7)
    alone = httpx.post(f"{url}/v1/embed", json={"model": "golden", "images": [b64(target)]}, timeout=60)
    assert alone.status_code == 200
    for _ in range(2):
        body, statuses = asyncio.run(_burst(url, target, others))
        assert statuses == [200] * 32
        assert body == alone.content  # byte-identical JSON, hence bitwise-identical floats
    # The load really was batched: some backend calls carried more than one image.
    buckets = _batch_sizes(url)
    assert buckets["1.0"] < buckets["+Inf"], buckets


def test_oip_rows_bitwise_independent_of_batch_mates(url):
    images = [np.random.default_rng(s).integers(0, 256, (32, 32, 3), dtype=np.uint8) for s in range(5)]
    single = [httpx.post(f"{url}/v2/models/golden/infer", json=_oip(im), timeout=60).json()["outputs"][0]["data"] for im in images]
    x = np.stack([(im.astype(np.float32) / 255 * 2 - 1).transpose(2, 0, 1) for im in images])
    together = httpx.post(f"{url}/v2/models/golden/infer", timeout=60, json={"inputs": [
        {"name": "pixel_values", "shape": [5, 3, 32, 32], "datatype": "FP32", "data": x.reshape(-1).tolist()}],
        "outputs": [{"name": "logits"}]}).json()["outputs"][0]
    rows = np.array(together["data"], np.float32).reshape(5, 10)
    for i in range(5):
        assert np.array_equal(rows[i], np.array(single[i], np.float32))


def test_text_tower_deterministic_under_load(url):
    async def run() -> list[bytes]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            texts = [f"the {w}" for w in ("cat", "dog", "car", "tree", "house", "bird", "boat", "apple")] * 3
            rs = await asyncio.gather(*(client.post("/v1/embed", json={"model": "lit", "texts": [t]}) for t in texts))
            return [r.content for r in rs]

    alone = httpx.post(f"{url}/v1/embed", json={"model": "lit", "texts": ["the cat"]}, timeout=60).content
    bodies = asyncio.run(run())
    assert bodies[0] == alone and bodies[8] == alone and bodies[16] == alone
