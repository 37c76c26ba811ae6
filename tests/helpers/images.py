"""Image helpers for server tests."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from conftest import golden_npz


def png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def golden_pngs() -> list[bytes]:
    return [png(im) for im in golden_npz("softmoe_e8p1")["inputs/images_uint8"]]


def random_pngs(n: int, size: int = 32, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [png(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]
