"""`softmoe convert` of sparse V-MoE checkpoints (vmoe's Tokens and Experts Choice routers):
shared/golden/vmoe-sparse's three models from npz, its legacy partitioned checkpoint, an orbax
checkpoint written here; what the parameters show is inferred, the routing comes from flags or a
preset, and every conflict is one ``error: ...`` line with exit status 2.

Converted packages, loaded by ``load_model`` (what the torch backend serves), against vmoe's
outputs for groups of one image (``group1``, how this port always routes), measured on this CPU:
fp32 dispatch vs ``outputs_fp32dispatch/*`` within 2.2e-6 (asserted 1e-4); ``--dispatch-dtype
bfloat16`` vs ``outputs/*`` within 1.9e-6 for the one-MoE-layer models, 7.5e-5 (cf 1.05) and
4.3e-4 (cf 4.0) for vmoe_tc_e8k2 (asserted 1e-3; tests/models/test_sparse_golden.py says why).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SHARED
from softmoe_models.config import ViTConfig
from softmoe_models.convert import ConversionError, convert_checkpoint
from softmoe_models.convert.convert import resolve_config
from softmoe_models.convert.presets import PRESETS
from softmoe_models.convert.readers import read_checkpoint
from softmoe_models.convert.sparse import SparseOptions
from softmoe_models.package import load_model, read_package

GOLDEN = SHARED / "golden" / "vmoe-sparse"
SOFT_GOLDEN = SHARED / "golden" / "vmoe"
LEGACY = GOLDEN / "checkpoint" / "vmoe_tc_e8k2"
MODELS = ["vmoe_tc_e8k2", "vmoe_tc_bpr_e4k1", "vmoe_ec_e4"]
CFS = ["1.05", "4.0"]
FP32_TOL = 1e-4  # vs outputs_fp32dispatch/CF/group1 (measured <= 2.2e-6)
BF16_TOL = 1e-3  # vs outputs/CF/group1, bf16 dispatcher (measured <= 4.4e-4)


@functools.lru_cache(maxsize=None)
def _golden(name: str) -> tuple[dict[str, np.ndarray], dict]:
    path = GOLDEN / f"{name}.npz"
    if not path.is_file():
        pytest.skip(f"golden data not found at {path}")
    with np.load(path) as d:
        data = {k: d[k] for k in d.files}
    return data, json.loads((GOLDEN / f"{name}.json").read_text())


def _flags(name: str) -> dict:
    """The routing of a golden model as convert_checkpoint's keywords, read from its vmoe config."""
    router = _golden(name)[1]["config"]["encoder"]["moe"]["router"]
    if router.get("name") == "NoisyTopItemsPerExpertRouter":
        return {"router": "experts-choice"}
    return {"router": "tokens-choice", "experts_per_token": router["num_selected_experts"],
            "batch_priority": bool(router["dispatcher"].get("batch_priority", False))}


def _cli_flags(name: str) -> list[str]:
    out = []
    for key, value in _flags(name).items():
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [] if value is False else [flag, str(value)]
    return out


def _logits(pkg: Path, images: np.ndarray) -> np.ndarray:
    model = load_model(pkg)
    with torch.no_grad():
        return model(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()).numpy()


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[tuple[str, str, str], Path]:
    """(model, cf, dispatch dtype) -> package converted from the golden npz."""
    root = tmp_path_factory.mktemp("sparse")
    out = {}
    for name in MODELS:
        for cf in CFS:
            for dtype in ("float32", "bfloat16"):
                pkg, _ = convert_checkpoint(GOLDEN / f"{name}.npz", root / f"{name}-{cf}-{dtype}",
                                            capacity_factor=float(cf), dispatch_dtype=dtype, **_flags(name))
                out[name, cf, dtype] = pkg
    return out


# ---------------------------------------------------------------- against vmoe's outputs


@pytest.mark.parametrize("cf", CFS)
@pytest.mark.parametrize("name", MODELS)
def test_converted_package_matches_vmoe_per_image(converted, name, cf):
    data, _ = _golden(name)
    images = data["inputs/images"]
    got = _logits(converted[name, cf, "float32"], images)
    assert np.abs(got - data[f"outputs_fp32dispatch/cf{cf}/group1/logits"]).max() <= FP32_TOL
    got = _logits(converted[name, cf, "bfloat16"], images)
    assert np.abs(got - data[f"outputs/cf{cf}/group1/logits"]).max() <= BF16_TOL


