"""``--decode-device cuda``: everything around nvJPEG, on the CPU. The decoder itself (torchvision on a
CUDA device) runs in tests/gpu/test_gpu_decode.py and in ``make gpu-check``; here a stand-in decoder
checks where the pipeline calls it: only for JPEGs, never in draft mode, always after the probe,
the pixel budget and the deadline; a JPEG it refuses goes through Pillow and is counted."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
import torch
from PIL import Image

from server.errors import BadRequest, DeadlineExceeded, PayloadTooLarge
from server.pipeline.decode import decode


def _enc(im: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _photo(width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


class Recorder:
    """A JPEG decoder that returns a flat image of the declared size, so its use shows in the pixels."""

    def __init__(self, fail: bool = False) -> None:
        self.calls, self.fail, self.fallbacks = 0, fail, 0

    def __call__(self, data: bytes) -> Image.Image:
        self.calls += 1
        if self.fail:
            raise RuntimeError("nvjpeg: unsupported JPEG")
        w, h = Image.open(io.BytesIO(data)).size
        return Image.new("RGB", (w, h), (1, 2, 3))

    def fell_back(self) -> None:
        self.fallbacks += 1


def test_jpegs_go_to_the_gpu_decoder():
    rec = Recorder()
    im = decode(_enc(_photo(64, 48), "JPEG"), 32, jpeg_decoder=rec, on_fallback=rec.fell_back)
    assert rec.calls == 1 and im.getpixel((0, 0)) == (1, 2, 3)


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "BMP", "GIF"])
def test_other_formats_stay_with_pillow(fmt):
    rec = Recorder()
    data = _enc(_photo(64, 48), fmt)
    im = decode(data, 32, jpeg_decoder=rec)
    assert rec.calls == 0 and np.array_equal(np.asarray(im), np.asarray(decode(data, 32)))


def test_draft_mode_stays_with_pillow():
    rec = Recorder()
    im = decode(_enc(_photo(640, 480), "JPEG"), 32, draft=True, jpeg_decoder=rec)
    assert rec.calls == 0 and im.size == (80, 60)


def test_a_refused_jpeg_is_decoded_by_pillow_and_counted():
    rec = Recorder(fail=True)
    data = _enc(_photo(64, 48), "JPEG", progressive=True)
    im = decode(data, 32, jpeg_decoder=rec, on_fallback=rec.fell_back)
    assert (rec.calls, rec.fallbacks) == (1, 1)
    assert np.array_equal(np.asarray(im), np.asarray(decode(data, 32)))


def test_a_corrupt_jpeg_refused_by_both_is_a_400():
    rec = Recorder(fail=True)
    data = _enc(_photo(64, 48), "JPEG")
    with pytest.raises(BadRequest):
        decode(data[: len(data) // 2], 32, jpeg_decoder=rec, on_fallback=rec.fell_back)
    assert rec.fallbacks == 1


def test_budget_and_deadline_come_first():
    rec = Recorder()
    data = _enc(_photo(300, 200), "JPEG")
    with pytest.raises(PayloadTooLarge):
        decode(data, 32, max_pixels=300 * 200 - 1, jpeg_decoder=rec)
    with pytest.raises(DeadlineExceeded):
        decode(data, 32, deadline=time.perf_counter() - 1, jpeg_decoder=rec)
    assert rec.calls == 0


def test_a_decoder_that_reads_another_size_is_refused():
    data = _enc(_photo(64, 48), "JPEG")
    with pytest.raises(BadRequest, match="declares 64x48, the decoder reads 10x10"):
        decode(data, 32, jpeg_decoder=lambda d: Image.new("RGB", (10, 10)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_decoder_refuses_in_one_line():
    from server.pipeline.gpu_decode import GpuDecodeUnavailable, open_decoder

    with pytest.raises(GpuDecodeUnavailable, match="needs a CUDA device") as e:
        open_decoder()
    assert "\n" not in str(e.value)



class FakeNvjpeg:
    """torchvision.io's CUDA ``decode_jpeg`` as it behaves: RGB CHW uint8, EXIF orientation not
    applied (its CUDA path has no such option). Pixels from Pillow, so the wrapper's own work
    (orientation, layout, the host copy) is what is checked."""

    class ImageReadMode:
        RGB = "RGB"

    @staticmethod
    def decode_jpeg(raw, mode, device):
        assert mode == "RGB" and device == "cuda"
        im = Image.open(io.BytesIO(raw.numpy().tobytes())).convert("RGB")  # no exif_transpose
        return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_the_gpu_decoder_applies_exif_orientation_as_pillow(orientation):
    from server.pipeline.gpu_decode import CudaJpegDecoder

    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    _photo(64, 32).save(buf, "JPEG", quality=95, exif=exif.tobytes())
    data = buf.getvalue()
    got = CudaJpegDecoder(torch, FakeNvjpeg, "cuda").decode(data)
    assert np.array_equal(np.asarray(got), np.asarray(decode(data)))
