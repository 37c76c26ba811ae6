"""Batch-invariant forms of the models' layers on CPU: an image's outputs the same bits at every
batch size, so strict determinism can run a lone request at a padded shape of one.

What differs by batch size on CPU, found layer by layer (torch 2.13, MKL and oneDNN): the patch
convolution for a batch of one (oneDNN picks another algorithm), and every GEMM of fewer than four
rows (small-M kernels): the Soft MoE expert GEMMs (B x slots rows) and the heads (B rows). GEMMs of
four rows and more give each row the same bits whatever the row count.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .soft_moe import SoftMoE

MIN_GEMM_ROWS = 4  # on CPU, GEMMs of fewer rows take small-M kernels whose rows differ in the last bit


def set_batch_invariant(model: nn.Module, on: bool = True) -> nn.Module:
    """Forms whose per-image outputs do not depend on the batch size on CPU, for serving at small
    padded shapes (the server still proves every shape at start-up):

    * the patch embedding as one GEMM over the flattened patches instead of a convolution (the
      oneDNN convolution picks another algorithm for a batch of one);
    * every GEMM on at least ``MIN_GEMM_ROWS`` rows, zero rows padding the rest and their outputs
      dropped: the Soft MoE expert GEMMs (B * slots rows) and every ``nn.Linear`` whose input has
      fewer rows (the heads, on B rows).

    A batch of one then costs more than its unpadded time (its GEMMs run padded rows; batches of
    ``MIN_GEMM_ROWS`` and more cost the same in both forms), but less than running it at the
    smallest shape the stock forms prove (docs/benchmarks.md has the figures). Off (the default,
    and what exports carry): the convolution and GEMMs as they come.
    """
    for module in model.modules():
        if isinstance(module, SoftMoE):
            module.min_expert_rows = MIN_GEMM_ROWS if on else 0
        elif isinstance(module, nn.Linear):
            if on:
                module.forward = functools.partial(_linear_min_rows, module)
            else:
                module.__dict__.pop("forward", None)
        elif hasattr(module, "patch_form"):
            module.patch_form = "matmul" if on else "conv"
    return model


def _linear_min_rows(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` with the GEMM on at least ``MIN_GEMM_ROWS`` rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows < MIN_GEMM_ROWS:
        return F.linear(x, module.weight, module.bias)
    padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, MIN_GEMM_ROWS - rows))
    return F.linear(padded, module.weight, module.bias)[:rows].reshape(*x.shape[:-1], module.out_features)
