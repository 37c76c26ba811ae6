"""Infer a model config from a vmoe parameter tree (flat ``/``-joined paths -> arrays).

Everything comes from names and shapes: layers from ``encoderblock_i``, heads and head dim from
the ``(D, H, Dh)`` attention kernels, patch size and width from the ``(P, P, C, D)`` patch
kernel, tokens (hence image size) from the position embedding, experts and slots from
``Router/mu (D, n, p)``, MoE layers from which blocks hold ``Moe``, qk-norm from ``query_ln``,
the classifier from ``cls`` / ``MapHead``, class count from ``head``.

A sparse V-MoE (vmoe's Tokens or Experts Choice routers) is recognised by its
``Moe/Router/dense/kernel (D, E)`` where Soft MoE has ``Router/mu``; the experts come from its
shape, the routing from :class:`~softmoe_models.convert.sparse.SparseOptions` (flags or a preset),
since the parameters of the two routers are the same.

The text tower's pooling is the one thing the parameters mostly cannot show: of vmoe's
``TextTransformer.pool_type`` values only 'map' has parameters (``txt/MapHead/*``). Without them
the pooling must be given (``text_pool=``, ``softmoe convert --text-pool``); it is never assumed.
"""

from __future__ import annotations

import math
import re

import numpy as np

from ..config import TEXT_POOLS, EncoderConfig, MoEConfig, ModelConfig, TextConfig, TwoTowerConfig, ViTConfig
from .errors import ConversionError
from .sparse import E3_REFUSAL, SparseOptions, sparse_moe_config

Params = dict[str, np.ndarray]


def _get(params: Params, key: str, ndim: int | None = None) -> np.ndarray:
    if key not in params:
        raise ConversionError(f"missing parameter {key!r}")
    value = params[key]
    if ndim is not None and value.ndim != ndim:
        raise ConversionError(f"parameter {key!r} has shape {value.shape}, expected {ndim} dimensions")
    return value


def _block_indices(params: Params, encoder: str) -> list[int]:
    pat = re.compile(re.escape(encoder) + r"/encoderblock_(\d+)/")
    found = sorted({int(m.group(1)) for k in params if (m := pat.match(k))})
    if not found:
        raise ConversionError(f"no transformer blocks found under {encoder!r}/encoderblock_*")
    if found != list(range(len(found))):
        missing = sorted(set(range(found[-1] + 1)) - set(found))
        raise ConversionError(f"{encoder}: encoder blocks are not contiguous; missing encoderblock_{missing}")
    return found


SOFT_ROUTER = "Moe/Router/mu"  # Soft MoE: slot parameters (D, n, p)
SPARSE_ROUTER = "Moe/Router/dense/kernel"  # vmoe's sparse routers: (D, E), no bias


def _moe_kind(params: Params, encoder: str, blocks: list[int]) -> tuple[list[int], bool]:
    """The MoE blocks and whether they are sparse; every MoE block must route the same way."""
    soft = [i for i in blocks if f"{encoder}/encoderblock_{i}/{SOFT_ROUTER}" in params]
    sparse = [i for i in blocks if f"{encoder}/encoderblock_{i}/{SPARSE_ROUTER}" in params]
    if soft and sparse:
        raise ConversionError(
            f"{encoder}: blocks {soft} hold Soft MoE routers ({SOFT_ROUTER}) and blocks {sparse} sparse ones "
            f"({SPARSE_ROUTER}); one model routes one way")
    return (sparse, True) if sparse else (soft, False)


