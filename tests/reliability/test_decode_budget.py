"""The decode budget: image sizes read from the header bytes (``probe``) agree with Pillow, over-limit
and hostile images are refused before any decoder runs, decoding is thread-safe and bounded by the
request's deadline, and the chunked decode gives the same pixels as plain Pillow.

No test asserts on time. ``DECODE_BENCH=1`` turns on a report (``-s``) of the CPU-seconds one megapixel
costs to decode, per format, on the machine running it."""

from __future__ import annotations

import dataclasses
import io
import os
import random
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image, ImageFile, ImageOps

from server.errors import (BadRequest, DeadlineExceeded, PayloadTooLarge, ServiceError, Unprocessable,
                           UnsupportedMediaType)
from server.pipeline import decode as decode_mod
from server.pipeline.decode import decode, to_rgb
from server.pipeline.probe import MAX_STEPS, ImageInfo, budget, probe

LIMIT = 16_777_216  # the default max_image_pixels
REQUEST_LIMIT = 33_554_432  # the default max_request_pixels


# ---------------------------------------------------------------------------------------------- builders


def _enc(im: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise: compresses like a photo, not like a flat colour."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1)
    return Image.fromarray(np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8))


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_bomb(width: int, height: int) -> bytes:
    """A real, valid PNG of one flat colour: ~100 KB declaring 6000x6000 (36 MP, ~1 s to decode)."""
    z = zlib.compressobj(9)
    row = b"\0" * (1 + 3 * width)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _jpeg_with_size(data: bytes, width: int, height: int) -> bytes:
    """A JPEG whose frame header is rewritten to declare ``width`` x ``height``."""
    sof = data.index(b"\xff\xc0")
    return data[:sof + 5] + struct.pack(">HH", height, width) + data[sof + 9:]


def _gif_descriptor(data: bytes) -> int:
    """Offset of the first image descriptor of a GIF."""
    flags = data[10]
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    while data[pos] == 0x21:
        pos += 2
        while data[pos]:
            pos += data[pos] + 1
        pos += 1
    assert data[pos] == 0x2C
    return pos


def _gif_reframed(screen: tuple[int, int], offset: tuple[int, int], frame: int = 50) -> bytes:
    """A real ``frame`` x ``frame`` GIF image placed at ``offset`` on a logical screen of ``screen``."""
    data = bytearray(_enc(_photo(frame, frame).convert("P"), "GIF"))
    data[6:10] = struct.pack("<HH", *screen)
    d = _gif_descriptor(bytes(data))
    data[d + 1:d + 5] = struct.pack("<HH", *offset)
    return bytes(data)


