"""Build a module from any model config, and count its parameters without allocating them."""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig, SeqEncoderConfig, TwoTowerConfig, ViTConfig
from .encoder import SoftMoESequenceEncoder
from .two_tower import TwoTower
from .vit import VisionTransformer


def build_model(cfg: ModelConfig, device: str | torch.device | None = None) -> nn.Module:
    """The PyTorch module for ``cfg``; ``device='meta'`` allocates nothing."""
    with torch.device(device or "cpu"):
        if isinstance(cfg, ViTConfig):
            return VisionTransformer(cfg)
        if isinstance(cfg, TwoTowerConfig):
            return TwoTower(cfg)
        if isinstance(cfg, SeqEncoderConfig):
            return SoftMoESequenceEncoder(cfg)
    raise TypeError(f"unsupported config {type(cfg).__name__}")


def count_params(cfg: ModelConfig) -> int:
    """Parameter count of the real module, instantiated on the meta device."""
    model = build_model(cfg, device="meta")
    return sum(p.numel() for p in model.parameters())
