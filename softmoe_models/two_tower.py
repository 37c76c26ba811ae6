"""vmoe contrastive ``TwoTower`` (LiT / SigLIP-style image-text model).

    zimg = img / (||img|| + 1e-8),  ztxt = txt / (||txt|| + 1e-8)
    logits[i, j] = exp(s) * <zimg_i, ztxt_j> + b
``sigmoid(logits)`` is the calibrated match probability (SigLIP loss).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import TwoTowerConfig
from .text import TextTransformer
from .vit import VisionTransformer

EMBED_EPS = 1e-8


def normalize_embeddings(z: torch.Tensor) -> torch.Tensor:
    """vmoe's normalisation: eps added to the norm, not inside a sqrt."""
    return z / (torch.linalg.vector_norm(z, dim=-1, keepdim=True) + EMBED_EPS)


class TwoTower(nn.Module):
    """Image tower (``image.*``) and text tower (``text.*``) with a learned scale and bias."""

    def __init__(self, cfg: TwoTowerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.image = VisionTransformer(cfg.image)
        self.text = TextTransformer(cfg.text)
        self.s = nn.Parameter(torch.tensor(math.log(10.0)))  # log of the logit scale
        self.b = nn.Parameter(torch.tensor(-10.0)) if cfg.has_bias else None

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.s.exp()

    @property
    def logit_bias(self) -> torch.Tensor:
        return self.b if self.b is not None else torch.zeros((), device=self.s.device)

    def encode_image(self, pixel_values: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        z = self.image(pixel_values)
        return normalize_embeddings(z) if normalize else z

    def encode_text(self, input_ids: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        z = self.text(input_ids)
        return normalize_embeddings(z) if normalize else z

    def logits(self, zimg: torch.Tensor, ztxt: torch.Tensor) -> torch.Tensor:
        """Pairwise logits ``(num_images, num_texts)`` from normalised embeddings."""
        return self.logit_scale * zimg @ ztxt.t() + self.logit_bias

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.logits(self.encode_image(pixel_values), self.encode_text(input_ids))
