"""nvJPEG (``--decode-device cuda``) on a real CUDA device: same sizes and orientation as Pillow,
pixels within a few levels; the held-out top-1 agreement is measured by ``make gpu-check``."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def decoder():
    from server.pipeline.gpu_decode import GpuDecodeUnavailable, open_decoder

    try:
        return open_decoder()
    except GpuDecodeUnavailable as e:
        pytest.skip(str(e))


def _jpeg(im: Image.Image, **kwargs) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90, **kwargs)
    return buf.getvalue()


def _smooth(w: int, h: int) -> Image.Image:
    y, x = np.mgrid[0:h, 0:w]
    arr = np.stack([x * 255 // w, y * 255 // h, (x + y) * 255 // (w + h)], -1).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_pixels_close_to_pillow(decoder, mode):
    from server.pipeline.decode import decode

    data = _jpeg(_smooth(640, 480).convert(mode))
    gpu, cpu = np.asarray(decoder.decode(data), np.int16), np.asarray(decode(data), np.int16)
    assert gpu.shape == cpu.shape == (480, 640, 3)
    assert np.abs(gpu - cpu).max() <= 8, np.abs(gpu - cpu).max()


def test_exif_orientation_as_pillow(decoder):
    from server.pipeline.decode import decode

    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    data = _jpeg(_smooth(64, 32), exif=exif.tobytes())
    assert decoder.decode(data).size == decode(data).size == (32, 64)
