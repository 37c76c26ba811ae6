"""vmoe-layout parameter files of configurations not in shared/, against an independent
float64 numpy implementation (tests/helpers/vmoe_numpy.py): config inference, layout mapping
and the math, through the real converter and package loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import vmoe_numpy as ref
from softmoe_models.convert import convert_checkpoint
from softmoe_models.convert.infer import infer_config
from softmoe_models.package import load_model

CONFIGS = {
    "wide-e6p3-img24": dict(d=48, heads=3, mlp_dim=80, layers=3, moe_layers=(1, 2), n=6, p=3, patch=6, image_size=24, num_classes=13),
    "dense-no-moe": dict(d=32, heads=4, mlp_dim=64, layers=2, moe_layers=(), num_classes=5),
    "moe-everywhere-e16": dict(d=40, heads=5, mlp_dim=56, layers=2, moe_layers=(0, 1), n=16, p=1, patch=8, image_size=32, num_classes=3),
    "token-classifier": dict(classifier="token", moe_layers=(), num_classes=4),
    "map-head": dict(classifier="map", num_classes=6, moe_layers=(0,)),
    "representation": dict(representation_size=20, num_classes=9),
    "no-qk-norm": dict(qk_norm=False, num_classes=11),
    "features-only": dict(num_classes=None),
}


def _images(cfg: dict, batch: int = 3, seed: int = 0) -> np.ndarray:
    s = cfg.get("image_size", 16)
    return np.random.default_rng(seed).uniform(-1, 1, (batch, s, s, 3)).astype(np.float32)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_converted_matches_numpy_reference(name, tmp_path):
    kw = CONFIGS[name]
    params = ref.random_vit_params(seed=len(name), **kw)
    np.savez(tmp_path / "ckpt.npz", **{f"params/{k}": v for k, v in params.items()})
    pkg, _ = convert_checkpoint(tmp_path / "ckpt.npz", tmp_path / "pkg")
    model = load_model(pkg)
    images = _images(kw)
    expected = ref.vit(params, images.astype(np.float64))
    with torch.no_grad():
        got = model(torch.from_numpy(images).permute(0, 3, 1, 2)).numpy()
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_inference(name):
    kw = CONFIGS[name]
    cfg = infer_config(ref.random_vit_params(**kw))
    enc = cfg.encoder
    assert enc.hidden_size == kw.get("d", 32)
    assert enc.num_heads == kw.get("heads", 2)
    assert enc.num_layers == kw.get("layers", 2)
    assert cfg.patch_size == kw.get("patch", 4)
    assert cfg.image_size == kw.get("image_size", 16)
    assert cfg.num_classes == kw.get("num_classes", 7)
    assert cfg.classifier == kw.get("classifier", "gap")
    assert enc.qk_norm == kw.get("qk_norm", True)
    assert cfg.representation_size == kw.get("representation_size")
    moe_layers = tuple(kw.get("moe_layers", (1,)))
    if moe_layers:
        assert enc.moe.layers == moe_layers
        assert (enc.moe.num_experts, enc.moe.slots_per_expert) == (kw.get("n", 4), kw.get("p", 1))
    else:
        assert enc.moe is None


def test_two_tower_other_config(tmp_path):
    params = ref.random_two_tower_params(seed=3, d=40, text_d=24, vocab=77, max_len=10, heads=4, n=5, p=2)
    np.savez(tmp_path / "tt.npz", **{f"params/{k}": v for k, v in params.items()})
    pkg, _ = convert_checkpoint(tmp_path / "tt.npz", tmp_path / "pkg", text_pool="last")
    model = load_model(pkg)
    images = _images({}, batch=2)
    ids = np.random.default_rng(1).integers(0, 77, (4, 10))
    img = ref.vit({k[4:]: v for k, v in params.items() if k.startswith("img/")}, images.astype(np.float64))
    txt = ref.text({k[4:]: v for k, v in params.items() if k.startswith("txt/")}, ids)
    zimg = img / (np.linalg.norm(img, axis=-1, keepdims=True) + 1e-8)
    ztxt = txt / (np.linalg.norm(txt, axis=-1, keepdims=True) + 1e-8)
    with torch.no_grad():
        got_i = model.encode_image(torch.from_numpy(images).permute(0, 3, 1, 2)).numpy()
        got_t = model.encode_text(torch.from_numpy(ids)).numpy()
    assert np.abs(got_i - zimg).max() <= 1e-4
    assert np.abs(got_t - ztxt).max() <= 1e-4
    assert model.cfg.text.max_len == 10 and model.cfg.text.vocab_size == 77
