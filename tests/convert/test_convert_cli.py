"""`softmoe convert` on every golden source, then `load_model` against the golden outputs."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import GOLDEN, golden_npz, golden_params
from softmoe_models.config import TwoTowerConfig
from softmoe_models.convert import ConversionError, params_to_state_dict
from softmoe_models.convert.infer import infer_config
from softmoe_models.package import load_model, read_package

SOURCES = {
    "npz-e8p1": ("softmoe_e8p1.npz", "softmoe_e8p1"),
    "npz-twotower": ("twotower.npz", "twotower"),
    "npz-e4p2": ("softmoe_e4p2.npz", "softmoe_e4p2"),
    "legacy-partitioned": ("checkpoint/partitioned/softmoe_e4p2", "softmoe_e4p2"),
    "orbax": ("checkpoint/orbax/ckpt/0", "softmoe_e4p2"),
}


def softmoe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, golden_dir):
    out = {}
    root = tmp_path_factory.mktemp("pkgs")
    for key, (src, _) in SOURCES.items():
        pool = ["--text-pool", "last"] if key == "npz-twotower" else []  # twotower.json: text_pool_type "last"
        r = softmoe("convert", str(GOLDEN / src), "--out", str(root / key), *pool)
        assert r.returncode == 0, r.stderr
        assert "wrote" in r.stdout
        out[key] = root / key
    return out


@pytest.mark.parametrize("key", list(SOURCES))
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32dispatch", "bf16"])
def test_converted_package_matches_golden(converted, key, bf16):
    data = golden_npz(SOURCES[key][1])
    model = load_model(converted[key], bf16_dispatch=bf16)
    assert not model.training
    images = torch.from_numpy(data["inputs/images"]).permute(0, 3, 1, 2).contiguous()
    prefix, tol = ("outputs/", 3e-3) if bf16 else ("outputs_fp32dispatch/", 1e-4)
    with torch.no_grad():
        if isinstance(model.cfg, TwoTowerConfig):
            zimg = model.encode_image(images).numpy()
            ztxt = model.encode_text(torch.from_numpy(data["inputs/texts"])).numpy()
            assert np.abs(zimg - data[prefix + "zimg"]).max() <= tol
            assert np.abs(ztxt - data[prefix + "ztxt"]).max() <= tol
            assert np.allclose(np.linalg.norm(zimg, axis=-1), 1, atol=1e-5)
        else:
            logits = model(images).numpy()
            assert np.abs(logits - data[prefix + "logits"]).max() <= tol


def test_provenance_and_kind(converted):
    pkg = read_package(converted["legacy-partitioned"])
    assert pkg.kind == "classifier"
    assert pkg.meta["provenance"]["format"] == "vmoe-partitioned"
    assert len(pkg.meta["provenance"]["sha256"]) == 64
    assert read_package(converted["orbax"]).meta["provenance"]["format"] == "orbax"
    assert read_package(converted["npz-twotower"]).kind == "two-tower"
    assert read_package(converted["npz-twotower"]).text["eos_id"] == 1
    # The same parameters from three formats give the same weights.
    from safetensors.torch import load_file

    a, b, c = (load_file(str(converted[k] / "model.safetensors")) for k in ("npz-e4p2", "legacy-partitioned", "orbax"))
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


def test_notices_for_ignored_groups(tmp_path, golden_dir):
    r = softmoe("convert", str(GOLDEN / "checkpoint/orbax/ckpt/0"), "--out", str(tmp_path / "p"))
    assert "opt_state" in r.stderr and r.returncode == 0
    r = softmoe("convert", str(GOLDEN / "softmoe_e8p1.npz"), "--out", str(tmp_path / "q"))
    assert "outputs" in r.stderr and r.returncode == 0


def test_labels_and_tokenizer_options(tmp_path, golden_dir):
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(f"digit {i}" for i in range(10)) + "\n")
    r = softmoe("convert", str(GOLDEN / "softmoe_e8p1.npz"), "--out", str(tmp_path / "p"), "--labels", str(labels),
                "--head-activation", "sigmoid")
    assert r.returncode == 0, r.stderr
    pkg = read_package(tmp_path / "p")
    assert pkg.labels[3] == "digit 3" and pkg.head_activation == "sigmoid"
    labels.write_text("a\nb\n")
    r = softmoe("convert", str(GOLDEN / "softmoe_e8p1.npz"), "--out", str(tmp_path / "q"), "--labels", str(labels))
    assert r.returncode == 2 and "2 labels given for a model with 10 classes" in r.stderr


# ------------------------------------------------------------------ key accounting


def _params():
    return golden_params(golden_npz("softmoe_e8p1"))


def test_missing_key_is_named():
    params = _params()
    del params["Encoder/encoderblock_1/SelfAttention/key/bias"]
    with pytest.raises(ConversionError, match="missing 1 key.*encoderblock_1/SelfAttention/key/bias"):
        params_to_state_dict(params, infer_config(params))


def test_unexpected_key_is_named():
    params = _params()
    params["Encoder/encoderblock_0/Extra/kernel"] = np.zeros((2, 2), np.float32)
    with pytest.raises(ConversionError, match="unexpected 1 key.*encoderblock_0/Extra/kernel"):
        params_to_state_dict(params, infer_config(params))


def test_wrong_shape_is_named():
    params = _params()
    params["Encoder/encoderblock_3/Moe/Mlp/Dense_1/bias"] = np.zeros((8, 65), np.float32)
    with pytest.raises(ConversionError, match=r"encoderblock_3/Moe/Mlp/Dense_1/bias.*\(8, 65\)"):
        params_to_state_dict(params, infer_config(params))


def test_non_contiguous_blocks():
    params = {k: v for k, v in _params().items() if "encoderblock_1/" not in k}
    with pytest.raises(ConversionError, match=r"missing encoderblock_\[1\]"):
        infer_config(params)


def test_unrelated_tree():
    with pytest.raises(ConversionError, match="not a vmoe VisionTransformerMoe or TwoTower"):
        infer_config({"foo/bar": np.zeros(3, np.float32)})


@pytest.mark.parametrize("make", ["png", "text", "missing", "truncated-npz"])
def test_cli_bad_sources_are_one_line(tmp_path, make, golden_dir):
    src = tmp_path / "src"
    if make == "png":
        src = tmp_path / "x.png"
        src.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    elif make == "text":
        src.write_text("hello")
    elif make == "truncated-npz":
        src = tmp_path / "t.npz"
        src.write_bytes((GOLDEN / "softmoe_e8p1.npz").read_bytes()[:5000])
    r = softmoe("convert", str(src), "--out", str(tmp_path / "out"))
    assert r.returncode == 2
    assert r.stderr.startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr and str(src) in r.stderr


def test_cli_truncated_shard(tmp_path, golden_dir):
    import shutil

    for f in (GOLDEN / "checkpoint/partitioned").iterdir():
        shutil.copy(f, tmp_path / f.name)
    shard = tmp_path / "softmoe_e4p2.data-00001-of-00002"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    r = softmoe("convert", str(tmp_path / "softmoe_e4p2"), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "data-00001-of-00002" in r.stderr and "Traceback" not in r.stderr


def test_models_json_is_a_list():
    r = softmoe("models", "--json", "--num-classes", "29593")
    rows = json.loads(r.stdout)
    assert all({"name", "params"} <= set(row) for row in rows)
