"""/v1/routing, the routing statistics and the drift gauge, on both CPU backends.

The served maps are compared with the torch model's own internals (``softmoe_models.routing.routing_of``:
the tensors the forward pass multiplies with) for the built-in digits model and for golden packages;
the drift gauge is shown separating in-distribution digits from inverted and noise images.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from helpers.images import b64, png, random_pngs
from server.http.app import create_app
from server.engine.defaults import SHIPPED
from server.settings import Settings
from softmoe_models.demo.calibration import calibration_pixels
from softmoe_models.package import load_model, read_package
from softmoe_models.routing import PROFILE_FILE, compute_profile, layout_for, routing_of

DIGITS = SHIPPED / "digits"
TOL = 1e-5


def _served_pixels(package, blobs: list[bytes]) -> np.ndarray:
    """The pixels the server computes for ``blobs``: its decoder, then the package's preprocessing."""
    from server.pipeline.decode import decode
    from softmoe_models.preprocess import preprocess_image

    pre = read_package(package).preprocess
    return np.stack([preprocess_image(decode(b, pre.image_size), pre) for b in blobs]).astype(np.float32)


def _maps(body: dict, layout) -> tuple[np.ndarray, np.ndarray]:
    """(images, L, m, s) dispatch and combine weights rebuilt from a /v1/routing JSON body."""
    g, s = layout.grid, layout.num_slots
    disp, comb = [], []
    for res in body["results"]:
        d_layers, c_layers = [], []
        for layer in res["layers"]:
            d = np.array(layer["dispatch"], np.float64).reshape(s, g * g).T  # (patches, s)
            c = np.array(layer["combine"], np.float64).reshape(g * g, s)
            if layout.cls:
                d = np.vstack([np.array(layer["cls_dispatch"])[None], d])
                c = np.vstack([np.array(layer["cls_combine"])[None], c])
            d_layers.append(d)
            c_layers.append(c)
        disp.append(d_layers)
        comb.append(c_layers)
    return np.array(disp), np.array(comb)


def _max_errors(body: dict, want: dict[str, np.ndarray], layout) -> dict[str, float]:
    d, c = _maps(body, layout)
    stats = {k: np.array([[layer[k] for layer in res["layers"]] for res in body["results"]])
             for k in ("dispatch_entropy", "combine_entropy", "expert_share")}
    got = {"dispatch_weights": d, "combine_weights": c, **stats}
    return {k: float(np.abs(got[k] - want[k]).max()) for k in got}


def _digit_pngs(n: int = 6) -> list[bytes]:
    from softmoe_models.demo.data import load_splits

    _, held = load_splits()
    return held.pngs[:n]


@pytest.fixture(scope="module", params=["torch", "onnxruntime"])
def client(request, tmp_path_factory):
    settings = Settings(models=[f"digits={DIGITS}", f"digits-lit={SHIPPED / 'digits-lit'}"], backend=request.param,
                        max_batch_size=4, max_delay_ms=2, routing_stats_sample=2,
                        cache_dir=str(tmp_path_factory.getbasetemp() / "cache"))
    with TestClient(create_app(settings)) as c:
        c.backend = request.param
        yield c


# ------------------------------------------------------------------ maps equal the torch internals


def test_digits_maps_equal_torch_internals(client):
    blobs = _digit_pngs()
    r = client.post("/v1/routing", json={"images": [b64(b) for b in blobs]})
    assert r.status_code == 200, r.text
    assert r.headers["x-model"] == "digits"
    body = r.json()
    model = load_model(DIGITS)
    layout = layout_for(model.cfg)
    assert body["grid"] == [4, 4] and body["tokens"] == 16 and body["num_experts"] == 8
    assert [layer["layer"] for layer in body["results"][0]["layers"]] == [2, 3]
    errors = _max_errors(body, routing_of(model, _served_pixels(DIGITS, blobs)), layout)
    print(f"\n{client.backend}: digits /v1/routing vs torch internals, max abs error {errors}")
    assert max(errors.values()) <= TOL, errors
    # The same answer as /v1/classify: its prediction is the classifier's top label and score.
    top = client.post("/v1/classify", json={"model": "digits", "images": [b64(b) for b in blobs], "top_k": 1}).json()
    for res, cls in zip(body["results"], top["results"]):
        assert res["prediction"]["label"] == cls["predictions"][0]["label"]
        assert abs(res["prediction"]["score"] - cls["predictions"][0]["score"]) <= 1e-6


