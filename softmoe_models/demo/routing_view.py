"""The paper's routing view for a few held-out digits: what the most focused slots read.

    python -m softmoe_models.demo.routing_view [--package PKG] [--index 9 13 8] [--slots 4]
                                               [--out docs/routing-digits.png]

One row per digit and Soft MoE layer: the digit (8x8, enlarged), then its most focused slots,
each panel the digit with that slot's dispatch weights over the 4x4 patch grid (a slot's weights
sum to 1 over the 16 patches; the tint is stretched between its smallest and largest weight, the
largest printed in the title). The same picture as ``POST /v1/routing?format=png``, drawn by
``softmoe_models.routing_png`` from the torch model's own routing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from ..package import load_model
from ..routing import layout_for, routing_of
from ..routing_png import render_png
from .data import LABELS, load_splits

SHIPPED_DIGITS = Path(__file__).resolve().parents[2] / "server" / "default_models" / "digits"


def render(package: Path, indices: list[int], out: Path, slots: int = 4) -> Path:
    """Write the sheet for the held-out digits at ``indices`` to ``out``."""
    model = load_model(package)
    _, held = load_splits()
    pixels = held.pixels[indices]
    outputs = routing_of(model, pixels)
    with torch.no_grad():
        logits = model(torch.from_numpy(pixels)).numpy()
    rows = [{k: v[i] for k, v in outputs.items()} for i in range(len(indices))]
    captions = [f"true {held.targets[i]}, pred {LABELS[int(np.argmax(z))]}" for i, z in zip(indices, logits)]
    value_range = model.package.preprocess.value_range
    png = render_png(layout_for(model.cfg), list(pixels), rows, value_range, slots=slots, captions=captions)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, default=SHIPPED_DIGITS)
    parser.add_argument("--index", type=int, nargs="+", default=[9, 13, 8], help="positions in the held-out split")
    parser.add_argument("--slots", type=int, default=4, help="slots drawn per layer, the most focused first")
    parser.add_argument("--out", type=Path, default=Path("docs/routing-digits.png"))
    args = parser.parse_args(argv)
    print(f"wrote {render(args.package, args.index, args.out, args.slots)}")


if __name__ == "__main__":
    main()
