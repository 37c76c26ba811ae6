"""The Soft MoE layer, numerically as google-research/vmoe ``SoftRouter`` + ``MlpMoeBlock``.

Puigcerver et al., "From Sparse to Soft Mixtures of Experts", ICLR 2024,
https://arxiv.org/abs/2308.00951

Notation, per sequence (one image is one routing group):
    m  tokens        d  width        n  experts        p  slots per expert     s = n * p slots
    X  (m, d) tokens, mu (d, n, p) slot parameters, scale a learned scalar.

    Xn = X * rsqrt(sum_d X^2 + 1e-6)                 token L2 normalisation (vmoe's eps)
    Mn = mu * rsqrt(sum_d mu^2 + 1e-6)               per (expert, slot) column
    logits[m, n, p] = scale * Xn @ Mn                 (m, n, p)
    D = softmax over m (tokens), for every slot       dispatch weights
    C = softmax over (n, p) jointly, for every token  combine weights
    Xs[n, p] = sum_m D[m, n, p] * X[m]                slot inputs (un-normalised X)
    Ys[n, p] = Expert_n(Xs[n, p])                     tanh-GELU MLP, experts stacked [n, ...]
    Y[m] = sum_{n,p} C[m, n, p] * Ys[n, p]

Two code paths behind one flag (``fused``):
  * reference: the paper's einsums, the layer as written above;
  * fused: ``scale * Mn`` folded once into a constant slot matrix S (s, d); logits X̂ Sᵀ are
    computed once and shared by both softmaxes; dispatch and combine are two matmuls; experts are
    batched matmuls (``baddbmm``), or per-expert 2-D matmuls (``experts_form='per_expert'``),
    which ONNX Runtime CPU runs faster. No ``einsum`` on this path, so exports carry no Einsum.

``bf16_dispatch`` emulates vmoe's ``Bfloat16Dispatcher``: the data entering dispatch (X) and
leaving the experts (Ys) are rounded to bfloat16, weights and accumulation stay float32.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Literal

import torch
import torch.nn.functional as F
from torch import nn

NORM_EPS = 1e-6
ExpertsForm = Literal["batched", "per_expert"]


def l2_normalize(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + 1e-6)`` with the sum of squares in float32 (fp16 overflows)."""
    sq = x.float().pow(2).sum(dim=dim, keepdim=True)
    return (x.float() * torch.rsqrt(sq + NORM_EPS)).to(x.dtype)


def _bf16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


class _Capture(threading.local):
    """Per thread: which layers keep their routing internals, and the internals they kept. One
    model may run batches from several threads at once (the server's ``--concurrent-batches``): a
    call must see its own routing, never that of a call beside it."""

    def __init__(self) -> None:
        self.on: set[int] = set()
        self.internals: dict[int, dict[str, torch.Tensor]] = {}


_CAPTURE = _Capture()


class CapturesRouting:
    """``capture`` and ``internals`` of an MoE layer (Soft MoE or sparse): both per thread
    (``_Capture``), plain Python state that torch.export traces through; soft_moe.capture_routing
    switches them for either kind of layer."""

    @property
    def capture(self) -> bool:
        return id(self) in _CAPTURE.on

    @capture.setter
    def capture(self, on: bool) -> None:
        if on:
            _CAPTURE.on.add(id(self))
        else:
            _CAPTURE.on.discard(id(self))

    @property
    def internals(self) -> dict[str, torch.Tensor]:
        return _CAPTURE.internals.get(id(self), {})

    @internals.setter
    def internals(self, value: dict[str, torch.Tensor]) -> None:
        if value:
            _CAPTURE.internals[id(self)] = value
        else:
            _CAPTURE.internals.pop(id(self), None)