@pytest.mark.parametrize("name", MODELS)
def test_package_config_holds_the_routing(converted, name):
    _, meta = _golden(name)
    disp = meta["config"]["encoder"]["moe"]["router"]["dispatcher"]
    pkg = read_package(converted[name, "1.05", "bfloat16"])
    moe = pkg.config.encoder.moe
    assert moe.router == _flags(name)["router"]
    assert moe.capacity_factor == 1.05 and moe.dispatch_dtype == "bfloat16"
    # The router picks the rounding: vmoe's defaults for tokens-choice, its experts-choice config's
    # round / multiple of 1 (what the golden json records in both cases).
    assert moe.capacity_rounding == disp.get("capacity_ceil_or_round", "ceil")
    assert moe.capacity_multiple_of == disp.get("capacity_multiple_of", 4)
    assert moe.batch_priority == bool(disp.get("batch_priority", False))
    assert pkg.meta["provenance"]["routing"].startswith("flags --router")
    assert len(pkg.meta["provenance"]["sha256"]) == 64


def test_capacity_factor_defaults_to_vmoe_eval_value(tmp_path):
    pkg, _ = convert_checkpoint(GOLDEN / "vmoe_tc_e8k2.npz", tmp_path / "p", **_flags("vmoe_tc_e8k2"))
    cfg = read_package(pkg).config
    assert cfg.encoder.moe.capacity_factor == 4.0 and cfg.encoder.moe.dispatch_dtype == "float32"


# ---------------------------------------------------------------- the three formats


