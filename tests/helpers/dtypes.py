"""Records the dtype torch functions see (fp32 norms and softmax under fp16/bf16)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class Dtypes(TorchFunctionMode):
    """Records the input dtype of every LayerNorm, softmax and rsqrt call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("layer_norm", "softmax", "rsqrt") and args and isinstance(args[0], torch.Tensor):
            self.seen.append((name, args[0].dtype))
        return func(*args, **(kwargs or {}))
