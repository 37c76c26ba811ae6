"""The model served when `softmoe serve` gets no --model.

Interim: small randomly initialised Soft MoE packages (a classifier and a two-tower), created
deterministically on first use under the cache directory. They exercise every endpoint but do
not classify anything real; the trained default model replaces them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from softmoe_models.config import EncoderConfig, MoEConfig, TextConfig, TwoTowerConfig, ViTConfig
from softmoe_models.models import build_model
from softmoe_models.package import save_package

from .backends.onnxruntime_backend import cache_root

VERSION = "random-v1"


def _classifier() -> ViTConfig:
    enc = EncoderConfig(64, 4, 4, 128, moe=MoEConfig((2, 3), 8, 1, group_size=16))
    return ViTConfig(enc, image_size=32, patch_size=8, num_classes=10)


def _two_tower() -> TwoTowerConfig:
    image = ViTConfig(EncoderConfig(64, 2, 4, 128, moe=MoEConfig((1,), 4, 1, group_size=16)), image_size=32,
                      patch_size=8, num_classes=None)
    text = TextConfig(EncoderConfig(64, 2, 4, 128), vocab_size=1000, max_len=16, num_classes=64)
    return TwoTowerConfig(image, text)


def default_packages(cache_dir: str = "") -> list[str]:
    root = cache_root(cache_dir) / "default-models" / VERSION
    out = []
    for name, cfg in (("default", _classifier()), ("default-lit", _two_tower())):
        pkg = root / name
        if not (pkg / "config.json").is_file():
            torch.manual_seed(0)
            model = build_model(cfg)
            labels = [f"class_{i}" for i in range(10)] if name == "default" else None
            save_package(model, cfg, pkg, labels=labels,
                         provenance={"source": "built-in random default model", "format": "random-init", "seed": 0})
        out.append(f"{name}={pkg}")
    return out