def test_legacy_checkpoint_converts_to_the_npz_weights(converted, tmp_path):
    from safetensors.torch import load_file

    pkg, _ = convert_checkpoint(LEGACY, tmp_path / "legacy", capacity_factor=1.05, **_flags("vmoe_tc_e8k2"))
    a = load_file(str(converted["vmoe_tc_e8k2", "1.05", "float32"] / "model.safetensors"))
    b = load_file(str(pkg / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = read_package(pkg).meta
    assert meta["provenance"]["format"] == "vmoe-partitioned"
    assert meta["model"] == read_package(converted["vmoe_tc_e8k2", "1.05", "float32"]).meta["model"]
    data, _ = _golden("vmoe_tc_e8k2")
    got = _logits(pkg, data["inputs/images"])
    assert np.abs(got - data["outputs_fp32dispatch/cf1.05/group1/logits"]).max() <= FP32_TOL


def _write_orbax(step_dir: Path, params: dict[str, np.ndarray]) -> None:
    """An orbax ``ckpt/<step>/state`` as vmoe's trainer writes it (OCDBT, zarr), params and a step."""
    ts = pytest.importorskip("tensorstore")
    state = step_dir / "state"
    state.mkdir(parents=True)
    context = ts.Context()
    arrays = {**{f"params/{k}": v for k, v in params.items()}, "step": np.array(7, np.int32)}
    tree = {}
    for path, array in arrays.items():
        keys = path.split("/")
        tree[str(tuple(keys))] = {"key_metadata": [{"key": k, "key_type": 2} for k in keys],
                                  "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False}}
        kvstore = {"driver": "ocdbt", "base": {"driver": "file", "path": f"{state}/"}, "path": f"{'.'.join(keys)}/"}
        store = ts.open({"driver": "zarr", "kvstore": kvstore}, create=True, dtype=array.dtype, shape=array.shape,
                        context=context).result()
        store.write(array).result()
    (state / "_METADATA").write_text(json.dumps({"tree_metadata": tree, "use_ocdbt": True, "use_zarr3": False,
                                                 "store_array_data_equal_to_fill_value": True}))


def test_orbax_checkpoint_converts_to_the_npz_weights(converted, tmp_path):
    from safetensors.torch import load_file

    params, _, _ = read_checkpoint(GOLDEN / "vmoe_ec_e4.npz")
    _write_orbax(tmp_path / "ckpt" / "7", params)
    pkg, notices = convert_checkpoint(tmp_path / "ckpt", tmp_path / "orbax", capacity_factor=4.0,
                                      **_flags("vmoe_ec_e4"))
    assert any("using step 7" in n for n in notices)
    a = load_file(str(converted["vmoe_ec_e4", "4.0", "float32"] / "model.safetensors"))
    b = load_file(str(pkg / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_package(pkg).meta["provenance"]["format"] == "orbax"


# ---------------------------------------------------------------- what the parameters show


@pytest.mark.parametrize("name", MODELS)
def test_inferred_from_the_parameters(name):
    data, meta = _golden(name)
    c, derived = meta["config"], meta["derived"]
    params = {k[len("params/"):]: v for k, v in data.items() if k.startswith("params/")}
    cfg, _, provenance = resolve_config(params, sparse=SparseOptions(**_flags(name)))
    assert isinstance(cfg, ViTConfig)
    enc = cfg.encoder
    assert (enc.hidden_size, enc.num_layers, enc.num_heads, enc.mlp_dim, enc.qk_norm) == (
        c["hidden_size"], c["encoder"]["num_layers"], c["encoder"]["num_heads"], c["encoder"]["mlp_dim"], False)
    assert (cfg.patch_size, cfg.image_size, cfg.num_classes) == (c["patch_size"][0], derived["image_size"],
                                                                 c["num_classes"])
    assert cfg.classifier == c["classifier"] == "token"
    assert cfg.representation_size == c["representation_size"]
    assert list(enc.moe.layers) == c["encoder"]["moe"]["layers"] == derived["moe_layers"]
    assert enc.moe.num_experts == c["encoder"]["moe"]["num_experts"] and enc.moe.mlp_dim is None
    assert provenance == {"routing": "flags " + ", ".join(SparseOptions(**_flags(name)).given())}


def _shape_params(d: int, layers: int, mlp: int, heads: int, patch: int, image: int, classes: int,
                  rep: int | None, experts: int, moe_layers: tuple[int, ...], classifier: str = "token",
                  router_ndim: int = 2) -> dict[str, np.ndarray]:
    """A vmoe V-MoE parameter tree of the given sizes, shapes only (zero-stride arrays): inference
    reads names and shapes, so the public models' sizes cost no memory."""
    def z(*shape: int) -> np.ndarray:
        return np.broadcast_to(np.float32(0), shape)

    tokens = (image // patch) ** 2 + (classifier == "token")
    p = {"embedding/kernel": z(patch, patch, 3, d), "embedding/bias": z(d),
         "Encoder/posembed_input/pos_embedding": z(1, tokens, d),
         "Encoder/encoder_norm/scale": z(d), "Encoder/encoder_norm/bias": z(d),
         "head/kernel": z(rep or d, classes), "head/bias": z(classes)}
    if classifier == "token":
        p["cls"] = z(1, 1, d)
    if rep:
        p |= {"pre_logits/kernel": z(d, rep), "pre_logits/bias": z(rep)}
    for i in range(layers):
        b = f"Encoder/encoderblock_{i}"
        for ln in ("LayerNorm_0", "LayerNorm_1"):
            p |= {f"{b}/{ln}/scale": z(d), f"{b}/{ln}/bias": z(d)}
        for qkv in ("query", "key", "value"):
            p |= {f"{b}/SelfAttention/{qkv}/kernel": z(d, heads, d // heads),
                  f"{b}/SelfAttention/{qkv}/bias": z(heads, d // heads)}
        p |= {f"{b}/SelfAttention/out/kernel": z(heads, d // heads, d), f"{b}/SelfAttention/out/bias": z(d)}
        if i in moe_layers:
            router = z(d, experts) if router_ndim == 2 else z(d, 2, experts // 2)
            p |= {f"{b}/Moe/Router/dense/kernel": router,
                  f"{b}/Moe/Mlp/Dense_0/kernel": z(experts, d, mlp), f"{b}/Moe/Mlp/Dense_0/bias": z(experts, mlp),
                  f"{b}/Moe/Mlp/Dense_1/kernel": z(experts, mlp, d), f"{b}/Moe/Mlp/Dense_1/bias": z(experts, d)}
        else:
            p |= {f"{b}/Mlp/Dense_0/kernel": z(d, mlp), f"{b}/Mlp/Dense_0/bias": z(mlp),
                  f"{b}/Mlp/Dense_1/kernel": z(mlp, d), f"{b}/Mlp/Dense_1/bias": z(d)}
    return p


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_inferred_classifier_and_representation(classifier):
    params = _shape_params(32, 2, 64, 2, 4, 16, 5, None if classifier == "gap" else 24, 4, (1,), classifier)
    cfg, _, _ = resolve_config(params, sparse=SparseOptions(router="experts-choice"))
    assert cfg.classifier == classifier
    assert cfg.representation_size == (None if classifier == "gap" else 24)
    assert cfg.num_tokens == 16 + (classifier == "token")


# ---------------------------------------------------------------- presets

# What vmoe's config files say about each public checkpoint (google-research/vmoe
# vmoe/configs/vmoe_paper/*.py, eee_paper/*.py, README), written out independently of
# softmoe_models/convert/presets.py:
# name: (D, layers, M, heads, patch, image, classes, representation, E, MoE blocks, K, BPR, eval cf)
EXPECTED = {
    "vmoe_s32_last2_ilsvrc2012_randaug_light1": (512, 8, 2048, 8, 32, 224, 1000, 512, 8, (5, 7), 2, False, 4.0),
    "vmoe_s32_last2_ilsvrc2012_randaug_medium": (512, 8, 2048, 8, 32, 224, 1000, 512, 8, (5, 7), 2, False, 4.0),
    "vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012":
        (512, 8, 2048, 8, 32, 384, 1000, None, 8, (5, 7), 2, False, 1.5),
    "vmoe_b16_imagenet21k_randaug_strong":
        (768, 12, 3072, 12, 16, 224, 21843, None, 8, (1, 3, 5, 7, 9, 11), 2, False, 1.05),
    "vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012":
        (768, 12, 3072, 12, 16, 384, 1000, None, 8, (1, 3, 5, 7, 9, 11), 2, False, 1.5),
}
E3 = ["eee_s32_last2_ilsvrc2012", "eee_s32_last2_ilsvrc2012_ft_cifar100"]


def test_every_public_checkpoint_has_a_preset():
    assert set(PRESETS) == set(EXPECTED) | set(E3)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_preset_sets_vmoe_config_values(name):
    d, layers, mlp, heads, patch, image, classes, rep, e, moe_layers, k, bpr, cf = EXPECTED[name]
    params = _shape_params(d, layers, mlp, heads, patch, image, classes, rep, e, moe_layers)
    cfg, notices, provenance = resolve_config(params, preset=name)
    moe = cfg.encoder.moe
    assert (moe.router, moe.experts_per_token, moe.batch_priority, moe.capacity_factor) == ("tokens-choice", k, bpr, cf)
    assert (moe.capacity_rounding, moe.capacity_multiple_of, moe.dispatch_dtype) == ("ceil", 4, "float32")
    assert (moe.num_experts, moe.layers, cfg.image_size, cfg.num_classes, cfg.representation_size) == (
        e, moe_layers, image, classes, rep)
    assert provenance == {"preset": name, "routing": f"preset {name}"} and notices == []
    labels = "ImageNet-21k" if classes == 21843 else "ILSVRC2012"
    assert PRESETS[name].labels == labels


def test_preset_evaluation_flags_override_with_a_notice():
    name = "vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012"
    params = _shape_params(*EXPECTED[name][:10])
    given = SparseOptions(capacity_factor=4.0, batch_priority=True, dispatch_dtype="bfloat16")
    cfg, notices, provenance = resolve_config(params, preset=name, sparse=given)
    moe = cfg.encoder.moe
    assert (moe.capacity_factor, moe.batch_priority, moe.dispatch_dtype) == (4.0, True, "bfloat16")
    assert notices == [f"--capacity-factor 4.0 overrides preset {name}'s 1.5",
                       f"--batch-priority overrides preset {name}'s batch priority off"]
    assert provenance["routing"] == f"preset {name}, flags --capacity-factor, --batch-priority, --dispatch-dtype"


def test_preset_conflicting_with_the_parameters_names_each_difference():
    light1, ft = "vmoe_s32_last2_ilsvrc2012_randaug_light1", "vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012"
    params = _shape_params(*EXPECTED[ft][:10])
    with pytest.raises(ConversionError) as e:
        resolve_config(params, preset=light1)
    msg = str(e.value)
    assert "\n" not in msg and f"does not match --preset {light1}" in msg
    assert "image size 224 vs 384; representation size 512 vs None" in msg and "experts" not in msg
    params = _shape_params(512, 8, 2048, 8, 32, 224, 1000, 512, 4, (3, 5, 7))
    with pytest.raises(ConversionError, match=r"MoE blocks \[5, 7\] vs \[3, 5, 7\]; experts 8 vs 4$"):
        resolve_config(params, preset=light1)


@pytest.mark.parametrize("name", E3)
def test_e3_presets_are_refused(name):
    params = _shape_params(512, 8, 2048, 8, 32, 224, 1000, 512, 8, (5, 7))
    with pytest.raises(ConversionError, match=f"--preset {name}: E³ .* is not served"):
        resolve_config(params, preset=name)


def test_e3_ensemble_router_is_refused_from_the_parameters():
    params = _shape_params(512, 8, 2048, 8, 32, 128, 100, 512, 8, (5, 7), router_ndim=3)
    with pytest.raises(ConversionError, match=r"\(512, 2, 4\), \(D, M, E/M\): an E³ ensemble router; E³"):
        resolve_config(params, sparse=SparseOptions(router="tokens-choice", experts_per_token=1))


def test_sparse_flags_refused_for_a_dense_vit():
    params = _shape_params(32, 2, 64, 2, 4, 16, 5, None, 4, ())
    assert resolve_config(params)[0].encoder.moe is None
    with pytest.raises(ConversionError, match="^--capacity-factor is for sparse V-MoE checkpoints .* no MoE blocks$"):
        resolve_config(params, sparse=SparseOptions(capacity_factor=2.0))


# ---------------------------------------------------------------- the command line


def softmoe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", *args], capture_output=True, text=True)


def test_cli_converts_with_labels(tmp_path):
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"class {i}\n" for i in range(10)))
    r = softmoe("convert", str(LEGACY), "--out", str(tmp_path / "pkg"), *_cli_flags("vmoe_tc_e8k2"),
                "--capacity-factor", "1.05", "--dispatch-dtype", "bfloat16", "--labels", str(labels))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {tmp_path / 'pkg'} (classifier, 385,418 params, from vmoe-partitioned)")
    pkg = read_package(tmp_path / "pkg")
    assert pkg.labels == [f"class {i}" for i in range(10)]
    moe = pkg.config.encoder.moe
    assert (moe.router, moe.experts_per_token, moe.capacity_factor, moe.dispatch_dtype) == (
        "tokens-choice", 2, 1.05, "bfloat16")


def _cli_error(capsys, *argv: str) -> str:
    """Run ``softmoe`` in this process; the one stderr line of a user error (exit status 2)."""
    from server.main import main

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


def _npz(name: str) -> str:
    return str(GOLDEN / f"{name}.npz")


CONFLICTS = {
    "no-router": ([_npz("vmoe_tc_e8k2")], "the checkpoint is a sparse V-MoE (Encoder/encoderblock_1/Moe/Router/"
                                          "dense/kernel, 8 experts in blocks [1, 3]), whose parameters do not show "
                                          "the router: pass --router"),
    "no-k": ([_npz("vmoe_tc_e8k2"), "--router", "tokens-choice"], "--router tokens-choice needs --experts-per-token K"),
    "k-above-experts": ([_npz("vmoe_tc_e8k2"), "--router", "tokens-choice", "--experts-per-token", "9"],
                        "--experts-per-token 9 exceeds the checkpoint's 8 experts"),
    "k-zero": ([_npz("vmoe_tc_e8k2"), "--router", "tokens-choice", "--experts-per-token", "0"],
               "--experts-per-token must be >= 1, got 0"),
    "cf-zero": ([_npz("vmoe_tc_e8k2"), "--router", "tokens-choice", "--experts-per-token", "2",
                 "--capacity-factor", "0"], "--capacity-factor must be > 0, got 0.0"),
    "k-with-experts-choice": ([_npz("vmoe_ec_e4"), "--router", "experts-choice", "--experts-per-token", "2"],
                              "--experts-per-token is for --router tokens-choice"),
    "bpr-with-experts-choice": ([_npz("vmoe_ec_e4"), "--router", "experts-choice", "--batch-priority"],
                                "--batch-priority is for --router tokens-choice"),
    "experts-choice-capacity": ([_npz("vmoe_ec_e4"), "--router", "experts-choice", "--capacity-factor", "5"],
                                "experts-choice capacity 21 exceeds the 17 tokens of an image"),
    "router-on-soft-moe": ([str(SOFT_GOLDEN / "softmoe_e8p1.npz"), "--router", "tokens-choice"],
                           "--router is for sparse V-MoE checkpoints (Moe/Router/dense/kernel); this checkpoint "
                           "holds Soft MoE routers (Moe/Router/mu)"),
    "flags-on-soft-moe": ([str(SOFT_GOLDEN / "softmoe_e8p1.npz"), "--capacity-factor", "2",
                           "--dispatch-dtype", "bfloat16"],
                          "--capacity-factor, --dispatch-dtype are for sparse V-MoE checkpoints"),
    "preset-on-soft-moe": ([str(SOFT_GOLDEN / "softmoe_e8p1.npz"), "--preset",
                            "vmoe_s32_last2_ilsvrc2012_randaug_light1"],
                           "(preset vs checkpoint): router tokens-choice vs Soft MoE (Moe/Router/mu); hidden size 512"),
    "preset-vs-params": ([_npz("vmoe_tc_e8k2"), "--preset", "vmoe_b16_imagenet21k_randaug_strong"],
                         "does not match --preset vmoe_b16_imagenet21k_randaug_strong (preset vs checkpoint): "
                         "hidden size 768 vs 64"),
    "preset-vs-router": ([_npz("vmoe_ec_e4"), "--preset", "vmoe_s32_last2_ilsvrc2012_randaug_light1",
                          "--router", "experts-choice"],
                         "--router experts-choice contradicts --preset vmoe_s32_last2_ilsvrc2012_randaug_light1, "
                         "which was trained with tokens-choice"),
    "preset-vs-k": ([_npz("vmoe_tc_e8k2"), "--preset", "vmoe_s32_last2_ilsvrc2012_randaug_medium",
                     "--experts-per-token", "1"], "--experts-per-token 1 contradicts --preset"),
    "unknown-preset": ([_npz("vmoe_tc_e8k2"), "--preset", "vmoe_l16"], "argument --preset: invalid choice: 'vmoe_l16'"),
    "e3-preset": ([_npz("vmoe_tc_e8k2"), "--preset", "eee_s32_last2_ilsvrc2012_ft_cifar100"],
                  "--preset eee_s32_last2_ilsvrc2012_ft_cifar100: E³ (vmoe VisionTransformerMoeEnsemble"),
    "unknown-router": ([_npz("vmoe_tc_e8k2"), "--router", "soft"], "argument --router: invalid choice: 'soft'"),
}


@pytest.mark.parametrize("case", list(CONFLICTS))
def test_cli_conflicts_are_one_line(capsys, tmp_path, case):
    argv, expected = CONFLICTS[case]
    err = _cli_error(capsys, "convert", *argv, "--out", str(tmp_path / "pkg"))
    assert expected in err
    assert not (tmp_path / "pkg").exists()


def test_cli_labels_count_mismatch_refused(capsys, tmp_path):
    labels = tmp_path / "labels.txt"
    labels.write_text("a\nb\nc\n")
    err = _cli_error(capsys, "convert", _npz("vmoe_ec_e4"), "--router", "experts-choice", "--labels", str(labels),
                     "--out", str(tmp_path / "pkg"))
    assert "3 labels given for a model with 10 classes" in err
    assert not (tmp_path / "pkg").exists()


def test_cli_e3_checkpoint_name_refused(capsys, tmp_path):
    (tmp_path / "eee_s32_last2_ilsvrc2012.npz").symlink_to(GOLDEN / "vmoe_tc_e8k2.npz")
    err = _cli_error(capsys, "convert", str(tmp_path / "eee_s32_last2_ilsvrc2012.npz"), *_cli_flags("vmoe_tc_e8k2"),
                     "--out", str(tmp_path / "pkg"))
    assert "eee_s32_last2_ilsvrc2012.npz: vmoe's eee_* checkpoints are E³ models; E³" in err


def test_cli_mixed_soft_and_sparse_blocks_refused(capsys, tmp_path):
    data, _ = _golden("vmoe_tc_e8k2")
    params = {k: v for k, v in data.items() if k.startswith("params/")}
    del params["params/Encoder/encoderblock_3/Moe/Router/dense/kernel"]
    params["params/Encoder/encoderblock_3/Moe/Router/mu"] = np.zeros((64, 8, 1), np.float32)
    params["params/Encoder/encoderblock_3/Moe/Router/scale"] = np.ones((), np.float32)
    np.savez(tmp_path / "mixed.npz", **params)
    err = _cli_error(capsys, "convert", str(tmp_path / "mixed.npz"), *_cli_flags("vmoe_tc_e8k2"),
                     "--out", str(tmp_path / "pkg"))
    assert "blocks [3] hold Soft MoE routers (Moe/Router/mu) and blocks [1] sparse ones" in err
