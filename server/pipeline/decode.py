"""Bytes -> RGB PIL image, defensively: a format allowlist checked from the magic bytes before any
decoder runs, the pixel count checked from the header before decoding, JPEG draft mode when
downscaling, EXIF orientation applied, first frame only, every mode converted to RGB the same way
(alpha composited on white, 16-bit scaled to 8-bit).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from ..errors import BadRequest, PayloadTooLarge, Unprocessable, UnsupportedMediaType

ALLOWED = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
BACKGROUND = (255, 255, 255)  # alpha is composited on white
MIN_SIDE = 1

ImageFile.LOAD_TRUNCATED_IMAGES = False

# Formats we recognise only to refuse them with 415 (their decoders never run).
_REFUSED = (
    (b"8BPS", "PSD"), (b"%PDF", "PDF"), (b"%!PS", "EPS"), (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO"), (b"icns", "ICNS"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG2000"), (b"\xff\x4f\xff\x51", "JPEG2000"), (b"gimp xcf", "XCF"),
    (b"DDS ", "DDS"), (b"\x59\xa6\x6a\x95", "SUN"), (b"FORM", "IFF"),
)


def sniff(data: bytes) -> str:
    """The image format from the magic bytes; 415 for known non-allowed formats, 400 otherwise."""
    if not data:
        raise BadRequest("empty image")
    head = data[:32]
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:2] == b"BM":
        return "BMP"
    for magic, name in _REFUSED:
        if head.startswith(magic):
            raise UnsupportedMediaType(f"{name} images are not accepted; send one of {', '.join(ALLOWED)}")
    text = head.lstrip().lower()
    if text.startswith((b"<svg", b"<?xml", b"<!doctype svg")):
        raise UnsupportedMediaType(f"SVG images are not accepted; send one of {', '.join(ALLOWED)}")
    raise BadRequest(f"not a recognised image (expected one of {', '.join(ALLOWED)})")


def decode(data: bytes, target_size: int | None = None, max_pixels: int = 40_000_000) -> Image.Image:
    """Decode one image to RGB.

    Args:
        data: the encoded file.
        target_size: the model's input side; JPEGs are decoded at a reduced scale (draft mode)
            when that still leaves at least this many pixels per side.
        max_pixels: width x height above which the image is refused (413) before decoding.
    """
    fmt = sniff(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=[fmt])
            w, h = im.size
            if w * h > max_pixels:
                raise PayloadTooLarge(f"image is {w}x{h} = {w * h} pixels; the limit is {max_pixels}")
            if w < MIN_SIDE or h < MIN_SIDE:
                raise Unprocessable(f"image is {w}x{h}; it must be at least {MIN_SIDE}x{MIN_SIDE}")
            # Animated GIF/WebP: Image.open stands on the first frame and load() decodes only it;
            # n_frames is never asked for (it would walk every frame).
            if fmt == "JPEG" and target_size:
                im.draft("RGB", (target_size, target_size))
            im.load()
            im = ImageOps.exif_transpose(im)
            return to_rgb(im)
    except (PayloadTooLarge, Unprocessable):
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise PayloadTooLarge(f"image exceeds the decoder's pixel limit ({e})") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError) as e:
        reason = "truncated" if "truncated" in str(e).lower() else "corrupt or unreadable"
        raise BadRequest(f"{fmt} image is {reason}") from None


def to_rgb(im: Image.Image) -> Image.Image:
    """Any Pillow mode -> RGB, deterministically."""
    if im.mode == "RGB":
        return im
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        arr = np.asarray(im, dtype=np.int64)
        scale = 257 if arr.max(initial=0) > 255 or im.mode.startswith("I;16") else 1
        return Image.fromarray(np.clip(arr // scale, 0, 255).astype(np.uint8), "L").convert("RGB")
    if im.mode == "F":
        return Image.fromarray(np.clip(np.asarray(im), 0, 255).astype(np.uint8), "L").convert("RGB")
    if im.mode == "P":
        im = im.convert("RGBA") if "transparency" in im.info else im.convert("RGB")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return im.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV
