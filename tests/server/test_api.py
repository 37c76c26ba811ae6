"""Every endpoint and input form on real small models (golden vmoe packages), on both CPU backends."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import golden_npz
from helpers.images import b64, golden_pngs, png
from server.api.oip_codec import HttpWire
from server.http.app import create_app
from server.settings import Settings


def _settings(packages, backend, tmp_path_factory, **kw) -> Settings:
    models = [f"golden={packages['golden']}", f"tt={packages['tt']}", f"lit={packages['tt-tok']}"]
    return Settings(models=models, backend=backend, max_batch_size=4, max_delay_ms=2,
                    cache_dir=str(tmp_path_factory.getbasetemp() / "cache"), **kw)


@pytest.fixture(scope="module", params=["torch", "onnxruntime"])
def client(request, packages, tmp_path_factory):
    app = create_app(_settings(packages, request.param, tmp_path_factory))
    with TestClient(app) as c:
        c.backend = request.param
        yield c


def _nchw(data):
    return np.ascontiguousarray(data["inputs/images"].transpose(0, 3, 1, 2))


# ------------------------------------------------------------------ golden through the server


def test_oip_golden_logits(client):
    data = golden_npz("softmoe_e8p1")
    x = _nchw(data)
    r = client.post("/v2/models/golden/infer", json={"id": "7", "inputs": [
        {"name": "pixel_values", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "7" and body["model_name"] == "golden"
    out = {o["name"]: o for o in body["outputs"]}
    logits = np.array(out["logits"]["data"], np.float32).reshape(out["logits"]["shape"])
    assert np.abs(logits - data["outputs_fp32dispatch/logits"]).max() <= 1e-4
    pre = np.array(out["pre_logits"]["data"], np.float32).reshape(4, 64)
    assert np.abs(pre - data["outputs_fp32dispatch/pre_logits"]).max() <= 1e-4


def test_classify_golden_pngs_give_golden_argmax(client):
    data = golden_npz("softmoe_e8p1")
    want = data["outputs/logits"].argmax(-1)
    files = [("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(golden_pngs())]
    r = client.post("/v1/classify", files=files, data={"model": "golden", "top_k": "3"})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [res["predictions"][0]["index"] for res in results] == want.tolist()
    assert results[0]["predictions"][0]["label"] == f"label{want[0]}"
    scores = [p["score"] for p in results[0]["predictions"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == 3


def test_two_tower_embed_and_oip_match_golden(client):
    data = golden_npz("twotower")
    u8 = np.round((data["inputs/images"] + 1) / 2 * 255).astype(np.uint8)
    x = _nchw(data)
    r = client.post("/v2/models/tt/infer", json={"inputs": [
        {"name": "pixel_values", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()},
        {"name": "input_ids", "shape": [5, 16], "datatype": "INT32", "data": data["inputs/texts"].tolist()}]})
    assert r.status_code == 200, r.text
    out = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}
    assert np.abs(out["image_embeds"] - data["outputs_fp32dispatch/zimg"]).max() <= 1e-4
    assert np.abs(out["text_embeds"] - data["outputs_fp32dispatch/ztxt"]).max() <= 1e-4
    # /v1/embed on PNGs of the uint8-rounded images: the same tower, through decode + preprocess.
    r = client.post("/v1/embed", json={"model": "tt", "images": [b64(png(im)) for im in u8]})
    assert r.status_code == 200, r.text
    emb = np.array(r.json()["image_embeddings"], np.float32)
    with_pixels = client.post("/v2/models/tt/infer", json={"inputs": [{
        "name": "pixel_values", "shape": [4, 3, 32, 32], "datatype": "FP32",
        "data": (u8.astype(np.float32) / 255 * 2 - 1).transpose(0, 3, 1, 2).reshape(-1).tolist()}]}).json()
    ref = np.array(with_pixels["outputs"][0]["data"], np.float32).reshape(4, 64)
    assert np.abs(emb - ref).max() <= 1e-6
    assert np.abs(emb - data["outputs_fp32dispatch/zimg"]).max() <= 1e-4  # the golden pixels are u8-exact
    assert np.allclose(np.linalg.norm(emb, axis=1), 1, atol=1e-5)


# ------------------------------------------------------------------ input forms


def test_all_input_forms_agree(client):
    img = golden_pngs()[1]
    as_json = client.post("/v1/classify", json={"images": [b64(img)], "top_k": 2})
    as_uri = client.post("/v1/classify", json={"images": ["data:image/png;base64," + b64(img)], "top_k": 2})
    as_multipart = client.post("/v1/classify?top_k=2", files={"images": ("x.png", img, "image/png")})
    as_raw = client.post("/v1/classify?top_k=2", content=img, headers={"content-type": "image/png"})
    bodies = [r.json() for r in (as_json, as_uri, as_multipart, as_raw)]
    assert all(r.status_code == 200 for r in (as_json, as_uri, as_multipart, as_raw))
    assert all(b == bodies[0] for b in bodies)
    assert bodies[0]["model"] == "golden"  # the first classifier when model is omitted


def test_embed_classifier_features_and_normalize(client):
    img = b64(golden_pngs()[0])
    raw = client.post("/v1/embed", json={"model": "golden", "images": [img], "normalize": False}).json()
    unit = client.post("/v1/embed", json={"model": "golden", "images": [img]}).json()
    raw_v, unit_v = np.array(raw["image_embeddings"][0]), np.array(unit["image_embeddings"][0])
    assert np.allclose(raw_v / np.linalg.norm(raw_v), unit_v, atol=1e-6)
    assert abs(np.linalg.norm(raw_v) - 1) > 1e-3


def test_embed_texts_with_tokenizer(client):
    r = client.post("/v1/embed", json={"model": "lit", "texts": ["a photo of a cat", "The Dog"]})
    assert r.status_code == 200, r.text
    t = np.array(r.json()["text_embeddings"])
    assert t.shape == (2, 64) and np.allclose(np.linalg.norm(t, axis=1), 1, atol=1e-5)
    # ASCII lowercasing: "The Dog" == "the dog"
    again = client.post("/v1/embed", json={"model": "lit", "texts": ["the dog"]}).json()["text_embeddings"][0]
    assert np.array_equal(t[1], np.array(again))


def _bytes_tensor(texts: list[str], shape: list[int]) -> tuple[dict, bytes]:
    """Triton's binary BYTES form: each element as a 4-byte little-endian length and its UTF-8 bytes."""
    data = b"".join(len(b).to_bytes(4, "little") + b for b in (t.encode() for t in texts))
    return {"name": "text", "shape": shape, "datatype": "BYTES", "parameters": {"binary_data_size": len(data)}}, data


