"""A converted Hugging Face SigLIP package served like every model, against transformers' own outputs.

Both CPU backends, on a real server: /v1/embed (image and text embeddings), /v1/zero-shot (sigmoid
scores), /v1/embeddings and OIP v2 within 1e-4 of transformers' SiglipModel for the same JPEG / PNG
files and prompts; a vision-only SiglipVisionModel package; batching determinism under load.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("transformers")

from convert.test_hf_siglip import (  # noqa: E402  (builders shared with the converter tests)
    _perturb, _quiet, build_siglip, image_files, pil_image_processor, reference, spiece,  # noqa: F401  (spiece: a fixture)
)
from helpers.images import b64  # noqa: E402
from helpers.live import live_server  # noqa: E402
from server.http.app import create_app  # noqa: E402
from server.settings import Settings  # noqa: E402
from softmoe_models.convert import convert_checkpoint  # noqa: E402

TOL = 1e-4
SHAPE = "d36-h3-p7-s30"  # odd widths and heads, patch 7 on a 30-pixel side, text width != image width
PROMPTS = ["a photo of a cat", "A PHOTO OF A DOG!", "the café, at night...", "日本 東京 — emoji 😀",
           "tab\tand  spaces", "a </s> b", "word " * 20, "it's (very) small"]


@pytest.fixture(scope="module")
def siglip(tmp_path_factory, spiece):
    """A SigLIP directory, its package (converted with `softmoe convert`), transformers' reference outputs."""
    root = tmp_path_factory.mktemp("siglip-served")
    src = build_siglip(root / "hf", spiece, SHAPE, seed=11)
    r = subprocess.run([sys.executable, "-m", "server", "convert", str(src), "--out", str(root / "pkg")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    files = image_files(seed=4)
    model, proc = reference(src)
    with _quiet():
        inputs = proc(text=PROMPTS, images=[Image.open(io.BytesIO(b)) for b in files.values()], padding="max_length",
                      truncation=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    ref = {"image_embeds": out.image_embeds.numpy(), "text_embeds": out.text_embeds.numpy(),
           "scores": torch.sigmoid(out.logits_per_image).numpy(), "pixel_values": inputs["pixel_values"].numpy(),
           "input_ids": inputs["input_ids"].numpy()}
    return root / "pkg", files, ref


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """A SiglipVisionModel package and transformers' pooled outputs for the test images."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    root = tmp_path_factory.mktemp("siglip-vision")
    torch.manual_seed(5)
    model = SiglipVisionModel(SiglipVisionConfig(hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                                                 num_attention_heads=5, image_size=25, patch_size=5)).eval()
    _perturb(model, 5)
    model.save_pretrained(root / "hf")
    proc = pil_image_processor()(size={"height": 25, "width": 25})
    proc.save_pretrained(root / "hf")
    pkg, _ = convert_checkpoint(root / "hf", root / "pkg")
    files = image_files(seed=4)
    pixels = proc(images=[Image.open(io.BytesIO(b)) for b in files.values()], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        pooled = model(pixel_values=pixels).pooler_output.numpy()
    return pkg, pooled


@pytest.fixture(scope="module", params=["torch", "onnxruntime"])
def url(request, siglip, vision, tmp_path_factory):
    settings = Settings(models=[f"siglip={siglip[0]}", f"siglip-vision={vision[0]}"], backend=request.param,
                        max_batch_size=8, max_delay_ms=20, cache_dir=str(tmp_path_factory.getbasetemp() / "cache"))
    with live_server(create_app(settings)) as u:
        yield u


def _max_err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max())


def test_embed_images_and_texts_match_transformers(url, siglip):
    _, files, ref = siglip
    r = httpx.post(f"{url}/v1/embed", json={"model": "siglip", "images": [b64(b) for b in files.values()],
                                            "texts": PROMPTS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    errs = {name: _max_err(got, want) for name, got, want in zip(files, body["image_embeddings"], ref["image_embeds"])}
    assert max(errs.values()) <= TOL, errs
    assert _max_err(body["text_embeddings"], ref["text_embeds"]) <= TOL


def test_zero_shot_matches_transformers(url, siglip):
    _, files, ref = siglip
    imgs = [b64(b) for b in files.values()]
    for templates in (None, ["{}"]):  # the package's default template is the label itself
        req = {"model": "siglip", "images": imgs, "labels": PROMPTS}
        if templates:
            req["templates"] = templates
        r = httpx.post(f"{url}/v1/zero-shot", json=req, timeout=60)
        assert r.status_code == 200, r.text
        got = np.array([[{s["label"]: s["score"] for s in res["scores"]}[p] for p in PROMPTS]
                        for res in r.json()["results"]])
        assert _max_err(got, ref["scores"]) <= TOL


def test_openai_embeddings_match_transformers(url, siglip):
    _, files, ref = siglip
    png = files["png-rgba"]
    r = httpx.post(f"{url}/v1/embeddings", json={"model": "siglip", "input": [
        PROMPTS[2], "data:image/png;base64," + b64(png)]}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert _max_err(data[0]["embedding"], ref["text_embeds"][2]) <= TOL
    assert _max_err(data[1]["embedding"], ref["image_embeds"][list(files).index("png-rgba")]) <= TOL


def test_oip_infer_matches_transformers(url, siglip, vision):
    _, _, ref = siglip
    px, ids = ref["pixel_values"], ref["input_ids"]
    r = httpx.post(f"{url}/v2/models/siglip/infer", json={"inputs": [
        {"name": "pixel_values", "shape": list(px.shape), "datatype": "FP32", "data": px.reshape(-1).tolist()},
        {"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids.reshape(-1).tolist()}]},
        timeout=60)
    assert r.status_code == 200, r.text
    out = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}
    assert _max_err(out["image_embeds"], ref["image_embeds"]) <= TOL
    assert _max_err(out["text_embeds"], ref["text_embeds"]) <= TOL


def test_vision_only_package(url, siglip, vision):
    _, files, _ = siglip
    _, pooled = vision
    r = httpx.post(f"{url}/v1/embed", json={"model": "siglip-vision", "images": [b64(b) for b in files.values()],
                                            "normalize": False}, timeout=60)
    assert r.status_code == 200, r.text
    assert _max_err(r.json()["image_embeddings"], pooled) <= TOL


# ------------------------------------------------------------------ batching determinism


async def _burst(url: str, make, target, others) -> tuple[bytes, list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        tasks = [asyncio.create_task(client.post("/v1/embed", json=make(o))) for o in others[:12]]
        await asyncio.sleep(0)
        mine = asyncio.create_task(client.post("/v1/embed", json=make(target)))
        tasks += [asyncio.create_task(client.post("/v1/embed", json=make(o))) for o in others[12:]]
        responses = await asyncio.gather(mine, *tasks)
    return responses[0].content, [r.status_code for r in responses]


def test_bitwise_identical_alone_and_under_load(url, siglip):
    _, files, _ = siglip
    rng = np.random.default_rng(9)
    others = [b64(_png(rng.integers(0, 256, (int(rng.integers(20, 70)), int(rng.integers(20, 70)), 3), np.uint8)))
              for _ in range(23)]
    target = b64(files["jpeg-rgb-large"])
    image = lambda img: {"model": "siglip", "images": [img]}  # noqa: E731
    alone = httpx.post(f"{url}/v1/embed", json=image(target), timeout=60)
    assert alone.status_code == 200
    body, statuses = asyncio.run(_burst(url, image, target, others))
    assert statuses == [200] * 24 and body == alone.content
    text = lambda t: {"model": "siglip", "texts": [t]}  # noqa: E731
    words = [f"a photo of {w}" for w in ("a cat", "two dogs", "the car", "TREES!", "a house", "birds", "boats", "an apple")] * 3
    alone = httpx.post(f"{url}/v1/embed", json=text(PROMPTS[2]), timeout=60)
    body, statuses = asyncio.run(_burst(url, text, PROMPTS[2], words))
    assert statuses == [200] * 25 and body == alone.content


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def test_usage_counts_siglip_tokens(url):
    r = httpx.post(f"{url}/v1/embeddings", json={"model": "siglip", "input": ["a photo of a cat"]}, timeout=60)
    assert r.status_code == 200 and 0 < r.json()["usage"]["prompt_tokens"] <= 12
