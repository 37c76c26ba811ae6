"""The text tower's pooling is inferred only when the parameters show it ('map'), else given with
``--text-pool``; every vmoe pool type against the independent numpy reference. Also the rule for
the dropped ``MoEConfig.group_size`` in existing config.json files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import vmoe_numpy as ref
from softmoe_models.config import TEXT_POOLS
from softmoe_models.convert import ConversionError, convert_checkpoint
from softmoe_models.package import PackageError, load_model, read_package

TEXT_D, TEXT_HEADS, MAX_LEN, VOCAB = 24, 2, 8, 50


def _two_tower(map_head: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    params = ref.random_two_tower_params(seed=seed, d=32, text_d=TEXT_D, vocab=VOCAB, max_len=MAX_LEN)
    if map_head:  # vmoe TextTransformer 'map': MapHead with the text encoder's heads, mlp_dim and qk-norm
        rng = np.random.default_rng(seed + 7)
        d, dh, mlp = TEXT_D, TEXT_D // TEXT_HEADS, 2 * TEXT_D
        m = "txt/MapHead/MultiHeadDotProductAttention"
        params["txt/MapHead/probe"] = rng.normal(0, 0.5, (1, 1, d))
        for name in ("query", "key", "value"):
            params[f"{m}/{name}/kernel"] = rng.normal(0, d**-0.5, (d, TEXT_HEADS, dh))
            params[f"{m}/{name}/bias"] = rng.normal(0, 0.1, (TEXT_HEADS, dh))
        params[f"{m}/out/kernel"] = rng.normal(0, d**-0.5, (TEXT_HEADS, dh, d))
        params[f"{m}/out/bias"] = rng.normal(0, 0.1, d)
        params[f"{m}/query_ln/scale"] = 1 + rng.normal(0, 0.1, dh)
        params[f"{m}/key_ln/scale"] = 1 + rng.normal(0, 0.1, dh)
        params["txt/MapHead/LayerNorm/scale"] = 1 + rng.normal(0, 0.1, d)
        params["txt/MapHead/LayerNorm/bias"] = rng.normal(0, 0.1, d)
        params["txt/MapHead/Mlp/Dense_0/kernel"] = rng.normal(0, d**-0.5, (d, mlp))
        params["txt/MapHead/Mlp/Dense_0/bias"] = rng.normal(0, 0.1, mlp)
        params["txt/MapHead/Mlp/Dense_1/kernel"] = rng.normal(0, mlp**-0.5, (mlp, d))
        params["txt/MapHead/Mlp/Dense_1/bias"] = rng.normal(0, 0.1, d)
    return {k: np.asarray(v, np.float32) for k, v in params.items()}


def _save(params: dict[str, np.ndarray], path) -> None:
    np.savez(path, **{f"params/{k}": v for k, v in params.items()})


def _ref_text(params: dict[str, np.ndarray], ids: np.ndarray, pool: str) -> np.ndarray:
    """vmoe TextTransformer with ``apply_pooling(pool)``, float64 numpy."""
    p = {k[len("txt/"):]: np.asarray(v, np.float64) for k, v in params.items() if k.startswith("txt/")}
    x = ref.encoder(ref.sub(p, "Encoder"), p["Embed_0/embedding"][ids])  # (B, L, D)
    if pool == "last":
        pooled = x[:, -1]
    elif pool == "first":
        pooled = x[:, 0]
    elif pool == "gap":
        pooled = x.mean(axis=1)
    elif pool == "gmp":
        pooled = x.max(axis=1)
    else:
        mh = ref.sub(p, "MapHead")
        probe = np.broadcast_to(mh["probe"], (x.shape[0], 1, x.shape[-1]))
        a = ref.attention(ref.sub(mh, "MultiHeadDotProductAttention"), probe, x)
        pooled = (a + ref.mlp(ref.sub(mh, "Mlp"), ref.layer_norm(a, mh["LayerNorm/scale"], mh["LayerNorm/bias"])))[:, 0]
    return pooled @ p["head/kernel"] + p["head/bias"]


def softmoe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", *args], capture_output=True, text=True,
                          timeout=300)


def test_no_pooling_evidence_is_an_error_naming_the_flag(tmp_path):
    _save(_two_tower(), tmp_path / "tt.npz")
    with pytest.raises(ConversionError, match=r"--text-pool \{last,first,gap,gmp\}") as e:
        convert_checkpoint(tmp_path / "tt.npz", tmp_path / "pkg")
    assert "'last' when the config does not set it" in str(e.value)
    assert not (tmp_path / "pkg" / "config.json").exists()


@pytest.mark.parametrize("pool", [p for p in TEXT_POOLS if p != "map"])
def test_given_pooling_converts_and_matches_vmoe(tmp_path, pool):
    params = _two_tower()
    _save(params, tmp_path / "tt.npz")
    pkg, _ = convert_checkpoint(tmp_path / "tt.npz", tmp_path / "pkg", text_pool=pool)
    meta = read_package(pkg).meta
    assert meta["model"]["text"]["pool_type"] == pool
    assert meta["provenance"]["text_pool"] == "given"
    ids = np.random.default_rng(1).integers(0, VOCAB, (5, MAX_LEN))
    with torch.no_grad():
        got = load_model(pkg).encode_text(torch.from_numpy(ids), normalize=False).numpy()
    assert np.abs(got - _ref_text(params, ids, pool)).max() <= 1e-4


def test_pooling_types_differ(tmp_path):
    """The test above would not notice a pooling that is ignored: the outputs must differ."""
    params = _two_tower(map_head=True)
    ids = np.random.default_rng(2).integers(0, VOCAB, (3, MAX_LEN))
    outs = [_ref_text(params, ids, p) for p in TEXT_POOLS]
    for i in range(len(outs)):
        for j in range(i + 1, len(outs)):
            assert np.abs(outs[i] - outs[j]).max() > 1e-3, (TEXT_POOLS[i], TEXT_POOLS[j])


@pytest.mark.parametrize("given", [None, "map"])
def test_map_head_is_inferred_from_its_parameters(tmp_path, given):
    params = _two_tower(map_head=True)
    _save(params, tmp_path / "tt.npz")
    pkg, _ = convert_checkpoint(tmp_path / "tt.npz", tmp_path / "pkg", text_pool=given)
    meta = read_package(pkg).meta
    assert meta["model"]["text"]["pool_type"] == "map"
    assert meta["provenance"]["text_pool"] == ("given" if given else "inferred from the parameters")
    ids = np.random.default_rng(3).integers(0, VOCAB, (4, MAX_LEN))
    with torch.no_grad():
        got = load_model(pkg).encode_text(torch.from_numpy(ids), normalize=False).numpy()
    assert np.abs(got - _ref_text(params, ids, "map")).max() <= 1e-4


@pytest.mark.parametrize("map_head,given", [(True, "last"), (True, "gap"), (False, "map")])
def test_contradicting_pooling_is_an_error(tmp_path, map_head, given):
    _save(_two_tower(map_head=map_head), tmp_path / "tt.npz")
    with pytest.raises(ConversionError, match=rf"--text-pool {given} contradicts the checkpoint.*txt/MapHead"):
        convert_checkpoint(tmp_path / "tt.npz", tmp_path / "pkg", text_pool=given)


def test_text_pool_for_a_classifier_is_an_error(tmp_path):
    _save(ref.random_vit_params(), tmp_path / "c.npz")
    with pytest.raises(ConversionError, match="classifier"):
        convert_checkpoint(tmp_path / "c.npz", tmp_path / "pkg", text_pool="last")
    with pytest.raises(ConversionError, match="is not one of"):
        convert_checkpoint(tmp_path / "c.npz", tmp_path / "pkg", text_pool="mean")


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def test_cli(tmp_path):
    _save(_two_tower(), tmp_path / "tt.npz")
    line = _one_error_line(softmoe("convert", str(tmp_path / "tt.npz"), "--out", str(tmp_path / "a")))
    assert "--text-pool {last,first,gap,gmp}" in line
    line = _one_error_line(softmoe("convert", str(tmp_path / "tt.npz"), "--out", str(tmp_path / "b"), "--text-pool", "map"))
    assert "contradicts" in line
    line = _one_error_line(softmoe("convert", str(tmp_path / "tt.npz"), "--out", str(tmp_path / "c"), "--text-pool", "mean"))
    assert "--text-pool" in line and "invalid choice" in line
    r = softmoe("convert", str(tmp_path / "tt.npz"), "--out", str(tmp_path / "d"), "--text-pool", "first")
    assert r.returncode == 0, r.stderr
    assert read_package(tmp_path / "d").config.text.pool_type == "first"
    assert "--text-pool {last,first,gap,gmp,map}" in " ".join(softmoe("convert", "--help").stdout.split())


# ---------------------------------------------------------------- MoEConfig.group_size is gone


def _package_with_group_size(tmp_path, value):
    """An existing package (the shipped digits) whose config.json still records group_size."""
    from server.engine.defaults import SHIPPED

    pkg = tmp_path / "digits"
    shutil.copytree(SHIPPED / "digits", pkg)
    meta = json.loads((pkg / "config.json").read_text())
    meta["model"]["encoder"]["moe"]["group_size"] = value
    (pkg / "config.json").write_text(json.dumps(meta))
    return pkg, meta


@pytest.mark.parametrize("value", [16, None])  # 16: the digits model's tokens (8x8 pixels, 2x2 patches)
def test_old_group_size_of_one_sequence_is_accepted_and_dropped(tmp_path, value):
    pkg, _ = _package_with_group_size(tmp_path, value)
    cfg = read_package(pkg).config
    assert cfg.num_tokens == 16
    assert not hasattr(cfg.encoder.moe, "group_size")
    with torch.no_grad():
        assert load_model(pkg)(torch.zeros(2, 3, cfg.image_size, cfg.image_size)).shape == (2, cfg.num_classes)


def test_old_group_size_straddling_sequences_is_refused(tmp_path):
    pkg, _ = _package_with_group_size(tmp_path, 32)
    with pytest.raises(PackageError, match=r"encoder\.moe\.group_size = 32 differs from the sequence length 16"):
        read_package(pkg)


def test_shipped_two_tower_config_with_group_size_still_loads():
    from server.engine.defaults import SHIPPED

    raw = json.loads((SHIPPED / "digits-lit" / "config.json").read_text())
    assert "group_size" in json.dumps(raw)  # written before the field was dropped
    assert read_package(SHIPPED / "digits-lit").config.image.encoder.moe is not None
