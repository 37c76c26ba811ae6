"""What the experts of a sparse V-MoE image model see: the sparse counterpart of routing.py.

Per sparse MoE layer and image (m tokens, E experts, K experts per token for Tokens Choice;
tokens are row-major over the patch grid, after the cls token if any; one image is one routing
group, so none of this depends on the image's batch-mates):

    combine_weights  C (m, E)  gates[t, e] (softmax over experts, not renormalised) where token t
                               was dispatched to expert e, 0 where not: vmoe's combine tensor summed
                               over the capacity slots (a token holds at most one slot per expert)
    dropped          (m,)      Tokens Choice: how many of the token's K choices found no room;
                               Experts Choice: 1 when no expert took the token. A token with all its
                               choices dropped (or untaken) gets no MoE output: its residual alone
    expert_load      (E,)      the image's tokens each expert processed (at most its capacity)

The plain forward pass keeps none of this: ``routing_of`` runs the model with the layers'
capture switched on (soft_moe.capture_routing, shared with the Soft MoE layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

# The routing outputs, per image ``(L, ...)`` (names are the wire contract, as routing.OUTPUTS).
OUTPUTS = ("combine_weights", "dropped", "expert_load")


@dataclass(frozen=True)
class SparseLayout:
    """Where the routing of a sparse image model lives and how its tokens map onto the image."""

    layers: tuple[int, ...]  # encoder block index of every sparse MoE layer, in forward order
    num_experts: int  # E
    router: str  # "tokens-choice" | "experts-choice"
    experts_per_token: int  # K (1 for experts choice)
    grid: int  # patches per side
    cls: bool  # a cls token precedes the patches (token 0)
    image_size: int

    @property
    def tokens(self) -> int:
        return self.grid * self.grid + (1 if self.cls else 0)


def layout_for(cfg: Any) -> SparseLayout | None:
    """The sparse routing layout of a model config (a classifier, or a two-tower's image tower);
    None when its image model has no sparse MoE layer or the model takes no images."""
    from .config import TwoTowerConfig, ViTConfig

    image = cfg.image if isinstance(cfg, TwoTowerConfig) else cfg if isinstance(cfg, ViTConfig) else None
    moe = image.encoder.moe if image is not None else None
    if moe is None or not moe.layers or not moe.sparse:
        return None
    return SparseLayout(tuple(sorted(moe.layers)), moe.num_experts, moe.router,
                        moe.k if moe.router == "tokens-choice" else 1, image.grid,
                        image.classifier == "token", image.image_size)


# ------------------------------------------------------------------ in the graph (torch)


def stack_routing(layers: Sequence[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The captured ``(B, L, m, E)`` combine weights (float32), ``(B, L, m)`` dropped counts and
    ``(B, L, E)`` expert loads (int64) of ``layers``."""
    combine = torch.stack([layer.internals["combine_weights"] for layer in layers], dim=1).float()
    dropped = torch.stack([layer.internals["dropped"] for layer in layers], dim=1).long()
    load = torch.stack([layer.internals["expert_load"] for layer in layers], dim=1).long()
    return combine, dropped, load


@torch.no_grad()
def routing_of(model: torch.nn.Module, pixels: np.ndarray | torch.Tensor) -> dict[str, np.ndarray]:
    """The torch model's own sparse routing for a batch of pixel values: every name in ``OUTPUTS``,
    ``(B, L, m, E)``, ``(B, L, m)``, ``(B, L, E)``."""
    from .soft_moe import capture_routing
    from .sparse_moe import sparse_moe_layers

    image = getattr(model, "image", model)  # a two-tower's image tower
    layers = sparse_moe_layers(image)
    if not layers:
        raise ValueError("the model has no sparse MoE layers")
    x = torch.as_tensor(pixels, dtype=torch.float32)
    with capture_routing(layers):
        image(x.to(next(image.parameters()).dtype))
        stacked = stack_routing(layers)
    return {k: v.numpy() for k, v in zip(OUTPUTS, stacked)}


# ------------------------------------------------------------------ per image, for clients


def image_routing(layout: SparseLayout, outputs: dict[str, np.ndarray], layers: Sequence[int] | None = None
                  ) -> list[dict]:
    """One image's sparse routing as JSON-ready dicts, one per sparse MoE layer (``layers``: block
    indices to keep, default all): ``combine[row][col][expert]``, ``dropped[row][col]``,
    ``expert_load[expert]``, the layer's totals, and ``cls_combine`` / ``cls_dropped`` when there
    is a cls token.

    Args:
        layout: the model's sparse routing layout.
        outputs: the image's routing outputs (``combine_weights`` ``(L, m, E)``, ``dropped``
            ``(L, m)``, ``expert_load`` ``(L, E)``).
        layers: block indices to keep (default all).
    """
    g, off = layout.grid, 1 if layout.cls else 0
    keep = set(layout.layers if layers is None else layers)
    out = []
    for i, block in enumerate(layout.layers):
        if block not in keep:
            continue
        c = np.asarray(outputs["combine_weights"][i], dtype=np.float32)  # (m, E)
        dropped = np.asarray(outputs["dropped"][i], dtype=np.int64)  # (m,)
        entry: dict[str, Any] = {
            "layer": block,
            "router": layout.router,
            "combine": c[off:].reshape(g, g, layout.num_experts).tolist(),
            "dropped": dropped[off:].reshape(g, g).tolist(),
            "expert_load": np.asarray(outputs["expert_load"][i], dtype=np.int64).tolist(),
            "dropped_total": int(dropped.sum()),
            "tokens_without_expert": int((dropped == layout.experts_per_token).sum()),  # residual alone
        }
        if layout.cls:
            entry["cls_combine"], entry["cls_dropped"] = c[0].tolist(), int(dropped[0])
        out.append(entry)
    return out
