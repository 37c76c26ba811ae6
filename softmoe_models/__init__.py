"""Soft MoE vision transformers and LiT two-tower models, numerically as google-research/vmoe."""

from .config import VARIANTS, EncoderConfig, MoEConfig, SeqEncoderConfig, TextConfig, TwoTowerConfig, ViTConfig
from .models import build_model, count_params
from .package import load_model, read_package, save_package

__version__ = "0.1.0"

__all__ = [
    "VARIANTS", "EncoderConfig", "MoEConfig", "SeqEncoderConfig", "TextConfig", "TwoTowerConfig", "ViTConfig",
    "build_model", "count_params", "load_model", "read_package", "save_package",
]
