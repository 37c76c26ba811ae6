"""What the experts of a Soft MoE image model see: routing maps, statistics, reference profiles, drift.

Per Soft MoE layer and image (m tokens, n experts, p slots per expert, s = n * p slots; slot j
belongs to expert j // p; tokens are row-major over the patch grid, after the cls token if any):

    dispatch  D (m, s)  softmax over the tokens, per slot: slot j reads sum_t D[t, j] X[t]
    combine   C (m, s)  softmax over the slots, per token: token t gets sum_j C[t, j] Y[j]

Statistics per image and layer (the paper's analysis section measures how many tokens a slot
mixes and how much each expert contributes; these are the cheap, bounded versions of that):

    dispatch_entropy  mean over slots of H(D[:, j]) / log m    1: a slot averages every patch evenly
    combine_entropy   mean over tokens of H(C[t, :]) / log s   1: a token mixes every slot evenly
    expert_share      (n,) sum_t sum_{j of e} C[t, j] / m      expert e's share of the layer's output
                                                               mass (sums to 1 over experts)

Reference profile (``routing_profile.json`` in the package, computed here from calibration pixels
the caller gives: ``softmoe_models.demo.calibration`` picks them): per layer, the mean and
variance over images of the expert shares and the mean and std of both entropies.

Drift: the live window is the last W sampled images. Its divergence from the profile is the
Jensen-Shannon divergence (bits) between the window's mean expert shares and the profile's,
averaged over layers. Sampling noise alone gives an in-distribution window of k images about
``sum_e var_e / mean_e * (1/k + 1/N) / (8 ln 2)`` bits (N calibration images; the chi-square
expansion of JS): ``baseline``, so drift / baseline is ~1 in distribution whatever the model.

``write_profile`` stores the profile as ``PKG/routing_profile.json`` and names it, with its sha256, in
``PKG/config.json`` (the command: ``python -m softmoe_models.routing_cli profile PKG``). The
paper-style picture of the maps is drawn by :mod:`softmoe_models.routing_png`. Nothing here
imports the server.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from . import sparse_routing
from .config import TwoTowerConfig, ViTConfig
from .soft_moe import capture_routing, soft_moe_layers

PROFILE_FORMAT = "softmoe-routing-profile"
PROFILE_FILE = "routing_profile.json"
# The extra outputs of a routing graph, after the plain graph's own (names are the wire contract).
OUTPUTS = ("dispatch_weights", "combine_weights", "dispatch_entropy", "combine_entropy", "expert_share")
STATS = ("dispatch_entropy", "combine_entropy", "expert_share")


@dataclass(frozen=True)
class Layout:
    """Where the routing of an image model lives and how its tokens map onto the image."""

    layers: tuple[int, ...]  # encoder block index of every Soft MoE layer, in forward order
    num_experts: int  # n
    slots_per_expert: int  # p
    grid: int  # patches per side
    cls: bool  # a cls token precedes the patches (token 0)
    image_size: int

    @property
    def num_slots(self) -> int:
        return self.num_experts * self.slots_per_expert

    @property
    def tokens(self) -> int:
        return self.grid * self.grid + (1 if self.cls else 0)


def layout_for(cfg: Any) -> Layout | None:
    """The routing layout of a model config (a classifier, or a two-tower's image tower); None
    when the image model has no Soft MoE layer or the model takes no images."""
    image = cfg.image if isinstance(cfg, TwoTowerConfig) else cfg if isinstance(cfg, ViTConfig) else None
    moe = image.encoder.moe if image is not None else None
    if moe is None or not moe.layers or moe.sparse:
        return None
    return Layout(tuple(sorted(moe.layers)), moe.num_experts, moe.slots_per_expert, image.grid,
                  image.classifier == "token", image.image_size)


def any_layout(cfg: Any):
    """The routing layout of an image model's MoE layers: a :class:`Layout` (Soft MoE), a
    ``sparse_routing.SparseLayout`` (sparse V-MoE), or None when it has none."""
    return layout_for(cfg) or sparse_routing.layout_for(cfg)


def outputs_of(layout: Any) -> tuple[str, ...]:
    """The extra outputs of the routing graph of ``layout``'s model, after the plain ones."""
    return OUTPUTS if isinstance(layout, Layout) else sparse_routing.OUTPUTS


def stats_of(layout: Any) -> tuple[str, ...]:
    """The per-image statistics among them (the server keeps these from sampled calls)."""
    return STATS if isinstance(layout, Layout) else sparse_routing.STATS


def any_routing_of(model: torch.nn.Module, pixels: np.ndarray | torch.Tensor) -> dict[str, np.ndarray]:
    """``routing_of`` or ``sparse_routing.routing_of``, by the model's MoE layers."""
    return routing_of(model, pixels) if layout_for(model.cfg) is not None else sparse_routing.routing_of(model, pixels)


def any_image_routing(layout: Any, outputs: dict[str, np.ndarray], layers: Sequence[int] | None = None) -> list[dict]:
    """``image_routing`` or ``sparse_routing.image_routing``, by ``layout``'s kind."""
    if isinstance(layout, Layout):
        return image_routing(layout, outputs, layers)
    return sparse_routing.image_routing(layout, outputs, layers)


# ------------------------------------------------------------------ in the graph (torch)


def stack_routing(layers: Sequence[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor]:
    """The captured ``(B, L, m, s)`` dispatch and combine weights of ``layers`` (float32)."""
    d = [layer.internals["dispatch_weights"].flatten(2) for layer in layers]  # (B, m, s) each
    c = [layer.internals["combine_weights"].flatten(2) for layer in layers]
    return torch.stack(d, dim=1).float(), torch.stack(c, dim=1).float()


def routing_statistics(dispatch: torch.Tensor, combine: torch.Tensor, num_experts: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B, L, m, s)`` weights -> dispatch_entropy ``(B, L)``, combine_entropy ``(B, L)``,
    expert_share ``(B, L, n)``: a few reductions, float32 (a weight of 0 contributes 0)."""
    m, s = dispatch.shape[-2], dispatch.shape[-1]
    tiny = torch.finfo(torch.float32).tiny
    h_dispatch = -(dispatch * dispatch.clamp_min(tiny).log()).sum(dim=2).mean(dim=2) / max(math.log(m), 1e-12)
    h_combine = -(combine * combine.clamp_min(tiny).log()).sum(dim=3).mean(dim=2) / max(math.log(s), 1e-12)
    share = combine.unflatten(-1, (num_experts, s // num_experts)).sum(dim=(2, 4)) / m  # (B, L, n)
    return h_dispatch, h_combine, share


@torch.no_grad()
def routing_of(model: torch.nn.Module, pixels: np.ndarray | torch.Tensor) -> dict[str, np.ndarray]:
    """The torch model's own routing for a batch of pixel values: every name in ``OUTPUTS``
    (``(B, L, m, s)`` weights and the statistics), the reference the served maps are checked against."""
    image = getattr(model, "image", model)  # a two-tower's image tower
    layers = soft_moe_layers(image)
    n = layers[0].num_experts
    x = torch.as_tensor(pixels, dtype=torch.float32)
    with capture_routing(layers):
        image(x.to(next(image.parameters()).dtype))
        dispatch, combine = stack_routing(layers)
    stats = routing_statistics(dispatch, combine, n)
    return {k: v.numpy() for k, v in zip(OUTPUTS, (dispatch, combine, *stats))}


# ------------------------------------------------------------------ per image, for clients


def image_routing(layout: Layout, outputs: dict[str, np.ndarray], layers: Sequence[int] | None = None) -> list[dict]:
    """One image's routing as JSON-ready dicts, one per Soft MoE layer (``layers``: block indices
    to keep, default all): ``dispatch[slot][row][col]`` (sums to 1 over the patches, plus
    ``cls_dispatch`` when there is a cls token), ``combine[row][col][slot]`` (sums to 1 over the
    slots), and the layer's statistics."""
    g, off = layout.grid, 1 if layout.cls else 0
    keep = set(layout.layers if layers is None else layers)
    out = []
    for i, block in enumerate(layout.layers):
        if block not in keep:
            continue
        d = np.asarray(outputs["dispatch_weights"][i], dtype=np.float32)  # (m, s)
        c = np.asarray(outputs["combine_weights"][i], dtype=np.float32)
        entry: dict[str, Any] = {
            "layer": block,
            "dispatch": d[off:].T.reshape(layout.num_slots, g, g).tolist(),
            "combine": c[off:].reshape(g, g, layout.num_slots).tolist(),
            "dispatch_entropy": float(outputs["dispatch_entropy"][i]),
            "combine_entropy": float(outputs["combine_entropy"][i]),
            "expert_share": np.asarray(outputs["expert_share"][i], dtype=np.float32).tolist(),
        }
        if layout.cls:
            entry["cls_dispatch"], entry["cls_combine"] = d[0].tolist(), c[0].tolist()
        out.append(entry)
    return out


# ------------------------------------------------------------------ profile and drift


def js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence in bits (0..1) between two distributions on the same support."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float((a[nz] * np.log2(a[nz] / m[nz])).sum())

    return max(0.0, 0.5 * kl(p) + 0.5 * kl(q))


def compute_profile(model: torch.nn.Module, pixels: np.ndarray, source: str, batch: int = 64) -> dict[str, Any]:
    """The reference routing profile of ``model`` on calibration ``pixels`` ``(N, 3, H, W)``."""
    layout = any_layout(model.cfg)
    assert layout is not None, "the model has no MoE image layers"
    parts: dict[str, list[np.ndarray]] = {k: [] for k in STATS}
    for start in range(0, len(pixels), batch):
        out = any_routing_of(model, pixels[start:start + batch])
        for k in STATS:
            parts[k].append(out[k])
    hd, hc, share = (np.concatenate(parts[k]).astype(np.float64) for k in STATS)  # (N, L), (N, L), (N, L, n)

    def r(a: np.ndarray) -> list:
        return np.vectorize(lambda v: float(f"{v:.7g}"))(a).tolist()

    return {
        "format": PROFILE_FORMAT,
        "format_version": 1,
        "calibration": {"source": source, "images": int(len(pixels))},
        "layers": list(layout.layers),
        "num_experts": layout.num_experts,
        **({"slots_per_expert": layout.slots_per_expert} if isinstance(layout, Layout) else {"router": layout.router}),
        "expert_share": {"mean": r(share.mean(0)), "var": r(share.var(0))},
        "dispatch_entropy": {"mean": r(hd.mean(0)), "std": r(hd.std(0))},
        "combine_entropy": {"mean": r(hc.mean(0)), "std": r(hc.std(0))},
    }


def check_profile(profile: dict[str, Any], layout: Layout) -> None:
    """Raise ValueError unless ``profile`` is a routing profile for ``layout``."""
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        raise ValueError("not a softmoe routing profile")
    if list(profile.get("layers", [])) != list(layout.layers) or profile.get("num_experts") != layout.num_experts:
        raise ValueError(f"profile for layers {profile.get('layers')} x {profile.get('num_experts')} experts; "
                         f"the model has {list(layout.layers)} x {layout.num_experts}")
    shape = np.asarray(profile["expert_share"]["mean"]).shape
    if shape != (len(layout.layers), layout.num_experts):
        raise ValueError(f"profile expert_share has shape {shape}")


class Window:
    """The expert shares of the last ``size`` sampled images, and their drift from a profile."""

    def __init__(self, size: int, layers: int, experts: int) -> None:
        self.size = size
        self._shares = np.zeros((size, layers, experts), dtype=np.float64)
        self._next = 0
        self.count = 0

    def add(self, shares: np.ndarray) -> None:
        """Append ``(k, L, n)`` per-image expert shares (the oldest fall out)."""
        rows = np.asarray(shares, dtype=np.float64).reshape((-1, *self._shares.shape[1:]))[-self.size:]
        idx = (self._next + np.arange(len(rows))) % self.size
        self._shares[idx] = rows
        self._next = int((self._next + len(rows)) % self.size)
        self.count = min(self.count + len(rows), self.size)

    def mean(self) -> np.ndarray:
        """``(L, n)`` mean expert shares of the window (zeros while empty)."""
        if self.count == 0:
            return np.zeros(self._shares.shape[1:])
        return self._shares[: self.count].mean(axis=0) if self.count < self.size else self._shares.mean(axis=0)

    def drift(self, profile: dict[str, Any]) -> float:
        """JS divergence (bits) of the window's mean shares from the profile's, averaged over layers."""
        if self.count == 0:
            return 0.0
        ref = np.asarray(profile["expert_share"]["mean"], dtype=np.float64)
        return float(np.mean([js_divergence(live, want) for live, want in zip(self.mean(), ref)]))

    def baseline(self, profile: dict[str, Any]) -> float:
        """The drift sampling noise alone gives a window of this many in-distribution images."""
        ref = np.asarray(profile["expert_share"]["mean"], dtype=np.float64)
        var = np.asarray(profile["expert_share"]["var"], dtype=np.float64)
        n_cal = max(1, int(profile.get("calibration", {}).get("images", 1)))
        chi2 = (var / np.maximum(ref, 1e-12)).sum(axis=1)  # per layer
        return float(np.mean(chi2) * (1 / max(1, self.count) + 1 / n_cal) / (8 * math.log(2)))


# ------------------------------------------------------------------ the profile in the package


def write_profile(package: str | Path, profile: dict[str, Any]) -> Path:
    """Write ``routing_profile.json`` into ``package`` and name it, with its sha256, in config.json."""
    package = Path(package)
    path = package / PROFILE_FILE
    data = (json.dumps(profile, indent=1) + "\n").encode()
    path.write_bytes(data)
    cfg_file = package / "config.json"
    meta = json.loads(cfg_file.read_text())
    meta["routing_profile"] = {"file": PROFILE_FILE, "sha256": hashlib.sha256(data).hexdigest()}
    cfg_file.write_text(json.dumps(meta, indent=2) + "\n")
    return path
