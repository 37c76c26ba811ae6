"""The paper's routing view for a served digit: dispatch weights of a few slots over the patches.

    python -m softmoe_models.demo.routing_view [--package PKG] [--index 0] [--out docs/routing.png]

Each panel is the digit (8x8, shown 24x enlarged) with the 4x4 patch grid tinted by one slot's
dispatch weights in the last Soft MoE layer: which tokens that slot's expert input is averaged
from (the weights of one slot sum to 1 over the 16 patches; the tint is stretched between that
slot's smallest and largest weight, printed in the title).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from ..package import load_model
from ..soft_moe import SoftMoE
from .data import load_splits

SCALE = 24


def dispatch_weights(model, pixels: np.ndarray) -> np.ndarray:
    """(tokens, slots) dispatch weights of the last Soft MoE layer for one image."""
    layer = [m for m in model.modules() if isinstance(m, SoftMoE)][-1]
    layer.capture = True
    with torch.no_grad():
        model(torch.from_numpy(pixels[None]))
    layer.capture = False
    d = layer.internals["dispatch_weights"][0]  # (m, n, p)
    return d.reshape(d.shape[0], -1).numpy()


def panel(gray: np.ndarray, weights: np.ndarray, grid: int, title: str) -> Image.Image:
    side = gray.shape[0] * SCALE
    base = Image.fromarray(gray, "L").resize((side, side), Image.Resampling.NEAREST).convert("RGB")
    heat = Image.new("RGB", (side, side))
    draw = ImageDraw.Draw(heat)
    cell = side // grid
    lo, hi = float(weights.min()), float(weights.max())
    w = (weights - lo) / max(hi - lo, 1e-12)  # contrast-stretched: one slot's min..max
    for t, value in enumerate(w):
        r, c = divmod(t, grid)
        draw.rectangle([c * cell, r * cell, (c + 1) * cell - 1, (r + 1) * cell - 1], fill=(int(255 * value), 40, 40))
    img = Image.blend(base, heat, 0.55)
    draw = ImageDraw.Draw(img)
    for k in range(1, grid):
        draw.line([(k * cell, 0), (k * cell, side)], fill=(90, 90, 90))
        draw.line([(0, k * cell), (side, k * cell)], fill=(90, 90, 90))
    out = Image.new("RGB", (side, side + 18), (255, 255, 255))
    out.paste(img, (0, 18))
    ImageDraw.Draw(out).text((4, 3), title, fill=(0, 0, 0))
    return out


def render(package: Path, index: int, out: Path, slots: int = 4) -> Path:
    model = load_model(package)
    _, held = load_splits()
    pixels, target = held.pixels[index], int(held.targets[index])
    weights = dispatch_weights(model, pixels)  # (16, 8)
    grid = model.cfg.grid
    gray = np.round((pixels[0] + 1) / 2 * 255).astype(np.uint8)
    with torch.no_grad():
        pred = int(model(torch.from_numpy(pixels[None])).argmax())
    picks = np.argsort(-weights.max(axis=0))[:slots]  # the most focused slots
    panels = [panel(gray, np.zeros(grid * grid), grid, f"digit {target} (pred {pred})")]
    panels += [panel(gray, weights[:, s], grid, f"slot {s}: {weights[:, s].min():.3f}-{weights[:, s].max():.3f}")
               for s in picks]
    w, h = panels[0].size
    sheet = Image.new("RGB", (len(panels) * (w + 6), h), (255, 255, 255))
    for i, p in enumerate(panels):
        sheet.paste(p, (i * (w + 6), 0))
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out)
    return out


def main(argv: list[str] | None = None) -> None:
    from server.default_model import SHIPPED

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, default=SHIPPED / "digits")
    parser.add_argument("--index", type=int, default=0, help="position in the held-out split")
    parser.add_argument("--out", type=Path, default=Path("docs/routing.png"))
    args = parser.parse_args(argv)
    print(f"wrote {render(args.package, args.index, args.out)}")


if __name__ == "__main__":
    main()
