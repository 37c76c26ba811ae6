"""The paper-style picture of a Soft MoE layer's routing: per image and layer, the image and then
its most focused slots, each panel the image with that slot's dispatch map over the patch grid.

Drawn from the routing outputs of :mod:`softmoe_models.routing` (``dispatch_weights``, per layer
``(m, s)``) and the model's :class:`~softmoe_models.routing.Layout`; served as
``POST /v1/routing?format=png`` and drawn for the held-out digits by ``softmoe_models.demo.routing_view``.
Needs Pillow and numpy only.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Sequence

import numpy as np
from PIL import Image, ImageDraw

if TYPE_CHECKING:
    from .routing import Layout


def _u8(pixels: np.ndarray, value_range: tuple[float, float]) -> np.ndarray:
    """``(3, H, W)`` pixel values -> ``(H, W, 3)`` uint8."""
    lo, hi = value_range
    x = (np.asarray(pixels, dtype=np.float32).transpose(1, 2, 0) - lo) / max(hi - lo, 1e-12)
    return np.round(np.clip(x, 0, 1) * 255).astype(np.uint8)


def _panel(rgb: np.ndarray, weights: np.ndarray | None, grid: int, title: str, side: int):
    """The image enlarged to ``side`` with one slot's dispatch map over the patch grid (red,
    stretched between that slot's smallest and largest weight) and a title strip."""
    base = Image.fromarray(rgb, "RGB").resize((side, side), Image.Resampling.NEAREST)
    cell = side / grid
    if weights is not None:
        heat = Image.new("RGB", (side, side))
        draw = ImageDraw.Draw(heat)
        lo, hi = float(weights.min()), float(weights.max())
        w = (weights - lo) / max(hi - lo, 1e-12)
        for t, value in enumerate(w):
            r, c = divmod(t, grid)
            box = [round(c * cell), round(r * cell), round((c + 1) * cell) - 1, round((r + 1) * cell) - 1]
            draw.rectangle(box, fill=(int(255 * value), 40, 40))
        base = Image.blend(base, heat, 0.55)
        draw = ImageDraw.Draw(base)
        for k in range(1, grid):
            draw.line([(round(k * cell), 0), (round(k * cell), side)], fill=(90, 90, 90))
            draw.line([(0, round(k * cell)), (side, round(k * cell))], fill=(90, 90, 90))
    out = Image.new("RGB", (side, side + 16), (255, 255, 255))
    out.paste(base, (0, 16))
    ImageDraw.Draw(out).text((3, 2), title, fill=(0, 0, 0))
    return out


def panel_side(layout: Layout) -> int:
    """Panel side in pixels: the image's own size, small images enlarged to about 128."""
    size = layout.image_size
    return size if size >= 128 else size * round(128 / size)


def sheet_pixels(layout: Layout, images: int, layers: int, slots: int) -> int:
    """Pixels of the sheet ``render_png`` draws (to bound it before drawing)."""
    side = panel_side(layout)
    return (min(slots, layout.num_slots) + 1) * (side + 4) * images * layers * (side + 20)


def focused_slots(dispatch: np.ndarray, k: int) -> list[int]:
    """The ``k`` slots whose dispatch map is most peaked (highest largest weight) for this image."""
    peak = np.asarray(dispatch).max(axis=0)  # (s,)
    return [int(j) for j in np.argsort(-peak, kind="stable")[:k]]


def render_png(layout: Layout, pixels: Sequence[np.ndarray], outputs: Sequence[dict[str, np.ndarray]],
               value_range: tuple[float, float] = (-1.0, 1.0), layers: Sequence[int] | None = None,
               slots: int = 4, captions: Sequence[str] | None = None) -> bytes:
    """A PNG sheet: per image and Soft MoE layer one row, the image and then its ``slots`` most
    focused slots, each panel the image with that slot's dispatch map over the patch grid.

    Args:
        layout: the model's routing layout.
        pixels: per image, the ``(3, H, W)`` pixel values the model saw.
        outputs: per image, its routing outputs (``dispatch_weights`` ``(L, m, s)``).
        value_range: the preprocessing value range (to show the pixels).
        layers: block indices to draw (default all).
        slots: panels per row after the image.
        captions: per image, a short text for its first panel (e.g. the prediction).
    """
    side = panel_side(layout)
    keep = set(layout.layers if layers is None else layers)
    off = 1 if layout.cls else 0
    rows = []
    for n, (px, out) in enumerate(zip(pixels, outputs)):
        rgb = _u8(px, value_range)
        for i, block in enumerate(layout.layers):
            if block not in keep:
                continue
            d = np.asarray(out["dispatch_weights"][i])[off:]  # (patches, s)
            head = f"#{n} layer {block}" + (f" {captions[n]}" if captions and captions[n] else "")
            panels = [_panel(rgb, None, layout.grid, head, side)]
            for j in focused_slots(d, min(slots, layout.num_slots)):
                who = f"slot {j}" if layout.slots_per_expert == 1 else f"slot {j} (e{j // layout.slots_per_expert})"
                panels.append(_panel(rgb, d[:, j], layout.grid, f"{who} max {d[:, j].max():.2f}", side))
            rows.append(panels)
    width = max(len(r) for r in rows) * (side + 4)
    height = len(rows) * (side + 20)
    sheet = Image.new("RGB", (width, height), (255, 255, 255))
    for r, panels in enumerate(rows):
        for c, p in enumerate(panels):
            sheet.paste(p, (c * (side + 4), r * (side + 20)))
    buf = io.BytesIO()
    sheet.save(buf, "PNG", optimize=True)
    return buf.getvalue()