def test_oip_text_as_bytes_is_what_embed_gives(client):
    """A Triton user sends strings as BYTES: tokenized here, they give /v1/embed's text embeddings bit for bit."""
    texts = ["a photo of a cat", "The Dog", "ünïcode ✓"]
    want = np.array(client.post("/v1/embed", json={"model": "lit", "texts": texts}).json()["text_embeddings"], np.float32)
    meta = {t["name"]: t for t in client.get("/v2/models/lit").json()["inputs"]}
    assert meta["text"] == {"name": "text", "datatype": "BYTES", "shape": [-1]}
    assert "text" not in {t["name"] for t in client.get("/v2/models/tt").json()["inputs"]}  # no tokenizer: ids only
    for data, shape in ((texts, [3]), ([[t] for t in texts], [3, 1])):
        r = client.post("/v2/models/lit/infer", json={"inputs": [{"name": "text", "shape": shape, "datatype": "BYTES",
                                                                   "data": data}]})
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        assert out["name"] == "text_embeds" and out["shape"] == [3, 64]
        assert np.array_equal(np.array(out["data"], np.float32).reshape(3, 64), want)
    tensor, data = _bytes_tensor(texts, [3, 1])
    head = json.dumps({"inputs": [tensor], "outputs": [{"name": "text_embeds", "parameters": {"binary_data": True}}]}).encode()
    r = client.post("/v2/models/lit/infer", content=head + data,
                    headers={"inference-header-content-length": str(len(head)), "content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    assert np.array_equal(np.frombuffer(r.content[n:], "<f4").reshape(3, 64), want)


@pytest.mark.parametrize("texts, raw, needle, param", [
    (["ok", "bad"], b"\xff", "not Unicode", "inputs.0.data.1"),
    (["ok"], None, "overruns", "inputs.0.data.0"),
    ([["x", "y"]], None, "must be a string", "inputs.0.data.0"),
    ([3], None, "must be a string", "inputs.0.data.0"),
    (["x" * 1001], None, "limit is 1000", "inputs.0.data.0"),
])
def test_oip_text_errors_name_the_element(client, texts, raw, needle, param):
    if raw is not None or needle == "overruns":
        tensor, data = _bytes_tensor(texts, [len(texts)])
        if raw is not None:  # the last element's bytes replaced by bytes that are no UTF-8
            data = data[:-3] + b"\xff\xfe\xfd"
        else:
            data = data[:-1]
            tensor["parameters"]["binary_data_size"] -= 1
        head = json.dumps({"inputs": [tensor]}).encode()
        r = client.post("/v2/models/lit/infer", content=head + data, headers={"inference-header-content-length": str(len(head))})
    else:
        r = client.post("/v2/models/lit/infer", json={"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES",
                                                                   "data": texts}]})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"].startswith(f"{param}: ") and needle in r.json()["error"], r.text


