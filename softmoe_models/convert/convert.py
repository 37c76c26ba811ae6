"""vmoe parameter tree -> state dict -> model package, with every key accounted for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..config import EncoderConfig, ModelConfig, MoEConfig, TwoTowerConfig, ViTConfig
from ..models import build_model
from ..package import save_package
from .errors import ConversionError
from .hf_siglip import convert_hf_siglip, is_hf_directory
from .infer import infer_config
from .mapping import TO_TORCH, entries
from .presets import apply_preset, check_preset, get_preset
from .readers import read_checkpoint, sha256_of
from .sparse import E3_REFUSAL, SparseOptions

Params = dict[str, np.ndarray]

def _inverse(layout: str, t: np.ndarray, heads: tuple[int, int] | None) -> np.ndarray:
    """Inverse of ``TO_TORCH[layout]``; ``heads`` = (H, Dh) for attention tensors."""
    if layout == "conv":
        return t.transpose(2, 3, 1, 0)
    if layout == "dense":
        return t.T
    if layout == "qkv":
        return t.T.reshape(t.shape[1], *heads)
    if layout == "qkv_bias":
        return t.reshape(heads)
    if layout == "out":
        return t.T.reshape(*heads, t.shape[0])
    return t


def params_to_state_dict(params: Params, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map a flat vmoe parameter dict onto the state dict of ``build_model(cfg)``.

    Raises:
        ConversionError: naming every missing, unexpected or mis-shaped key.
    """
    table = entries(cfg)
    expected = {f for f, _, _ in table}
    missing = sorted(expected - set(params))
    unexpected = sorted(set(params) - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s): {', '.join(missing[:10])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s): {', '.join(unexpected[:10])}")
        raise ConversionError("checkpoint does not match the inferred architecture: " + "; ".join(parts))
    shapes = {k: tuple(v.shape) for k, v in build_model(cfg, device="meta").state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for flax_key, torch_key, layout in table:
        value = np.asarray(params[flax_key])
        if not np.issubdtype(value.dtype, np.floating):
            raise ConversionError(f"parameter {flax_key!r} has dtype {value.dtype}, expected a float type")
        want = shapes[torch_key]
        try:
            converted = TO_TORCH[layout](value.astype(np.float32, copy=False))
        except ValueError:
            converted = None
        if converted is None or tuple(converted.shape) != want:
            raise ConversionError(
                f"parameter {flax_key!r} has shape {tuple(value.shape)}, which does not fit {torch_key} {want}"
            )
        state[torch_key] = torch.from_numpy(np.array(converted, order="C", copy=True))
    return state


def state_dict_to_params(state: dict[str, torch.Tensor], cfg: ModelConfig) -> Params:
    """Inverse mapping: a vmoe-layout flat parameter dict from our state dict."""
    out: Params = {}
    for flax_key, torch_key, layout in entries(cfg):
        t = state[torch_key].detach().float().cpu().numpy()
        enc = _encoder_for(cfg, flax_key)
        out[flax_key] = np.array(_inverse(layout, t, (enc.num_heads, enc.head_dim)), order="C", copy=True)
    return out


def _encoder_for(cfg: ModelConfig, flax_key: str) -> EncoderConfig:
    if isinstance(cfg, TwoTowerConfig):
        return cfg.text.encoder if flax_key.startswith("txt/") else cfg.image.encoder
    assert isinstance(cfg, ViTConfig)
    return cfg.encoder


def _moe_configs(cfg: ModelConfig) -> list[MoEConfig]:
    encoders = [cfg.image.encoder, cfg.text.encoder] if isinstance(cfg, TwoTowerConfig) else [cfg.encoder]
    return [e.moe for e in encoders if e.moe is not None]


def resolve_config(
    params: Params,
    *,
    text_pool: str | None = None,
    preset: str | None = None,
    sparse: SparseOptions | None = None,
    source_name: str | None = None,
) -> tuple[ModelConfig, list[str], dict[str, str]]:
    """The model config of a vmoe parameter tree: what the parameters show, plus what they cannot
    show (text pooling; a sparse V-MoE's routing) from the options and preset given.

    Args:
        params: the flat parameter tree (only names and shapes are read).
        text_pool: the text tower's pooling (two-tower).
        preset: a public V-MoE checkpoint's name (:data:`~softmoe_models.convert.presets.PRESETS`).
        sparse: a sparse V-MoE's routing flags; with ``preset``, the evaluation ones override it.
        source_name: the checkpoint's file or prefix name (vmoe's E³ checkpoints are ``eee_*``).

    Returns:
        The config, notices, and provenance entries (how the routing was chosen).

    Raises:
        ConversionError: one line: an option that contradicts the parameters or the preset, a
            sparse checkpoint without its router, a preset the parameters do not match, E³.
    """
    given = sparse or SparseOptions()
    given.check()
    notices: list[str] = []
    chosen = get_preset(preset) if preset is not None else None
    if chosen is None and source_name and source_name.startswith("eee_"):
        raise ConversionError(f"{source_name}: vmoe's eee_* checkpoints are E³ models; {E3_REFUSAL}")
    options = given
    if chosen is not None:
        options, overridden = apply_preset(chosen, given)
        notices += overridden
    cfg = infer_config(params, text_pool=text_pool, sparse=options)
    moes = _moe_configs(cfg)
    is_sparse = any(m.sparse for m in moes)
    provenance: dict[str, str] = {}
    if chosen is not None:
        if not isinstance(cfg, ViTConfig):
            raise ConversionError(
                f"--preset {chosen.name} is a V-MoE classifier; the checkpoint is a {type(cfg).__name__}")
        check_preset(chosen, cfg)
        provenance["preset"] = chosen.name
    elif given.given() and not is_sparse:
        flags = given.given()
        what = "holds Soft MoE routers (Moe/Router/mu)" if moes else "has no MoE blocks"
        raise ConversionError(
            f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} for sparse V-MoE checkpoints "
            f"(Moe/Router/dense/kernel); this checkpoint {what}")
    if is_sparse:
        parts = [f"preset {chosen.name}"] if chosen else []
        if given.given():
            parts.append(f"flags {', '.join(given.given())}")
        provenance["routing"] = ", ".join(parts)
    return cfg, notices, provenance


