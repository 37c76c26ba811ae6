"""vmoe ``VisionTransformerMoe`` in PyTorch: a ViT whose configured blocks are Soft MoE."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .config import ViTConfig
from .layers import Attention, Encoder, Mlp, layer_norm


class MapHead(nn.Module):
    """Multihead attention pooling (vmoe ``MapHead``): a learned probe attends to the tokens."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, qk_norm: bool) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.zeros(1, 1, dim))
        self.attn = Attention(dim, num_heads, qk_norm)
        self.norm = layer_norm(dim)
        self.mlp = Mlp(dim, mlp_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.probe.expand(x.shape[0], -1, -1), kv=x)  # (B, 1, D)
        return (a + self.mlp(self.norm(a)))[:, 0]


class VisionTransformer(nn.Module):
    """Image classifier or image tower.

    ``forward(pixel_values)`` takes NCHW float32 in the package's value range (vmoe: [-1, 1])
    and returns logits, or the pooled representation when ``num_classes`` is None.
    """

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        enc = cfg.encoder
        d = enc.hidden_size
        if cfg.image_size < cfg.patch_size:
            raise ValueError(f"image size {cfg.image_size} is smaller than the patch {cfg.patch_size}")
        # VALID patches, as flax nn.Conv and transformers' SigLIP: a side that is not a multiple of the
        # patch drops its last image_size % patch_size pixels (grid = image_size // patch_size).
        self.patch_embed = nn.Conv2d(cfg.in_channels, d, cfg.patch_size, stride=cfg.patch_size)
        # "conv": the Conv2d (what exports carry); "matmul": the same weights as one GEMM over the
        # flattened patches, whose per-image result does not depend on the batch size on CPU (the
        # oneDNN convolution picks another algorithm for a batch of one). See set_batch_invariant.
        self.patch_form: Literal["conv", "matmul"] = "conv"
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if cfg.classifier == "token" else None
        self.encoder = Encoder(enc, cfg.num_tokens)
        self.map_head = (
            MapHead(d, enc.num_heads, cfg.map_mlp_dim or enc.mlp_dim, enc.qk_norm)
            if cfg.classifier == "map"
            else None
        )
        self.pre_logits = (
            nn.Sequential(nn.Linear(d, cfg.representation_size), nn.Tanh())
            if cfg.representation_size
            else nn.Identity()
        )
        self.head = nn.Linear(cfg.feature_dim, cfg.num_classes) if cfg.num_classes else None

    def tokens(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Patch tokens ``(B, N, D)``, row-major over the patch grid."""
        if self.patch_form == "matmul":
            x = self._patch_matmul(pixel_values)
        else:
            x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x

    def _patch_matmul(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The patch convolution as ``(B, N, C*p*p) @ W^T + b``: VALID patches, row-major."""
        b, c, h, w = pixel_values.shape
        p = self.cfg.patch_size
        gh, gw = h // p, w // p
        x = pixel_values[:, :, :gh * p, :gw * p].reshape(b, c, gh, p, gw, p)
        x = x.permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * p * p)
        weight = self.patch_embed.weight
        return F.linear(x, weight.reshape(weight.shape[0], -1), self.patch_embed.bias)

    def forward_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The pooled representation (vmoe ``pre_logits``), ``(B, feature_dim)``."""
        x = self.encoder(self.tokens(pixel_values))
        if self.cfg.classifier == "gap":
            pooled = x.mean(dim=1)
        elif self.cfg.classifier == "token":
            pooled = x[:, 0]
        else:
            assert self.map_head is not None
            pooled = self.map_head(x)
        return self.pre_logits(pooled)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.forward_features(pixel_values)
        return self.head(features) if self.head is not None else features