def _gif_many_frames(n: int) -> bytes:
    """A 1x1 GIF with ``n`` frames of one white pixel each (clear, 1, end-of-information)."""
    frame = b"," + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x4c\x01\x00"
    return b"GIF89a" + struct.pack("<HHBBB", 1, 1, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff" + frame * n + b";"


def _riff(chunks: bytes) -> bytes:
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WEBP" + chunks


def _webp_chunk(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("<I", len(body)) + body + b"\0" * (len(body) & 1)


def _vp8x(width: int, height: int, flags: int = 0) -> bytes:
    return _webp_chunk(b"VP8X", bytes([flags, 0, 0, 0]) + (width - 1).to_bytes(3, "little")
                       + (height - 1).to_bytes(3, "little"))


def _vp8l_header(width: int, height: int) -> bytes:
    return _webp_chunk(b"VP8L", b"\x2f" + ((width - 1) | (height - 1) << 14).to_bytes(4, "little") + b"\0" * 8)


def _anmf(x: int, y: int, width: int, height: int, image: bytes) -> bytes:
    head = b"".join(v.to_bytes(3, "little") for v in (x // 2, y // 2, width - 1, height - 1, 100)) + b"\0"
    return _webp_chunk(b"ANMF", head + image)


def _bmp_top_down(im: Image.Image) -> bytes:
    """A 24-bit BMP stored top-down (negative height), which Pillow reads but never writes."""
    data = _enc(im, "BMP")
    offset, height = struct.unpack_from("<I", data, 10)[0], struct.unpack_from("<i", data, 22)[0]
    stride = (len(data) - offset) // height
    rows = [data[offset + i * stride:offset + (i + 1) * stride] for i in range(height)]
    return data[:22] + struct.pack("<i", -height) + data[26:offset] + b"".join(reversed(rows))


def _plain(data: bytes, target_size: int | None = None) -> np.ndarray:
    """The reference: plain Image.open + load (draft for JPEG as decode does), then the same post-processing."""
    im = Image.open(io.BytesIO(data))
    if target_size and im.format == "JPEG":
        im.draft("RGB", (target_size, target_size))
    im.load()
    return np.asarray(to_rgb(ImageOps.exif_transpose(im)))


def _normal_files() -> dict[str, bytes]:
    photo, small = _photo(333, 251), _photo(40, 30, 1)
    exif = Image.Exif()
    exif[0x0112] = 6
    pal = photo.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    return {
        "jpeg": _enc(photo, "JPEG", quality=90),
        "jpeg progressive": _enc(photo, "JPEG", quality=90, progressive=True),
        "jpeg 4:4:4": _enc(photo, "JPEG", subsampling=0),
        "jpeg gray": _enc(photo.convert("L"), "JPEG"),
        "jpeg cmyk": _enc(photo.convert("CMYK"), "JPEG"),
        "jpeg exif rotated": _enc(photo, "JPEG", exif=exif.tobytes()),
        "png rgb": _enc(photo, "PNG"),
        "png rgba": _enc(photo.convert("RGBA"), "PNG"),
        "png 16-bit": _enc(Image.fromarray(np.asarray(photo.convert("L"), np.uint16) * 257), "PNG"),
        "png optimized": _enc(photo, "PNG", optimize=True),
        "png palette": _enc(pal, "PNG"),
        "png 1-bit": _enc(photo.convert("1"), "PNG"),
        "apng": _enc(photo, "PNG", save_all=True, append_images=[photo.rotate(90), photo.rotate(180)]),
        "gif": _enc(pal, "GIF"),
        "gif animated": _enc(pal, "GIF", save_all=True, append_images=[small.convert("P")] * 2 + [pal.rotate(90)]),
        "webp lossy": _enc(photo, "WEBP"),
        "webp lossless": _enc(photo, "WEBP", lossless=True),
        "webp alpha": _enc(photo.convert("RGBA"), "WEBP"),
        "webp animated": _enc(photo, "WEBP", save_all=True, append_images=[photo.rotate(90)], lossless=True),
        "bmp 24-bit": _enc(photo, "BMP"),
        "bmp palette": _enc(pal, "BMP"),
        "bmp 1-bit": _enc(photo.convert("1"), "BMP"),
        "bmp rgba": _enc(photo.convert("RGBA"), "BMP"),
        "bmp top-down": _bmp_top_down(photo),
    }


NORMAL = _normal_files()


@pytest.fixture(scope="module")
def png_bomb() -> bytes:
    return _png_bomb(6000, 6000)


@pytest.fixture
def no_decoding(monkeypatch):
    """Fail the test if Pillow opens or decodes anything."""
    def refuse(*args, **kwargs):
        raise AssertionError("a decoder ran")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    monkeypatch.setattr(Image, "open", refuse)


# ---------------------------------------------------------------------------------------------- probe == Pillow


@pytest.mark.parametrize("name", list(NORMAL))
def test_probe_reads_the_size_pillow_reads(name):
    data = NORMAL[name]
    info = probe(data)
    im = Image.open(io.BytesIO(data))
    assert (info.width, info.height) == im.size
    assert info.format == im.format or (info.format, im.format) == ("JPEG", "MPO")
    assert info.cost_pixels == im.size[0] * im.size[1]
    im.load()  # the first frame decodes to what the probe counted
    assert im.size[0] * im.size[1] == info.cost_pixels
    assert (info.frames > 1) == ("animated" in name or name == "apng")


def test_the_png_bomb_is_what_the_users_reported(png_bomb):
    assert len(png_bomb) < 120_000
    assert probe(png_bomb) == ImageInfo("PNG", 6000, 6000, 36_000_000)
    assert Image.open(io.BytesIO(png_bomb)).size == (6000, 6000)  # a valid PNG, never decoded here


@pytest.mark.parametrize("size,target,scale", [
    ((2000, 1500), 224, 4), ((1799, 1799), 224, 8), ((1792, 1791), 224, 4), ((500, 300), 224, 1),
    ((900, 449), 224, 2), ((2001, 1503), 250, 4), ((1700, 1650), 200, 8), ((777, 555), 100, 4), ((333, 251), None, 1),
])
@pytest.mark.parametrize("progressive", [False, True])
def test_jpeg_draft_cost_is_the_pixels_pillow_decodes(size, target, scale, progressive):
    data = _enc(_photo(*size), "JPEG", quality=85, progressive=progressive)
    info = probe(data, target_size=target, draft=True)
    im = Image.open(io.BytesIO(data))
    if target:
        im.draft("RGB", (target, target))
    im.load()
    assert info.scale == scale and im.size == info.decoded_size
    # Baseline: libjpeg allocates only the scaled output. Progressive: it buffers every coefficient of the
    # full-size image whatever the scale, so the image counts at full size.
    assert info.cost_pixels == (size[0] * size[1] if progressive else im.size[0] * im.size[1])
    assert probe(data, target_size=target, draft=False).cost_pixels == size[0] * size[1]


def test_decode_uses_the_draft_scale_the_probe_counted():
    data = _enc(_photo(1800, 1200), "JPEG")
    assert decode(data, 224, draft=True).size == (450, 300)
    assert decode(data, 224).size == (1800, 1200)  # draft mode is opt-in
    # A draft JPEG over the limit at full size but under it at 1/4 scale is accepted, as its cost says.
    assert decode(data, 224, max_pixels=1800 * 1200 // 16, draft=True).size == (450, 300)
    with pytest.raises(PayloadTooLarge):
        decode(data, 224, max_pixels=1800 * 1200 // 16)


# ---------------------------------------------------------------------------------------------- refusals


def _gif_frame_size(data: bytes, width: int, height: int) -> bytes:
    """A GIF whose first image descriptor is rewritten to declare ``width`` x ``height``."""
    d = _gif_descriptor(data)
    return data[:d + 5] + struct.pack("<HH", width, height) + data[d + 9:]


def _hostile() -> dict[str, bytes]:
    top_down = _bmp_top_down(_photo(4, 4))
    return {
        "jpeg 30000x30000": _jpeg_with_size(_enc(_photo(64, 48), "JPEG"), 30000, 30000),
        "gif frame larger than its screen": _gif_frame_size(_gif_reframed((8, 8), (0, 0)), 5000, 5000),
        "gif frame offset far outside its screen": _gif_reframed((8, 8), (60000, 60000)),
        "webp vp8x canvas 16383x16383": _riff(_vp8x(16383, 16383) + _vp8l_header(16383, 16383)),
        "animated webp canvas 16383x16383": _riff(_vp8x(16383, 16383, 0x02) + _anmf(0, 0, 1, 1, _vp8l_header(1, 1))),
        "bmp 5000x-5000": top_down[:18] + struct.pack("<ii", 5000, -5000) + top_down[26:],
    }


HOSTILE = _hostile()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_over_limit_images_are_413_before_any_decoder_runs(name, no_decoding):
    data = HOSTILE[name]
    info = probe(data)
    assert info.cost_pixels > LIMIT
    with pytest.raises(PayloadTooLarge) as e:
        decode(data, None, LIMIT)
    assert f"{info.width}x{info.height}" in e.value.message and str(LIMIT) in e.value.message
    assert e.value.status == 413


def test_the_png_bomb_is_refused_64_times_without_decoding(png_bomb, no_decoding):
    for _ in range(64):
        with pytest.raises(PayloadTooLarge, match="6000x6000 = 36000000 pixels; the limit is 16777216"):
            decode(png_bomb, 224, LIMIT)
    with pytest.raises(PayloadTooLarge) as e:
        budget([probe(png_bomb) for _ in range(64)], LIMIT, REQUEST_LIMIT)
    assert e.value.param == "images[0]"


def test_gif_frames_count_at_their_extent():
    off = _gif_reframed((8, 8), (100, 120))
    info = probe(off)
    assert (info.width, info.height) == (150, 170) == Image.open(io.BytesIO(off)).size
    assert info.cost_pixels == 150 * 170
    assert decode(off).size == (150, 170)
    with pytest.raises(BadRequest, match="first frame is 0x50"):  # Pillow cannot decode it either
        probe(_gif_frame_size(off, 0, 50))


def test_a_gif_with_100000_frames_is_walked_only_up_to_the_bound():
    data = _gif_many_frames(100_000)
    info = probe(data)
    assert info.frames < MAX_STEPS < 100_000 and info.frames > 1
    assert (info.width, info.height, info.cost_pixels) == (1, 1, 1)
    assert np.asarray(decode(data)).tolist() == [[[255, 255, 255]]]  # the first frame only


def test_frame_rects_outside_the_canvas_are_corrupt():
    apng = bytearray(NORMAL["apng"])
    fctl = apng.index(b"fcTL", apng.index(b"IDAT"))  # the second frame's control
    apng[fctl + 8:fctl + 12] = struct.pack(">I", 10_000)  # its width
    apng[fctl + 30:fctl + 34] = struct.pack(">I", zlib.crc32(bytes(apng[fctl:fctl + 30])))
    with pytest.raises(BadRequest, match="outside the 333x251 canvas"):
        probe(bytes(apng))
    webp = _riff(_vp8x(16, 16, 0x02) + _anmf(0, 0, 1, 1, _vp8l_header(1, 1)) + _anmf(10, 10, 8, 8, _vp8l_header(8, 8)))
    with pytest.raises(BadRequest, match="outside the 16x16 canvas"):
        probe(webp)
    with pytest.raises(BadRequest, match="does not fill the 16383x16383 canvas"):
        probe(_riff(_vp8x(16383, 16383) + _vp8l_header(1, 1)))


def test_a_top_down_bmp_decodes_upright():
    photo = _photo(31, 17)
    data = _bmp_top_down(photo)
    assert struct.unpack_from("<i", data, 22)[0] == -17
    assert probe(data) == ImageInfo("BMP", 31, 17, 31 * 17)
    assert np.array_equal(np.asarray(decode(data)), np.asarray(photo))
    with pytest.raises(BadRequest, match="negative width"):
        probe(data[:18] + struct.pack("<i", -31) + data[22:])


def _bmp_rle8(width: int, height: int) -> bytes:
    """An RLE8 BMP of one-pixel runs: Pillow's Python decoder spends ~0.7 CPU-seconds per megapixel on it."""
    pixels = (b"\x01\x05" * width + b"\x00\x00") * height + b"\x00\x01"
    palette = bytes(4 * 256)
    offset = 14 + 40 + len(palette)
    header = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(pixels), 0, 0, 256, 0)
    return b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset) + header + palette + pixels


def test_rle_bmps_are_415_before_pillows_python_decoder_runs(no_decoding):
    with pytest.raises(UnsupportedMediaType, match="RLE-compressed BMP"):
        decode(_bmp_rle8(64, 64))


def test_zero_sized_images_are_422():
    ihdr = struct.pack(">IIBBBBB", 0, 5, 8, 2, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"")) + _chunk(b"IEND", b"")
    with pytest.raises(Unprocessable, match="0x5; it must be at least 1x1"):
        decode(data)


# ---------------------------------------------------------------------------------------------- bounded walks


def _many_segments() -> dict[str, bytes]:
    jpeg, png = NORMAL["jpeg"], NORMAL["png rgb"]
    gif, n = NORMAL["gif"], MAX_STEPS + 10
    idat = png.index(b"IDAT") - 4
    app0 = 4 + struct.unpack_from(">H", jpeg, 4)[0]  # past the first segment
    d = _gif_descriptor(gif)
    return {
        "jpeg comments": jpeg[:2] + b"\xff\xfe\x00\x02" * n + jpeg[2:],
        "jpeg junk": jpeg[:app0] + b"\0" * 100_000 + jpeg[app0:],
        "png text chunks before the image": png[:idat] + _chunk(b"tEXt", b"k\0v") * n + png[idat:],
        "png chunks after the image": png[:-12] + _chunk(b"zzZz", b"") * n + png[-12:],
        "gif comments": gif[:d] + b"!\xfe\x01x\x00" * n + gif[d:],
        "webp chunks": _riff(_vp8x(4, 4) + _webp_chunk(b"ZZZZ", b"") * n + _vp8l_header(4, 4)),
    }


@pytest.mark.parametrize("name", list(_many_segments()))
def test_header_walks_are_bounded_and_refused_before_pillow_walks_them(name, no_decoding):
    with pytest.raises(Unprocessable, match="refused before decoding"):
        decode(_many_segments()[name])


# ---------------------------------------------------------------------------------------------- malformed headers


def _header_end(name: str, data: bytes) -> tuple[int, int]:
    """The range of cut points that leave a format's magic but not the header the probe needs."""
    if name.startswith("jpeg"):
        return 3, data.index(b"\xff\xda") + 5
    if name.startswith(("png", "apng")):
        return 8, data.index(b"IDAT") + 4
    if name.startswith("gif"):
        return 6, _gif_descriptor(data) + 11
    if name.startswith("webp"):
        if data[12:16] == b"VP8X":
            return 12, data.index(b"ANMF" if b"ANMF" in data else b"VP8", 30) + 8 + 5
        return 12, 30 if data[12:16] == b"VP8 " else 25
    return 2, 14 + struct.unpack_from("<I", data, 14)[0]


@pytest.mark.parametrize("name", list(NORMAL))
def test_truncated_headers_are_400_naming_the_problem(name, no_decoding):
    data = NORMAL[name]
    lo, hi = _header_end(name, data)
    for cut in range(lo, hi):
        with pytest.raises(BadRequest, match="truncated") as e:
            decode(data[:cut])
        assert e.value.status == 400 and name.split()[0].upper().removeprefix("A") in e.value.message


def test_probe_raises_only_service_errors_on_damaged_files():
    rng = random.Random(0)
    for name, data in NORMAL.items():
        for _ in range(150):
            bad = bytearray(data[:rng.randrange(1, len(data) + 1)])
            for _ in range(rng.randrange(0, 6)):
                bad[rng.randrange(len(bad))] = rng.randrange(256)
            try:
                info = probe(bytes(bad))
            except ServiceError as e:
                assert 400 <= e.status < 500, (name, e)
            else:
                assert info.width >= 0 and info.height >= 0 and info.cost_pixels >= 0


# ---------------------------------------------------------------------------------------------- budget


def test_budget_names_the_image_or_the_request():
    small = probe(NORMAL["png rgb"])
    assert budget([small] * 3, LIMIT, REQUEST_LIMIT) == 3 * 333 * 251
    big = ImageInfo("PNG", 5000, 4000, 20_000_000)
    with pytest.raises(PayloadTooLarge) as e:
        budget([small, big], LIMIT, REQUEST_LIMIT)
    assert e.value.param == "images[1]"
    assert e.value.message == "images[1] is 5000x4000 = 20000000 pixels; the limit is 16777216 (max_image_pixels)"
    four = ImageInfo("JPEG", 4000, 3000, 12_000_000)
    with pytest.raises(PayloadTooLarge) as e:
        budget([four, four, four], LIMIT, REQUEST_LIMIT)
    assert e.value.param == "images"
    assert e.value.message == ("the request's images decode to 36000000 pixels; "
                               "the limit is 33554432 (max_request_pixels)")
    draft = probe(_jpeg_with_size(NORMAL["jpeg"], 9000, 9000), target_size=224, draft=True)
    assert (draft.scale, draft.cost_pixels) == (8, 1125 * 1125)
    assert budget([draft], LIMIT, REQUEST_LIMIT) == 1125 * 1125
    with pytest.raises(PayloadTooLarge, match=r"9000x9000, decoded at 1/8 scale to 1125x1125 = 1265625 pixels"):
        budget([draft], 1_000_000, REQUEST_LIMIT)


def test_pillows_ceiling_refuses_first_so_its_warning_never_fires(no_decoding):
    # 12000x12000 is above Image.MAX_IMAGE_PIXELS (Pillow would warn), yet 1500x1500 at the 1/8 draft scale.
    data = _jpeg_with_size(NORMAL["jpeg"], 12000, 12000)
    assert probe(data, target_size=224, draft=True).cost_pixels == 1500 * 1500
    with pytest.raises(PayloadTooLarge, match="the decoder's limit is 89478485"):
        decode(data, 224, LIMIT, draft=True)
    with pytest.raises(PayloadTooLarge, match=r"images\[0\] is 12000x12000 = 144000000 pixels; the decoder's limit"):
        budget([probe(data, target_size=224, draft=True)], LIMIT, REQUEST_LIMIT)


def test_pillows_decompression_bomb_error_stays_a_413_backstop(monkeypatch):
    data = _enc(_photo(100, 100), "PNG")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    lying = ImageInfo("PNG", 10, 10, 100)  # a probe that got it wrong: Pillow's own check still refuses
    with pytest.raises(PayloadTooLarge, match="decoder's pixel limit"):
        decode(data, info=lying)


def test_a_header_pillow_reads_differently_is_corrupt():
    data = NORMAL["png rgb"]
    with pytest.raises(BadRequest, match="declares 334x251, the decoder reads 333x251"):
        decode(data, info=dataclasses.replace(probe(data), width=334))


def test_a_given_info_is_used_unless_it_was_taken_for_another_draft_size(monkeypatch):
    data = _enc(_photo(1800, 1200), "JPEG")
    full = probe(data)  # what service.py may pass: taken without a target size
    assert decode(data, 224, info=full, draft=True).size == (450, 300)
    drafted = probe(data, target_size=224, draft=True)
    monkeypatch.setattr(decode_mod, "probe", lambda *a, **k: pytest.fail("probed again"))
    assert decode(data, 224, info=drafted, draft=True).size == (450, 300)


# ---------------------------------------------------------------------------------------------- pixels


IDENTITY = {
    "jpeg": (_enc(_photo(700, 500), "JPEG", quality=95), None),
    "jpeg draft": (_enc(_photo(700, 500), "JPEG", quality=95), 150),
    "jpeg progressive draft": (_enc(_photo(700, 500), "JPEG", progressive=True), 150),
    "png": (_enc(_photo(700, 500), "PNG"), None),
    "png 16-bit": (NORMAL["png 16-bit"], None),
    "apng": (NORMAL["apng"], None),
    "gif": (_enc(_photo(700, 500).convert("P"), "GIF"), None),
    "gif animated": (NORMAL["gif animated"], None),
    "webp": (_enc(_photo(700, 500), "WEBP"), None),
    "webp lossless": (_enc(_photo(700, 500), "WEBP", lossless=True), None),
    "bmp": (_enc(_photo(700, 500), "BMP"), None),
    "bmp top-down": (NORMAL["bmp top-down"], None),
    "jpeg exif rotated": (NORMAL["jpeg exif rotated"], 100),
}


@pytest.mark.parametrize("chunk", [decode_mod.CHUNK_BYTES, 1000])
@pytest.mark.parametrize("name", list(IDENTITY))
def test_chunked_decode_gives_plain_pillows_pixels(name, chunk, monkeypatch):
    data, target = IDENTITY[name]
    monkeypatch.setattr(decode_mod, "CHUNK_BYTES", chunk)
    out = decode(data, target, draft=target is not None)
    assert out.mode == "RGB"
    assert np.array_equal(np.asarray(out), _plain(data, target))


# ---------------------------------------------------------------------------------------------- threads


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
def test_concurrent_decodes_each_get_their_own_answer(png_bomb):
    jobs = [NORMAL[k] for k in ("jpeg", "png rgba", "gif animated", "webp alpha", "bmp palette", "jpeg cmyk")]
    jobs += [png_bomb, HOSTILE["gif frame larger than its screen"], _jpeg_with_size(NORMAL["jpeg"], 12000, 12000),
             NORMAL["png rgb"][:3000], b"GIF89a" + b"\x01" * 40]

    def run(data: bytes):
        try:
            return np.asarray(decode(data, 64, LIMIT)).tobytes()
        except ServiceError as e:
            return type(e).__name__, e.message

    expected = [run(d) for d in jobs]
    assert {type(x) for x in expected} == {bytes, tuple}
    order = [i for i in range(len(jobs)) for _ in range(6)]
    random.Random(1).shuffle(order)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: run(jobs[i]), order))
    for i, result in zip(order, got):
        assert result == expected[i], i


# ---------------------------------------------------------------------------------------------- deadline


def test_a_past_deadline_stops_before_any_decoder_runs(no_decoding):
    with pytest.raises(DeadlineExceeded, match="before the image was decoded") as e:
        decode(NORMAL["png rgb"], deadline=time.perf_counter() - 0.001)
    assert e.value.status == 504


class _Clock:
    """A fake perf_counter: 0.0 for the first ``passes_after`` readings, then far past any deadline."""

    def __init__(self, passes_after: int | None) -> None:
        self.passes_after, self.calls = passes_after, 0

    def __call__(self) -> float:
        self.calls += 1
        return 0.0 if self.passes_after is None or self.calls <= self.passes_after else 1e9


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "BMP", "GIF"])
def test_a_deadline_passing_mid_decode_stops_it_at_the_next_chunk(fmt, monkeypatch):
    im = _photo(1200, 1000, 3)
    data = _enc(im.convert("P") if fmt == "GIF" else im, fmt, **({"quality": 100} if fmt == "JPEG" else {}))
    whole = _Clock(None)
    monkeypatch.setattr(decode_mod, "_now", whole)
    decode(data, deadline=1.0)
    assert whole.calls > 50  # one reading per chunk read: the whole decode reads this many
    late = _Clock(20)
    monkeypatch.setattr(decode_mod, "_now", late)
    with pytest.raises(DeadlineExceeded, match="while the image was decoding"):
        decode(data, deadline=1.0)
    assert late.calls == 21  # stopped at the first chunk after the deadline, not at the end


# ---------------------------------------------------------------------------------------------- measurement


@pytest.mark.skipif(not os.environ.get("DECODE_BENCH"), reason="a measurement, not a test: set DECODE_BENCH=1")
def test_report_cpu_seconds_per_megapixel():
    """CPU-seconds per decoded megapixel for each format at 4096x4096 (the default max_image_pixels),
    flat colour (the most compressible: smallest upload per pixel) and noisy content, through decode()."""
    side = 4096
    rng = np.random.default_rng(0)
    flat = Image.new("RGB", (side, side), (200, 30, 90))
    noisy = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
    cases = {
        "PNG flat": _enc(flat, "PNG"), "PNG noise": _enc(noisy, "PNG", compress_level=1),
        "JPEG flat q90": _enc(flat, "JPEG", quality=90), "JPEG noise q90": _enc(noisy, "JPEG", quality=90),
        "JPEG flat progressive": _enc(flat, "JPEG", progressive=True),
        "WEBP flat lossy": _enc(flat, "WEBP"), "WEBP flat lossless": _enc(flat, "WEBP", lossless=True),
        "WEBP noise lossy": _enc(noisy, "WEBP", quality=90),
        "WEBP noise lossless": _enc(noisy, "WEBP", lossless=True, method=0),
        "GIF flat": _enc(flat.convert("P"), "GIF"), "GIF noise": _enc(noisy.convert("P"), "GIF"),
        "BMP": _enc(flat, "BMP"),
    }
    mp = side * side / 1e6
    print(f"\nCPU-seconds per megapixel, {side}x{side}, decode() incl. to_rgb, best of 3:")
    for name, data in cases.items():
        runs = []
        for _ in range(3):
            t = time.process_time()
            decode(data, None, side * side)
            runs.append(time.process_time() - t)
        print(f"  {name:24s} {len(data) / 2**20:7.2f} MiB  {min(runs) / mp:.4f} s/MP")
