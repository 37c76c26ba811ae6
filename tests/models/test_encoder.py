"""The generic Soft MoE sequence encoder (Axon ``SoftMoE.build`` interface)."""

from __future__ import annotations

import pytest
import torch

from softmoe_models import encoder
from softmoe_models.soft_moe import SoftMoE


def test_defaults_match_the_builder():
    model = encoder.build(embed_dim=12)
    cfg = model.cfg
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_layers, cfg.dropout, cfg.seq_len) == (256, 4, 4, 0.1, 60)
    assert len(model.blocks) == 4
    assert all(isinstance(b.moe, SoftMoE) for b in model.blocks)


@pytest.mark.parametrize("embed_dim,hidden,experts,layers,seq", [(12, 32, 4, 2, 60), (32, 32, 2, 1, 7), (5, 16, 8, 3, 20)])
def test_shapes(embed_dim, hidden, experts, layers, seq):
    model = encoder.build(embed_dim=embed_dim, hidden_size=hidden, num_experts=experts, num_layers=layers, seq_len=seq).eval()
    out = model(torch.randn(3, seq, embed_dim))
    assert out.shape == (3, hidden)
    assert encoder.output_size(hidden_size=hidden) == hidden
    assert isinstance(model.input_proj, torch.nn.Identity) == (embed_dim == hidden)


def test_window_size_alias_and_output_size_default():
    assert encoder.build(embed_dim=4, window_size=30).cfg.seq_len == 30
    assert encoder.output_size() == 256


def test_standalone_block_and_per_sequence_independence():
    block = encoder.soft_moe_block(16, num_experts=4, dropout=0.0).eval()
    x = torch.randn(4, 10, 16)
    with torch.no_grad():
        y = block(x)
        assert y.shape == x.shape
        assert (block(x[2:3])[0] - y[2]).abs().max() <= 1e-6


def test_wrong_input_width_is_a_clear_error():
    model = encoder.build(embed_dim=8, hidden_size=16, num_layers=1)
    with pytest.raises(ValueError, match=r"\(batch, seq_len, 8\)"):
        model(torch.randn(2, 5, 9))
