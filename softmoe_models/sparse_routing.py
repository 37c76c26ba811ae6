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

Statistics per image and layer, under the Soft MoE names so the server's histograms, window and
drift take them unchanged (``STATS``):

    dispatch_entropy  mean over the experts that took any token of H(C[:, e] / sum_t C[t, e]) / log m:
                      how evenly an expert's combine mass spreads over the image's tokens
    combine_entropy   mean over tokens of H(C[t, :]) / log E (a dropped token's row is 0: entropy 0)
    expert_share      (E,) sum_t C[t, e] / sum C: expert e's share of the layer's combine mass
    dropped_choices   the token choices that found no room (Experts Choice: the untaken tokens),
                      out of ``layout.choices`` per image

The plain forward pass keeps none of this: ``routing_of`` runs the model with the layers'
capture switched on (soft_moe.capture_routing, shared with the Soft MoE layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import math

import numpy as np
import torch

from .config import TwoTowerConfig, ViTConfig
from .soft_moe import capture_routing
from .sparse_moe import sparse_moe_layers

# The routing outputs, per image ``(L, ...)`` (names are the wire contract, as routing.OUTPUTS):
# the maps, then the statistics.
STATS = ("dispatch_entropy", "combine_entropy", "expert_share", "dropped_choices")
OUTPUTS = ("combine_weights", "dropped", "expert_load", *STATS)


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

    @property
    def choices(self) -> int:
        """Token choices per image and layer that may be dropped: m K (Experts Choice: m tokens)."""
        return self.tokens * self.experts_per_token


def layout_for(cfg: Any) -> SparseLayout | None:
    """The sparse routing layout of a model config (a classifier, or a two-tower's image tower);
    None when its image model has no sparse MoE layer or the model takes no images."""
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


def routing_statistics(combine: torch.Tensor, dropped: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B, L, m, E)`` combine weights and ``(B, L, m)`` dropped counts -> dispatch_entropy,
    combine_entropy ``(B, L)``, expert_share ``(B, L, E)``, dropped_choices ``(B, L)`` (float32)."""
    m, e = combine.shape[-2], combine.shape[-1]
    tiny = torch.finfo(torch.float32).tiny
    mass = combine.sum(dim=2)  # (B, L, E)
    p = combine / mass.clamp_min(tiny).unsqueeze(2)
    per_expert = -(p * p.clamp_min(tiny).log()).sum(dim=2) / max(math.log(m), 1e-12)  # (B, L, E)
    used = (mass > 0).float()
    h_dispatch = (per_expert * used).sum(dim=-1) / used.sum(dim=-1).clamp_min(1)
    h_combine = -(combine * combine.clamp_min(tiny).log()).sum(dim=3).mean(dim=2) / max(math.log(e), 1e-12)
    share = mass / mass.sum(dim=-1, keepdim=True).clamp_min(tiny)
    return h_dispatch, h_combine, share, dropped.sum(dim=2).float()


@torch.no_grad()
def routing_of(model: torch.nn.Module, pixels: np.ndarray | torch.Tensor) -> dict[str, np.ndarray]:
    """The torch model's own sparse routing for a batch of pixel values: every name in ``OUTPUTS``,
    ``(B, L, m, E)``, ``(B, L, m)``, ``(B, L, E)``."""
    image = getattr(model, "image", model)  # a two-tower's image tower
    layers = sparse_moe_layers(image)
    if not layers:
        raise ValueError("the model has no sparse MoE layers")
    x = torch.as_tensor(pixels, dtype=torch.float32)
    with capture_routing(layers):
        image(x.to(next(image.parameters()).dtype))
        combine, dropped, load = stack_routing(layers)
    stats = routing_statistics(combine, dropped)
    return {k: v.numpy() for k, v in zip(OUTPUTS, (combine, dropped, load, *stats))}


# ------------------------------------------------------------------ per image, for clients


def image_routing(layout: SparseLayout, outputs: dict[str, np.ndarray], layers: Sequence[int] | None = None
                  ) -> list[dict]:
    """One image's sparse routing as JSON-ready dicts, one per sparse MoE layer (``layers``: block
    indices to keep, default all): ``combine[token][expert]`` (the cls token first when the model
    has one, then the patches row-major; 0 where the token was not dispatched), ``dropped[token]``
    (its choices that found no room; Experts Choice: 1 when no expert took it), ``expert_load``
    (tokens per expert), the layer's totals and statistics."""
    keep = set(layout.layers if layers is None else layers)
    out = []
    for i, block in enumerate(layout.layers):
        if block not in keep:
            continue
        c = np.asarray(outputs["combine_weights"][i], dtype=np.float32)  # (m, E)
        dropped = np.asarray(outputs["dropped"][i], dtype=np.int64)  # (m,)
        out.append({
            "layer": block,
            "router": layout.router,
            "combine": c.tolist(),
            "dropped": dropped.tolist(),
            "expert_load": np.asarray(outputs["expert_load"][i], dtype=np.int64).tolist(),
            "dropped_total": int(dropped.sum()),
            "tokens_without_expert": int((dropped == layout.experts_per_token).sum()),  # residual alone
            "dispatch_entropy": float(outputs["dispatch_entropy"][i]),
            "combine_entropy": float(outputs["combine_entropy"][i]),
            "expert_share": np.asarray(outputs["expert_share"][i], dtype=np.float32).tolist(),
        })
    return out
