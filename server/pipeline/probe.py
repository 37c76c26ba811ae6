"""Image sizes read from the raw header bytes before any decoder runs, and a request's pixel budget.

``probe`` reads what each allowed format declares with plain byte arithmetic (no Pillow decoder, no
decompression): the JPEG frame header, the PNG IHDR and APNG frame controls, the GIF logical screen and
image descriptors, the WebP VP8/VP8L/VP8X headers and ANMF frames, the BMP info header.

RLE-compressed BMPs are refused (415): Pillow decodes them pixel by pixel in Python, so their CPU cost is
not bounded by their pixel count the way every other decoder's is.

``ImageInfo.cost_pixels`` is what the first frame really costs the decoder: the size of the image Pillow
allocates. A GIF frame larger than or offset outside its logical screen grows Pillow's canvas, so it counts
at its extent; a JPEG decoded in draft mode counts at the scale ``Image.draft`` picks (1/2, 1/4, 1/8),
unless it is progressive, multi-scan or lossless, where libjpeg buffers every coefficient of the full-size
image whatever the output scale.

Walks are bounded. The part of a file that Pillow parses in Python while opening and loading the first
frame (JPEG segments and junk bytes before the scan, PNG chunks, GIF blocks before the first image) must
fit in ``MAX_STEPS`` steps, or the image is refused (422) before Pillow walks it. The rest of a file is
walked only to count frames, and that walk stops quietly at the same bound.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from PIL import Image

from server.errors import BadRequest, PayloadTooLarge, Unprocessable, UnsupportedMediaType

ALLOWED = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
MAX_STEPS = 4096  # segments, chunks or blocks walked in one file (a 16 MiB PNG of 8 KiB IDAT chunks: 2048)
MAX_JUNK = 65536  # JPEG bytes outside any segment that Pillow would skip one at a time

# Formats we recognise only to refuse them with 415 (their decoders never run).
_REFUSED = (
    (b"8BPS", "PSD"), (b"%PDF", "PDF"), (b"%!PS", "EPS"), (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO"), (b"icns", "ICNS"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG2000"), (b"\xff\x4f\xff\x51", "JPEG2000"), (b"gimp xcf", "XCF"),
    (b"DDS ", "DDS"), (b"\x59\xa6\x6a\x95", "SUN"), (b"FORM", "IFF"),
)

_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_SOF_FULL_BUFFER = {0xC2, 0xC3, 0xC6, 0xC7, 0xCA, 0xCB, 0xCE, 0xCF}  # progressive or lossless
_NO_LENGTH = {0x01, *range(0xD0, 0xD9)}  # TEM, RST0-7, SOI: markers without a segment
_INT31 = 2**31 - 1


@dataclass(frozen=True)
class ImageInfo:
    """What an image header declares, and what decoding its first frame costs."""

    format: str  # one of ALLOWED
    width: int  # the size Pillow's Image.open reports (GIF: the logical screen grown to hold the first frame)
    height: int
    cost_pixels: int  # pixels the decoder allocates for the first frame (JPEG: at the draft scale)
    frames: int = 1  # frames the bounded walk found (a lower bound when the walk stopped at MAX_STEPS)
    scale: int = 1  # JPEG DCT scaling denominator draft mode will use (1, 2, 4 or 8); 1 for other formats
    draft_size: int | None = None  # the target side JPEG draft mode was assumed for; None: full size

    @property
    def decoded_size(self) -> tuple[int, int]:
        """The size Pillow decodes to (the JPEG draft size, else the opened size)."""
        s = self.scale
        return (self.width + s - 1) // s, (self.height + s - 1) // s


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


def probe(data: bytes, *, target_size: int | None = None, draft: bool = False) -> ImageInfo:
    """Read an image's size and first-frame cost from its header bytes alone.

    Args:
        data: the encoded file.
        target_size: the model's input side; with ``draft``, a JPEG's cost is counted at the reduced
            scale Pillow's draft mode will decode it at (as ``decode`` does).
        draft: whether JPEG draft mode will be used when ``target_size`` is given.

    Raises:
        BadRequest: a truncated or corrupt header (400).
        UnsupportedMediaType: a recognised format outside the allowlist, or an RLE-compressed BMP (415).
        Unprocessable: a header walk longer than ``MAX_STEPS`` steps (422).
    """
    fmt = sniff(data)
    if fmt == "JPEG":
        return _jpeg(data, target_size if draft and target_size else None)
    return {"PNG": _png, "GIF": _gif, "WEBP": _webp, "BMP": _bmp}[fmt](data)


def describe(info: ImageInfo) -> str:
    """``"6000x6000 = 36000000 pixels"``, with the draft scale when one applies."""
    w, h = info.width, info.height
    if info.cost_pixels == w * h:
        return f"{w}x{h} = {w * h} pixels"
    dw, dh = info.decoded_size
    return f"{w}x{h}, decoded at 1/{info.scale} scale to {dw}x{dh} = {info.cost_pixels} pixels"


def check_pixels(info: ImageInfo, max_pixels: int, *, name: str = "image", param: str | None = None,
                 setting: str | None = None) -> None:
    """Refuse one image (413) whose first frame costs more than ``max_pixels``, or whose opened size is
    above Pillow's own ceiling (``Image.MAX_IMAGE_PIXELS``, so that Pillow never warns, from any thread).

    Args:
        info: the probed image.
        max_pixels: the most pixels the image may decode to.
        name: how the message names the image.
        param: the request field the error points at.
        setting: the setting named in the message after the limit.
    """
    if info.cost_pixels > max_pixels:
        named = f" ({setting})" if setting else ""
        raise PayloadTooLarge(f"{name} is {describe(info)}; the limit is {max_pixels}{named}", param=param)
    ceiling = Image.MAX_IMAGE_PIXELS
    opened = max(1, info.width) * max(1, info.height)
    if ceiling is not None and opened > ceiling:
        raise PayloadTooLarge(f"{name} is {info.width}x{info.height} = {opened} pixels; the decoder's limit is "
                              f"{ceiling} (PIL.Image.MAX_IMAGE_PIXELS)", param=param)


def budget(infos: list[ImageInfo], max_image_pixels: int, max_request_pixels: int, *, param: str = "images") -> int:
    """Check a request's images against the per-image and per-request pixel limits, before decoding.

    Args:
        infos: the probed images, in request order.
        max_image_pixels: the most pixels one image may decode to.
        max_request_pixels: the most pixels all images together may decode to.
        param: the request field holding the images (errors point at ``param[i]``).

    Returns:
        The pixels the request's images decode to.

    Raises:
        PayloadTooLarge: naming the first image over its limit, or the request's total (413).
    """
    total = 0
    for i, info in enumerate(infos):
        check_pixels(info, max_image_pixels, name=f"{param}[{i}]", param=f"{param}[{i}]", setting="max_image_pixels")
        total += info.cost_pixels
    if total > max_request_pixels:
        raise PayloadTooLarge(f"the request's images decode to {total} pixels; the limit is {max_request_pixels} "
                              "(max_request_pixels)", param=param)
    return total


# ---------------------------------------------------------------------------------------------- helpers


def _truncated(fmt: str, what: str) -> BadRequest:
    return BadRequest(f"{fmt} image is truncated ({what})")


def _corrupt(fmt: str, what: str) -> BadRequest:
    return BadRequest(f"{fmt} image is corrupt ({what})")


def _too_long(fmt: str, what: str) -> Unprocessable:
    return Unprocessable(f"{fmt} image has more than {MAX_STEPS} {what}; it is refused before decoding")


def _need(data: bytes, end: int, fmt: str, what: str) -> None:
    if len(data) < end:
        raise _truncated(fmt, f"the file ends inside {what}")


# ---------------------------------------------------------------------------------------------- JPEG


def _jpeg_scale(width: int, height: int, target: int | None) -> int:
    """The DCT scale denominator ``JpegImageFile.draft`` picks for a ``target`` x ``target`` request."""
    if not target:
        return 1
    ratio = min(width // target, height // target)
    return next((s for s in (8, 4, 2) if ratio >= s), 1)


def _jpeg(data: bytes, draft_size: int | None) -> ImageInfo:
    pos, steps, junk, sof = 2, 0, 0, None
    n = len(data)
    while True:
        if pos >= n:
            raise _truncated("JPEG", "no scan before the end of the file")
        if data[pos] != 0xFF or pos + 1 < n and data[pos + 1] == 0xFF:  # junk or fill bytes, skipped one by one
            nxt = data.find(b"\xff", pos + 1)
            nxt = n if nxt < 0 else nxt
            junk += nxt - pos
            if junk > MAX_JUNK:
                raise Unprocessable(f"JPEG image has more than {MAX_JUNK} bytes outside its segments; "
                                    "it is refused before decoding")
            pos = nxt
            continue
        _need(data, pos + 2, "JPEG", "a marker")
        marker = data[pos + 1]
        steps += 1
        if steps > MAX_STEPS:
            raise _too_long("JPEG", "segments before its scan")
        if marker in _NO_LENGTH or marker == 0x00:
            pos += 2
            continue
        if marker == 0xD9:
            raise _corrupt("JPEG", "the image ends before its scan")
        _need(data, pos + 4, "JPEG", "a segment header")
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if length < 2:
            raise _corrupt("JPEG", f"a segment of length {length}")
        if marker in _SOF:
            if sof is not None:
                raise _corrupt("JPEG", "more than one frame header")
            _need(data, pos + 10, "JPEG", "the frame header")
            if length < 8:
                raise _corrupt("JPEG", f"a frame header of length {length}")
            height, width = struct.unpack_from(">HH", data, pos + 5)
            sof = marker, width, height, data[pos + 9]
        elif marker == 0xDA:
            if sof is None:
                raise _corrupt("JPEG", "a scan before any frame header")
            _need(data, pos + 5, "JPEG", "the scan header")
            kind, width, height, components = sof
            scale = _jpeg_scale(width, height, draft_size)
            full = kind in _SOF_FULL_BUFFER or data[pos + 4] < components  # coefficients buffered at full size
            out = ((width + scale - 1) // scale) * ((height + scale - 1) // scale)
            return ImageInfo("JPEG", width, height, width * height if full else out, scale=scale,
                             draft_size=draft_size)
        pos += 2 + length


# ---------------------------------------------------------------------------------------------- PNG


def _png(data: bytes) -> ImageInfo:
    _need(data, 33, "PNG", "the IHDR chunk")
    length, kind, width, height = struct.unpack_from(">I4sII", data, 8)
    if kind != b"IHDR" or length != 13:
        raise _corrupt("PNG", "the first chunk is not a 13-byte IHDR")
    if width > _INT31 or height > _INT31:
        raise _corrupt("PNG", f"IHDR declares {width}x{height}")
    pos, steps, frames = 33, 1, 0
    animated = seen_idat = False
    strict = True  # still inside what Pillow walks for the first frame
    while True:
        steps += 1
        if steps > MAX_STEPS:
            if strict:
                raise _too_long("PNG", "chunks")
            break
        if pos + 8 > len(data):
            if not seen_idat:
                raise _truncated("PNG", "no image data before the end of the file")
            break
        length, kind = struct.unpack_from(">I4s", data, pos)
        if length > _INT31:
            if strict:
                raise _corrupt("PNG", f"a {kind!r} chunk of length {length}")
            break
        if kind == b"IEND":
            break
        if kind == b"acTL" and not seen_idat and length >= 8 and pos + 16 <= len(data):
            animated = 0 < struct.unpack_from(">I", data, pos + 8)[0] <= 2**31
        elif kind == b"fcTL":
            if length < 26 or pos + 8 + 20 > len(data):
                if strict:
                    raise _truncated("PNG", "an APNG frame control chunk")
                break
            fw, fh, fx, fy = struct.unpack_from(">IIII", data, pos + 12)
            if fw == 0 or fh == 0 or fx + fw > width or fy + fh > height:
                raise _corrupt("PNG", f"APNG frame {frames} is {fw}x{fh} at ({fx},{fy}), "
                                      f"outside the {width}x{height} canvas")
            frames += 1
            if seen_idat and animated:
                strict = False  # Pillow's first frame ends at the next frame control
        elif kind == b"IDAT":
            seen_idat = True
        pos += 12 + length
    return ImageInfo("PNG", width, height, width * height, frames=max(frames, 1) if animated else 1)


# ---------------------------------------------------------------------------------------------- GIF


def _gif(data: bytes) -> ImageInfo:
    _need(data, 13, "GIF", "the logical screen descriptor")
    screen_w, screen_h, flags = struct.unpack_from("<HHB", data, 6)
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    steps, frames, first = 0, 0, None
    n = len(data)
    while steps < MAX_STEPS:
        if pos >= n or data[pos] == 0x3B:  # end of file or trailer
            if first is None:
                raise _truncated("GIF", "no image before the end of the file") if pos >= n else \
                    _corrupt("GIF", "no image before the trailer")
            break
        block = data[pos]
        steps += 1
        if block == 0x21:  # extension: label, then data sub-blocks
            pos += 2
        elif block == 0x2C:  # image descriptor, optional local colour table, LZW code size, data sub-blocks
            if first is None:
                _need(data, pos + 10, "GIF", "the first image descriptor")
            elif pos + 10 > n:
                break
            x, y, w, h, local = struct.unpack_from("<HHHHB", data, pos + 1)
            end = pos + 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0) + 1  # past the LZW code size
            frames += 1
            if first is None:
                _need(data, end, "GIF", "the first image descriptor")
                if w == 0 or h == 0:
                    raise _corrupt("GIF", f"the first frame is {w}x{h}")
                first = x, y, w, h
            pos = end
        else:  # a stray byte: Pillow skips it
            pos += 1
            continue
        while steps < MAX_STEPS and pos < n and data[pos]:  # data sub-blocks, skipped undecoded
            pos += data[pos] + 1
            steps += 1
        pos += 1
    if first is None:
        raise _too_long("GIF", "blocks before its first image")
    x, y, w, h = first
    width, height = max(screen_w, x + w), max(screen_h, y + h)
    return ImageInfo("GIF", width, height, width * height, frames=frames)


# ---------------------------------------------------------------------------------------------- WebP


def _webp_bitstream(kind: bytes, data: bytes, pos: int, size: int) -> tuple[int, int]:
    """Width and height of a VP8 (lossy) or VP8L (lossless) bitstream starting at ``pos``."""
    if kind == b"VP8 ":
        _need(data, pos + 10, "WEBP", "the VP8 frame header")
        if size < 10 or data[pos] & 1 or data[pos + 3:pos + 6] != b"\x9d\x01\x2a":
            raise _corrupt("WEBP", "the VP8 bitstream does not start with a key frame")
        w, h = struct.unpack_from("<HH", data, pos + 6)
        return w & 0x3FFF, h & 0x3FFF
    _need(data, pos + 5, "WEBP", "the VP8L header")
    bits = int.from_bytes(data[pos + 1:pos + 5], "little")
    if size < 5 or data[pos] != 0x2F or bits >> 29:
        raise _corrupt("WEBP", "the VP8L bitstream has a bad signature or version")
    return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1


def _webp(data: bytes) -> ImageInfo:
    _need(data, 20, "WEBP", "the first chunk header")
    kind, size = data[12:16], int.from_bytes(data[16:20], "little")
    if kind in (b"VP8 ", b"VP8L"):
        w, h = _webp_bitstream(kind, data, 20, size)
        return ImageInfo("WEBP", w, h, w * h)
    if kind != b"VP8X":
        raise _corrupt("WEBP", f"unknown first chunk {kind!r}")
    _need(data, 30, "WEBP", "the VP8X header")
    animated = bool(data[20] & 0x02)
    width = int.from_bytes(data[24:27], "little") + 1
    height = int.from_bytes(data[27:30], "little") + 1
    pos, steps, frames = 20 + size + (size & 1), 0, 0
    while steps < MAX_STEPS and pos + 8 <= len(data):
        steps += 1
        kind, size = data[pos:pos + 4], int.from_bytes(data[pos + 4:pos + 8], "little")
        body = pos + 8
        if not animated and kind in (b"VP8 ", b"VP8L"):
            if _webp_bitstream(kind, data, body, size) != (width, height):
                raise _corrupt("WEBP", f"the image inside does not fill the {width}x{height} canvas")
            return ImageInfo("WEBP", width, height, width * height)
        if animated and kind == b"ANMF":
            if frames == 0:
                _need(data, body + 16, "WEBP", "the first animation frame header")
            elif body + 16 > len(data):
                break
            x = 2 * int.from_bytes(data[body:body + 3], "little")
            y = 2 * int.from_bytes(data[body + 3:body + 6], "little")
            w = int.from_bytes(data[body + 6:body + 9], "little") + 1
            h = int.from_bytes(data[body + 9:body + 12], "little") + 1
            if x + w > width or y + h > height:
                raise _corrupt("WEBP", f"animation frame {frames} is {w}x{h} at ({x},{y}), "
                                       f"outside the {width}x{height} canvas")
            frames += 1
        pos = body + size + (size & 1)
    if animated and frames:
        return ImageInfo("WEBP", width, height, width * height, frames=frames)
    if steps >= MAX_STEPS:
        raise _too_long("WEBP", "chunks before its image")
    raise _truncated("WEBP", "no image data before the end of the file")


# ---------------------------------------------------------------------------------------------- BMP


def _bmp(data: bytes) -> ImageInfo:
    _need(data, 18, "BMP", "the file header")
    header = int.from_bytes(data[14:18], "little")
    if header == 12:  # BITMAPCOREHEADER: unsigned 16-bit sides, always bottom-up
        _need(data, 26, "BMP", "the core header")
        width, height = struct.unpack_from("<HH", data, 18)
    elif header in (40, 52, 56, 64, 108, 124):  # BITMAPINFOHEADER and its successors: signed 32-bit sides
        _need(data, 14 + header, "BMP", "the info header")
        width, height = struct.unpack_from("<ii", data, 18)
        if int.from_bytes(data[30:34], "little") in (1, 2):
            raise UnsupportedMediaType("RLE-compressed BMP images are not accepted (Pillow decodes them in Python, "
                                       "up to 0.7 CPU-seconds per megapixel); send an uncompressed BMP or a PNG")
        if width < 0:
            raise _corrupt("BMP", f"negative width {width}")
        if height < 0:  # top-down rows; Pillow reads only heights whose top byte is 0xFF as negative
            if height < -(1 << 24):
                raise _corrupt("BMP", f"height {height}")
            height = -height
    else:
        raise _corrupt("BMP", f"unknown info header size {header}")
    return ImageInfo("BMP", width, height, width * height)