def test_zero_shot(client):
    imgs = [b64(b) for b in golden_pngs()[:2]]
    labels = ["cat", "dog", "car", "tree"]
    r1 = client.post("/v1/zero-shot", json={"model": "lit", "images": imgs, "labels": labels})
    assert r1.status_code == 200, r1.text
    res = r1.json()["results"]
    assert len(res) == 2 and [s["label"] for s in res[0]["scores"]] != []
    scores = [s["score"] for s in res[0]["scores"]]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    # Independent of label order.
    r2 = client.post("/v1/zero-shot", json={"model": "lit", "images": imgs, "labels": labels[::-1]})
    assert r2.json()["results"] == res
    soft = client.post("/v1/zero-shot", json={"model": "lit", "images": imgs, "labels": labels, "activation": "softmax"}).json()
    assert sum(s["score"] for s in soft["results"][0]["scores"]) == pytest.approx(1.0)
    assert [s["label"] for s in soft["results"][0]["scores"]] == [s["label"] for s in res[0]["scores"]]
    custom = client.post("/v1/zero-shot", json={"model": "lit", "images": imgs[:1], "labels": labels, "templates": ["{}"]})
    assert custom.status_code == 200


def test_zero_shot_label_cache_avoids_text_compute(client):
    app = client.app
    text_queue = app.state.models["lit"].queues["text"]
    labels = ["apple", "boat", "bird"]
    img = [b64(golden_pngs()[3])]
    first = client.post("/v1/zero-shot", json={"model": "lit", "images": img, "labels": labels, "templates": ["the {}"]})
    calls_before = app.state.batcher.calls
    depth_fn = text_queue.fn
    seen = []
    text_queue.fn = lambda rows: seen.append(len(rows["input_ids"])) or depth_fn(rows)
    try:
        second = client.post("/v1/zero-shot", json={"model": "lit", "images": img, "labels": labels[::-1], "templates": ["the {}"]})
    finally:
        text_queue.fn = depth_fn
    assert second.status_code == 200 and first.json()["results"] == second.json()["results"]
    assert seen == []  # no text-tower call: every prompt came from the cache
    assert app.state.batcher.calls == calls_before + 1  # only the image


