"""One image's bytes -> one backend row, as every image path of the server does it: the header
probed and the pixel budget checked before decoding, the decode bounded by a deadline, then the
model's own preprocessing. The request path (``Service.pixel_rows``, in its thread pool) and the
dataset jobs (``softmoe eval`` / ``softmoe embed``, in their process pool) both call
:func:`prepare_image`, so the same file gives the same row, bit for bit."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from softmoe_models.preprocess import PreprocessConfig, model_rgb, preprocess_image

from server.backends.base import PIXELS
from server.pipeline.decode import decode
from server.pipeline.probe import ImageInfo, budget, probe


def probe_image(data: bytes, cfg: PreprocessConfig, max_image_pixels: int, max_request_pixels: int) -> ImageInfo:
    """One image's header read and its pixel cost checked against the budgets (413 before decoding).

    Raises:
        ServiceError: not an allowed image format, a bad header, or over a budget.
    """
    info = probe(data, target_size=cfg.image_size, draft=cfg.jpeg_draft)
    budget([info], max_image_pixels, max_request_pixels)
    return info


def prepare_image(data: bytes, cfg: PreprocessConfig, *, uint8: bool, max_pixels: int, info: ImageInfo | None,
                  deadline: float | None, jpeg_decoder: Callable | None = None,
                  on_fallback: Callable[[], None] | None = None) -> tuple[dict[str, np.ndarray], float, float]:
    """``(row, decode seconds, preprocess seconds)``: ``{"pixels": uint8}`` where the backend takes
    uint8 transfer (``uint8``), else ``{"pixel_values": float32}``.

    Raises:
        ServiceError: the image cannot be decoded within its budgets and deadline.
    """
    t0 = time.perf_counter()
    im = decode(data, cfg.image_size, max_pixels, deadline=deadline, info=info, draft=cfg.jpeg_draft,
                jpeg_decoder=jpeg_decoder, on_fallback=on_fallback)
    t1 = time.perf_counter()
    row = {PIXELS: model_rgb(im, cfg)} if uint8 else {"pixel_values": preprocess_image(im, cfg)}
    return row, t1 - t0, time.perf_counter() - t1
