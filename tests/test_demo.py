"""The built-in default models: the training pipeline, its reproducibility, the shipped weights'
recorded accuracy, and what `softmoe serve` with no arguments really does with held-out digits."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from helpers.images import b64
from server.http.app import create_app
from server.engine.defaults import SHIPPED
from server.settings import Settings
from softmoe_models.demo.data import PREPROCESS, WORDS, digit_png, load_splits, pixels_from_png
from softmoe_models.demo.evaluate import evaluate
from softmoe_models.demo.train import train_demo


@pytest.fixture(scope="module")
def splits():
    return load_splits()


def test_split_is_the_documented_one(splits):
    train, held = splits
    assert len(held.targets) == 360 and len(train.targets) == 1437
    assert (held.indices % 5 == 0).all() and not (train.indices % 5 == 0).any()
    assert held.pixels.shape == (360, 3, 8, 8) and held.pixels.min() == -1.0 and held.pixels.max() == 1.0


def test_demo_decodes_every_digit_as_the_server_does():
    """The demo decodes its PNGs with Pillow, not the server's ``decode`` (imports flow down only):
    every digit must still give bitwise the pixels the served path gives."""
    from sklearn.datasets import load_digits

    from server.pipeline.decode import decode
    from softmoe_models.preprocess import preprocess_image

    for values in load_digits().data:
        png = digit_png(values)
        served = preprocess_image(decode(png, PREPROCESS.image_size), PREPROCESS)
        demo = pixels_from_png(png)
        assert demo.dtype == served.dtype and np.array_equal(demo, served)


def test_short_retrain_is_reproducible(tmp_path):
    quiet = dict(epochs=3, lit_steps=40, log=lambda *_: None)
    a = train_demo(tmp_path / "a", seed=3, **quiet)
    b = train_demo(tmp_path / "b", seed=3, **quiet)
    c = train_demo(tmp_path / "c", seed=4, **quiet)
    for pa, pb, pc in zip(a, b, c):
        wa, wb, wc = ((p / "model.safetensors").read_bytes() for p in (pa, pb, pc))
        assert wa == wb and wa != wc
    assert (a[1] / "tokenizer.model").read_bytes() == (b[1] / "tokenizer.model").read_bytes()
    meta = json.loads((a[0] / "config.json").read_text())
    assert meta["kind"] == "classifier" and 0.0 <= meta["eval"]["heldout_top1"] <= 1.0
    lit = json.loads((a[1] / "config.json").read_text())
    assert lit["kind"] == "two-tower" and lit["tokenizer"] == "tokenizer.model" and lit["zero_shot_templates"]
    for pa, pb in zip(a, b):  # the drift reference profile is written, recorded and reproducible
        assert json.loads((pa / "config.json").read_text())["routing_profile"]["file"] == "routing_profile.json"
        assert (pa / "routing_profile.json").read_bytes() == (pb / "routing_profile.json").read_bytes()


@pytest.mark.parametrize("name,key", [("digits", "heldout_top1"), ("digits-lit", "heldout_zero_shot_top1")])
def test_shipped_weights_reproduce_recorded_accuracy(name, key):
    recorded = json.loads((SHIPPED / name / "config.json").read_text())["eval"][key]
    assert evaluate(SHIPPED / name)[key] == pytest.approx(recorded, abs=1e-6)
    assert recorded >= 0.95


@pytest.fixture(scope="module")
def served():
    with TestClient(create_app(Settings(max_batch_size=16))) as client:  # no --model: the default models
        yield client


def test_default_models_are_served(served):
    assert set(served.app.state.models) == {"digits", "digits-lit"}


def _chunks(items, n=64):
    return [items[i:i + n] for i in range(0, len(items), n)]


def test_served_classify_heldout_accuracy(served, splits):
    _, held = splits
    predicted = []
    for chunk in _chunks(held.pngs):
        r = served.post("/v1/classify", json={"images": [b64(p) for p in chunk], "top_k": 1})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "digits"
        predicted += [res["predictions"][0]["index"] for res in r.json()["results"]]
    accuracy = float(np.mean(np.array(predicted) == held.targets))
    assert accuracy >= 0.95, accuracy


def test_served_zero_shot_heldout_accuracy_and_label_order(served, splits):
    _, held = splits
    predicted, shuffled_pred = [], []
    shuffled = WORDS[3:] + WORDS[:3]
    for chunk in _chunks(held.pngs):
        images = [b64(p) for p in chunk]
        r = served.post("/v1/zero-shot", json={"images": images, "labels": WORDS})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "digits-lit"
        res = r.json()["results"]
        predicted += [WORDS.index(x["scores"][0]["label"]) for x in res]
        s = served.post("/v1/zero-shot", json={"images": images, "labels": shuffled}).json()["results"]
        assert s == res  # the result does not depend on the order of the labels
    accuracy = float(np.mean(np.array(predicted) == held.targets))
    assert accuracy >= 0.90, accuracy


def test_served_text_embeddings(served):
    r = served.post("/v1/embeddings", json={"model": "digits-lit", "input": ["the number seven", "Seven"]})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
