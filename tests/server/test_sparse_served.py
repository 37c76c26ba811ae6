"""Sparse V-MoE packages converted by `softmoe convert` from vmoe's goldens, served on both CPU
backends with default settings: OIP logits and /v1/classify from PNG files against vmoe's own
per-image-group outputs, /v1/routing's combine weights against vmoe's, batch invariance at
capacity factor 1.05 (where vmoe's 8-image groups flip top-1 classes), and the drop counters."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest

from conftest import SHARED
from helpers.images import b64, png
from helpers.live import live_server
from server.http.app import create_app
from server.settings import Settings

GOLDEN = SHARED / "golden" / "vmoe-sparse"
# name -> convert flags (what the parameters cannot show)
MODELS = {
    "vmoe_tc_e8k2": {"router": "tokens-choice", "experts_per_token": 2},
    "vmoe_tc_bpr_e4k1": {"router": "tokens-choice", "experts_per_token": 1, "batch_priority": True},
    "vmoe_ec_e4": {"router": "experts-choice"},
}
CFS = ("1.05", "4.0")
LOGITS_TOL = 1e-4  # OIP logits vs vmoe's float32-dispatch outputs (measured <= 2.2e-6)
COMBINE_TOL = 1e-5  # the first MoE layer's combine weights vs vmoe's summed over capacity slots


def _golden(name: str) -> dict[str, np.ndarray]:
    path = GOLDEN / f"{name}.npz"
    if not path.is_file():
        pytest.skip(f"golden data not found at {path}")
    with np.load(path) as d:
        return {k: d[k] for k in d.files if not k.startswith("params/")}


@pytest.fixture(scope="module")
def sparse_packages(tmp_path_factory):
    from softmoe_models.convert import convert_checkpoint

    if not GOLDEN.is_dir():
        pytest.skip(f"golden data not found at {GOLDEN}")
    root = tmp_path_factory.mktemp("sparse")
    out = {}
    for name, flags in MODELS.items():
        for cf in CFS:
            out[f"{name}@{cf}"], _ = convert_checkpoint(GOLDEN / f"{name}.npz", root / f"{name}-{cf}",
                                                        labels=[f"class{i}" for i in range(10)],
                                                        capacity_factor=float(cf), **flags)
    return out


@pytest.fixture(scope="module", params=["torch", "onnxruntime"])
def url(request, sparse_packages, tmp_path_factory):
    models = [f"{key}={path}" for key, path in sparse_packages.items()]
    settings = Settings(models=models, backend=request.param, cache_dir=str(tmp_path_factory.mktemp("cache")))
    with live_server(create_app(settings), timeout=600) as u:
        yield u


def _oip(url: str, model: str, x: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"name": "pixel_values", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.reshape(-1).tolist()}]}
    r = httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}
    return out["logits"]


def _pixels(data) -> np.ndarray:
    return np.ascontiguousarray(data["inputs/images"].transpose(0, 3, 1, 2))


@pytest.mark.parametrize("cf", CFS)
@pytest.mark.parametrize("name", list(MODELS))
def test_oip_logits_are_vmoes_per_image_outputs(url, name, cf):
    data = _golden(name)
    logits = _oip(url, f"{name}@{cf}", _pixels(data))
    want = data[f"outputs_fp32dispatch/cf{cf}/group1/logits"]
    assert np.abs(logits - want).max() <= LOGITS_TOL


@pytest.mark.parametrize("name", list(MODELS))
def test_classify_from_png_files_gives_vmoes_top1(url, name):
    data = _golden(name)
    images = [b64(png(img)) for img in data["inputs/images_uint8"]]
    for cf in CFS:
        r = httpx.post(f"{url}/v1/classify", json={"model": f"{name}@{cf}", "images": images}, timeout=60)
        assert r.status_code == 200, r.text
        top = [res["predictions"][0]["index"] for res in r.json()["results"]]
        assert top == data[f"outputs_fp32dispatch/cf{cf}/group1/logits"].argmax(-1).tolist()


@pytest.mark.parametrize("cf", CFS)
@pytest.mark.parametrize("name", list(MODELS))
def test_routing_combine_is_vmoes(url, name, cf):
    """The first MoE layer's ``combine[token][expert]`` against vmoe's combine tensor summed over
    its capacity slots (later layers follow vmoe's bf16 dispatcher, with which its routing was
    stored; tests/models/test_sparse_golden.py measures them)."""
    data = _golden(name)
    images = [b64(png(img)) for img in data["inputs/images_uint8"]]
    r = httpx.post(f"{url}/v1/routing", json={"model": f"{name}@{cf}", "images": images}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    first = min(int(k.split("/")[3].removeprefix("layer")) for k in data if k.startswith(f"routing/cf{cf}/group1/"))
    want = data[f"routing/cf{cf}/group1/layer{first}/combine"].sum(-1)  # (images, tokens, experts)
    assert body["tokens"] == want.shape[1] and body["cls"] is True and body["num_experts"] == want.shape[2]
    for i, result in enumerate(body["results"]):
        layer = next(entry for entry in result["layers"] if entry["layer"] == first)
        got = np.asarray(layer["combine"], np.float32)
        assert got.shape == want[i].shape and np.abs(got - want[i]).max() <= COMBINE_TOL
        dispatched = data[f"routing/cf{cf}/group1/layer{first}/dispatch"][i].any(-1)  # (tokens, experts)
        assert layer["expert_load"] == dispatched.sum(0).tolist()
        assert sum(layer["dropped"]) == layer["dropped_total"]


@pytest.mark.parametrize("name", list(MODELS))
def test_an_image_alone_and_among_31_others_is_the_same_bits(url, name):
    """At capacity factor 1.05 vmoe's 8-image groups change results by batch-mate; one image per
    routing group cannot."""
    data = _golden(name)
    x = _pixels(data)
    rng = np.random.default_rng(3)
    others = rng.uniform(-1, 1, (31, *x.shape[1:])).astype(np.float32)
    alone = _oip(url, f"{name}@1.05", x[:1])
    among = _oip(url, f"{name}@1.05", np.concatenate([others[:13], x[:1], others[13:]]))
    assert np.array_equal(alone[0], among[13])


def test_drops_are_counted_and_png_is_refused(url):
    data = _golden("vmoe_ec_e4")
    images = [b64(png(img)) for img in data["inputs/images_uint8"]]
    r = httpx.post(f"{url}/v1/routing", json={"model": "vmoe_ec_e4@1.05", "images": images}, timeout=60)
    dropped = sum(layer["dropped_total"] for res in r.json()["results"] for layer in res["layers"])
    assert dropped > 0  # experts choice at 1.05 leaves tokens untaken
    text = httpx.get(f"{url}/metrics", timeout=10).text

    def value(metric: str) -> float:
        found = re.search(rf'{metric}\{{layer="1",model="vmoe_ec_e4@1.05"\}} (\S+)', text)
        assert found, metric
        return float(found[1])

    assert value("softmoe_routing_dropped_choices_total") >= dropped
    assert value("softmoe_routing_token_choices_total") >= 17 * len(images)
    r = httpx.post(f"{url}/v1/routing", json={"model": "vmoe_ec_e4@1.05", "images": images[:1], "format": "png"},
                   timeout=60)
    assert r.status_code == 422 and "format json" in r.json()["error"]["message"]


def test_a_reference_profile_and_drift_work_for_sparse_models(sparse_packages):
    """`python -m softmoe_models.routing_cli profile` on a sparse package: a profile the server accepts for
    its layout, and a window of the calibration images themselves drifts by sampling noise only."""
    from softmoe_models import routing
    from softmoe_models.package import load_model

    data = _golden("vmoe_tc_e8k2")
    model = load_model(sparse_packages["vmoe_tc_e8k2@1.05"])
    pixels = _pixels(data)
    profile = routing.compute_profile(model, pixels, "golden images")
    layout = routing.any_layout(model.cfg)
    routing.check_profile(profile, layout)
    assert profile["router"] == "tokens-choice" and profile["layers"] == [1, 3]
    window = routing.Window(256, len(layout.layers), layout.num_experts)
    window.add(routing.any_routing_of(model, pixels)["expert_share"])
    assert window.drift(profile) < 1e-9  # the same images: the same mean shares
    window.add(routing.any_routing_of(model, -pixels)["expert_share"])  # inverted images route otherwise
    assert window.drift(profile) > 1e-4