def test_two_tower_routes_its_image_tower(client):
    blobs = _digit_pngs(3)
    r = client.post("/v1/routing", json={"model": "digits-lit", "images": [b64(b) for b in blobs]})
    assert r.status_code == 200, r.text
    body = r.json()
    model = load_model(SHIPPED / "digits-lit")
    errors = _max_errors(body, routing_of(model, _served_pixels(SHIPPED / "digits-lit", blobs)), layout_for(model.cfg))
    assert max(errors.values()) <= TOL, errors
    assert body["results"][0]["prediction"] is None  # an image tower has no labels


def test_weights_are_distributions(client):
    r = client.post("/v1/routing", json={"images": [b64(b) for b in _digit_pngs(2)], "layers": [3]})
    assert r.status_code == 200, r.text
    (layer,) = r.json()["results"][0]["layers"]
    assert layer["layer"] == 3
    dispatch = np.array(layer["dispatch"])  # (slots, rows, cols)
    combine = np.array(layer["combine"])  # (rows, cols, slots)
    assert dispatch.shape == (8, 4, 4) and combine.shape == (4, 4, 8)
    assert np.allclose(dispatch.sum(axis=(1, 2)), 1, atol=1e-6)  # each slot: over the patches
    assert np.allclose(combine.sum(axis=2), 1, atol=1e-6)  # each patch: over the slots
    assert abs(sum(layer["expert_share"]) - 1) <= 1e-6
    assert 0 < layer["dispatch_entropy"] <= 1 and 0 < layer["combine_entropy"] <= 1