class SoftMoE(CapturesRouting, nn.Module):
    """Soft MoE MLP replacement: ``(B, m, d) -> (B, m, d)``, routed per sequence.

    Args:
        dim: token width d.
        num_experts: n.
        slots_per_expert: p.
        mlp_dim: expert hidden width.
        fused: use the fused fast path (default) instead of the reference einsums.
        bf16_dispatch: emulate vmoe's bfloat16 dispatcher.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        slots_per_expert: int,
        mlp_dim: int,
        fused: bool = True,
        bf16_dispatch: bool = False,
    ) -> None:
        super().__init__()
        n, p = num_experts, slots_per_expert
        self.dim, self.num_experts, self.slots_per_expert, self.mlp_dim = dim, n, p, mlp_dim
        self.fused = fused
        self.bf16_dispatch = bf16_dispatch
        self.experts_form: ExpertsForm = "batched"
        # The expert GEMMs run on at least this many rows (zero rows pad the rest, their outputs
        # dropped): on CPU, a GEMM of fewer than 4 rows takes a small-M kernel whose rows differ in
        # the last bit from the same rows in a larger GEMM. 0: no padding (exports). See
        # set_batch_invariant.
        self.min_expert_rows = 0
        self.capture = False  # when True, keep this thread's last call's routing internals in .internals
        self.internals = {}
        # Router (vmoe names: Router/mu, Router/scale).
        self.mu = nn.Parameter(torch.randn(dim, n, p) * dim**-0.5)  # (d, n, p), lecun normal
        self.scale = nn.Parameter(torch.ones(()))
        # Experts, stacked on the expert axis (vmoe Moe/Mlp/Dense_{0,1}, flax (in, out) layout).
        self.w1 = nn.Parameter(torch.randn(n, dim, mlp_dim) * dim**-0.5)  # (n, d, M)
        self.b1 = nn.Parameter(torch.zeros(n, mlp_dim))  # (n, M)
        self.w2 = nn.Parameter(torch.randn(n, mlp_dim, dim) * mlp_dim**-0.5)  # (n, M, d)
        self.b2 = nn.Parameter(torch.zeros(n, dim))  # (n, d)
        # Folded slot matrix S = (scale * Mn)^T, (s, d): a constant at inference.
        self.register_buffer("slots", torch.empty(0), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, _: module.fold())

    @property
    def num_slots(self) -> int:
        return self.num_experts * self.slots_per_expert

    @torch.no_grad()
    def fold(self) -> None:
        """Recompute the constant slot matrix from ``mu`` and ``scale`` (after loading)."""
        if self.mu.is_meta:
            return
        self.slots = self._slot_matrix().contiguous()  # (s, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            if self.training:  # the folded constant has no gradient: train on the live slot matrix
                return self._forward_fused(x, self._slot_matrix())
            if self.slots.numel() == 0 or self.slots.device != x.device:
                self.fold()
            return self._forward_fused(x, self.slots)
        return self._forward_reference(x)

    def _slot_matrix(self) -> torch.Tensor:
        """``(scale * normalize(mu))^T``, (s, d), differentiable."""
        mn = l2_normalize(self.mu.float(), dim=0)
        return (self.scale.float() * mn).reshape(self.dim, self.num_slots).t().to(self.mu.dtype)

    # ------------------------------------------------------------------ reference path

    def _forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        b, m, d = x.shape
        n, p = self.num_experts, self.slots_per_expert
        xn = l2_normalize(x)  # (B, m, d)
        mn = l2_normalize(self.mu, dim=0)  # (d, n, p)
        logits = torch.einsum("bmd,dnp->bmnp", xn, self.scale * mn).float()  # (B, m, n, p)
        dispatch = logits.softmax(dim=1).to(x.dtype)  # over tokens (softmax in float32)
        combine = logits.reshape(b, m, n * p).softmax(dim=-1).reshape(b, m, n, p).to(x.dtype)  # over slots
        xd = _bf16_round(x) if self.bf16_dispatch else x
        slot_in = torch.einsum("bmnp,bmd->bnpd", dispatch, xd)  # (B, n, p, d)
        h = torch.einsum("bnpd,ndh->bnph", slot_in, self.w1) + self.b1[None, :, None, :]
        h = F.gelu(h, approximate="tanh")
        expert_out = torch.einsum("bnph,nhd->bnpd", h, self.w2) + self.b2[None, :, None, :]
        yd = _bf16_round(expert_out) if self.bf16_dispatch else expert_out
        y = torch.einsum("bmnp,bnpd->bmd", combine, yd)  # (B, m, d)
        if self.capture:
            self.internals = dict(
                dispatch_weights=dispatch, combine_weights=combine,
                slot_in=slot_in, expert_out=expert_out,
            )
        return y

    # ------------------------------------------------------------------ fused path

    def _forward_fused(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        b, m, d = x.shape
        n, p, s = self.num_experts, self.slots_per_expert, self.num_slots
        xn = l2_normalize(x)  # (B, m, d)
        logits = torch.matmul(xn, slots.t()).float()  # (B, m, s), computed once
        dispatch = logits.softmax(dim=1).to(x.dtype)  # over tokens (softmax in float32)
        combine = logits.softmax(dim=2).to(x.dtype)  # over slots
        xd = _bf16_round(x) if self.bf16_dispatch else x
        slot_in = torch.matmul(dispatch.transpose(1, 2), xd)  # (B, s, d)
        expert_out = self._experts(slot_in.view(b, n, p, d))  # (B, n, p, d)
        yd = _bf16_round(expert_out) if self.bf16_dispatch else expert_out
        y = torch.matmul(combine, yd.reshape(b, s, d))  # (B, m, d)
        if self.capture:
            self.internals = dict(
                dispatch_weights=dispatch.view(b, m, n, p),
                combine_weights=combine.view(b, m, n, p),
                slot_in=slot_in.view(b, n, p, d),
                expert_out=expert_out,
            )
        return y

    def _experts(self, xs: torch.Tensor) -> torch.Tensor:
        """``(B, n, p, d) -> (B, n, p, d)``: expert e applied to its p slots of every sequence."""
        b, n, p, d = xs.shape
        per_expert = xs.transpose(0, 1).reshape(n, b * p, d)  # (n, B*p, d)
        rows = b * p
        if rows < self.min_expert_rows:
            per_expert = F.pad(per_expert, (0, 0, 0, self.min_expert_rows - rows))
        if self.experts_form == "per_expert":
            outs = []
            for e in range(n):  # export-only form: ONNX Runtime prepacks constant 2-D MatMuls
                h = F.gelu(torch.addmm(self.b1[e], per_expert[e], self.w1[e]), approximate="tanh")
                outs.append(torch.addmm(self.b2[e], h, self.w2[e]))
            y = torch.stack(outs)  # (n, B*p, d)
        else:
            h = torch.baddbmm(self.b1.unsqueeze(1), per_expert, self.w1)  # (n, B*p, M)
            h = F.gelu(h, approximate="tanh")
            y = torch.baddbmm(self.b2.unsqueeze(1), h, self.w2)  # (n, B*p, d)
        if rows < self.min_expert_rows:
            y = y[:, :rows]
        return y.reshape(n, b, p, d).transpose(0, 1)


def soft_moe_layers(model: nn.Module) -> list[SoftMoE]:
    """The Soft MoE layers of ``model`` in forward order."""
    return [m for m in model.modules() if isinstance(m, SoftMoE)]


@contextlib.contextmanager
def capture_routing(layers: list[SoftMoE]) -> Iterator[list[SoftMoE]]:
    """Keep each layer's routing internals of the calls this thread makes inside the block (``.internals``:
    ``dispatch_weights`` and ``combine_weights`` as ``(B, m, n, p)``, the very tensors the
    forward pass multiplies with, so the numerics of both paths are untouched). Restores the
    flags and drops the tensors on exit; traceable by ``torch.export`` (plain Python state)."""
    before = [layer.capture for layer in layers]
    for layer in layers:
        layer.capture = True
    try:
        yield layers
    finally:
        for layer, flag in zip(layers, before):
            layer.capture = flag
            if not flag:
                layer.internals = {}


def configure_routing(
    model: nn.Module,
    fused: bool | None = None,
    bf16_dispatch: bool | None = None,
    experts_form: ExpertsForm | None = None,
) -> nn.Module:
    """Set the routing path of every Soft MoE layer in ``model``; returns ``model``."""
    for module in model.modules():
        if isinstance(module, SoftMoE):
            if fused is not None:
                module.fused = fused
            if bf16_dispatch is not None:
                module.bf16_dispatch = bf16_dispatch
            if experts_form is not None:
                module.experts_form = experts_form
    return model
