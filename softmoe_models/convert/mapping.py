"""The one table between vmoe (flax) parameter paths and our PyTorch state-dict keys.

Each entry is ``(flax path, torch key, layout)``; the layout names the tensor transform
(vmoe-reference.md section 4; the sparse V-MoE router, vmoe-sparse-reference.md section 9). The
table is built from a model config, so it is also the list of keys a checkpoint must hold: nothing
missing, nothing left over.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from ..config import EncoderConfig, ModelConfig, SeqEncoderConfig, TextConfig, TwoTowerConfig, ViTConfig

Entry = tuple[str, str, str]


def _dense_t(k: np.ndarray) -> np.ndarray:
    return k.T


def _qkv_kernel(k: np.ndarray) -> np.ndarray:  # (D, H, Dh) -> (H*Dh, D)
    return k.reshape(k.shape[0], -1).T


def _qkv_bias(b: np.ndarray) -> np.ndarray:  # (H, Dh) -> (H*Dh,)
    return b.reshape(-1)


def _out_kernel(k: np.ndarray) -> np.ndarray:  # (H, Dh, D) -> (D, H*Dh)
    return k.reshape(-1, k.shape[-1]).T


def _conv(k: np.ndarray) -> np.ndarray:  # HWIO -> OIHW
    return k.transpose(3, 2, 0, 1)


def _same(x: np.ndarray) -> np.ndarray:
    return x


TO_TORCH: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "dense": _dense_t,
    "qkv": _qkv_kernel,
    "qkv_bias": _qkv_bias,
    "out": _out_kernel,
    "conv": _conv,
    "same": _same,
}


def _attention(f: str, t: str, qk_norm: bool) -> Iterator[Entry]:
    for fname, tname in (("query", "q"), ("key", "k"), ("value", "v")):
        yield f"{f}/{fname}/kernel", f"{t}.{tname}.weight", "qkv"
        yield f"{f}/{fname}/bias", f"{t}.{tname}.bias", "qkv_bias"
    yield f"{f}/out/kernel", f"{t}.out.weight", "out"
    yield f"{f}/out/bias", f"{t}.out.bias", "same"
    if qk_norm:
        yield f"{f}/query_ln/scale", f"{t}.q_norm.weight", "same"
        yield f"{f}/key_ln/scale", f"{t}.k_norm.weight", "same"


def _layer_norm(f: str, t: str) -> Iterator[Entry]:
    yield f"{f}/scale", f"{t}.weight", "same"
    yield f"{f}/bias", f"{t}.bias", "same"


def _dense(f: str, t: str) -> Iterator[Entry]:
    yield f"{f}/kernel", f"{t}.weight", "dense"
    yield f"{f}/bias", f"{t}.bias", "same"


def _mlp(f: str, t: str) -> Iterator[Entry]:
    yield from _dense(f"{f}/Dense_0", f"{t}.fc1")
    yield from _dense(f"{f}/Dense_1", f"{t}.fc2")


def _encoder(f: str, t: str, cfg: EncoderConfig) -> Iterator[Entry]:
    yield f"{f}/posembed_input/pos_embedding", f"{t}.pos_embed", "same"
    moe_layers = set(cfg.moe.layers) if cfg.moe else set()
    for i in range(cfg.num_layers):
        fb, tb = f"{f}/encoderblock_{i}", f"{t}.blocks.{i}"
        yield from _layer_norm(f"{fb}/LayerNorm_0", f"{tb}.norm1")
        yield from _attention(f"{fb}/SelfAttention", f"{tb}.attn", cfg.qk_norm)
        yield from _layer_norm(f"{fb}/LayerNorm_1", f"{tb}.norm2")
        if i in moe_layers:
            assert cfg.moe is not None
            if cfg.moe.sparse:  # vmoe's sparse routers: one bias-free Dense (D, E), kept as is
                yield f"{fb}/Moe/Router/dense/kernel", f"{tb}.mlp.router", "same"
            else:  # Soft MoE: slot parameters (D, n, p) and the normalisation scale
                yield f"{fb}/Moe/Router/mu", f"{tb}.mlp.mu", "same"
                yield f"{fb}/Moe/Router/scale", f"{tb}.mlp.scale", "same"
            yield f"{fb}/Moe/Mlp/Dense_0/kernel", f"{tb}.mlp.w1", "same"
            yield f"{fb}/Moe/Mlp/Dense_0/bias", f"{tb}.mlp.b1", "same"
            yield f"{fb}/Moe/Mlp/Dense_1/kernel", f"{tb}.mlp.w2", "same"
            yield f"{fb}/Moe/Mlp/Dense_1/bias", f"{tb}.mlp.b2", "same"
        else:
            yield from _mlp(f"{fb}/Mlp", f"{tb}.mlp")
    yield from _layer_norm(f"{f}/encoder_norm", f"{t}.norm")


def _map_head(f: str, t: str, qk_norm: bool) -> Iterator[Entry]:
    yield f"{f}/probe", f"{t}.probe", "same"
    yield from _attention(f"{f}/MultiHeadDotProductAttention", f"{t}.attn", qk_norm)
    yield from _layer_norm(f"{f}/LayerNorm", f"{t}.norm")
    yield from _mlp(f"{f}/Mlp", f"{t}.mlp")


def _join(prefix: str, name: str, sep: str) -> str:
    return f"{prefix}{sep}{name}" if prefix else name


def vit_entries(cfg: ViTConfig, f: str = "", t: str = "") -> Iterator[Entry]:
    F = lambda name: _join(f, name, "/")  # noqa: E731
    T = lambda name: _join(t, name, ".")  # noqa: E731
    yield F("embedding/kernel"), T("patch_embed.weight"), "conv"
    yield F("embedding/bias"), T("patch_embed.bias"), "same"
    if cfg.classifier == "token":
        yield F("cls"), T("cls_token"), "same"
    yield from _encoder(F("Encoder"), T("encoder"), cfg.encoder)
    if cfg.classifier == "map":
        yield from _map_head(F("MapHead"), T("map_head"), cfg.encoder.qk_norm)
    if cfg.representation_size:
        yield from _dense(F("pre_logits"), T("pre_logits.0"))
    if cfg.num_classes:
        yield from _dense(F("head"), T("head"))


def text_entries(cfg: TextConfig, f: str = "txt", t: str = "text") -> Iterator[Entry]:
    yield f"{f}/Embed_0/embedding", f"{t}.embed.weight", "same"
    yield from _encoder(f"{f}/Encoder", f"{t}.encoder", cfg.encoder)
    if cfg.pool_type == "map":
        yield from _map_head(f"{f}/MapHead", f"{t}.map_head", cfg.encoder.qk_norm)
    if cfg.num_classes:
        yield from _dense(f"{f}/head", f"{t}.head")


def entries(cfg: ModelConfig) -> list[Entry]:
    """Every (flax path, torch key, layout) of a model with this config."""
    if isinstance(cfg, ViTConfig):
        return list(vit_entries(cfg))
    if isinstance(cfg, TwoTowerConfig):
        out = list(vit_entries(cfg.image, "img", "image")) + list(text_entries(cfg.text))
        out.append(("s", "s", "same"))
        if cfg.has_bias:
            out.append(("b", "b", "same"))
        return out
    if isinstance(cfg, SeqEncoderConfig):
        raise ValueError("the generic sequence encoder has no vmoe checkpoint layout")
    raise TypeError(f"unsupported config {type(cfg).__name__}")
