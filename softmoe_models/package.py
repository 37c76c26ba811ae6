"""The model package: one directory a server, an exporter or an evaluator can load on its own.

    PKG/
      config.json        kind, architecture, preprocessing contract, provenance (below)
      model.safetensors  the state dict, float32
      labels.json        optional: class names, a JSON list (classifiers)
      tokenizer.model    optional: SentencePiece model (two-tower text input)
      routing_profile.json  optional: reference routing statistics (softmoe_models.routing)

config.json::

    {"format": "softmoe-package", "format_version": 1,
     "kind": "classifier" | "two-tower" | "encoder",
     "variant": "soft-s16-e128" | null,
     "model": {...the model config...},
     "preprocess": {"image_size", "resize", "value_range", "layout", "channels", "crop"},
     "text": {"max_len", "eos_id", "pad_id", "lowercase", ...}     (two-tower only)
     "head_activation": "softmax" | "sigmoid" | null,
     "labels": "labels.json" | null, "tokenizer": "tokenizer.model" | null,
     "routing_profile": {"file": "routing_profile.json", "sha256": ...}    (optional)
     "provenance": {"source", "format", "sha256"}, "num_params": int}

Loading checks the config against the weights: every key and shape must agree.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .config import ModelConfig, TwoTowerConfig, ViTConfig, from_dict, kind_of, to_dict
from .models import build_model
from .preprocess import PreprocessConfig
from .soft_moe import configure_routing

FORMAT = "softmoe-package"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
LABELS_FILE = "labels.json"
TOKENIZER_FILE = "tokenizer.model"


class PackageError(Exception):
    """A model package is missing, malformed, or its config does not match its weights."""


@dataclass
class Package:
    """A loaded package: config, preprocessing contract and optional assets."""

    path: Path
    kind: str
    config: ModelConfig
    preprocess: PreprocessConfig
    meta: dict[str, Any]
    labels: list[str] | None = None
    text: dict[str, Any] = field(default_factory=dict)

    @property
    def tokenizer_path(self) -> Path | None:
        name = self.meta.get("tokenizer")
        return self.path / name if name else None

    @property
    def head_activation(self) -> str | None:
        return self.meta.get("head_activation")

    def routing_profile(self) -> dict[str, Any] | None:
        """The reference routing profile named in config.json (``softmoe_models.routing``), checked
        against the sha256 recorded there; None when the package has none."""
        entry = self.meta.get("routing_profile")
        if not entry:
            return None
        path = self.path / entry["file"]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise PackageError(f"{path}: cannot read the routing profile ({e})") from None
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise PackageError(f"{path}: sha256 differs from config.json's routing_profile entry (edited or stale; "
                               "recompute it with `python -m softmoe_models.routing_cli profile`)")
        return json.loads(data)


def default_text_contract(max_len: int) -> dict[str, Any]:
    """vmoe LAION tokenisation: ASCII lowercase, SentencePiece, EOS=1, sticky EOS, pad with 1."""
    return {"max_len": max_len, "eos_id": 1, "pad_id": 1, "lowercase": "ascii", "add_eos": True, "sticky_eos": True}


def save_package(
    model: nn.Module,
    cfg: ModelConfig,
    out: str | Path,
    *,
    labels: list[str] | None = None,
    tokenizer: str | Path | None = None,
    provenance: dict[str, Any] | None = None,
    head_activation: str | None = None,
    preprocess: PreprocessConfig | None = None,
    variant: str | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (built from ``cfg``) as a package directory; returns its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kind = kind_of(cfg)
    image_cfg = cfg.image if isinstance(cfg, TwoTowerConfig) else cfg if isinstance(cfg, ViTConfig) else None
    if labels is not None:
        n = getattr(cfg, "num_classes", None)
        if n is not None and len(labels) != n:
            raise PackageError(f"{len(labels)} labels given for a model with {n} classes")
    if head_activation is None and kind == "classifier":
        head_activation = "softmax"
    meta: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "variant": variant,
        "model": to_dict(cfg),
        "preprocess": to_dict(preprocess or PreprocessConfig(image_size=image_cfg.image_size)) if image_cfg else None,
        "head_activation": head_activation,
        "labels": LABELS_FILE if labels is not None else None,
        "tokenizer": TOKENIZER_FILE if tokenizer is not None else None,
        "provenance": provenance or {},
        "num_params": sum(p.numel() for p in model.parameters()),
    }
    if isinstance(cfg, TwoTowerConfig):
        meta["text"] = default_text_contract(cfg.text.max_len)
    meta.update(extra or {})
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": FORMAT})
    if labels is not None:
        (out / LABELS_FILE).write_text(json.dumps(list(labels), indent=1) + "\n")
    if tokenizer is not None and Path(tokenizer).resolve() != (out / TOKENIZER_FILE).resolve():
        shutil.copyfile(tokenizer, out / TOKENIZER_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_package(path: str | Path) -> Package:
    """Read and validate ``config.json`` and the assets it names (weights are not loaded)."""
    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise PackageError(f"{path}: not a model package (no {CONFIG_FILE})")
    try:
        meta = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PackageError(f"{cfg_file}: invalid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PackageError(f"{cfg_file}: not a {FORMAT} config")
    if meta.get("format_version") != FORMAT_VERSION:
        raise PackageError(f"{cfg_file}: format_version {meta.get('format_version')} is not supported")
    try:
        cfg = from_dict(meta["kind"], meta["model"])
        pre = PreprocessConfig.from_dict(meta["preprocess"]) if meta.get("preprocess") else PreprocessConfig(0)
    except (KeyError, ValueError, TypeError) as e:
        raise PackageError(f"{cfg_file}: invalid model config ({e})") from None
    labels = None
    if meta.get("labels"):
        try:
            labels = json.loads((path / meta["labels"]).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PackageError(f"{path / meta['labels']}: cannot read labels ({e})") from None
        n = getattr(cfg, "num_classes", None)
        if not isinstance(labels, list) or (n is not None and len(labels) != n):
            raise PackageError(f"{path / meta['labels']}: expected a list of {n} labels")
        labels = [str(x) for x in labels]
    if meta.get("tokenizer") and not (path / meta["tokenizer"]).is_file():
        raise PackageError(f"{path}: tokenizer file {meta['tokenizer']!r} is missing")
    return Package(path, meta["kind"], cfg, pre, meta, labels, meta.get("text") or {})


def load_weights(pkg: Package, model: nn.Module, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
    """Load ``model.safetensors`` into ``model`` after checking every key and shape.

    Args:
        pkg: the package.
        model: the module (typically built on the meta device).
        device: read the tensors one at a time straight onto this device, cast to ``dtype`` as they
            arrive (the host never holds the float32 state dict). None: the whole file at once on
            the host, as stored.
        dtype: with ``device``: cast floating tensors to this dtype.
    """
    weights = pkg.path / WEIGHTS_FILE
    if not weights.is_file():
        raise PackageError(f"{pkg.path}: missing {WEIGHTS_FILE}")
    try:
        if device is None:
            state = load_file(str(weights))
            _check_shapes(model, {k: tuple(v.shape) for k, v in state.items()}, weights)
        else:
            state = {}
            with safe_open(str(weights), framework="pt", device=str(torch.device(device))) as f:
                _check_shapes(model, {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, weights)
                for k in f.keys():
                    t = f.get_tensor(k)
                    state[k] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    except (SafetensorError, OSError) as e:
        raise PackageError(f"{weights}: cannot read weights ({e})") from None
    model.load_state_dict(state, assign=True)


def _check_shapes(model: nn.Module, got: dict[str, tuple[int, ...]], weights: Path) -> None:
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    bad = sorted(k for k in set(want) & set(got) if got[k] != want[k])
    if missing or unexpected or bad:
        detail = []
        if missing:
            detail.append(f"missing {missing[:8]}")
        if unexpected:
            detail.append(f"unexpected {unexpected[:8]}")
        if bad:
            detail.append("shape mismatch " + ", ".join(f"{k} {got[k]} != {want[k]}" for k in bad[:8]))
        raise PackageError(f"{weights} does not match {CONFIG_FILE}: " + "; ".join(detail))


def load_model(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    fused: bool = True,
    bf16_dispatch: bool = False,
) -> nn.Module:
    """Load a package into an eval-mode module.

    Args:
        path: the package directory.
        device: where to put the weights. Not the CPU: tensors are read one at a time onto the
            device and cast there, so the host never holds the float32 state dict.
        dtype: cast weights to this dtype (default: float32 as stored).
        fused: fused Soft MoE routing (default) or the reference einsums.
        bf16_dispatch: emulate vmoe's bfloat16 dispatcher (exact parity with vmoe outputs).
    """
    pkg = read_package(path)
    model = build_model(pkg.config, device="meta")
    if torch.device(device).type == "cpu":
        load_weights(pkg, model)
        model.to(device=device, dtype=dtype)
    else:  # an accelerator: tensors go straight there in the compute dtype
        load_weights(pkg, model, device=device, dtype=dtype)
    configure_routing(model, fused=fused, bf16_dispatch=bf16_dispatch)
    for m in model.modules():
        if hasattr(m, "fold"):
            m.fold()
    model.package = pkg  # type: ignore[assignment]
    return model.eval().requires_grad_(False)