def test_png_in_every_body_form(client):
    blob = _digit_pngs(1)[0]
    forms = [
        dict(json={"images": [b64(blob)], "format": "png", "slots": 3}),
        dict(params={"format": "png", "layers": "2,3"}, files=[("images", ("d.png", blob, "image/png"))]),
        dict(params={"format": "png"}, content=blob, headers={"content-type": "image/png"}),
    ]
    for kw in forms:
        r = client.post("/v1/routing", **kw)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "image/png" and r.content[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(io.BytesIO(r.content)) as im:
            assert im.format == "PNG" and im.height >= 2 * 128  # one row per Soft MoE layer


def test_refusals(client):
    r = client.post("/v1/routing", json={"images": [b64(_digit_pngs(1)[0])], "layers": [0]})
    assert r.status_code == 422 and "are not MoE layers" in r.json()["error"]["message"]
    r = client.post("/v1/routing", json={"images": [b64(_digit_pngs(1)[0])], "format": "gif"})
    assert r.status_code == 422
    r = client.post("/v1/routing", json={"model": "nope", "images": [b64(_digit_pngs(1)[0])]})
    assert r.status_code == 404
    r = client.post("/v1/routing", json={"images": [b64(_digit_pngs(1)[0])] * 64, "format": "png", "slots": 8})
    assert r.status_code == 422 and "pixels" in r.json()["error"]["message"]  # refused before decoding


def test_golden_maps_equal_torch_internals(packages, tmp_path_factory):
    """A converted vmoe checkpoint (32x32, 8 experts) and a two-tower's image tower, both backends."""
    blobs = random_pngs(3, size=32, seed=5)
    for backend in ("torch", "onnxruntime"):
        settings = Settings(models=[f"golden={packages['golden']}", f"tt={packages['tt']}"], backend=backend,
                            max_batch_size=4, cache_dir=str(tmp_path_factory.getbasetemp() / "cache"))
        with TestClient(create_app(settings)) as c:
            for name in ("golden", "tt"):
                r = c.post("/v1/routing", json={"model": name, "images": [b64(b) for b in blobs]})
                assert r.status_code == 200, r.text
                model = load_model(packages[name])
                want = routing_of(model, _served_pixels(packages[name], blobs))
                errors = _max_errors(r.json(), want, layout_for(model.cfg))
                print(f"\n{backend}: {name} /v1/routing vs torch internals, max abs error {max(errors.values()):.2e}")
                assert max(errors.values()) <= TOL, (backend, name, errors)


def test_plain_graph_is_the_routing_graph_cut_to_its_plain_outputs(tmp_path, tmp_path_factory):
    """The served classifier graph of an export with the routing graph is that graph cut down to the
    plain outputs (export.graph_passes.only_outputs): each of its nodes is the routing graph's, on the
    same initializers; ONNX Runtime gives its outputs the routing graph's bits, and they are within
    float32 noise of the graph exported without the routing graph."""
    import numpy as np
    import onnx

    from export.onnx import export_onnx
    from export.runtime import ort_session
    from export.weights_file import write_standalone
    from server.backends.onnxruntime_backend import exported_files

    quiet = dict(log=lambda *a: None)
    (served,) = exported_files(DIGITS, str(tmp_path_factory.getbasetemp() / "cache"), "fp32", routing=True, **quiet)
    routing_file = served.with_name("model.routing.onnx")
    assert routing_file.is_file()
    plain, routing = (onnx.load(str(f), load_external_data=False).graph for f in (served, routing_file))
    assert [o.name for o in plain.output] == ["logits", "pre_logits"]
    assert 0 < len(plain.node) < len(routing.node)
    theirs = {n.SerializeToString(deterministic=True) for n in routing.node}
    assert all(n.SerializeToString(deterministic=True) in theirs for n in plain.node)
    inits = {t.name: t.SerializeToString(deterministic=True) for t in routing.initializer}
    assert all(inits[t.name] == t.SerializeToString(deterministic=True) for t in plain.initializer)

    export_onnx(DIGITS, tmp_path / "plain.onnx", towers="split", **quiet)
    weights = DIGITS / "model.safetensors"
    x = np.random.default_rng(0).uniform(-1, 1, (4, 3, 8, 8)).astype(np.float32)
    cut = ort_session(served, weights=weights).run(None, {"pixel_values": x})
    full = ort_session(routing_file, weights=weights).run(None, {"pixel_values": x})
    alone = ort_session(tmp_path / "plain.onnx").run(None, {"pixel_values": x})
    for a, b, c in zip(cut, full, alone):
        assert np.array_equal(a, b)
        assert float(np.abs(a - c).max()) <= 1e-5
    assert write_standalone(served, weights, tmp_path / "s.onnx").is_file()


# ------------------------------------------------------------------ statistics


def _metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            return float(m.group(2))
    raise AssertionError(f"{name}{{{want}}} not in /metrics")


def test_statistics_series_exist_from_a_fresh_start():
    with TestClient(create_app(Settings(backend="torch"))) as c:
        text = c.get("/metrics").text
    for model in ("digits", "digits-lit"):
        for layer in ("2", "3"):
            assert _metric(text, "softmoe_routing_dispatch_entropy_count", model=model, layer=layer) == 0
            assert _metric(text, "softmoe_routing_combine_entropy_count", model=model, layer=layer) == 0
            for e in range(8):
                assert _metric(text, "softmoe_routing_expert_share", model=model, layer=layer, expert=e) == 0
        assert _metric(text, "softmoe_routing_drift", model=model) == 0
        assert _metric(text, "softmoe_routing_drift_baseline", model=model) == 0
        assert _metric(text, "softmoe_routing_window_images", model=model) == 0


def test_sampled_calls_give_statistics_and_the_same_answers(client):
    """1 call in 2 is sampled: statistics for exactly those images, and answers bitwise equal
    whether a call was sampled or not."""
    before = client.get("/metrics").text
    blob = b64(_digit_pngs(1)[0])
    answers = [client.post("/v1/classify", json={"model": "digits", "images": [blob]}).json() for _ in range(4)]
    assert all(a == answers[0] for a in answers)
    oip = [client.post("/v2/models/digits/infer", json={"inputs": [{"name": "pixel_values", "shape": [1, 3, 8, 8],
           "datatype": "FP32", "data": [0.25] * 192}]}).json() for _ in range(2)]
    assert oip[0] == oip[1] and {o["name"] for o in oip[0]["outputs"]} == {"logits", "pre_logits"}
    after = client.get("/metrics").text
    count = [_metric(t, "softmoe_routing_dispatch_entropy_count", model="digits", layer="2") for t in (before, after)]
    assert count[1] - count[0] == 3  # 6 single-image calls, 1 in 2 sampled
    shares = [_metric(after, "softmoe_routing_expert_share", model="digits", layer="3", expert=e) for e in range(8)]
    assert abs(sum(shares) - 1) <= 1e-6


def test_routing_off():
    with TestClient(create_app(Settings(backend="torch", routing=False))) as c:
        r = c.post("/v1/routing", json={"images": [b64(_digit_pngs(1)[0])]})
        assert r.status_code == 404 and "routing" in r.json()["error"]["message"]
        assert c.post("/v1/classify", json={"images": [b64(_digit_pngs(1)[0])]}).status_code == 200
        assert "softmoe_routing_expert_share{" not in c.get("/metrics").text


# ------------------------------------------------------------------ the reference profile and drift


# The profile's statistics are means, variances and standard deviations over float32 per-image
# values in [0, 1]. Another CPU's kernels (AVX2 against AVX-512, MKL's and oneDNN's paths) move
# those values by a few float32 ulps, so a recomputation agrees to about 1e-8 absolute, not digit
# for digit: a standard deviation near 1e-3 moved 4e-6 relative between two x86-64 machines.
# Rounding the stored values cannot fix that (a value near a rounding boundary still flips), so
# the shipped file is checked by its sha256 and a recomputation within this tolerance.
PROFILE_RTOL, PROFILE_ATOL = 1e-6, 1e-7


def test_shipped_profile_is_what_the_package_hash_covers():
    import hashlib

    data = (DIGITS / PROFILE_FILE).read_bytes()
    entry = json.loads((DIGITS / "config.json").read_text())["routing_profile"]
    assert entry["file"] == PROFILE_FILE and hashlib.sha256(data).hexdigest() == entry["sha256"]
    assert read_package(DIGITS).routing_profile() == json.loads(data)


def test_shipped_profile_is_reproducible():
    """``python -m softmoe_models.routing_cli profile server/default_models/digits`` gives the shipped
    file's statistics on any x86-64 CPU, within ``PROFILE_RTOL``/``PROFILE_ATOL``."""
    pixels, source = calibration_pixels(DIGITS)
    profile = compute_profile(load_model(DIGITS), pixels, source)
    shipped = json.loads((DIGITS / PROFILE_FILE).read_text())
    stats = ("expert_share", "dispatch_entropy", "combine_entropy")
    assert {k: v for k, v in profile.items() if k not in stats} == {k: v for k, v in shipped.items() if k not in stats}
    for key in stats:
        assert profile[key].keys() == shipped[key].keys(), key
        for part in shipped[key]:
            np.testing.assert_allclose(profile[key][part], shipped[key][part], rtol=PROFILE_RTOL, atol=PROFILE_ATOL,
                                       err_msg=f"{key}/{part}")


def test_edited_profile_refuses_to_load(tmp_path):
    import shutil

    from server.engine.models import ModelLoadError, load_served_model

    pkg = tmp_path / "digits"
    shutil.copytree(DIGITS, pkg)
    profile = json.loads((pkg / PROFILE_FILE).read_text())
    profile["expert_share"]["mean"][0][0] += 0.01
    (pkg / PROFILE_FILE).write_text(json.dumps(profile))
    with pytest.raises(ModelLoadError, match="sha256"):
        load_served_model(f"d={pkg}", Settings(backend="torch"))


def _inverted_png(values: np.ndarray) -> bytes:
    from softmoe_models.demo.data import digit_png

    return digit_png(16 - values)


def test_drift_separates_in_distribution_from_out_of_distribution():
    """256 images per phase through /v1/classify (every call sampled, a window of 256): training-split
    digits (in distribution, not the calibration images), then inverted held-out digits, then noise."""
    from sklearn.datasets import load_digits

    from softmoe_models.demo.data import load_splits

    train, held = load_splits()
    values = load_digits().data
    rng = np.random.default_rng(0)
    phases = {
        "in-distribution digits (train split)": train.pngs[:256],
        "inverted digits": [_inverted_png(values[i]) for i in held.indices[:256]],
        "uniform noise": [png(rng.integers(0, 256, (8, 8), dtype=np.uint8)) for _ in range(256)],
    }
    settings = Settings(models=[f"digits={DIGITS}"], backend="torch", routing_stats_sample=1, routing_drift_window=256,
                        max_batch_size=8, max_delay_ms=1)
    figures = {}
    with TestClient(create_app(settings)) as c:
        for name, blobs in phases.items():
            for start in range(0, len(blobs), 32):
                r = c.post("/v1/classify", json={"images": [b64(b) for b in blobs[start:start + 32]]})
                assert r.status_code == 200, r.text
            text = c.get("/metrics").text
            assert _metric(text, "softmoe_routing_window_images", model="digits") == 256  # the phase alone
            drift = _metric(text, "softmoe_routing_drift", model="digits")
            baseline = _metric(text, "softmoe_routing_drift_baseline", model="digits")
            figures[name] = (drift, baseline, drift / baseline)
    print("\nrouting drift on the digits model (window of 256 sampled images):")
    for name, (drift, baseline, ratio) in figures.items():
        print(f"  {name:38s} drift {drift:.2e} bits, baseline {baseline:.2e}, ratio {ratio:5.1f}")
    ratio = {k: v[2] for k, v in figures.items()}
    assert ratio["in-distribution digits (train split)"] < 3
    assert ratio["inverted digits"] > 10 and ratio["uniform noise"] > 10
    assert min(ratio["inverted digits"], ratio["uniform noise"]) > 4 * ratio["in-distribution digits (train split)"]


def test_window_keeps_the_last_images_and_baseline_tracks_its_size():
    from softmoe_models.routing import Window

    profile = json.loads((DIGITS / PROFILE_FILE).read_text())
    rng = np.random.default_rng(0)
    shares = rng.dirichlet(np.ones(8), size=(300, 2))  # (images, layers, experts)
    w = Window(64, 2, 8)
    assert w.drift(profile) == 0 and np.all(w.mean() == 0)
    seen = []
    for k in (1, 5, 63, 100, 3, 128):  # batches of every size, some larger than the window
        start = sum(len(s) for s in seen)
        seen.append(shares[start:start + k])
        w.add(shares[start:start + k])
        last = np.concatenate(seen)[-64:]
        assert w.count == len(last)
        assert np.allclose(w.mean(), last.mean(axis=0))
    small, full = Window(8, 2, 8), Window(256, 2, 8)
    small.add(shares[:8])
    full.add(shares[:256])
    assert small.baseline(profile) > 4 * full.baseline(profile)  # noise shrinks like 1/size
