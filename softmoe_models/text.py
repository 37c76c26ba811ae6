"""vmoe contrastive ``TextTransformer``: token embedding, encoder, pooling, head.

No attention mask (pad tokens are ordinary tokens) and no sqrt(D) embedding scale; with
``pool_type='last'`` the output is position L-1, which the sticky-EOS tokenizer makes the EOS.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import TextConfig
from .layers import Encoder


class TextTransformer(nn.Module):
    """``forward(input_ids)`` with int ids ``(B, L)`` returns ``(B, num_classes or D)``."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.encoder.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.encoder = Encoder(cfg.encoder, cfg.max_len)
        self.head = nn.Linear(d, cfg.num_classes) if cfg.num_classes else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != self.cfg.max_len:
            raise ValueError(f"input_ids must have length {self.cfg.max_len}, got {input_ids.shape[-1]}")
        x = self.encoder(self.embed(input_ids.long()))  # (B, L, D)
        if self.cfg.pool_type == "last":
            x = x[:, -1]
        elif self.cfg.pool_type == "first":
            x = x[:, 0]
        else:
            x = x.mean(dim=1)
        return self.head(x) if self.head is not None else x