def test_openai_embeddings_shape(client):
    img = "data:image/png;base64," + b64(golden_pngs()[0])
    r = client.post("/v1/embeddings", json={"model": "lit", "input": ["a photo of a cat", img]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]
    b = client.post("/v1/embeddings", json={"model": "lit", "input": "a photo of a cat", "encoding_format": "base64"}).json()
    vec = np.frombuffer(__import__("base64").b64decode(b["data"][0]["embedding"]), "<f4")
    assert np.allclose(vec, body["data"][0]["embedding"], atol=1e-7)


def test_oip_metadata_and_health(client):
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 200
    assert client.get("/v2").json()["name"] == "softmoe-serve"
    meta = client.get("/v2/models/tt").json()
    names = {t["name"]: t for t in meta["inputs"]}
    assert names["pixel_values"]["shape"] == [-1, 3, 32, 32] and names["input_ids"]["datatype"] == "INT64"
    assert {t["name"] for t in meta["outputs"]} == {"image_embeds", "text_embeds"}
    assert client.get("/v2/models/golden/ready").json()["ready"] is True
    assert client.get("/v2/models/golden/versions/1").status_code == 200
    assert client.get("/v2/models/golden/versions/7").status_code == 404
    assert client.get("/v2/models/nope").json() == {"error": "model 'nope' is not served; served: ['golden', 'lit', 'tt']"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["golden", "tt", "lit"]
    assert {m["name"] for m in client.post("/v2/repository/index").json()} == {"golden", "tt", "lit"}


def test_oip_classification_extension_and_gzip(client):
    import gzip

    data = golden_npz("softmoe_e8p1")
    x = _nchw(data)
    req = {"inputs": [{"name": "pixel_values", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}],
           "outputs": [{"name": "logits", "parameters": {"classification": 2}}]}
    r = client.post("/v2/models/golden/infer", content=gzip.compress(json.dumps(req).encode()),
                    headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["datatype"] == "BYTES" and out["shape"] == [4, 2]
    top = [int(s.split(":")[1]) for s in out["data"][::2]]
    assert top == data["outputs_fp32dispatch/logits"].argmax(-1).tolist()
    assert out["data"][0].split(":")[2] == f"label{top[0]}"


def test_timing_headers_and_request_id(client):
    r = client.post("/v1/classify", json={"images": [b64(golden_pngs()[0])]}, headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    for h in ("x-decode-time", "x-preprocess-time", "x-queue-time", "x-inference-time", "x-postprocess-time", "x-total-time"):
        assert float(r.headers[h]) >= 0
    assert len(client.get("/v2/health/live").headers["x-request-id"]) == 32


@pytest.mark.parametrize("binary", [False, True])
def test_oip_encoding_is_timed_in_the_postprocess_stage(client, monkeypatch, binary):
    """The answer's encoding runs inside the postprocess stage: an encode made 80 ms slower shows in
    x-postprocess-time (it did not while the stage closed before encoding)."""
    encode = HttpWire.encode

    def slow(self, *args):
        time.sleep(0.08)
        return encode(self, *args)

    monkeypatch.setattr(HttpWire, "encode", slow)
    x = _nchw(golden_npz("softmoe_e8p1"))
    req = {"inputs": [{"name": "pixel_values", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}],
           "parameters": {"binary_data_output": binary}}
    r = client.post("/v2/models/golden/infer", json=req)
    assert r.status_code == 200, r.text
    assert ("inference-header-content-length" in r.headers) == binary
    assert float(r.headers["x-postprocess-time"]) >= 80


def test_generated_request_ids_are_unique_and_differ_in_forked_children(client):
    import os
    import re

    from server.api.door import new_request_id

    ids = {client.get("/v2/health/live").headers["x-request-id"] for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)
    # Front ends are forked: each must draw its own ids, not replay its parent's sequence.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(w, new_request_id().encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 64).decode()
    os.waitpid(pid, 0)
    os.close(r)
    assert child != new_request_id()


# ------------------------------------------------------------------ errors: JSON bodies naming the problem


@pytest.mark.parametrize("kwargs,status,needle", [
    (dict(json={"images": ["!!!notbase64"]}), 400, "base64"),
    (dict(json={"images": ["data:text/plain;base64,aGk="]}), 422, "not an image"),
    (dict(json={"images": ["https://example.com/cat.jpg"]}), 422, "not fetched"),
    (dict(json={"images": []}), 422, "images"),
    (dict(json={"images": [b64(b"random bytes, not an image")]}), 400, "not a recognised image"),
    (dict(json={"model": "nope", "images": ["aGk="]}), 404, "not served"),
    (dict(json={"model": "tt", "images": ["aGk="]}), 422, "cannot classify"),
    (dict(json={"images": ["aGk="], "top_k": 0}), 422, "top_k"),
    (dict(json={"images": ["aGk="], "bogus": 1}), 422, "bogus"),
    (dict(content=b"{not json", headers={"content-type": "application/json"}), 400, "not valid JSON"),
    (dict(content=b"", headers={"content-type": "image/png"}), 400, "empty"),
    (dict(content=b"abc", headers={"content-type": "text/plain"}), 415, "content type"),
])
def test_classify_errors(client, kwargs, status, needle):
    r = client.post("/v1/classify", **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status


def test_too_many_images_names_the_limit(client):
    limit = client.app.state.settings.max_images_per_request
    r = client.post("/v1/classify", json={"images": [b64(golden_pngs()[0])] * (limit + 1)})
    assert r.status_code == 422 and str(limit) in r.json()["error"]["message"]


def test_text_without_tokenizer_is_422(client):
    r = client.post("/v1/embed", json={"model": "tt", "texts": ["hello"]})
    assert r.status_code == 422 and "tokenizer" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,needle", [
    ({"inputs": [{"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 5}]}, "5 values"),
    ({"inputs": [{"name": "pixel_values", "shape": [1, 3, 16, 16], "datatype": "FP32", "data": [0.0] * 768}]}, "expected [N, 3, 32, 32]"),
    ({"inputs": [{"name": "input_ids", "shape": [1, 16], "datatype": "INT64", "data": [1] * 16}]}, "unexpected input"),
    ({"inputs": [{"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "INT64", "data": [0] * 3072}]}, "must be FP32"),
    ({"inputs": []}, "no inputs"),
    ({"inputs": [{"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}],
      "outputs": [{"name": "nope"}]}, "not computed"),
])
def test_oip_errors(client, body, needle):
    r = client.post("/v2/models/golden/infer", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert needle in r.json()["error"]  # OIP error shape: {"error": "<message>"}


def test_oip_token_ids_out_of_vocab(client):
    r = client.post("/v2/models/tt/infer", json={"inputs": [{"name": "input_ids", "shape": [1, 16], "datatype": "INT64", "data": [5000] * 16}]})
    assert r.status_code == 400 and "[0, 1000)" in r.json()["error"]


def test_unknown_route_is_json(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


# ------------------------------------------------------------------ metrics


FAMILIES = ["softmoe_image_latency_seconds", "softmoe_request_duration_seconds", "softmoe_batch_size",
            "softmoe_batch_padding_ratio", "softmoe_queue_depth", "softmoe_requests_rejected_total",
            "softmoe_images_total", "softmoe_model_ready"]


def test_metrics_after_traffic(client):
    client.post("/v1/classify", json={"images": [b64(b) for b in golden_pngs()]})
    client.post("/v1/classify", json={"images": ["%%%"]})
    client.post("/v1/classify", json={"model": "nope", "images": ["aGk="]})
    text = client.get("/metrics").text
    for family in FAMILIES:
        assert f"# TYPE {family} " in text, family
    for stage in ("decode", "preprocess", "queue", "inference", "postprocess", "total"):
        assert f'softmoe_image_latency_seconds_count{{model="golden",stage="{stage}"}}' in text, stage
    assert 'softmoe_model_ready{model="golden"} 1.0' in text
    assert 'endpoint="/v1/classify",model="golden",status_class="2xx"' in text
    assert 'status_class="4xx"' in text
    count = [l for l in text.splitlines() if l.startswith('softmoe_images_total{endpoint="classify",model="golden"}')]
    assert count and float(count[0].split()[-1]) >= 4


def test_openapi_lists_every_endpoint(client):
    doc = client.get("/openapi.json").json()
    for path in ("/v1/classify", "/v1/embed", "/v1/zero-shot", "/v1/embeddings", "/v2/models/{model_name}/infer",
                 "/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/{model_name}", "/v2/models/{model_name}/ready"):
        assert path in doc["paths"], path
    content = doc["paths"]["/v1/classify"]["post"]["requestBody"]["content"]
    assert set(content) == {"application/json", "multipart/form-data", "image/*"}
    assert "ClassifyRequest" in doc["components"]["schemas"]
