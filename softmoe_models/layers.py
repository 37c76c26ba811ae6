"""Transformer building blocks with vmoe's numerics (flax defaults, vit_jax MlpBlock).

LayerNorm eps is 1e-6 (flax), GELU is the tanh approximation, attention has an optional
per-head LayerNorm on queries and keys (scale only, shared across heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import EncoderConfig
from .soft_moe import SoftMoE
from .sparse_moe import SparseMoE

LN_EPS = 1e-6


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that normalises in float32 whatever the input dtype, then returns the
    input dtype: fp16/bf16 models keep fp32 statistics. Float32 inputs take the parent's path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def layer_norm(dim: int, bias: bool = True) -> nn.LayerNorm:
    return LayerNorm(dim, eps=LN_EPS, bias=bias)


class Mlp(nn.Module):
    """Dense -> tanh-GELU -> Dense (vit_jax ``MlpBlock``); dropout is off at inference."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x), approximate="tanh"))))


class Attention(nn.Module):
    """Multi-head dot-product attention, no mask (flax ``MultiHeadDotProductAttention``).

    Separate q/k/v projections keep vmoe's ``(D, H, Dh)`` kernels a plain reshape away, and
    cross-attention (the MAP head's probe) uses the same module.
    """

    def __init__(self, dim: int, num_heads: int, qk_norm: bool) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.q_norm = layer_norm(self.head_dim, bias=False) if qk_norm else nn.Identity()
        self.k_norm = layer_norm(self.head_dim, bias=False) if qk_norm else nn.Identity()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim)  # (B, N, H, Dh)

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: optional bool ``(B, 1, 1, Nk)``, True where a key may be attended (None: all; vmoe)."""
        kv = x if kv is None else kv
        q = self.q_norm(self._heads(self.q(x))).transpose(1, 2)  # (B, H, Nq, Dh)
        k = self.k_norm(self._heads(self.k(kv))).transpose(1, 2)  # (B, H, Nk, Dh)
        v = self._heads(self.v(kv)).transpose(1, 2)
        if q.shape[2] == 1:
            # One query (the MAP head's probe): torch's CPU SDPA kernel shares such calls out over
            # threads so that a row's bits depend on its batch slot; the explicit form does not.
            s = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5  # (B, H, 1, Nk)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            o = torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # softmax(q k^T / sqrt(Dh)) v
        b, _, n, _ = o.shape
        return self.out(o.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class EncoderBlock(nn.Module):
    """Pre-LN block: ``x + Attn(LN0(x))`` then ``x + MLP(LN1(x))`` (or an MoE layer: Soft MoE, or
    vmoe's sparse one when ``cfg.moe.router`` is sparse)."""

    def __init__(self, cfg: EncoderConfig, moe: bool, dropout: float = 0.0) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.norm1 = layer_norm(d)
        self.attn = Attention(d, cfg.num_heads, cfg.qk_norm)
        self.norm2 = layer_norm(d)
        self.mlp: nn.Module
        if moe and cfg.moe is not None and cfg.moe.sparse:
            self.mlp = SparseMoE.from_config(d, cfg.moe, cfg.moe.mlp_dim or cfg.mlp_dim)
        elif moe:
            assert cfg.moe is not None
            self.mlp = SoftMoE(
                dim=d,
                num_experts=cfg.moe.num_experts,
                slots_per_expert=cfg.moe.slots_per_expert,
                mlp_dim=cfg.moe.mlp_dim or cfg.mlp_dim,
                bf16_dispatch=cfg.moe.dispatch_dtype == "bfloat16",
            )
        else:
            self.mlp = Mlp(d, cfg.mlp_dim, dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.mlp(self.norm2(x))


class Encoder(nn.Module):
    """vmoe ``EncoderMoe``: learned position embedding, blocks, final LayerNorm."""

    def __init__(self, cfg: EncoderConfig, num_tokens: int) -> None:
        super().__init__()
        moe_layers = set(cfg.moe.layers) if cfg.moe else set()
        bad = sorted(i for i in moe_layers if not 0 <= i < cfg.num_layers)
        if bad:
            raise ValueError(f"MoE layer indices {bad} outside 0..{cfg.num_layers - 1}")
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, cfg.hidden_size))
        self.blocks = nn.ModuleList(
            EncoderBlock(cfg, moe=i in moe_layers) for i in range(cfg.num_layers)
        )
        self.norm = layer_norm(cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: optional key mask passed to every block's attention (see ``Attention``)."""
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)
