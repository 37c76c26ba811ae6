"""vmoe contrastive ``TextTransformer``: token embedding, encoder, pooling, head.

No attention mask (pad tokens are ordinary tokens; ``padding_mask_id`` masks the trailing padding
as transformers' SigLIP does when given an ``attention_mask``) and no sqrt(D) embedding scale; with
``pool_type='last'`` the output is position L-1, which the sticky-EOS tokenizer makes the EOS.
Pooling as vmoe's ``apply_pooling``: 'last' x[:, -1], 'first' x[:, 0], 'gap' mean and 'gmp' max
over positions, 'map' a MAP head (vmoe ``MapHead`` with the encoder's heads, MLP width, qk-norm).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import TEXT_POOLS, TextConfig
from .layers import Encoder
from .vit import MapHead


def padding_mask(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Keys a position may attend to, ``(B, 1, 1, L)`` bool: all but the trailing padding.

    The tokenizer pads with its EOS id, so the trailing run of ``pad_id`` starts with the EOS that
    ends the text: that one is kept (transformers' ``attention_mask`` marks it 1, the pads 0).
    """
    pos = torch.arange(input_ids.shape[-1], device=input_ids.device)  # (L,)
    last = torch.where(input_ids != pad_id, pos, -1).amax(dim=-1, keepdim=True)  # (B, 1): last non-pad, -1 if none
    return (pos <= last + 1)[:, None, None, :]


class TextTransformer(nn.Module):
    """``forward(input_ids)`` with int ids ``(B, L)`` returns ``(B, num_classes or D)``."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        if cfg.pool_type not in TEXT_POOLS:
            raise ValueError(f"unknown text pooling {cfg.pool_type!r}; expected one of {list(TEXT_POOLS)}")
        self.cfg = cfg
        enc = cfg.encoder
        d = enc.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.encoder = Encoder(enc, cfg.max_len)
        self.map_head = (
            MapHead(d, enc.num_heads, cfg.map_mlp_dim or enc.mlp_dim, enc.qk_norm) if cfg.pool_type == "map" else None
        )
        self.head = nn.Linear(d, cfg.num_classes) if cfg.num_classes else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != self.cfg.max_len:
            raise ValueError(f"input_ids must have length {self.cfg.max_len}, got {input_ids.shape[-1]}")
        mask = None if self.cfg.padding_mask_id is None else padding_mask(input_ids, self.cfg.padding_mask_id)
        x = self.encoder(self.embed(input_ids.long()), mask)  # (B, L, D)
        pool = self.cfg.pool_type
        if pool == "last":
            x = x[:, -1]  # (B, D)
        elif pool == "first":
            x = x[:, 0]
        elif pool == "gap":
            x = x.mean(dim=1)
        elif pool == "gmp":
            x = x.amax(dim=1)
        else:
            assert self.map_head is not None
            x = self.map_head(x)
        return self.head(x) if self.head is not None else x
