"""What a decoder other than the full Pillow decode costs in answers: JPEG draft mode
(``--jpeg-draft``, the bench's ``decode`` section) and nvJPEG (``--decode-device cuda``,
``make gpu-check``), each against the full decode on the digits model's held-out images."""

from __future__ import annotations

import io
from typing import Callable

import numpy as np


def held_out_jpegs(limit: int | None = None) -> tuple[list[bytes], np.ndarray]:
    """The built-in digits classifier's held-out images (never trained on), each upscaled to 640x480
    (bicubic) and stored as a quality-90 JPEG, as a camera would; and their labels."""
    from PIL import Image

    from softmoe_models.demo.data import load_splits

    _, held = load_splits()
    n = len(held.targets) if limit is None else min(limit, len(held.targets))
    blobs = []
    for png in held.pngs[:n]:
        buf = io.BytesIO()
        Image.open(io.BytesIO(png)).convert("RGB").resize((640, 480), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=90)
        blobs.append(buf.getvalue())
    return blobs, held.targets[:n]


def decode_accuracy_cost(alt_decode: Callable, limit: int | None = None) -> dict[str, float]:
    """Another way of decoding (``alt_decode(data, target_size) -> PIL image``) against the full
    Pillow decode, on ``held_out_jpegs``: both preprocessed as the server does and classified by the
    same fp32 torch model on the CPU. Top-1 accuracy of each, their agreement, and the largest
    difference in preprocessed pixel values."""
    from server.backends.torch_backend import TorchBackend
    from server.engine.defaults import SHIPPED
    from server.pipeline.decode import decode
    from softmoe_models.package import read_package
    from softmoe_models.preprocess import preprocess_image

    digits = SHIPPED / "digits"
    pre = read_package(digits).preprocess
    blobs, y = held_out_jpegs(limit)
    full = np.stack([preprocess_image(decode(b, pre.image_size), pre) for b in blobs])
    alt = np.stack([preprocess_image(alt_decode(b, pre.image_size), pre) for b in blobs])
    backend = TorchBackend(digits, device="cpu", precision="fp32", max_batch_size=64)
    try:
        def top1(x: np.ndarray) -> np.ndarray:
            name = backend.functions["classify"].inputs[0].name
            out = [backend.run("classify", {name: x[i:i + 64]})["logits"] for i in range(0, len(x), 64)]
            return np.concatenate(out).argmax(-1)

        a, b = top1(full), top1(alt)
    finally:
        backend.close()
    return {"n": len(y), "acc_full": float((a == y).mean()), "acc_alt": float((b == y).mean()),
            "agree": float((a == b).mean()), "max_px": float(np.abs(full - alt).max())}


def draft_accuracy_cost(limit: int | None = None) -> dict[str, float]:
    """JPEG draft mode's accuracy cost (``decode_accuracy_cost`` of the draft decode)."""
    from server.pipeline.decode import decode

    return decode_accuracy_cost(lambda data, size: decode(data, size, draft=True), limit)