def convert_checkpoint(
    src: str | Path,
    out: str | Path,
    labels: list[str] | None = None,
    tokenizer: str | Path | None = None,
    head_activation: str | None = None,
    text_pool: str | None = None,
    text_padding_mask: str = "auto",
    *,
    preset: str | None = None,
    router: str | None = None,
    experts_per_token: int | None = None,
    capacity_factor: float | None = None,
    batch_priority: bool | None = None,
    dispatch_dtype: str | None = None,
) -> tuple[Path, list[str]]:
    """Convert a vmoe checkpoint (npz, legacy partitioned or orbax), or a Hugging Face SigLIP
    directory (:mod:`softmoe_models.convert.hf_siglip`), into a model package.

    Args:
        src: the checkpoint (see :func:`softmoe_models.convert.readers.read_checkpoint`), or a
            directory with a Hugging Face ``config.json``.
        out: the package directory to write.
        labels: class names (classifiers); their count must be the head's.
        tokenizer: SentencePiece model of the text tower (two-tower).
        head_activation: 'softmax' or 'sigmoid' (classifiers; default softmax).
        text_pool: the text tower's pooling, vmoe ``TextTransformer.pool_type`` (two-tower).
            Required unless the parameters show it (only 'map' has parameters); an error if
            it contradicts them or if the checkpoint has no text tower.
        text_padding_mask: Hugging Face SigLIP only: auto | on | off (see ``convert_hf_siglip``).
        preset: a public V-MoE checkpoint's name: sets its routing and checks its sizes
            (:mod:`softmoe_models.convert.presets`).
        router: sparse V-MoE only: 'tokens-choice' or 'experts-choice' (required unless ``preset``).
        experts_per_token: K, tokens-choice (required unless ``preset``).
        capacity_factor: sparse V-MoE: cf at serving (default 4.0, vmoe's evaluation value).
        batch_priority: tokens-choice: batch priority routing (default off).
        dispatch_dtype: sparse V-MoE: 'float32' (default) or 'bfloat16' (vmoe's dispatcher).

    Returns:
        The package directory and the notices collected on the way (ignored groups, ...).
    """
    src = Path(src)
    sparse = SparseOptions(router=router, experts_per_token=experts_per_token,  # type: ignore[arg-type]
                           capacity_factor=capacity_factor, batch_priority=batch_priority,
                           dispatch_dtype=dispatch_dtype)  # values checked by SparseOptions.check
    if is_hf_directory(src):
        if preset is not None or sparse.given():
            flags = ["--preset"] * (preset is not None) + sparse.given()
            raise ConversionError(f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} for vmoe sparse V-MoE "
                                  "checkpoints, not Hugging Face directories")
        return convert_hf_siglip(src, out, labels=labels, tokenizer=tokenizer, head_activation=head_activation,
                                 text_pool=text_pool, text_padding_mask=text_padding_mask)
    if src.is_file() and is_hf_directory(src.parent):
        raise ConversionError(f"{src} is one file of a Hugging Face model directory; pass the directory {src.parent}")
    if text_padding_mask != "auto":
        raise ConversionError("--text-padding-mask applies to Hugging Face SigLIP directories only")
    params, notices, fmt = read_checkpoint(src)
    cfg, more, routing = resolve_config(params, text_pool=text_pool, preset=preset, sparse=sparse,
                                        source_name=src.name.removesuffix(".index"))
    notices += more
    n = getattr(cfg, "num_classes", None)
    if labels is not None and n is not None and len(labels) != n:
        raise ConversionError(f"{len(labels)} labels given for a model with {n} classes (--labels names every class, "
                              "one per line)")
    if labels is None and preset is not None and n:
        notices.append(f"no --labels: the package has no class names; preset {preset}'s head predicts "
                       f"{get_preset(preset).labels}'s {n} classes (pass their names, one per line)")
    state = params_to_state_dict(params, cfg)
    model = build_model(cfg, device="meta")
    model.load_state_dict(state, assign=True)
    provenance = {"source": str(src), "format": fmt, "sha256": checkpoint_sha256(src, fmt), **routing}
    if isinstance(cfg, TwoTowerConfig):
        provenance["text_pool"] = "given" if text_pool is not None else "inferred from the parameters"
    pkg = save_package(
        model, cfg, out, labels=labels, tokenizer=tokenizer, provenance=provenance,
        head_activation=head_activation,
    )
    return pkg, notices


def checkpoint_sha256(src: Path, fmt: str) -> str:
    """One digest for the checkpoint's bytes: the file, the shards, or the directory tree."""
    if fmt == "vmoe-partitioned":
        prefix = src.with_suffix("") if src.suffix == ".index" else src
        index = prefix.with_name(prefix.name + ".index")
        shards = sorted(prefix.parent.glob(prefix.name + ".data-*"))
        return sha256_of([index, *shards], prefix.parent)
    if src.is_dir():
        return sha256_of(sorted(p for p in src.rglob("*") if p.is_file()), src)
    return sha256_of([src])