def infer_encoder(params: Params, encoder: str, sparse: SparseOptions | None = None) -> EncoderConfig:
    """Config of the encoder whose parameters sit under ``encoder`` (e.g. ``img/Encoder``).

    Args:
        params: the flat parameter tree.
        encoder: the encoder's group.
        sparse: the routing of sparse V-MoE blocks (required when there are any; ignored otherwise).
    """
    blocks = _block_indices(params, encoder)
    b0 = f"{encoder}/encoderblock_0"
    qk = _get(params, f"{b0}/SelfAttention/query/kernel", 3)
    d, h, dh = qk.shape
    if h * dh != d:
        raise ConversionError(f"{b0}/SelfAttention/query/kernel {qk.shape}: heads x head_dim != width")
    moe_layers, is_sparse = _moe_kind(params, encoder, blocks)
    dense_layers = [i for i in blocks if i not in moe_layers]
    mlp_dim = None
    if dense_layers:
        mlp_dim = int(_get(params, f"{encoder}/encoderblock_{dense_layers[0]}/Mlp/Dense_0/kernel", 2).shape[1])
    moe = None
    if moe_layers:
        first = f"{encoder}/encoderblock_{moe_layers[0]}/Moe"
        if is_sparse:
            key = f"{first}/Router/dense/kernel"
            if params[key].ndim == 3:
                raise ConversionError(f"{key} has shape {params[key].shape}, (D, M, E/M): an E³ ensemble router; "
                                      + E3_REFUSAL)
            router = _get(params, key, 2)
            if router.shape[0] != d:
                raise ConversionError(f"{key} has shape {router.shape}; its first axis must be the width {d}")
            num_experts, slots = int(router.shape[1]), 1
        else:
            mu = _get(params, f"{first}/Router/mu", 3)
            if mu.shape[0] != d:
                raise ConversionError(f"{first}/Router/mu has shape {mu.shape}; its first axis must be the width {d}")
            num_experts, slots = int(mu.shape[1]), int(mu.shape[2])
        w1 = _get(params, f"{first}/Mlp/Dense_0/kernel", 3)
        moe_mlp = int(w1.shape[2])
        if mlp_dim is None:  # every block is MoE: the experts' width is the encoder's
            mlp_dim = moe_mlp
        expert_mlp = None if moe_mlp == mlp_dim else moe_mlp
        if is_sparse:
            moe = sparse_moe_config(sparse, layers=tuple(moe_layers), num_experts=num_experts,
                                    mlp_dim=expert_mlp, where=encoder)
        else:
            moe = MoEConfig(layers=tuple(moe_layers), num_experts=num_experts, slots_per_expert=slots,
                            mlp_dim=expert_mlp)
    assert mlp_dim is not None
    return EncoderConfig(
        hidden_size=int(d),
        num_layers=len(blocks),
        num_heads=int(h),
        mlp_dim=mlp_dim,
        qk_norm=f"{b0}/SelfAttention/query_ln/scale" in params,
        moe=moe,
    )


def infer_vit(params: Params, prefix: str = "", sparse: SparseOptions | None = None) -> ViTConfig:
    """Config of the vmoe image model under ``prefix`` ('' for a classifier, 'img' in a TwoTower);
    ``sparse`` as :func:`infer_encoder`."""
    p = f"{prefix}/" if prefix else ""
    kernel = _get(params, f"{p}embedding/kernel", 4)
    ph, pw, cin, d = kernel.shape
    if ph != pw:
        raise ConversionError(f"{p}embedding/kernel {kernel.shape}: non-square patches are not supported")
    has_cls = f"{p}cls" in params
    classifier = "token" if has_cls else ("map" if f"{p}MapHead/probe" in params else "gap")
    pos = _get(params, f"{p}Encoder/posembed_input/pos_embedding", 3)
    tokens = int(pos.shape[1])
    patches = tokens - (1 if has_cls else 0)
    grid = math.isqrt(patches)
    if grid * grid != patches:
        raise ConversionError(
            f"{p}Encoder/posembed_input/pos_embedding has {patches} patch tokens, not a square grid"
        )
    encoder = infer_encoder(params, f"{p}Encoder", sparse)
    if encoder.hidden_size != d:
        raise ConversionError(f"{p}embedding/kernel width {d} != encoder width {encoder.hidden_size}")
    rep = params.get(f"{p}pre_logits/kernel")
    head = params.get(f"{p}head/kernel")
    map_mlp = None
    if classifier == "map":
        map_mlp = int(_get(params, f"{p}MapHead/Mlp/Dense_0/kernel", 2).shape[1])
        map_mlp = None if map_mlp == encoder.mlp_dim else map_mlp
    moe = encoder.moe
    if moe is not None and moe.router == "experts-choice" and moe.capacity(tokens) > tokens:
        raise ConversionError(
            f"--capacity-factor {moe.capacity_factor}: experts-choice capacity {moe.capacity(tokens)} exceeds the "
            f"{tokens} tokens of an image, the routing group (vmoe's top_k fails the same way); with "
            f"{moe.num_experts} experts, --capacity-factor {moe.num_experts} already gives every expert every token")
    try:
        return ViTConfig(
            encoder=encoder,
            image_size=grid * int(ph),
            patch_size=int(ph),
            num_classes=int(head.shape[1]) if head is not None and head.ndim == 2 else None,
            classifier=classifier,
            representation_size=int(rep.shape[1]) if rep is not None and rep.ndim == 2 else None,
            in_channels=int(cin),
            map_mlp_dim=map_mlp,
        )
    except ValueError as e:
        raise ConversionError(str(e)) from None


