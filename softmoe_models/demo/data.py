"""The demo data: scikit-learn's bundled handwritten digits (1,797 real 8x8 images, 10 classes).

Each digit (values 0..16) becomes an 8-bit grayscale PNG with ``pixel = round(v * 255 / 16)``;
training and evaluation decode that PNG to RGB as the server's decoder does (an 8-bit grayscale PNG
with one frame and no EXIF: Pillow's decode, then L -> RGB) and preprocess it with the package's
preprocessing contract, so what is evaluated is exactly what is served. The demo decodes with Pillow
itself, not through the server (imports flow server -> export -> softmoe_models);
tests/test_demo.py checks every digit is bitwise the same through the server's ``decode``.

Held out, never trained on: samples whose index in ``load_digits()`` satisfies ``index % 5 == 0``,
and the caption templates in ``HELDOUT_TEMPLATES`` (zero-shot on unseen wording).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..preprocess import PreprocessConfig, preprocess_image

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
LABELS = [str(i) for i in range(10)]  # sklearn's target_names
PREPROCESS = PreprocessConfig(image_size=8, resize="bilinear", value_range=(-1.0, 1.0))

# {w}: the digit as a word, {n}: as a numeral.
TRAIN_TEMPLATES = [
    "a handwritten digit {w}", "the digit {w}", "the number {w}", "the number {n}", "a photo of the digit {w}",
    "a drawing of the number {w}", "handwritten {w}", "number {w}", "{w}", "digit {n}", "a scan of a handwritten {w}",
    "a blurry handwritten {w}", "a small image of the digit {n}", "someone wrote the number {w}", "{n}",
    "a handwritten {n}", "an image of a {w}",
]
HELDOUT_TEMPLATES = ["a picture of a handwritten {w}", "the handwritten number {n}", "a photo of a {w}"]
# What `/v1/zero-shot` uses for this model when the request names no templates ({} = the label).
SERVING_TEMPLATES = ["a handwritten digit {}", "the digit {}", "the number {}", "{}"]


def caption(template: str, digit: int) -> str:
    return template.format(w=WORDS[digit], n=str(digit))


def digit_png(values: np.ndarray) -> bytes:
    """8x8 values 0..16 -> 8-bit grayscale PNG bytes."""
    u8 = np.round(values.reshape(8, 8).astype(np.float64) * 255 / 16).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(u8, "L").save(buf, "PNG")
    return buf.getvalue()


def decode_png(data: bytes) -> Image.Image:
    """PNG bytes of ``digit_png`` -> RGB image, the pixels the server's decoder gives for them.

    Only for the demo's own PNGs: the server's decoder adds what untrusted input needs (format
    allowlist, pixel limits, deadlines, EXIF orientation, every mode to RGB), none of which changes
    an 8-bit grayscale PNG of one frame without EXIF.
    """
    with Image.open(io.BytesIO(data), formats=["PNG"]) as im:
        return im.convert("RGB")


def pixels_from_png(data: bytes, cfg: PreprocessConfig = PREPROCESS) -> np.ndarray:
    """The served path: the PNG decoded as the server decodes it, then the package's preprocessing."""
    return preprocess_image(decode_png(data), cfg)


@dataclass
class Split:
    pixels: np.ndarray  # (N, 3, 8, 8) float32
    targets: np.ndarray  # (N,) int64
    indices: np.ndarray  # positions in load_digits()
    pngs: list[bytes]


def load_splits() -> tuple[Split, Split]:
    """(train, held-out) through PNG -> decode -> preprocess."""
    # heavy: scikit-learn only where the digits are read (training, calibration, the bench corpus)
    from sklearn.datasets import load_digits

    digits = load_digits()
    pngs = [digit_png(v) for v in digits.data]
    pixels = np.stack([pixels_from_png(p) for p in pngs]).astype(np.float32)
    targets = digits.target.astype(np.int64)
    idx = np.arange(len(targets))
    held = idx % 5 == 0

    def split(mask: np.ndarray) -> Split:
        return Split(pixels[mask], targets[mask], idx[mask], [p for p, m in zip(pngs, mask) if m])

    return split(~held), split(held)
