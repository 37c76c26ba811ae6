"""Model packages: round trip, config-vs-weights checks, `softmoe init` determinism."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from softmoe_models.config import EncoderConfig, MoEConfig, ViTConfig
from softmoe_models.models import build_model
from softmoe_models.package import PackageError, load_model, read_package, save_package

TINY = ViTConfig(EncoderConfig(32, 2, 2, 48, moe=MoEConfig((1,), 4, 1)), image_size=16, patch_size=4, num_classes=3)


def _pkg(tmp_path, labels=("a", "b", "c")):
    torch.manual_seed(0)
    model = build_model(TINY).eval()
    return model, save_package(model, TINY, tmp_path / "pkg", labels=list(labels))


def test_round_trip(tmp_path):
    model, pkg = _pkg(tmp_path)
    loaded = load_model(pkg)
    assert not loaded.training
    assert all(not p.requires_grad for p in loaded.parameters())
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    meta = read_package(pkg)
    assert meta.kind == "classifier" and meta.labels == ["a", "b", "c"]
    assert meta.preprocess.image_size == 16 and meta.preprocess.value_range == (-1.0, 1.0)
    assert meta.config == TINY


def test_weights_that_do_not_match_config(tmp_path):
    _, pkg = _pkg(tmp_path)
    state = load_file(str(pkg / "model.safetensors"))
    state["head.weight"] = torch.zeros(4, 32)
    save_file(state, str(pkg / "model.safetensors"))
    with pytest.raises(PackageError, match=r"head.weight \(4, 32\) != \(3, 32\)"):
        load_model(pkg)
    del state["head.weight"]
    save_file(state, str(pkg / "model.safetensors"))
    with pytest.raises(PackageError, match="missing.*head.weight"):
        load_model(pkg)


def test_bad_packages(tmp_path):
    with pytest.raises(PackageError, match="not a model package"):
        read_package(tmp_path)
    _, pkg = _pkg(tmp_path)
    (pkg / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(PackageError, match="cannot read weights"):
        load_model(pkg)
    (pkg / "config.json").write_text("{not json")
    with pytest.raises(PackageError, match="invalid JSON"):
        read_package(pkg)
    meta = {"format": "softmoe-package", "format_version": 1, "kind": "classifier", "model": {"bogus": 1}}
    (pkg / "config.json").write_text(json.dumps(meta))
    with pytest.raises(PackageError, match="unknown field"):
        read_package(pkg)


def test_label_count_checked(tmp_path):
    with pytest.raises(PackageError, match="2 labels given for a model with 3 classes"):
        _pkg(tmp_path, labels=("a", "b"))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "server", *args], capture_output=True, text=True)


def test_init_is_deterministic(tmp_path):
    for name in ("a", "b", "c"):
        seed = "1" if name != "c" else "2"
        r = _cli("init", "vit-s16", "--out", str(tmp_path / name), "--num-classes", "5", "--image-size", "32", "--seed", seed)
        assert r.returncode == 0, r.stderr
    a, b, c = (load_file(str(tmp_path / n / "model.safetensors")) for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["head.weight"], c["head.weight"])
    model = load_model(tmp_path / "a")
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 5)
    assert read_package(tmp_path / "a").meta["variant"] == "vit-s16"


def test_init_unknown_variant_is_one_line(tmp_path):
    r = _cli("init", "vit-q99", "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "unknown variant 'vit-q99'" in r.stderr
