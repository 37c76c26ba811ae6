"""The sparse MoE layer (softmoe_models/sparse_moe.py) on tiny random configs: its config, the fused
path against the reference einsums, the routing rules on hand-made gates, and routing capture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from softmoe_models.config import EncoderConfig, MoEConfig, ViTConfig, compute_capacity, from_dict, to_dict
from softmoe_models.models import build_model
from softmoe_models.soft_moe import SoftMoE, capture_routing
from softmoe_models.sparse_moe import (
    SparseMoE, configure_sparse_routing, einsum_tensors, experts_choice, sparse_moe_layers, tokens_choice,
)
from softmoe_models.sparse_routing import image_routing, layout_for, routing_of


def _vit(**moe) -> ViTConfig:
    enc = EncoderConfig(32, 2, 4, 64, moe=MoEConfig(layers=(1,), num_experts=4, **moe))
    return ViTConfig(enc, image_size=16, patch_size=4, num_classes=5, classifier="token")


# ---------------------------------------------------------------- config


def test_soft_stays_the_default_and_old_configs_load():
    old = to_dict(_vit())
    for name in ("router", "experts_per_token", "capacity_factor", "capacity_rounding", "capacity_multiple_of",
                 "batch_priority", "dispatch_dtype"):
        del old["encoder"]["moe"][name]  # a config.json written before these fields
    cfg = from_dict("classifier", old)
    assert cfg == _vit() and cfg.encoder.moe.router == "soft" and not cfg.encoder.moe.sparse
    assert isinstance(build_model(cfg).encoder.blocks[1].mlp, SoftMoE)


def test_sparse_config_round_trips_and_builds():
    cfg = _vit(router="tokens-choice", experts_per_token=2, capacity_factor=1.05, batch_priority=True,
               dispatch_dtype="bfloat16")
    assert from_dict("classifier", to_dict(cfg)) == cfg
    layer = build_model(cfg).encoder.blocks[1].mlp
    assert isinstance(layer, SparseMoE)
    assert (layer.router_kind, layer.experts_per_token, layer.capacity_factor, layer.batch_priority,
            layer.bf16_dispatch, layer.group_images) == ("tokens-choice", 2, 1.05, True, True, 1)
    ec = build_model(_vit(router="experts-choice", capacity_factor=1.0)).encoder.blocks
    assert isinstance(ec[1].mlp, SparseMoE) and ec[1].mlp.router_kind == "experts-choice"
    assert not isinstance(ec[0].mlp, (SparseMoE, SoftMoE))  # a dense block stays dense


@pytest.mark.parametrize("moe, message", [
    (dict(router="top-2"), "router 'top-2' is not one of"),
    (dict(router="tokens-choice", experts_per_token=5), "K=5 must be between 1 and num_experts=4"),
    (dict(router="tokens-choice", experts_per_token=0), "K=0 must be between 1"),
    (dict(router="experts-choice", experts_per_token=2), "experts_per_token .K. is for router 'tokens-choice'"),
    (dict(experts_per_token=1), "experts_per_token .K. is for router 'tokens-choice'; router 'soft' has slots"),
    (dict(router="experts-choice", batch_priority=True), "batch_priority orders tokens-choice claims"),
    (dict(router="tokens-choice", slots_per_expert=2), "slots_per_expert=2 is Soft MoE only"),
    (dict(capacity_factor=1.25), "are for sparse routers; router 'soft' has slots"),
    (dict(router="tokens-choice", capacity_factor=0.0), "capacity_factor must be > 0"),
    (dict(router="tokens-choice", capacity_multiple_of=0), "capacity_multiple_of must be >= 1"),
    (dict(router="tokens-choice", dispatch_dtype="float16"), "dispatch_dtype 'float16' is not one of"),
    (dict(router="tokens-choice", capacity_rounding="floor"), "capacity_rounding 'floor'"),
])
def test_impossible_settings_are_refused(moe, message):
    with pytest.raises(ValueError, match=f"^MoEConfig: .*{message}"):
        MoEConfig(layers=(1,), num_experts=4, **moe)


def test_experts_choice_capacity_must_fit_a_group():
    ok = _vit(router="experts-choice", capacity_factor=1.0)  # 17 tokens: ceil(4.25) = 5 -> 8
    assert ok.encoder.moe.capacity(ok.num_tokens) == 8
    with pytest.raises(ValueError, match="experts-choice capacity 20 exceeds the 17 tokens"):
        _vit(router="experts-choice", capacity_factor=4.0)
    vmoe_ec = _vit(router="experts-choice", capacity_rounding="round", capacity_multiple_of=1)  # cf 4.0
    assert vmoe_ec.encoder.moe.capacity(17) == 17


def test_capacity_rounding_as_vmoe():
    assert compute_capacity(136 * 2, 8, 1.05) == 36  # 35.7 -> 36
    assert compute_capacity(17 * 2, 8, 1.05) == 8  # 4.46 -> 5 -> 8
    assert compute_capacity(17 * 2, 8, 4.0) == 20  # 17 -> 20
    assert compute_capacity(17, 4, 1.05, "round", 1) == 4  # 4.46 -> 4
    assert compute_capacity(18, 4, 1.0, "round", 1) == 4  # 4.5 -> 4: Python's round, half to even
    with pytest.raises(ValueError, match="< 1"):
        compute_capacity(4, 8, 0.5, "round", 1)


# ---------------------------------------------------------------- routing rules


def test_tokens_choice_claims_first_choices_first_in_priority_order():
    # 4 tokens, 2 experts, K=2, C=2. Every token prefers expert 0 (ties: none).
    gates = torch.tensor([[[0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.8, 0.2]]])
    r = tokens_choice(gates, k=2, capacity=2)
    assert r.expert[0, :, 0].tolist() == [0, 0, 0, 0]
    assert r.kept[0].tolist() == [[True, True], [True, True], [False, False], [False, False]]
    bpr = tokens_choice(gates, k=2, capacity=2, batch_priority=True)  # by top-1 gate: tokens 2, 3, 1, 0
    assert bpr.order[0].tolist() == [2, 3, 1, 0]
    assert bpr.kept[0].tolist() == [[False, False], [False, False], [True, True], [True, True]]
    assert bpr.slot[0, :, 0].tolist() == [3, 2, 0, 1]


def test_ties_go_to_the_lower_index():
    gates = torch.full((1, 5, 4), 0.25)  # every gate equal
    r = tokens_choice(gates, k=2, capacity=4)
    assert r.expert[0].tolist() == [[0, 1]] * 5  # lower expert first
    assert r.kept[0, :, 0].tolist() == [True] * 4 + [False]  # position order claims
    ec = experts_choice(gates, capacity=3)
    assert ec.token[0].tolist() == [[0, 1, 2]] * 4  # lower token first
    bpr = tokens_choice(gates, k=1, capacity=4, batch_priority=True)
    assert bpr.order[0].tolist() == [0, 1, 2, 3, 4]  # stable


def test_einsum_tensors_are_one_hot_slots():
    gates = torch.rand(3, 10, 4).softmax(-1)
    r = tokens_choice(gates, k=2, capacity=4)
    dispatch, combine = einsum_tensors(r, 4, 10)
    assert dispatch.shape == (3, 10, 4, 4) and dispatch.sum(dim=(1, 2)).le(4).all()
    assert int(dispatch.sum()) == int(r.kept.sum())
    assert torch.equal(combine.sum(-1), torch.zeros(3, 10, 4).scatter(2, r.expert, r.gate * r.kept))


# ---------------------------------------------------------------- the layer


@pytest.mark.parametrize("router, k, bpr", [("tokens-choice", 1, False), ("tokens-choice", 3, True),
                                            ("tokens-choice", 2, False), ("experts-choice", 1, False)])
@pytest.mark.parametrize("cf", [0.5, 1.05, 4.0])
@pytest.mark.parametrize("group_images", [1, 2])
@pytest.mark.parametrize("bf16", [False, True])
def test_fused_path_equals_reference(router, k, bpr, cf, group_images, bf16):
    torch.manual_seed(0)
    layer = SparseMoE(16, 6, 24, router=router, experts_per_token=k, capacity_factor=cf, batch_priority=bpr,
                      capacity_rounding="round" if router == "experts-choice" else "ceil",
                      capacity_multiple_of=1, bf16_dispatch=bf16)
    with torch.no_grad():
        layer.b1.normal_()
        layer.b2.normal_()
    layer.group_images = group_images
    x = torch.randn(4, 9, 16)
    with torch.no_grad():
        fused = layer(x)
        forms = {}
        for form, block in (("routed", 0), ("routed", 3), ("capacity", 4)):
            configure_sparse_routing(layer, tokens_form=form, row_block=block)
            forms[form, block] = layer(x)
        configure_sparse_routing(layer, tokens_form="routed", row_block=4)
        layer.fused = False
        ref = layer(x)
    assert (fused - ref).abs().max() <= 1e-6
    for got in forms.values():  # routed rows, in blocks or not, and the capacity buffers (GEMMs of other sizes)
        assert (got - ref).abs().max() <= 1e-6
    layer.capture = True
    try:
        layer(x)
        dropped = layer.internals["dispatched"].sum(-1) == 0  # tokens no expert kept
        claims_dropped = int(layer.internals["dropped"].sum())
    finally:
        layer.capture = False
    assert torch.equal(fused[dropped], torch.zeros_like(fused[dropped]))  # the MoE output is exactly 0
    if cf == 0.5:
        assert claims_dropped > 0 and (k > 1 or dropped.any())


@pytest.mark.parametrize("k, cf", [(1, 4.0), (2, 1.05), (1, 0.5)])
def test_routed_form_computes_the_kept_claims_only(k, cf):
    """Tokens Choice's routed form runs each expert over exactly the claims it kept (row_block 0),
    or those rounded up to whole blocks per expert; the capacity form over E x C rows per group."""
    torch.manual_seed(1)
    layer = SparseMoE(16, 6, 24, experts_per_token=k, capacity_factor=cf)
    x = torch.randn(3, 20, 16)
    layer.capture = True
    with torch.no_grad():
        configure_sparse_routing(layer, row_block=0)
        layer(x)
        kept = int(layer.internals["dispatched"].sum())
        per_expert = layer.internals["expert_load"].sum(0)  # (E,) kept claims over the batch
        assert layer.rows_computed == kept == 3 * 20 * k - int(layer.internals["dropped"].sum())
        configure_sparse_routing(layer, row_block=4)
        layer(x)
        assert layer.rows_computed == int(((per_expert + 3) // 4 * 4).sum())
        configure_sparse_routing(layer, tokens_form="capacity")
        layer(x)
        assert layer.rows_computed == 6 * 3 * min(layer.capacity(20), 20)
    if cf == 0.5:
        assert kept < 3 * 20 * k  # drops, never run


def test_routed_rows_are_independent_of_batch_mates(block=4):
    """An image's outputs are the same bits alone, among others and at another position, at S/16's
    widths: every expert GEMM of ``row_block`` rows (torch's CPU GEMMs give a row other bits at
    other row counts, which the routed form's batch-mates change: with ``block=0`` this fails here).
    Exact row counts are the export's form, for ONNX Runtime, whose GEMMs keep a row's bits:
    tests/export/test_sparse_export.py."""
    torch.manual_seed(2)
    layer = SparseMoE(384, 8, 1536, experts_per_token=2, capacity_factor=4.0)
    configure_sparse_routing(layer, row_block=block)
    x = torch.randn(9, 50, 384)
    with torch.no_grad():
        full = layer(x)
        for i in (0, 4, 8):
            assert torch.equal(layer(x[i:i + 1])[0], full[i]), i
            assert torch.equal(layer(x[[i, (i + 3) % 9]])[0], full[i]), i
        assert torch.equal(layer(x.flip(0)), full.flip(0))


def test_group_images_must_divide_the_batch():
    layer = SparseMoE(8, 4, 8)
    layer.group_images = 3
    with pytest.raises(ValueError, match="not a multiple of group_images=3"):
        layer(torch.randn(4, 5, 8))
    with pytest.raises(ValueError, match="group_images must be >= 1"):
        configure_sparse_routing(layer, group_images=0)


def test_routing_capture_and_image_routing():
    torch.manual_seed(0)
    cfg = _vit(router="tokens-choice", experts_per_token=2, capacity_factor=1.05)
    model = build_model(cfg).eval()
    pixels = torch.rand(3, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        plain = model(pixels)
    out = routing_of(model, pixels)
    with torch.no_grad():
        assert torch.equal(model(pixels), plain)  # capture off again, same bits
    assert all(not layer.internals for layer in sparse_moe_layers(model))
    assert out["combine_weights"].shape == (3, 1, 17, 4)
    assert out["dropped"].shape == (3, 1, 17) and out["dropped"].max() <= 2
    assert out["expert_load"].shape == (3, 1, 4)
    assert (out["expert_load"].sum(-1) == 2 * 17 - out["dropped"].sum(-1)).all()
    assert (out["expert_load"] <= cfg.encoder.moe.capacity(17)).all()
    layout = layout_for(cfg)
    assert layout is not None and layout.experts_per_token == 2 and layout_for(_vit()) is None
    (entry,) = image_routing(layout, {k: v[1] for k, v in out.items()})
    assert entry["layer"] == 1 and entry["router"] == "tokens-choice"
    assert np.asarray(entry["combine"]).shape == (17, 4)  # the cls token first, then the 4 x 4 patches
    assert entry["combine"] == out["combine_weights"][1, 0].tolist()
    assert entry["dropped_total"] == int(out["dropped"][1, 0].sum()) == sum(entry["dropped"])


def test_capture_is_shared_with_soft_moe_capture_routing():
    layer = SparseMoE(8, 4, 8, router="experts-choice", capacity_factor=1.0)
    with capture_routing([layer]):
        layer(torch.randn(2, 8, 8))
        got = layer.internals
    assert set(got) == {"gates", "combine_weights", "dispatched", "dropped", "expert_load"}
    assert got["expert_load"].tolist() == [[4] * 4] * 2 and not layer.internals
