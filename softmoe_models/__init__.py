"""Soft MoE vision transformers and LiT two-tower models, numerically as google-research/vmoe.

The names below load on first use (PEP 562), so a process that needs only the light modules (the
preprocessing contract in a decode worker of ``softmoe embed``) does not import torch."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_WHERE = {
    "VARIANTS": "config", "EncoderConfig": "config", "MoEConfig": "config", "SeqEncoderConfig": "config",
    "TextConfig": "config", "TwoTowerConfig": "config", "ViTConfig": "config",
    "build_model": "models", "count_params": "models",
    "load_model": "package", "read_package": "package", "save_package": "package",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
