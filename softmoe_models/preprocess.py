"""The model's input contract, the single source of truth shared by serving, training and eval.

An RGB (or grayscale-expanded) image is resized to ``image_size`` x ``image_size`` with
``resize``, mapped from uint8 to ``value_range`` as vmoe's ``value_range(-1, 1)`` does
(``lo + (hi - lo) * (u8 / 255)`` in float32), and laid out NCHW.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from PIL import Image

Resize = Literal["bilinear", "bicubic", "nearest", "box", "lanczos", "hamming"]


@dataclass(frozen=True)
class PreprocessConfig:
    """How pixels become the model's ``pixel_values``."""

    image_size: int  # output side, pixels (square)
    resize: Resize = "bilinear"  # Pillow filter used to reach image_size
    value_range: tuple[float, float] = (-1.0, 1.0)  # uint8 0..255 maps linearly onto this
    layout: Literal["NCHW"] = "NCHW"
    channels: Literal["RGB"] = "RGB"
    crop: Literal["none", "center"] = "none"  # 'center': resize the short side, then crop
    # Opt-in: JPEGs at least twice image_size may be decoded at a reduced DCT scale (Pillow draft
    # mode) before the resize: 2-5x faster to decode, but not the pixels of the full-size decode the
    # model was evaluated with (the `decode` section of `make bench` measures the accuracy cost).
    # False (the default): always decode at full size, as timm, open_clip and transformers do.
    jpeg_draft: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PreprocessConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"preprocess: unknown field(s) {unknown}")
        data = dict(data)
        if "value_range" in data:
            data["value_range"] = tuple(float(v) for v in data["value_range"])
        return cls(**data)


def to_pixel_values(rgb_u8: np.ndarray, cfg: PreprocessConfig) -> np.ndarray:
    """``(H, W, 3)`` uint8 at the model's size -> ``(3, H, W)`` float32 in ``value_range``."""
    return np.ascontiguousarray(_affine(rgb_u8, cfg.value_range).transpose(2, 0, 1))


def pixel_table(value_range: tuple[float, float]) -> np.ndarray:
    """The 256 float32 values ``to_pixel_values`` maps uint8 0..255 to, computed by the same code.

    Looking a uint8 pixel up in this table is bitwise the value ``to_pixel_values`` gives it on any
    device: a gather, no floating-point arithmetic (which a device may contract into an FMA or turn
    into a multiplication by the reciprocal). The torch backend's uint8 transfer uses it.
    """
    return _affine(np.arange(256, dtype=np.uint8), value_range)


def _affine(u8: np.ndarray, value_range: tuple[float, float]) -> np.ndarray:
    lo, hi = value_range
    x = u8.astype(np.float32) / np.float32(255.0)
    return np.float32(lo) + np.float32(hi - lo) * x


def resize_image(image: Image.Image, cfg: PreprocessConfig) -> Image.Image:
    """Resize (and optionally centre-crop) an RGB PIL image to the model's square size."""
    resample = {
        "bilinear": Image.Resampling.BILINEAR,
        "bicubic": Image.Resampling.BICUBIC,
        "nearest": Image.Resampling.NEAREST,
        "box": Image.Resampling.BOX,
        "lanczos": Image.Resampling.LANCZOS,
        "hamming": Image.Resampling.HAMMING,
    }[cfg.resize]
    size = cfg.image_size
    if cfg.crop == "center":
        w, h = image.size
        scale = size / min(w, h)
        image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))), resample)
        w, h = image.size
        left, top = (w - size) // 2, (h - size) // 2
        return image.crop((left, top, left + size, top + size))
    if image.size == (size, size):
        return image
    return image.resize((size, size), resample)


def preprocess_image(image: Image.Image, cfg: PreprocessConfig) -> np.ndarray:
    """A decoded PIL image in any mode -> ``(3, S, S)`` float32 pixel values."""
    return to_pixel_values(model_rgb(image, cfg), cfg)


def model_rgb(image: Image.Image, cfg: PreprocessConfig) -> np.ndarray:
    """A decoded PIL image in any mode -> ``(S, S, 3)`` uint8 RGB at the model's size (resized, not
    yet mapped to ``value_range``)."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    return np.asarray(resize_image(image, cfg))
