"""A generic Soft MoE sequence encoder with the builder interface of Elixir/Axon ``SoftMoE.build``.

    build(embed_dim=..., hidden_size=256, num_experts=4, num_layers=4, dropout=0.1, seq_len=60)
    input (batch, seq_len, embed_dim) -> output (batch, hidden_size)

Architecture: a Dense input projection when ``embed_dim != hidden_size``; ``num_layers``
pre-norm residual blocks ``x + Dropout(SoftMoE(LN(x)))`` (the same Soft MoE layer as the image
models, experts ``4 * hidden_size`` wide); a final LayerNorm; the last timestep as output.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import SeqEncoderConfig
from .layers import layer_norm
from .soft_moe import SoftMoE


class SoftMoEBlock(nn.Module):
    """``x + Dropout(SoftMoE(LayerNorm(x)))``."""

    def __init__(
        self, hidden_size: int, num_experts: int = 4, dropout: float = 0.1,
        slots_per_expert: int = 1, expert_mult: int = 4,
    ) -> None:
        super().__init__()
        self.norm = layer_norm(hidden_size)
        self.moe = SoftMoE(hidden_size, num_experts, slots_per_expert, expert_mult * hidden_size)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.moe(self.norm(x)))


def soft_moe_block(
    hidden_size: int, num_experts: int = 4, dropout: float = 0.1, slots_per_expert: int = 1,
) -> SoftMoEBlock:
    """A standalone Soft MoE block, ``(B, L, hidden_size) -> (B, L, hidden_size)``."""
    return SoftMoEBlock(hidden_size, num_experts, dropout, slots_per_expert)


class SoftMoESequenceEncoder(nn.Module):
    """``(B, seq_len, embed_dim) -> (B, hidden_size)``."""

    def __init__(self, cfg: SeqEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_proj = (
            nn.Linear(cfg.embed_dim, cfg.hidden_size) if cfg.embed_dim != cfg.hidden_size else nn.Identity()
        )
        self.blocks = nn.ModuleList(
            SoftMoEBlock(cfg.hidden_size, cfg.num_experts, cfg.dropout, cfg.slots_per_expert, cfg.expert_mult)
            for _ in range(cfg.num_layers)
        )
        self.norm = layer_norm(cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.cfg.embed_dim:
            raise ValueError(f"expected (batch, seq_len, {self.cfg.embed_dim}), got {tuple(x.shape)}")
        x = self.input_proj(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)[:, -1]


def build(
    embed_dim: int, hidden_size: int = 256, num_experts: int = 4, num_layers: int = 4,
    dropout: float = 0.1, seq_len: int = 60, window_size: int | None = None,
) -> SoftMoESequenceEncoder:
    """Build the encoder; ``window_size`` is accepted as an alias of ``seq_len``."""
    cfg = SeqEncoderConfig(
        embed_dim=embed_dim, hidden_size=hidden_size, num_experts=num_experts,
        num_layers=num_layers, dropout=dropout, seq_len=window_size or seq_len,
    )
    return SoftMoESequenceEncoder(cfg)


def output_size(hidden_size: int = 256, **_: object) -> int:
    """Width of the encoder's output for the given build options."""
    return hidden_size
