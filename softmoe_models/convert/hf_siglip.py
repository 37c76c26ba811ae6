"""Hugging Face SigLIP directories -> model packages, without transformers.

What is read (a directory as ``save_pretrained`` writes it, or a hub snapshot):

    config.json                    model_type 'siglip' (SiglipModel) or 'siglip_vision_model' (SiglipVisionModel)
    model.safetensors              or model.safetensors.index.json and its shards
    spiece.model                   SentencePiece model of SiglipTokenizer (SiglipModel)
    tokenizer_config.json          SiglipTokenizer settings (optional: the class defaults)
    preprocessor_config.json       SiglipImageProcessor settings (or processor_config.json's "image_processor")

SigLIP is vmoe's TwoTower without Soft MoE, so it maps onto the existing modules (modeling_siglip ->
ours): patch conv with bias -> ``patch_embed``; position embedding ``(N, D)`` -> ``pos_embed (1, N, D)``;
pre-LN blocks (LayerNorm eps 1e-6, tanh GELU, no qk-norm) -> ``blocks``; ``post_layernorm`` /
``final_layer_norm`` -> the encoder's final norm; the attention-pooling head (probe, packed
``in_proj`` split into q/k/v, LayerNorm, MLP) -> ``MapHead``; the text tower pools the last position
and projects with ``head``; ``logit_scale`` (a log) -> ``s``, ``logit_bias`` -> ``b``.

Two things are read from the tokenizer and the processor rather than the weights: the text contract
(SiglipTokenizer: lowercasing, ASCII punctuation stripped, whitespace collapsed, word-start
SentencePiece encoding, EOS, padding to ``model_max_length`` with the pad id) and the preprocessing
(resize to ``size`` with ``resample`` on the full-size decode, rescale and normalise). When the
reference tokenizer returns an ``attention_mask`` (SiglipTokenizer does), transformers' SiglipModel
masks the padding when given it (``model(**processor(...))``), so the converted text tower masks it
too; ``text_padding_mask='off'`` gives the unmasked tower the model was trained as (big_vision).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
from safetensors import SafetensorError, safe_open

from ..config import EncoderConfig, ModelConfig, TextConfig, TwoTowerConfig, ViTConfig
from ..models import build_model
from ..package import TOKENIZER_FILE, save_package
from ..preprocess import PreprocessConfig
from .errors import ConversionError
from .readers import sha256_of

FORMAT = "hf-siglip"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
SPIECE = "spiece.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
PREPROCESSOR_CONFIGS = ("preprocessor_config.json", "processor_config.json")

TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # the same function (vmoe's tanh GELU)
LN_EPS = 1e-6
# PIL.Image.Resampling values, as transformers stores `resample`.
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}

# transformers' class defaults (configuration_siglip, SiglipImageProcessor, SiglipTokenizer): hub
# configs written by older versions hold only what differs from them.
TEXT_DEFAULTS = dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                     num_attention_heads=12, max_position_embeddings=64, hidden_act="gelu_pytorch_tanh",
                     layer_norm_eps=1e-6, projection_size=None)
VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
                       layer_norm_eps=1e-6, vision_use_head=True)
PROCESSOR_DEFAULTS = dict(do_resize=True, size={"height": 224, "width": 224}, resample=3, do_rescale=True,
                          rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5, 0.5, 0.5],
                          image_std=[0.5, 0.5, 0.5], do_center_crop=False, do_pad=False)
TOKENIZER_DEFAULTS = dict(do_lower_case=True, model_max_length=64, eos_token="</s>", pad_token="</s>",
                          unk_token="<unk>", model_input_names=["input_ids", "attention_mask"], legacy=True)

SUPPORTED = "SiglipModel (model_type 'siglip') and SiglipVisionModel (model_type 'siglip_vision_model')"


# ---------------------------------------------------------------- detection


def read_hf_config(path: Path) -> dict[str, Any] | None:
    """The ``config.json`` of a Hugging Face model directory, or None when ``path`` is not one."""
    cfg_file = path / CONFIG
    if not path.is_dir() or not cfg_file.is_file():
        return None
    try:
        data = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or not ("model_type" in data or "architectures" in data):
        return None
    return data


def is_hf_directory(path: str | Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory (a ``config.json`` naming a model type)."""
    return read_hf_config(Path(path)) is not None


# ---------------------------------------------------------------- configs


def _sub(data: dict[str, Any], key: str, defaults: dict[str, Any]) -> dict[str, Any]:
    sub = data.get(key) or {}
    if not isinstance(sub, dict):
        raise ConversionError(f"{CONFIG}: {key} is not an object")
    return {**defaults, **{k: v for k, v in sub.items() if v is not None or k not in defaults}}


def _square(value: Any, what: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ConversionError(f"{CONFIG}: {what} {list(value)} is not square; only square images and patches "
                                  "are supported")
        value = value[0]
    return int(value)


def _encoder(tc: dict[str, Any], where: str) -> EncoderConfig:
    act = tc["hidden_act"]
    if act not in TANH_GELUS:
        raise ConversionError(f"{CONFIG}: {where}.hidden_act {act!r} is not supported (only the tanh GELU: "
                              f"{', '.join(TANH_GELUS)})")
    if not math.isclose(float(tc["layer_norm_eps"]), LN_EPS, rel_tol=1e-9):
        raise ConversionError(f"{CONFIG}: {where}.layer_norm_eps {tc['layer_norm_eps']} is not supported (only {LN_EPS})")
    d, h = int(tc["hidden_size"]), int(tc["num_attention_heads"])
    if h <= 0 or d % h:
        raise ConversionError(f"{CONFIG}: {where}.hidden_size {d} is not divisible by num_attention_heads {h}")
    return EncoderConfig(hidden_size=d, num_layers=int(tc["num_hidden_layers"]), num_heads=h,
                         mlp_dim=int(tc["intermediate_size"]), qk_norm=False, moe=None)


def vision_config(vc: dict[str, Any], where: str = "vision_config") -> ViTConfig:
    """Our ViT config for a SiglipVisionConfig dict (defaults applied)."""
    if not vc["vision_use_head"]:
        raise ConversionError(f"{CONFIG}: {where}.vision_use_head is false: the image tower has no pooled output to serve")
    if int(vc["num_channels"]) != 3:
        raise ConversionError(f"{CONFIG}: {where}.num_channels {vc['num_channels']} is not supported (RGB only)")
    size, patch = _square(vc["image_size"], f"{where}.image_size"), _square(vc["patch_size"], f"{where}.patch_size")
    if size < patch:
        raise ConversionError(f"{CONFIG}: {where}.image_size {size} is smaller than patch_size {patch}")
    return ViTConfig(encoder=_encoder(vc, where), image_size=size, patch_size=patch, num_classes=None,
                     classifier="map", representation_size=None, in_channels=3, map_mlp_dim=None)


def text_config(tc: dict[str, Any], max_len: int, padding_mask_id: int | None) -> TextConfig:
    """Our text tower config for a SiglipTextConfig dict (defaults applied)."""
    d = int(tc["hidden_size"])
    return TextConfig(encoder=_encoder(tc, "text_config"), vocab_size=int(tc["vocab_size"]), max_len=max_len,
                      num_classes=int(tc["projection_size"] or d), pool_type="last", map_mlp_dim=None,
                      padding_mask_id=padding_mask_id)


# ---------------------------------------------------------------- weights


def read_weights(src: Path) -> tuple[dict[str, torch.Tensor], list[Path], list[str]]:
    """Every tensor of ``model.safetensors`` (or its shards), float32; the files read; notices."""
    index = src / WEIGHTS_INDEX
    if (src / WEIGHTS).is_file():
        files = [src / WEIGHTS]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ConversionError(f"{index}: not a safetensors index ({e})") from None
        files = [src / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConversionError(f"{src}: missing weight shard(s) {', '.join(missing[:5])} named by {WEIGHTS_INDEX}")
    else:
        others = [p.name for p in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack") if (src / p).is_file()]
        hint = f" (found {', '.join(others)}; only safetensors weights are read)" if others else ""
        raise ConversionError(f"{src}: missing {WEIGHTS} (or {WEIGHTS_INDEX} and its shards){hint}")
    tensors: dict[str, torch.Tensor] = {}
    dtypes: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    t = fh.get_tensor(key)
                    if key in tensors:
                        raise ConversionError(f"{f}: tensor {key!r} is also in another shard")
                    if t.is_floating_point():
                        dtypes.add(str(t.dtype).removeprefix("torch."))
                        t = t.float()
                    tensors[key] = t
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"{f}: cannot read weights ({e})") from None
    notices = [f"weights stored as {', '.join(sorted(dtypes))} were cast to float32"] if dtypes - {"float32"} else []
    return tensors, files, notices


def _entries(cfg: ViTConfig | TextConfig, hf: str, ours: str) -> list[tuple[str, str, str]]:
    """``(transformers key, our key, layout)`` of one tower; layouts: same | pos | q | k | v | scalar."""
    out: list[tuple[str, str, str]] = []
    enc = cfg.encoder
    if isinstance(cfg, ViTConfig):
        out += [(f"{hf}embeddings.patch_embedding.weight", f"{ours}patch_embed.weight", "same"),
                (f"{hf}embeddings.patch_embedding.bias", f"{ours}patch_embed.bias", "same"),
                (f"{hf}embeddings.position_embedding.weight", f"{ours}encoder.pos_embed", "pos")]
        final = "post_layernorm"
    else:
        out += [(f"{hf}embeddings.token_embedding.weight", f"{ours}embed.weight", "same"),
                (f"{hf}embeddings.position_embedding.weight", f"{ours}encoder.pos_embed", "pos")]
        final = "final_layer_norm"
    for i in range(enc.num_layers):
        h, o = f"{hf}encoder.layers.{i}.", f"{ours}encoder.blocks.{i}."
        for hn, on in (("layer_norm1", "norm1"), ("layer_norm2", "norm2"), ("self_attn.q_proj", "attn.q"),
                       ("self_attn.k_proj", "attn.k"), ("self_attn.v_proj", "attn.v"),
                       ("self_attn.out_proj", "attn.out"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
            out += [(f"{h}{hn}.weight", f"{o}{on}.weight", "same"), (f"{h}{hn}.bias", f"{o}{on}.bias", "same")]
    out += [(f"{hf}{final}.weight", f"{ours}encoder.norm.weight", "same"),
            (f"{hf}{final}.bias", f"{ours}encoder.norm.bias", "same")]
    if isinstance(cfg, ViTConfig):
        h, o = f"{hf}head.", f"{ours}map_head."
        out.append((f"{h}probe", f"{o}probe", "same"))
        for part in ("weight", "bias"):
            for name in ("q", "k", "v"):
                out.append((f"{h}attention.in_proj_{part}", f"{o}attn.{name}.{part}", name))
            out.append((f"{h}attention.out_proj.{part}", f"{o}attn.out.{part}", "same"))
            for hn, on in (("layernorm", "norm"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
                out.append((f"{h}{hn}.{part}", f"{o}{on}.{part}", "same"))
    else:
        out += [(f"{hf}head.weight", f"{ours}head.weight", "same"), (f"{hf}head.bias", f"{ours}head.bias", "same")]
    return out


def _convert(t: torch.Tensor, layout: str, want: tuple[int, ...]) -> torch.Tensor | None:
    if layout in ("q", "k", "v"):  # nn.MultiheadAttention's packed in_proj: rows [q; k; v]
        if t.shape[0] % 3:
            return None
        return t.chunk(3, dim=0)["qkv".index(layout)]
    if layout == "pos":  # (positions, D) -> (1, L, D): the first L positions (text: L <= positions)
        return t[None, : want[1]] if t.ndim == 2 and t.shape[0] >= want[1] else None
    if layout == "scalar":  # (1,) -> ()
        return t.reshape(()) if t.numel() == 1 else None
    return t


def state_dict_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig,
                       vision_prefix: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our state dict from transformers' tensors, every key accounted for.

    Raises:
        ConversionError: naming every missing, unexpected or mis-shaped tensor.
    """
    if isinstance(cfg, TwoTowerConfig):
        table = _entries(cfg.image, "vision_model.", "image.") + _entries(cfg.text, "text_model.", "text.")
        table += [("logit_scale", "s", "scalar"), ("logit_bias", "b", "scalar")]
    else:
        assert isinstance(cfg, ViTConfig)
        table = _entries(cfg, vision_prefix, "")
    wanted = {hf for hf, _, _ in table}
    buffers = {k for k in tensors if k.endswith("embeddings.position_ids")}  # non-persistent in recent versions
    missing = sorted(wanted - set(tensors))
    unexpected = sorted(set(tensors) - wanted - buffers)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:8])}")
        raise ConversionError(f"{WEIGHTS} does not match {CONFIG}: " + "; ".join(parts))
    shapes = {k: tuple(v.shape) for k, v in build_model(cfg, device="meta").state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for hf, ours, layout in table:
        value = tensors[hf]
        if not value.is_floating_point():
            raise ConversionError(f"tensor {hf!r} has dtype {value.dtype}, expected a float type")
        got = _convert(value, layout, shapes[ours])
        if got is None or tuple(got.shape) != shapes[ours]:
            raise ConversionError(f"tensor {hf!r} has shape {tuple(value.shape)}, which does not fit {ours} {shapes[ours]} "
                                  f"(from {CONFIG})")
        state[ours] = got if layout == "same" else got.contiguous().clone()  # views (q/k/v rows, slices): own storage
    notices = [f"ignored buffer(s) {', '.join(sorted(buffers))}"] if buffers else []
    return state, notices


# ---------------------------------------------------------------- preprocessing


def read_processor_config(src: Path) -> tuple[dict[str, Any], Path]:
    """SiglipImageProcessor settings with the class defaults, and the file they came from."""
    for name in PREPROCESSOR_CONFIGS:
        f = src / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"{f}: invalid JSON ({e})") from None
        if name == "processor_config.json":
            data = data.get("image_processor") if isinstance(data, dict) else None
            if not isinstance(data, dict):
                continue
        return {**PROCESSOR_DEFAULTS, **data}, f
    raise ConversionError(f"{src}: missing {PREPROCESSOR_CONFIGS[0]} (the image processor's settings; "
                          f"{PREPROCESSOR_CONFIGS[1]} with an 'image_processor' section also works)")


def preprocess_config(pc: dict[str, Any], image_size: int, where: Path) -> tuple[PreprocessConfig, list[str]]:
    """Our preprocessing contract for SiglipImageProcessor settings ``pc``.

    The processor resizes the RGB image to ``size`` with ``resample``, then ``x * rescale_factor``
    and ``(x - mean) / std``: one affine map of the uint8 values, the same for every channel when
    mean and std are, which is what ``value_range`` expresses (within 1 float32 ulp).
    """
    name = where.name
    ptype = str(pc.get("image_processor_type") or "SiglipImageProcessor")
    if not ptype.startswith("Siglip"):
        raise ConversionError(f"{where}: image_processor_type {ptype!r} is not a SigLIP image processor")
    if not pc["do_resize"]:
        raise ConversionError(f"{name}: do_resize is false; the model needs {image_size}x{image_size} inputs, "
                              "so the served preprocessing always resizes")
    if pc.get("do_center_crop") or pc.get("do_pad"):
        raise ConversionError(f"{name}: do_center_crop / do_pad are not supported for SigLIP")
    size = pc["size"] or {}
    h, w = size.get("height"), size.get("width")
    if h is None or w is None:
        raise ConversionError(f"{name}: size {size} is not supported (expected height and width)")
    if (int(h), int(w)) != (image_size, image_size):
        raise ConversionError(f"{name}: size {int(h)}x{int(w)} differs from the model's image_size {image_size}")
    resample = pc["resample"]
    if resample not in RESAMPLE:
        raise ConversionError(f"{name}: resample {resample!r} is not a PIL resampling filter (0..5)")
    mean = [float(m) for m in pc["image_mean"]] if pc["do_normalize"] else [0.0] * 3
    std = [float(s) for s in pc["image_std"]] if pc["do_normalize"] else [1.0] * 3
    if len(set(mean)) != 1 or len(set(std)) != 1 or len(mean) != 3 or len(std) != 3:
        raise ConversionError(f"{name}: per-channel normalisation (image_mean {pc['image_mean']}, image_std "
                              f"{pc['image_std']}) is not supported; every channel must share mean and std")
    scale = float(pc["rescale_factor"]) if pc["do_rescale"] else 1.0
    lo, hi = (0.0 - mean[0]) / std[0], (255.0 * scale - mean[0]) / std[0]
    cfg = PreprocessConfig(image_size=image_size, resize=RESAMPLE[resample], value_range=(round(lo, 12), round(hi, 12)),
                           crop="none", jpeg_draft=False)
    notices = []
    if ptype.endswith("Fast"):
        notices.append(f"{name}: {ptype} resizes with torchvision; the package resizes with Pillow as the "
                       "PIL-backend SiglipImageProcessor does (uint8 values may differ by 1 from torchvision's)")
    return cfg, notices


# ---------------------------------------------------------------- tokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return None if value is None else str(value)


def read_tokenizer_config(src: Path) -> dict[str, Any]:
    f = src / TOKENIZER_CONFIG
    data: dict[str, Any] = {}
    if f.is_file():
        try:
            data = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"{f}: invalid JSON ({e})") from None
    cls = str(data.get("tokenizer_class") or "SiglipTokenizer")
    if not cls.startswith("SiglipTokenizer"):
        if cls.startswith("Gemma") or (src / "tokenizer.json").is_file():
            raise ConversionError(f"{TOKENIZER_CONFIG}: tokenizer_class {cls!r} (SigLIP 2's Gemma tokenizer, "
                                  "tokenizer.json) is not supported; only SiglipTokenizer (spiece.model) is")
        raise ConversionError(f"{TOKENIZER_CONFIG}: tokenizer_class {cls!r} is not supported; only SiglipTokenizer is")
    if not (src / SPIECE).is_file():
        extra = (" (a tokenizer.json alone, e.g. SigLIP 2's Gemma tokenizer, is not supported)"
                 if (src / "tokenizer.json").is_file() else "")
        raise ConversionError(f"{src}: missing {SPIECE}, the SentencePiece model of the text tower{extra}")
    if data.get("sp_model_kwargs"):
        raise ConversionError(f"{TOKENIZER_CONFIG}: sp_model_kwargs {data['sp_model_kwargs']} (sampling) is not supported")
    return {**TOKENIZER_DEFAULTS, **{k: v for k, v in data.items() if v is not None}}


def sentencepiece_bytes(src: Path, legacy: bool) -> bytes:
    """``spiece.model`` as SiglipTokenizer loads it (``legacy=False`` turns ``add_dummy_prefix`` off)."""
    data = (src / SPIECE).read_bytes()
    if legacy:
        return data
    try:  # sentencepiece's protobuf module: needs protobuf, which only this legacy=false path uses
        from sentencepiece import sentencepiece_model_pb2 as pb2
    except Exception as e:  # protobuf missing, or a runtime older than the module's gencode (a VersionError)
        raise ConversionError(f"{TOKENIZER_CONFIG} sets legacy=false, which needs sentencepiece's model protobuf "
                              f"module to load ({type(e).__name__}: {e})") from None
    proto = pb2.ModelProto.FromString(data)
    if not proto.normalizer_spec.add_dummy_prefix:
        return data
    proto.normalizer_spec.add_dummy_prefix = False
    return proto.SerializeToString()


def text_contract(tok: dict[str, Any], sp_bytes: bytes, max_positions: int, vocab_size: int) -> dict[str, Any]:
    """The package's ``text`` section reproducing SiglipTokenizer with ``padding='max_length'``, ``truncation=True``."""
    sp = spm.SentencePieceProcessor(model_proto=sp_bytes)
    eos, pad, unk = (_token_text(tok[k]) for k in ("eos_token", "pad_token", "unk_token"))
    if eos is None or pad is None or unk is None:
        raise ConversionError(f"{TOKENIZER_CONFIG}: eos_token, pad_token and unk_token must be set")
    decoder = tok.get("added_tokens_decoder") or {}
    special: dict[str, dict[str, Any]] = {}
    for key, entry in decoder.items():
        content = _token_text(entry)
        if content is None:
            continue
        if isinstance(entry, dict) and (entry.get("single_word") or not entry.get("special", True)):
            raise ConversionError(f"{TOKENIZER_CONFIG}: added token {content!r} (non-special or single_word) "
                                  "is not supported")
        strip = entry if isinstance(entry, dict) else {}
        special[content] = {"text": content, "id": int(key), "lstrip": bool(strip.get("lstrip")),
                            "rstrip": bool(strip.get("rstrip"))}
    for content in (eos, pad, unk):  # SiglipTokenizer's own special tokens (stripping, as its constructor sets)
        if content not in special:
            pid = sp.piece_to_id(content)
            if sp.id_to_piece(pid) != content:
                raise ConversionError(f"{TOKENIZER_CONFIG}: special token {content!r} is not in {SPIECE}")
            special[content] = {"text": content, "id": pid, "lstrip": True, "rstrip": True}
    ids = [t["id"] for t in special.values()] + [sp.get_piece_size() - 1]
    if max(ids) >= vocab_size:
        raise ConversionError(f"{SPIECE} has {sp.get_piece_size()} pieces (ids up to {max(ids)}), but the text tower "
                              f"embeds only vocab_size {vocab_size}")
    limit = int(tok["model_max_length"]) if tok.get("model_max_length") is not None else max_positions
    max_len = min(limit, max_positions)
    return {
        "max_len": max_len,
        "eos_id": special[eos]["id"],
        "pad_id": special[pad]["id"],
        "lowercase": "unicode" if tok["do_lower_case"] else "none",
        "strip_punctuation": True,
        "collapse_whitespace": True,
        "word_start": unk,
        "special_tokens": sorted(special.values(), key=lambda t: t["id"]),
        "add_eos": True,
        "eos_if_absent": True,
        "sticky_eos": True,
        "reference": "transformers SiglipTokenizer, padding='max_length', truncation=True",
    }


# ---------------------------------------------------------------- the conversion


@dataclass(frozen=True)
class _Towers:
    """What ``config.json`` and the tokenizer files make of the model, before any weight is read."""

    cfg: ModelConfig  # TwoTowerConfig (SiglipModel) or ViTConfig (SiglipVisionModel)
    image_size: int  # the side the image processor must resize to
    sp_bytes: bytes | None = None  # the package's SentencePiece model (SiglipModel only)
    mask: bool = False  # whether the text tower masks the padding
    extra: dict[str, Any] = field(default_factory=dict)  # the package's text contract and zero-shot templates
    read: list[Path] = field(default_factory=list)  # the tokenizer files read (for the digest)
    notices: list[str] = field(default_factory=list)


def _hf_digest(files: list[Path], root: Path) -> str:
    return sha256_of(sorted(set(files)), root)


def _architecture(data: dict[str, Any]) -> tuple[str, str]:
    """The model type and architecture ``config.json`` names; anything but SUPPORTED is refused."""
    model_type = data.get("model_type")
    archs = data.get("architectures") or []
    if model_type == "siglip2":
        raise ConversionError(f"{CONFIG}: model_type 'siglip2' (SigLIP 2 NaFlex, variable resolution) is not supported; "
                              f"supported: {SUPPORTED}")
    if model_type not in ("siglip", "siglip_vision_model"):
        raise ConversionError(f"{CONFIG}: model_type {model_type!r} is not supported; supported: {SUPPORTED}")
    want_arch = "SiglipModel" if model_type == "siglip" else "SiglipVisionModel"
    if archs and archs[0] != want_arch:
        raise ConversionError(f"{CONFIG}: architecture {archs[0]!r} is not supported; supported: {SUPPORTED}")
    return model_type, want_arch


def _check_options(*, labels: list[str] | None, tokenizer: str | Path | None, head_activation: str | None,
                   text_pool: str | None, text_padding_mask: str) -> None:
    """Refuse the converter options that do not apply to SigLIP or contradict it (see ``convert_hf_siglip``)."""
    if text_padding_mask not in ("auto", "on", "off"):
        raise ConversionError(f"text padding mask {text_padding_mask!r} is not one of auto, on, off")
    if labels is not None or head_activation is not None:
        raise ConversionError("--labels / --head-activation do not apply: a SigLIP checkpoint has no classifier head")
    if tokenizer is not None:
        raise ConversionError(f"--tokenizer does not apply: the tokenizer is read from the directory ({SPIECE})")
    if text_pool not in (None, "last"):
        raise ConversionError(f"--text-pool {text_pool} contradicts SigLIP, whose text tower pools the last position")


def _masks_padding(tok: dict[str, Any], contract: dict[str, Any], text_padding_mask: str) -> bool:
    """Whether the text tower masks the padding: 'on', or 'auto' when the tokenizer returns an
    ``attention_mask``; only EOS padding can be masked."""
    mask = text_padding_mask == "on" or (
        text_padding_mask == "auto" and "attention_mask" in (tok.get("model_input_names") or []))
    if mask and contract["pad_id"] != contract["eos_id"]:
        raise ConversionError(f"{TOKENIZER_CONFIG}: the tokenizer pads with {contract['pad_id']}, not its EOS "
                              f"{contract['eos_id']}; only EOS padding can be masked (pass --text-padding-mask off)")
    return mask


def _text_length_notices(tok: dict[str, Any], max_len: int, positions: int) -> list[str]:
    """Where the tokenizer's ``model_max_length`` and the text tower's position table disagree."""
    if max_len < positions:
        return [f"text length {max_len} (tokenizer model_max_length) uses the first {max_len} of {positions} "
                "position embeddings"]
    if tok.get("model_max_length") is not None and int(tok["model_max_length"]) > positions:
        return [f"tokenizer model_max_length {tok['model_max_length']} exceeds the text tower's {positions} "
                f"position embeddings: texts are padded and truncated to {positions}"]
    return []


def _siglip_model(src: Path, data: dict[str, Any], text_padding_mask: str) -> _Towers:
    """SiglipModel: the image tower, and the text tower with its contract from the tokenizer files."""
    image = vision_config(_sub(data, "vision_config", VISION_DEFAULTS))
    tc = _sub(data, "text_config", TEXT_DEFAULTS)
    tok = read_tokenizer_config(src)
    read = [p for p in (src / SPIECE, src / TOKENIZER_CONFIG) if p.is_file()]
    sp_bytes = sentencepiece_bytes(src, legacy=bool(tok["legacy"]))
    positions = int(tc["max_position_embeddings"])
    contract = text_contract(tok, sp_bytes, positions, int(tc["vocab_size"]))
    mask = _masks_padding(tok, contract, text_padding_mask)
    text = text_config(tc, contract["max_len"], contract["pad_id"] if mask else None)
    if text.num_classes != image.encoder.hidden_size:
        raise ConversionError(f"{CONFIG}: text_config.projection_size {text.num_classes} differs from the image "
                              f"embedding width (vision_config.hidden_size {image.encoder.hidden_size})")
    return _Towers(cfg=TwoTowerConfig(image=image, text=text, has_bias=True), image_size=image.image_size,
                   sp_bytes=sp_bytes, mask=mask, extra={"text": contract, "zero_shot_templates": ["{}"]}, read=read,
                   notices=_text_length_notices(tok, contract["max_len"], positions))


def _siglip_vision_model(data: dict[str, Any]) -> _Towers:
    """SiglipVisionModel: the image tower alone, its settings at the top of ``config.json``."""
    cfg = vision_config({**VISION_DEFAULTS, **{k: v for k, v in data.items() if v is not None}}, "config")
    return _Towers(cfg=cfg, image_size=cfg.image_size)


def _load_weights(src: Path, cfg: ModelConfig) -> tuple[torch.nn.Module, list[Path], list[str]]:
    """Our model of ``cfg`` holding the directory's weights, every tensor accounted for; the weight
    files read; notices."""
    tensors, files, notices = read_weights(src)
    vision_prefix = "vision_model." if any(k.startswith("vision_model.") for k in tensors) else ""
    state, more = state_dict_from_hf(tensors, cfg, vision_prefix)
    model = build_model(cfg, device="meta")
    model.load_state_dict(state, assign=True)
    return model, files, notices + more


def _write_tokenizer(out: Path, sp_bytes: bytes | None) -> Path | None:
    """Create the package directory and write the SentencePiece model into it (SiglipModel only)."""
    out.mkdir(parents=True, exist_ok=True)
    if sp_bytes is None:
        return None
    tok_file = out / TOKENIZER_FILE
    tok_file.write_bytes(sp_bytes)
    return tok_file


def _provenance(src: Path, data: dict[str, Any], arch: str, pc_file: Path, read: list[Path], towers: _Towers,
                text_padding_mask: str) -> dict[str, Any]:
    """The package's record of its source: the directory, a digest of every file read, the
    architecture, the processor file and, for two towers, why the padding is (not) masked."""
    provenance: dict[str, Any] = {
        "source": str(src), "format": FORMAT, "sha256": _hf_digest(read, src), "architecture": arch,
        "transformers_version": data.get("transformers_version"),
        "image_processor": pc_file.name,
    }
    if isinstance(towers.cfg, TwoTowerConfig):
        why = "given" if text_padding_mask != "auto" else (
            f"auto: the reference tokenizer {'returns' if towers.mask else 'does not return'} an attention_mask")
        provenance["text_padding_mask"] = f"{'on' if towers.mask else 'off'} ({why})"
    return provenance


def convert_hf_siglip(
    src: str | Path,
    out: str | Path,
    *,
    labels: list[str] | None = None,
    tokenizer: str | Path | None = None,
    head_activation: str | None = None,
    text_pool: str | None = None,
    text_padding_mask: str = "auto",
) -> tuple[Path, list[str]]:
    """Convert a Hugging Face SigLIP directory into a model package.

    Args:
        src: the directory (``config.json``, safetensors weights, tokenizer and processor files).
        out: the package directory to write.
        labels, tokenizer, head_activation: not applicable (an error when given): the tokenizer
            comes from the directory and SigLIP has no classifier head.
        text_pool: only 'last' (SigLIP's pooling) or None.
        text_padding_mask: 'auto' (mask the padding when the reference tokenizer returns an
            ``attention_mask``, as transformers' processor + model do), 'on' or 'off' (attend to the
            padding, as SigLIP was trained in big_vision).

    Returns:
        The package directory and notices.

    Raises:
        ConversionError: an unsupported model or setting, or a missing file; one line naming it.
    """
    src, out = Path(src), Path(out)
    data = read_hf_config(src)
    if data is None:
        raise ConversionError(f"{src}: not a Hugging Face model directory (no {CONFIG} with a model_type)")
    model_type, arch = _architecture(data)
    _check_options(labels=labels, tokenizer=tokenizer, head_activation=head_activation, text_pool=text_pool,
                   text_padding_mask=text_padding_mask)
    pc, pc_file = read_processor_config(src)
    towers = _siglip_model(src, data, text_padding_mask) if model_type == "siglip" else _siglip_vision_model(data)
    preprocess, preprocess_notices = preprocess_config(pc, towers.image_size, pc_file)
    model, weight_files, weight_notices = _load_weights(src, towers.cfg)
    read = [src / CONFIG, pc_file, *towers.read, *weight_files]
    tok_file = _write_tokenizer(out, towers.sp_bytes)
    provenance = _provenance(src, data, arch, pc_file, read, towers, text_padding_mask)
    pkg = save_package(model, towers.cfg, out, tokenizer=tok_file, provenance=provenance, preprocess=preprocess,
                       extra=towers.extra)
    return pkg, towers.notices + preprocess_notices + weight_notices
