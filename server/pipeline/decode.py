"""Bytes -> RGB PIL image, defensively: a format allowlist checked from the magic bytes before any
decoder runs, the pixel cost read from the header (``probe``) and checked before Pillow decodes, JPEG
draft mode when downscaling, a deadline checked between the chunks fed to the decoder, EXIF orientation
applied, first frame only, every mode converted to RGB the same way (alpha composited on white, 16-bit
scaled to 8-bit).

Thread-safe: decoding runs in a thread pool, so nothing here touches the process-wide ``warnings``
filters. Pillow's own pixel ceiling (``Image.MAX_IMAGE_PIXELS``) is left as it is; ``check_pixels``
refuses anything above it first, so its warning never fires, and its ``DecompressionBombError`` stays as a
backstop mapped to 413.

The deadline bounds the decode itself: Pillow's decoders pull their input through ``read()`` of the file
object, ``CHUNK_BYTES`` at a time, and the file object given to Pillow checks the deadline before every
read. WebP is the exception: libwebp decodes the first frame in one call, so its deadline is checked only
before and after it.
"""

from __future__ import annotations

import io
import time
from typing import Callable

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from server.errors import BadRequest, DeadlineExceeded, PayloadTooLarge, ServiceError, Unprocessable
from server.pipeline.probe import ALLOWED, ImageInfo, check_pixels, probe, sniff

__all__ = ["ALLOWED", "BACKGROUND", "CHUNK_BYTES", "MIN_SIDE", "decode", "sniff", "to_rgb"]

BACKGROUND = (255, 255, 255)  # alpha is composited on white
MIN_SIDE = 1
CHUNK_BYTES = 16384  # encoded bytes fed to a decoder between two deadline checks (Pillow's default: 65536)

ImageFile.LOAD_TRUNCATED_IMAGES = False

_now = time.perf_counter  # the deadline's clock


class _DeadlineFile(io.BytesIO):
    """The encoded bytes as the file Pillow reads, refusing every read once the deadline has passed."""

    def __init__(self, data: bytes, deadline: float | None) -> None:
        super().__init__(data)
        self.deadline = deadline

    def read(self, size: int | None = -1, /) -> bytes:
        _check_deadline(self.deadline, "while the image was decoding")
        return super().read(size)


def _check_deadline(deadline: float | None, when: str) -> None:
    if deadline is not None and _now() > deadline:
        raise DeadlineExceeded(f"the request's deadline passed {when}")


def decode(data: bytes, target_size: int | None = None, max_pixels: int = 16_777_216, *,
           deadline: float | None = None, draft: bool = False, info: ImageInfo | None = None,
           jpeg_decoder: Callable[[bytes], Image.Image] | None = None,
           on_fallback: Callable[[], object] | None = None) -> Image.Image:
    """Decode one image to RGB.

    Args:
        data: the encoded file.
        target_size: the model's input side; with ``draft``, JPEGs are decoded at a reduced scale (draft
            mode) when that still leaves at least this many pixels per side.
        max_pixels: the most pixels the first frame may decode to (``ImageInfo.cost_pixels``); above it
            the image is refused (413) before decoding.
        deadline: a ``time.perf_counter()`` value; past it, decoding does not start, or stops at the next
            chunk (504).
        draft: whether JPEG draft mode may be used.
        info: the image's ``probe`` result, if the caller has it already; probed again when it was taken
            for another draft size.
        jpeg_decoder: decodes a JPEG (not in draft mode) instead of Pillow, after every check above
            (``--decode-device cuda``); a JPEG it raises on goes through Pillow, and ``on_fallback``
            is called.

    Raises:
        BadRequest: corrupt or truncated data, or a header that disagrees with what Pillow reads (400).
        PayloadTooLarge: more pixels than ``max_pixels`` or Pillow's ceiling (413).
        UnsupportedMediaType: a format outside the allowlist (415).
        Unprocessable: an image smaller than ``MIN_SIDE`` or a header too long to walk (422).
        DeadlineExceeded: the deadline passed before or during decoding (504).
    """
    _check_deadline(deadline, "before the image was decoded")
    fmt = sniff(data)
    wanted = target_size if fmt == "JPEG" and draft and target_size else None
    if info is None or info.format != fmt or info.draft_size != wanted:
        info = probe(data, target_size=target_size, draft=draft)
    if info.width < MIN_SIDE or info.height < MIN_SIDE:
        raise Unprocessable(f"image is {info.width}x{info.height}; it must be at least {MIN_SIDE}x{MIN_SIDE}")
    check_pixels(info, max_pixels)
    if jpeg_decoder is not None and fmt == "JPEG" and not info.draft_size:
        try:
            im = jpeg_decoder(data)
        except Exception:
            if on_fallback is not None:
                on_fallback()
        else:
            if im.size != (info.width, info.height) and im.size != (info.height, info.width):  # EXIF may rotate
                raise BadRequest(f"JPEG image is corrupt (its header declares {info.width}x{info.height}, "
                                 f"the decoder reads {im.size[0]}x{im.size[1]})")
            _check_deadline(deadline, "while the image was decoding")
            return im
    try:
        im = Image.open(_DeadlineFile(data, deadline), formats=[fmt])
        if im.size != (info.width, info.height):
            raise BadRequest(f"{fmt} image is corrupt (its header declares {info.width}x{info.height}, "
                             f"the decoder reads {im.size[0]}x{im.size[1]})")
        # Animated GIF/WebP/APNG: Image.open stands on the first frame and load() decodes only it;
        # n_frames is never asked for (it would walk every frame).
        if info.draft_size:
            im.draft("RGB", (info.draft_size, info.draft_size))
            if im.size != info.decoded_size:
                raise BadRequest(f"{fmt} image is corrupt (draft mode reads {im.size[0]}x{im.size[1]}, "
                                 f"not {info.decoded_size[0]}x{info.decoded_size[1]})")
        im.decodermaxblock = CHUNK_BYTES
        im.load()
        _check_deadline(deadline, "while the image was decoding")
        # In place: the default returns a copy even when there is nothing to turn, and that fresh
        # allocation cost 0.65 ms per 640x480 image, a third of its decode.
        ImageOps.exif_transpose(im, in_place=True)
        return to_rgb(im)
    except ServiceError:
        raise
    except Image.DecompressionBombError as e:
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