def infer_text_pool(params: Params, prefix: str = "txt", text_pool: str | None = None) -> str:
    """The text tower's ``pool_type``: shown by the parameters ('map') or given, never assumed.

    Args:
        params: the flat parameter tree.
        prefix: the text tower's group.
        text_pool: the pooling given by the user (``--text-pool``), or None.

    Raises:
        ConversionError: not given and not shown, unknown, or contradicting the parameters.
    """
    choices = "{" + ",".join(TEXT_POOLS) + "}"
    if text_pool is not None and text_pool not in TEXT_POOLS:
        raise ConversionError(f"--text-pool {text_pool!r} is not one of {choices}")
    has_map = any(k.startswith(f"{prefix}/MapHead/") for k in params)
    if has_map:
        if text_pool not in (None, "map"):
            raise ConversionError(
                f"--text-pool {text_pool} contradicts the checkpoint: it holds {prefix}/MapHead/* parameters, "
                "which only pool_type 'map' has"
            )
        return "map"
    if text_pool == "map":
        raise ConversionError(
            f"--text-pool map contradicts the checkpoint: pool_type 'map' needs {prefix}/MapHead/* parameters "
            "and there are none"
        )
    if text_pool is None:
        others = ",".join(p for p in TEXT_POOLS if p != "map")
        raise ConversionError(
            f"cannot infer the text tower's pooling: only 'map' has parameters ({prefix}/MapHead/*) and there are "
            f"none; pass --text-pool {{{others}}} (text_pool= in convert_checkpoint) with the text tower's pool_type "
            "from the vmoe training config ('last' when the config does not set it)"
        )
    return text_pool


def infer_text(params: Params, prefix: str = "txt", text_pool: str | None = None,
               sparse: SparseOptions | None = None) -> TextConfig:
    """Config of the text tower under ``prefix``; the pooling as :func:`infer_text_pool`, ``sparse``
    as :func:`infer_encoder`."""
    emb = _get(params, f"{prefix}/Embed_0/embedding", 2)
    pos = _get(params, f"{prefix}/Encoder/posembed_input/pos_embedding", 3)
    head = params.get(f"{prefix}/head/kernel")
    pool = infer_text_pool(params, prefix, text_pool)
    encoder = infer_encoder(params, f"{prefix}/Encoder", sparse)
    map_mlp = None
    if pool == "map":
        map_mlp = int(_get(params, f"{prefix}/MapHead/Mlp/Dense_0/kernel", 2).shape[1])
        map_mlp = None if map_mlp == encoder.mlp_dim else map_mlp
    try:
        return TextConfig(
            encoder=encoder,
            vocab_size=int(emb.shape[0]),
            max_len=int(pos.shape[1]),
            num_classes=int(head.shape[1]) if head is not None and head.ndim == 2 else None,
            pool_type=pool,  # type: ignore[arg-type]
            map_mlp_dim=map_mlp,
        )
    except ValueError as e:
        raise ConversionError(str(e)) from None


def infer_config(params: Params, text_pool: str | None = None, sparse: SparseOptions | None = None) -> ModelConfig:
    """Classifier when ``embedding/kernel`` is at the root; TwoTower when ``img/`` and ``txt/``.

    Args:
        params: the flat parameter tree.
        text_pool: the text tower's pooling (two-tower only); required unless the params show it.
        sparse: the routing of sparse V-MoE blocks; required when the params hold any, unused
            otherwise (the caller refuses options that found no sparse block).
    """
    if text_pool is not None and text_pool not in TEXT_POOLS:
        raise ConversionError(f"--text-pool {text_pool!r} is not one of {{{','.join(TEXT_POOLS)}}}")
    if "embedding/kernel" in params:
        if text_pool is not None:
            raise ConversionError(f"--text-pool {text_pool} was given, but the checkpoint is a classifier (no text tower)")
        return infer_vit(params, sparse=sparse)
    if any(k.startswith("img/") for k in params) and any(k.startswith("txt/") for k in params):
        image = infer_vit(params, "img", sparse)
        text = infer_text(params, text_pool=text_pool, sparse=sparse)
        return TwoTowerConfig(image=image, text=text, has_bias="b" in params)
    roots = sorted({k.split("/")[0] for k in params})
    raise ConversionError(
        "not a vmoe VisionTransformerMoe or TwoTower parameter tree: expected 'embedding/kernel' "
        f"or 'img/...' + 'txt/...' groups, found top-level groups {roots[:12]}"
    )
