"""JPEG decoding on the GPU (nvJPEG through ``torchvision.io.decode_jpeg``): an opt-in, ``--decode-device cuda``.

Why opt-in: nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's, so a JPEG's pixels differ
from Pillow's by a few levels, and served answers can differ from those the model was evaluated
with. ``make gpu-check`` measures the difference on the digits model's held-out images served as
640x480 JPEGs (max pixel difference and top-1 agreement with the Pillow path).

What moves to the GPU is the entropy decode and IDCT only, the costly part; the image comes back to
the host as uint8 and continues through the same resize and preprocessing as every other image, so
the batcher, the backends and strict determinism see nothing new. Every other format, and a JPEG
nvJPEG refuses (progressive and CMYK JPEGs, on some versions), goes through Pillow as before.
The header probe, the pixel budget and the deadline run before this decoder, exactly as for Pillow.

``torchvision`` is imported lazily (not a dependency of the CPU product); ``open_decoder`` checks at
start-up that it imports, that torch sees the device, and that a test JPEG decodes, else start-up
fails with one line (no silent fallback to the CPU decoder).
"""

from __future__ import annotations

import io
import threading
from typing import Any

import numpy as np
from PIL import Image


class GpuDecodeUnavailable(RuntimeError):
    """``--decode-device cuda`` cannot be honoured; the message names what is missing."""


class CudaJpegDecoder:
    """Decodes JPEG bytes with nvJPEG on one CUDA device into an RGB Pillow image on the host."""

    def __init__(self, torch: Any, io_mod: Any, device: str) -> None:
        self._torch, self._io, self.device = torch, io_mod, device
        # torchvision documents the CUDA decoder as thread-safe; one lock still keeps a single
        # decode in flight per process, so GPU memory for decoding stays one image's worth.
        self._lock = threading.Lock()

    def decode(self, data: bytes) -> Image.Image:
        """RGB, EXIF orientation applied as the Pillow path applies it (``ImageOps.exif_transpose``).

        torchvision's CUDA path takes no ``apply_exif_orientation`` (only its CPU decoder does), so
        the orientation is read from the header here (Pillow parses the markers, decodes nothing)
        and applied to the decoded image."""
        torch = self._torch
        orientation = exif_orientation(data)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        with self._lock:
            chw = self._io.decode_jpeg(raw, mode=self._io.ImageReadMode.RGB, device=self.device)
            hwc = chw.permute(1, 2, 0).contiguous().cpu().numpy()
        im = Image.fromarray(np.ascontiguousarray(hwc, dtype=np.uint8), "RGB")
        method = TRANSPOSE.get(orientation)
        return im.transpose(method) if method is not None else im


# EXIF orientation -> the transpose that displays it upright (the table ImageOps.exif_transpose uses).
TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def exif_orientation(data: bytes) -> int:
    """The EXIF orientation tag of a JPEG (1, upright, when absent or unreadable)."""
    try:
        return int(Image.open(io.BytesIO(data), formats=["JPEG"]).getexif().get(0x0112, 1))
    except Exception:  # a header Pillow cannot read: the decoder will say what is wrong
        return 1


def open_decoder(device: str = "cuda") -> CudaJpegDecoder:
    """The GPU decoder, checked end to end on a small JPEG.

    Raises:
        GpuDecodeUnavailable: torch sees no CUDA device, torchvision is missing or has no nvJPEG
            support, or the test decode fails.
    """
    # heavy: only a --decode-device cuda server loads torch here (front ends never do)
    import torch

    if not torch.cuda.is_available():
        raise GpuDecodeUnavailable(f"--decode-device cuda needs a CUDA device, and torch {torch.__version__} sees none")
    try:  # an optional extra, and heavy: whether it imports is part of the check
        import torchvision.io as tv_io
    except Exception as e:  # ImportError, or a torchvision built for another torch
        raise GpuDecodeUnavailable(f"--decode-device cuda needs torchvision (pip install torchvision "
                                   f"matching torch {torch.__version__}): {type(e).__name__}: {e}") from None
    decoder = CudaJpegDecoder(torch, tv_io, device)
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 90)).save(buf, "JPEG", quality=95)
    try:
        im = decoder.decode(buf.getvalue())
    except Exception as e:
        raise GpuDecodeUnavailable(f"--decode-device cuda: nvJPEG cannot decode a test JPEG: {type(e).__name__}: {e}") from None
    if im.size != (16, 16):
        raise GpuDecodeUnavailable(f"--decode-device cuda: a 16x16 test JPEG decoded to {im.size[0]}x{im.size[1]}")
    return decoder
