"""Real image files of several sizes, generated in memory (nothing is read from the repository).

- ``digits``: 8x8 grayscale PNGs of real handwritten digits (scikit-learn's ``load_digits``,
  the held-out samples of the built-in model), made with the same ``digit_png`` the model was
  trained and evaluated with.
- ``WxH`` (``64`` means ``64x64``): scikit-learn's two sample photos (``china.jpg``,
  ``flower.jpg``, 427x640 RGB), centre-cropped to the target aspect ratio, resized (Lanczos) and
  re-encoded as PNG and/or JPEG (quality 90).

Each size and format is one *group*; a request picks a group uniformly, then an image in it, so
an 8x8 PNG is as likely as a 640x480 PNG whatever the group sizes.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

DEFAULT_SIZES = ("digits", "64x64", "224x224", "640x480")
DEFAULT_FORMATS = ("png", "jpeg")
N_DIGITS = 20
MIME = {"png": "image/png", "jpeg": "image/jpeg"}


@dataclass(frozen=True)
class Image:
    group: str  # e.g. "digit-png-8x8", "photo-jpeg-224x224"
    name: str  # file name sent in multipart bodies
    data: bytes
    mime: str
    width: int
    height: int


def parse_size(text: str) -> tuple[int, int]:
    """``"64"`` -> (64, 64); ``"640x480"`` -> (640, 480) as (width, height)."""
    text = text.strip().lower()
    w, _, h = text.partition("x")
    width, height = int(w), int(h or w)
    if not (1 <= width <= 8192 and 1 <= height <= 8192):
        raise ValueError(f"image size out of range: {text!r}")
    return width, height


def _encode(img, fmt: str) -> bytes:
    buf = io.BytesIO()
    if fmt == "jpeg":
        img.save(buf, "JPEG", quality=90)
    else:
        img.save(buf, "PNG")
    return buf.getvalue()


def _fit(img, width: int, height: int):
    """Centre-crop ``img`` to the aspect ratio width:height, then resize (Lanczos)."""
    from PIL import Image as PILImage

    w, h = img.size
    target = width / height
    if w / h > target:  # too wide
        cw = max(1, round(h * target))
        box = ((w - cw) // 2, 0, (w - cw) // 2 + cw, h)
    else:
        ch = max(1, round(w / target))
        box = (0, (h - ch) // 2, w, (h - ch) // 2 + ch)
    return img.crop(box).resize((width, height), PILImage.Resampling.LANCZOS)


def digit_images(n: int = N_DIGITS) -> list[Image]:
    from sklearn.datasets import load_digits

    from softmoe_models.demo.data import digit_png

    digits = load_digits()
    held_out = [i for i in range(len(digits.target)) if i % 5 == 0][:n]
    return [Image("digit-png-8x8", f"digit{i}-{digits.target[i]}.png", digit_png(digits.data[i]), "image/png", 8, 8)
            for i in held_out]


def photo_images(width: int, height: int, fmt: str) -> list[Image]:
    from PIL import Image as PILImage
    from sklearn.datasets import load_sample_images

    photos = load_sample_images()
    out = []
    for name, arr in zip(photos.filenames, photos.images):
        stem = name.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        img = _fit(PILImage.fromarray(np.asarray(arr, dtype=np.uint8), "RGB"), width, height)
        ext = "jpg" if fmt == "jpeg" else "png"
        out.append(Image(f"photo-{fmt}-{width}x{height}", f"{stem}-{width}x{height}.{ext}", _encode(img, fmt),
                         MIME[fmt], width, height))
    return out


@lru_cache(maxsize=8)
def build_corpus(sizes: tuple[str, ...] = DEFAULT_SIZES, formats: tuple[str, ...] = DEFAULT_FORMATS) -> dict[str, list[Image]]:
    """Group name -> images. ``sizes``: ``digits`` and/or ``WxH``; ``formats``: png, jpeg (photos)."""
    bad = [f for f in formats if f not in MIME]
    if bad:
        raise ValueError(f"unknown image format(s) {bad}; use png, jpeg")
    corpus: dict[str, list[Image]] = {}
    for size in sizes:
        if size.strip().lower() == "digits":
            corpus["digit-png-8x8"] = digit_images()
            continue
        width, height = parse_size(size)
        for fmt in formats:
            images = photo_images(width, height, fmt)
            corpus[images[0].group] = images
    if not corpus:
        raise ValueError("no images: give at least one size")
    return corpus


def describe(corpus: dict[str, list[Image]]) -> list[dict]:
    """One row per group: count and mean encoded size (for the report)."""
    return [{"group": g, "images": len(v), "mean_bytes": round(sum(len(i.data) for i in v) / len(v))}
            for g, v in corpus.items()]


def pixel_values(image: Image, height: int, width: int, value_range: tuple[float, float] = (-1.0, 1.0)) -> np.ndarray:
    """Client-side preprocessing for the OIP tensor endpoint: RGB, bilinear resize, CHW float32."""
    return _pixels(image.data, height, width, value_range)


@lru_cache(maxsize=512)
def _pixels(data: bytes, height: int, width: int, value_range: tuple[float, float]) -> np.ndarray:
    from PIL import Image as PILImage

    img = PILImage.open(io.BytesIO(data)).convert("RGB").resize((width, height), PILImage.Resampling.BILINEAR)
    lo, hi = value_range
    arr = np.asarray(img, dtype=np.float32) / 255.0 * (hi - lo) + lo
    arr = np.ascontiguousarray(arr.transpose(2, 0, 1))
    arr.setflags(write=False)
    return arr
