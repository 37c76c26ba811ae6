"""Calibration images for a package's reference routing profile (``softmoe_models.routing``):
a folder the user names, or, for a package made by ``softmoe train-demo``, the digits it held out.
The routing module takes pixels and knows no dataset; which data stand for a package is decided
here, beside the demo data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from ..package import read_package
from ..preprocess import preprocess_image
from .data import load_splits


def calibration_pixels(package: Path, images: Path | None = None, limit: int | None = None) -> tuple[np.ndarray, str]:
    """``(N, 3, H, W)`` calibration pixels and a description of where they come from: the files of
    ``images`` (decoded and preprocessed by the package's contract), else the held-out digits of a
    package made by ``softmoe train-demo``.

    Raises:
        ValueError: ``images`` holds no file, or no images are known for the package.
    """
    pkg = read_package(package)
    if images is not None:
        files = sorted(p for p in Path(images).iterdir() if p.is_file())[:limit]
        if not files:
            raise ValueError(f"no image files in {images}")
        rows = []
        for f in files:
            with Image.open(f) as im:
                rows.append(preprocess_image(im, pkg.preprocess))
        return np.stack(rows).astype(np.float32), f"{len(files)} images from {Path(images).name}/"
    if pkg.meta.get("provenance", {}).get("source") == "softmoe train-demo":
        _, held = load_splits()
        return held.pixels[:limit], "sklearn digits held out by train-demo (index % 5 == 0)"
    raise ValueError(f"{package}: no held-out images known for this package; pass --images DIR")
