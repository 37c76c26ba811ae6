"""vmoe's sparse MoE layers as vmoe evaluates them: Tokens Choice and Experts Choice routing.

Riquelme et al., "Scaling Vision with Sparse Mixture of Experts", NeurIPS 2021,
https://arxiv.org/abs/2106.05974 (Tokens Choice, batch priority routing); Zhou et al.,
"Mixture-of-Experts with Expert Choice Routing", NeurIPS 2022, https://arxiv.org/abs/2202.09368.
Numerics: google-research/vmoe ``MlpMoeBlock`` with ``NoisyTopExpertsPerItemRouter`` /
``NoisyTopItemsPerExpertRouter`` and the ``einsum`` dispatcher, deterministic (no router noise);
shared/docs/vmoe-sparse-reference.md sections 3-7.

Notation, per routing group (one image by default; ``group_images`` consecutive images to
reproduce vmoe's trained grouping):
    S  tokens in the group      d  width        E  experts        K  experts per token
    C  capacity per expert and group = compute_capacity(S*K (TC) or S (EC), E, cf, ...)

    gates = softmax_E(X @ W_router)                       (S, E), float32, no bias, no noise
  Tokens Choice (TC):
    top-K experts per token (ties: lower expert first); claims are taken choice-major (every
    token's 1st choice, then every 2nd choice, ...), tokens in position order or, with batch
    priority, in descending top-1 gate order (stable; the same order for every round); an
    expert numbers its claims 0, 1, ...: that is the claim's buffer slot, kept iff slot < C.
    Y[s] = sum over kept claims (s, e) of gates[s, e] * Expert_e(X[s])   (no renormalisation)
  Experts Choice (EC):
    every expert takes the C tokens with its largest gates (ties: lower token first), C <= S.
    Y[s] = sum over experts e that took s of gates[s, e] * Expert_e(X[s])
  A token no expert kept gets Y = 0: the block passes its residual alone.

Two code paths behind one flag (``fused``), sharing the routing decisions:
  * reference: vmoe's EinsumDispatcher, the (G, S, E, C) one-hot dispatch and combine tensors
    and two einsums (what the golden tests read the routing from);
  * fused (default): no (S, E, C) tensor. Tokens Choice (``tokens_form="routed"``): the kept
    claims of the batch sorted by expert, each expert's MLP over exactly its own rows (no empty
    capacity slot, no dropped claim computed), every claim reading its row back; the capacity
    form (``tokens_form="capacity"``, for benchmarks) runs each expert over its whole capacity
    buffer. Experts Choice: each expert over the C tokens it took, the outputs added into them.
    Row counts that follow the routing depend on the batch-mates; see ``row_block`` and
    ``routed_experts`` for how a row keeps its bits anyway (docs/routing.md).

``bf16_dispatch`` emulates vmoe's ``Bfloat16Dispatcher``: the tokens entering the buffers and the
expert outputs leaving them are rounded to bfloat16; gates, weights and sums stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .config import CapacityRounding, MoEConfig, Router, compute_capacity
from .soft_moe import CapturesRouting


TokensForm = Literal["routed", "capacity"]
MIN_ROW_BLOCK = 4  # softmoe_models.batch_invariance.MIN_GEMM_ROWS: CPU GEMMs of fewer rows take small-M kernels


def _bf16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


@torch.library.custom_op("softmoe::routed_experts", mutates_args=())
def routed_experts(rows: torch.Tensor, count: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                   b2: torch.Tensor, bf16: bool) -> torch.Tensor:
    """``(A, d) -> (A, d)``: expert e's MLP (``w1[e]``, ``b1[e]``, tanh GELU, ``w2[e]``, ``b2[e]``) on
    its ``count[e]`` rows, which follow expert e-1's; the rows after the last expert's come back as
    zeros; ``bf16``: the outputs rounded to bfloat16.

    What ``SparseMoE`` calls while exporting: one node whose output has the input's shape, where
    per-expert slices of data-dependent length would give torch.export an unbacked size per expert
    (measured: 148 s to export 32 experts of one tiny layer, 254 s for 64). ``export.onnx``
    writes each node out as a Slice and two constant Gemms per expert (``_routed_experts_nodes``).
    """
    out = torch.zeros_like(rows)
    start = 0
    for e, n in enumerate(count.tolist()):
        if n:
            h = F.gelu(torch.addmm(b1[e], rows[start:start + n], w1[e]), approximate="tanh")
            y = torch.addmm(b2[e], h, w2[e])
            out[start:start + n] = _bf16_round(y) if bf16 else y
            start += n
    return out


@routed_experts.register_fake
def _(rows, count, w1, b1, w2, b2, bf16):
    return torch.empty_like(rows)


def _top(x: torch.Tensor, k: int, dim: int, largest: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest (or smallest) values along ``dim`` and their indices, sorted, equal values
    in index order: ``jax.lax.top_k``'s tie rule, and a stable argsort's.

    Eager: a stable sort (``torch.topk`` breaks ties in no documented order; on CPU it does not
    put the lower index first). Exporting: ``topk``, since the stable sort has no ONNX form and
    ONNX TopK breaks ties by the lower index, the rule wanted (the exported torch program itself
    inherits torch's topk ties).
    """
    if torch.compiler.is_exporting():
        return torch.topk(x, k, dim=dim, largest=largest, sorted=True)
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


@dataclass(frozen=True)
class TokensChoice:
    """Tokens Choice routing of G groups, per (token, choice) in token order."""

    expert: torch.Tensor  # (G, S, K) int64: the token's k-th expert
    gate: torch.Tensor  # (G, S, K) float32: its softmax gate (the combine weight if kept)
    slot: torch.Tensor  # (G, S, K) int64: the claim's number at that expert (its buffer slot if kept)
    kept: torch.Tensor  # (G, S, K) bool: slot < capacity
    order: torch.Tensor  # (G, S) int64: tokens in claim priority order
    capacity: int  # C


@dataclass(frozen=True)
class ExpertsChoice:
    """Experts Choice routing of G groups, per (expert, slot)."""

    token: torch.Tensor  # (G, E, C) int64: the token in each slot (the c-th largest gate)
    gate: torch.Tensor  # (G, E, C) float32: its gate for that expert (the combine weight)
    capacity: int  # C


def tokens_choice(gates: torch.Tensor, k: int, capacity: int, batch_priority: bool = False) -> TokensChoice:
    """vmoe ``_get_top_experts_per_item_common`` (deterministic) on gates ``(G, S, E)``.

    Args:
        gates: softmax gates, float32.
        k: experts per token (K).
        capacity: C, claims each expert keeps per group.
        batch_priority: claim in descending top-1 gate order instead of position order.
    """
    g, s, e = gates.shape
    top_gate, top_expert = _top(gates, k, dim=-1)  # (G, S, K)
    if batch_priority:
        # argsort(-top1), stable: descending top-1 gate, equal gates keep position order
        order = _top(top_gate[..., 0], s, dim=-1)[1]  # (G, S)
    else:
        order = torch.arange(s, device=gates.device).expand(g, s)
    by_priority = top_expert.gather(1, order.unsqueeze(-1).expand(g, s, k))  # (G, S, K)
    claims = by_priority.transpose(1, 2).reshape(g, k * s)  # (G, K*S) choice-major
    one_hot = F.one_hot(claims, e).to(torch.int32)  # (G, K*S, E): tokens x experts, no capacity axis
    number = ((one_hot.cumsum(dim=1) - 1) * one_hot).sum(dim=-1)  # (G, K*S) claim's number at its expert
    number = number.view(g, k, s).transpose(1, 2).to(torch.int64)  # (G, S, K) in priority order
    slot = torch.empty_like(number).scatter_(1, order.unsqueeze(-1).expand(g, s, k), number)  # token order
    return TokensChoice(top_expert, top_gate, slot, slot < capacity, order, capacity)


def experts_choice(gates: torch.Tensor, capacity: int) -> ExpertsChoice:
    """vmoe ``get_top_items_per_expert_dispatcher`` (deterministic) on gates ``(G, S, E)``."""
    s = gates.shape[1]
    if capacity > s:
        raise ValueError(f"experts-choice capacity {capacity} exceeds the {s} tokens of a routing group "
                         "(vmoe's top_k fails the same way)")
    gate, token = (t.transpose(1, 2) for t in _top(gates, capacity, dim=1))  # (G, E, C)
    return ExpertsChoice(token, gate, capacity)


def einsum_tensors(routing: TokensChoice | ExpertsChoice, num_experts: int, group_tokens: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """vmoe ``EinsumDispatcher``'s ``(G, S, E, C)`` dispatch (bool one-hot of the slot) and combine
    (the gate at that slot) tensors, for the reference path and the golden tests."""
    c = routing.capacity
    if isinstance(routing, TokensChoice):
        g, s, k = routing.expert.shape
        slot = F.one_hot(torch.where(routing.kept, routing.slot, c), c + 1)[..., :c]  # (G, S, K, C), 0 if dropped
        hot = F.one_hot(routing.expert, num_experts)  # (G, S, K, E)
        dispatch = torch.einsum("gske,gskc->gsec", hot.float(), slot.float()) > 0  # 0/1 sums: exact
        weight = torch.zeros(g, s, num_experts, dtype=routing.gate.dtype, device=routing.gate.device)
        weight.scatter_(2, routing.expert, routing.gate)  # (G, S, E)
    else:
        g, e, _ = routing.token.shape
        hot = F.one_hot(routing.token, group_tokens).permute(0, 3, 1, 2)  # (G, S, E, C)
        dispatch = hot > 0
        weight = (hot * routing.gate.unsqueeze(1)).sum(dim=-1)  # (G, S, E), one nonzero term
    combine = weight.unsqueeze(-1) * dispatch  # (G, S, E, C)
    return dispatch, combine


class SparseMoE(CapturesRouting, nn.Module):
    """vmoe sparse MoE MLP: ``(B, m, d) -> (B, m, d)``, routed per image (or per ``group_images``).

    Args:
        dim: token width d.
        num_experts: E.
        mlp_dim: expert hidden width.
        router: "tokens-choice" or "experts-choice".
        experts_per_token: K (tokens choice).
        capacity_factor: cf.
        capacity_rounding: "ceil" or "round" (vmoe capacity_ceil_or_round).
        capacity_multiple_of: C rounded up to a multiple of this.
        batch_priority: tokens choice claims in descending top-1 gate order.
        bf16_dispatch: emulate vmoe's bfloat16 dispatcher.
        fused: the gather path (default) instead of vmoe's einsums.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        mlp_dim: int,
        router: Router = "tokens-choice",
        experts_per_token: int = 1,
        capacity_factor: float = 4.0,
        capacity_rounding: CapacityRounding = "ceil",
        capacity_multiple_of: int = 4,
        batch_priority: bool = False,
        bf16_dispatch: bool = False,
        fused: bool = True,
    ) -> None:
        super().__init__()
        if router not in ("tokens-choice", "experts-choice"):
            raise ValueError(f"SparseMoE router must be 'tokens-choice' or 'experts-choice', got {router!r}")
        self.dim, self.num_experts, self.mlp_dim = dim, num_experts, mlp_dim
        self.router_kind: Router = router
        self.experts_per_token = experts_per_token if router == "tokens-choice" else 1
        self.capacity_factor = capacity_factor
        self.capacity_rounding: CapacityRounding = capacity_rounding
        self.capacity_multiple_of = capacity_multiple_of
        self.batch_priority = batch_priority
        self.bf16_dispatch = bf16_dispatch
        self.fused = fused
        # Tokens Choice's fused form: "routed" (default) runs each expert over the claims it kept
        # and nothing else; "capacity" over its whole capacity buffer (the form before, for the
        # benchmark that compares them).
        self.tokens_form: TokensForm = "routed"
        # The routed form's GEMM row block (_experts_routed): 4 in torch (every GEMM of 4 rows, the
        # smallest count whose rows CPU GEMMs give the bits of any larger one); 0 for the ONNX
        # export (each expert one GEMM over exactly its rows).
        self.row_block = MIN_ROW_BLOCK
        self.rows_computed: int | None = None  # expert rows the last eager call computed (all images, this layer)
        # Images per routing group. 1 (the default, and what serving uses): an image's routing and
        # output never depend on its batch-mates. vmoe trained and evaluated with 8 (group_size =
        # 8 images' tokens); set it only to reproduce those numbers (the batch must then be a
        # multiple of it). See configure_sparse_routing.
        self.group_images = 1
        # The expert GEMMs run on at least this many rows (zero rows pad the rest), as
        # SoftMoE.min_expert_rows: CPU small-M kernels give rows other bits. 0: no padding.
        self.min_expert_rows = 0
        self.capture = False  # when True, keep this thread's last call's routing in .internals
        # vmoe Moe/Router/dense/kernel (d, E), no bias; experts stacked (vmoe Moe/Mlp/Dense_{0,1}).
        self.router = nn.Parameter(torch.randn(dim, num_experts) * dim**-0.5)  # (d, E)
        self.w1 = nn.Parameter(torch.randn(num_experts, dim, mlp_dim) * dim**-0.5)  # (E, d, M)
        self.b1 = nn.Parameter(torch.zeros(num_experts, mlp_dim))  # (E, M)
        self.w2 = nn.Parameter(torch.randn(num_experts, mlp_dim, dim) * mlp_dim**-0.5)  # (E, M, d)
        self.b2 = nn.Parameter(torch.zeros(num_experts, dim))  # (E, d)

    @classmethod
    def from_config(cls, dim: int, moe: MoEConfig, mlp_dim: int) -> SparseMoE:
        """The layer a block with this MoE config holds."""
        return cls(
            dim, moe.num_experts, mlp_dim, router=moe.router, experts_per_token=moe.k,
            capacity_factor=moe.capacity_factor, capacity_rounding=moe.capacity_rounding,
            capacity_multiple_of=moe.capacity_multiple_of, batch_priority=moe.batch_priority,
            bf16_dispatch=moe.dispatch_dtype == "bfloat16",
        )

    def capacity(self, group_tokens: int) -> int:
        """C for a routing group of ``group_tokens`` tokens (vmoe compute_capacity)."""
        return compute_capacity(group_tokens * self.experts_per_token, self.num_experts, self.capacity_factor,
                                self.capacity_rounding, self.capacity_multiple_of)

    # ------------------------------------------------------------------ routing

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, TokensChoice | ExpertsChoice]:
        """Gates ``(G, S, E)`` (float32) and the routing of ``x`` ``(B, m, d)`` in its groups."""
        b, m, d = x.shape
        if b % self.group_images:
            raise ValueError(f"a batch of {b} is not a multiple of group_images={self.group_images} "
                             "(vmoe: B*N must be divisible by group_size)")
        s = self.group_images * m
        logits = torch.matmul(x.float().reshape(-1, s, d), self.router.float())  # (G, S, E)
        gates = logits.softmax(dim=-1)  # over experts, float32
        c = self.capacity(s)
        if self.router_kind == "tokens-choice":
            return gates, tokens_choice(gates, self.experts_per_token, c, self.batch_priority)
        return gates, experts_choice(gates, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, m, d = x.shape
        gates, routing = self.route(x)
        xs = x.reshape(gates.shape[0], -1, d)  # (G, S, d)
        xd = _bf16_round(xs) if self.bf16_dispatch else xs
        if not self.fused:
            y = self._forward_reference(xd, routing)
        elif isinstance(routing, TokensChoice) and self.tokens_form == "capacity":
            y = self._forward_tokens_choice_capacity(xd, routing)
        elif isinstance(routing, TokensChoice):
            y = self._forward_tokens_choice(xd, routing)
        else:
            y = self._forward_experts_choice(xd, routing)
        if self.capture:
            self.internals = self._internals(gates, routing, b, m)
        return y.reshape(b, m, d)

    def _experts(self, buf: torch.Tensor) -> torch.Tensor:
        """``(E, R, d) -> (E, R, d)``: expert e's MLP on its R buffer rows."""
        rows = buf.shape[1]
        self.rows_computed = buf.shape[0] * max(rows, self.min_expert_rows)
        if rows < self.min_expert_rows:
            buf = F.pad(buf, (0, 0, 0, self.min_expert_rows - rows))
        h = F.gelu(torch.baddbmm(self.b1.unsqueeze(1), buf, self.w1), approximate="tanh")  # (E, R, M)
        y = torch.baddbmm(self.b2.unsqueeze(1), h, self.w2)  # (E, R, d)
        y = y[:, :rows] if rows < self.min_expert_rows else y
        return _bf16_round(y) if self.bf16_dispatch else y

    # ------------------------------------------------------------------ reference path

    def _forward_reference(self, xs: torch.Tensor, routing: TokensChoice | ExpertsChoice) -> torch.Tensor:
        g, s, d = xs.shape
        dispatch, combine = einsum_tensors(routing, self.num_experts, s)  # (G, S, E, C)
        buf = torch.einsum("gsec,gsd->egcd", dispatch.to(xs.dtype), xs)  # (E, G, C, d)
        out = self._experts(buf.reshape(self.num_experts, -1, d)).view(buf.shape)
        return torch.einsum("gsec,egcd->gsd", combine.to(xs.dtype), out)  # (G, S, d)

    # ------------------------------------------------------------------ fused path

    def _forward_tokens_choice(self, xs: torch.Tensor, r: TokensChoice) -> torch.Tensor:
        """The routed rows only: every kept claim of the batch sorted by expert (a stable order:
        group, token, choice within an expert), each expert's MLP over its own rows, and every
        claim reading its row back. Nothing is computed for an empty capacity slot or a dropped
        claim; the rows an expert runs are exactly the claims vmoe's capacity rule kept."""
        g, s, d = xs.shape
        e, k = self.num_experts, self.experts_per_token
        a = g * s * k
        # A dropped claim gets key E: it sorts after every expert's rows and no expert runs it.
        key = torch.where(r.kept, r.expert, e).reshape(a)  # (A,) claims in (group, token, choice) order
        hot = (key.unsqueeze(-1) == torch.arange(e + 1, device=xs.device)).to(torch.int32)  # (A, E+1), no one-hot op
        count = hot.sum(dim=0)  # (E+1,) kept claims per expert over the batch; [E]: the dropped ones
        first = count.cumsum(dim=0) - count  # (E+1,) where each expert's rows start
        rank = ((hot.cumsum(dim=0) - 1) * hot).sum(dim=-1)  # (A,) the claim's number at its expert
        dest = (first.gather(0, key) + rank).to(torch.int64)  # (A,) the claim's row, a permutation of 0..A-1
        token = torch.arange(g * s, device=xs.device).unsqueeze(-1).expand(g * s, k).reshape(a)  # (A,) claim's token
        token = torch.empty_like(dest).scatter_(0, dest, token)  # (A,) each row's token (no division node)
        rows = xs.reshape(g * s, d).index_select(0, token)  # (A, d) exact copies, by expert
        out = self._experts_routed(rows, count[:e])  # (A, d); rows past the kept claims: 0
        got = out.index_select(0, dest).view(g, s, k, d)  # each claim's own row back
        w = r.gate.to(xs.dtype).unsqueeze(-1)  # (G, S, K, 1), not renormalised
        # Sum over the K choices in choice order, a dropped one contributing exactly 0 (as the
        # capacity form below; for K <= 2 a + b is exact in either order, so vmoe's einsum order
        # over (E, C) can differ only in its multiply-add rounding).
        return torch.where(r.kept.unsqueeze(-1), w * got, 0).sum(dim=2)  # (G, S, d)

    def _experts_routed(self, rows: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """``(A, d) -> (A, d)``: expert e's MLP on its ``count[e]`` rows, which follow expert
        e-1's; the rows after the last expert's (dropped claims) come back as zeros.

        ``row_block`` 0: each expert one GEMM over exactly its rows (ONNX export: a Slice and
        constant 2-D MatMuls per expert, which ONNX Runtime prepacks; MLAS gives a row the same bits
        whatever the row count, which every export verifies, ``export.onnx``). ``row_block`` b:
        each expert's rows zero-padded to a multiple of b and run as GEMMs of exactly b rows each
        (torch's CPU GEMMs give a row other bits at other row counts, and a row count here depends
        on the batch-mates; GEMMs of one shape do not)."""
        a, d = rows.shape
        if torch.compiler.is_exporting():  # one node; export.onnx writes it out per expert
            self.rows_computed = None
            return torch.ops.softmoe.routed_experts(rows, count.to(torch.int64), self.w1, self.b1, self.w2, self.b2,
                                                    self.bf16_dispatch)
        sizes = count.tolist()
        segs, start = [], 0
        computed = 0
        for i, n in enumerate(sizes):
            if n:
                seg = rows[start:start + n]
                start += n
                if self.row_block:
                    pad = -n % self.row_block
                    seg = F.pad(seg, (0, 0, 0, pad)).view(-1, self.row_block, d)
                    segs.append(self._expert(i, seg).reshape(-1, d)[:n])
                    computed += n + pad
                else:
                    segs.append(self._expert(i, seg))
                    computed += n
        segs.append(rows.new_zeros(a - start, d))
        self.rows_computed = computed
        return torch.cat(segs)

    def _expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Expert i's MLP on ``(n, d)`` rows, or ``(blocks, b, d)`` as GEMMs of b rows each."""
        if x.dim() == 3:
            nb = x.shape[0]
            h = F.gelu(torch.baddbmm(self.b1[i], x, self.w1[i].expand(nb, -1, -1)), approximate="tanh")
            y = torch.baddbmm(self.b2[i], h, self.w2[i].expand(nb, -1, -1))
        else:
            h = F.gelu(torch.addmm(self.b1[i], x, self.w1[i]), approximate="tanh")  # (n, M)
            y = torch.addmm(self.b2[i], h, self.w2[i])  # (n, d)
        return _bf16_round(y) if self.bf16_dispatch else y

    def _forward_tokens_choice_capacity(self, xs: torch.Tensor, r: TokensChoice) -> torch.Tensor:
        """The capacity form (before the routed one; kept for the benchmark that compares them):
        every expert runs over its whole capacity buffer, empty slots as zero rows."""
        g, s, d = xs.shape
        e, k = self.num_experts, self.experts_per_token
        # An expert gets at most one claim per token, so slots from S on stay empty: drop them.
        c = min(r.capacity, s)
        # Which token holds slot (e, c) of each group: the c-th claim for e in claim order. Claims
        # sorted by expert (stable, so claim order within an expert) start at `first[e]`.
        claims = r.expert.gather(1, r.order.unsqueeze(-1).expand(g, s, k)).transpose(1, 2).reshape(g, k * s)
        by_expert = _top(claims, k * s, dim=1, largest=False)[1]  # (G, K*S) claim indices, stable
        count = F.one_hot(claims, e).sum(dim=1)  # (G, E)
        first = count.cumsum(dim=1) - count  # (G, E)
        pos = first.unsqueeze(-1) + torch.arange(c, device=xs.device)  # (G, E, C)
        filled = torch.arange(c, device=xs.device) < count.clamp(max=c).unsqueeze(-1)  # (G, E, C)
        claim = by_expert.gather(1, pos.clamp(max=k * s - 1).flatten(1))  # (G, E*C)
        token = r.order.gather(1, claim % s)  # (G, E*C) the claim's token (claims are choice-major)
        buf = xs.gather(1, token.unsqueeze(-1).expand(-1, -1, d))  # (G, E*C, d), an exact copy
        buf = torch.where(filled.flatten(1).unsqueeze(-1), buf, 0)  # empty slots hold zeros (as vmoe)
        buf = buf.view(g, e, c, d).transpose(0, 1).reshape(e, g * c, d)  # (E, G*C, d)
        out = self._experts(buf).view(e, g, c, d).transpose(0, 1).reshape(g, e * c, d)  # (G, E*C, d)
        # Every claim reads its slot back; a dropped one contributes exactly 0.
        where = (r.expert * c + r.slot.clamp(max=c - 1)).view(g, s * k)  # (G, S*K)
        got = out.gather(1, where.unsqueeze(-1).expand(-1, -1, d)).view(g, s, k, d)
        w = r.gate.to(xs.dtype).unsqueeze(-1)  # (G, S, K, 1), not renormalised
        # Sum over the K choices in choice order. vmoe's einsum sums over (E, C); for K <= 2 the
        # kept terms are at most two, and a + b is exact in either order, so only the
        # multiply-add rounding of XLA's dot can differ (~1 ulp). K > 2: float order differs.
        return torch.where(r.kept.unsqueeze(-1), w * got, 0).sum(dim=2)  # (G, S, d)

    def _forward_experts_choice(self, xs: torch.Tensor, r: ExpertsChoice) -> torch.Tensor:
        g, s, d = xs.shape
        e, c = self.num_experts, r.capacity
        token = r.token.flatten(1)  # (G, E*C) expert-major
        buf = xs.gather(1, token.unsqueeze(-1).expand(-1, -1, d))  # (G, E*C, d)
        per_expert = buf.view(g, e, c, d).transpose(0, 1).reshape(e, g * c, d)  # (E, G*C, d)
        if torch.compiler.is_exporting():  # the routed experts' per-expert constant Gemms, G*C rows each
            count = torch.full((e,), g * c, dtype=torch.int64, device=xs.device)
            out = torch.ops.softmoe.routed_experts(per_expert.reshape(e * g * c, d), count, self.w1, self.b1,
                                                   self.w2, self.b2, self.bf16_dispatch).view(e, g * c, d)
        else:
            out = self._experts(per_expert)
        out = out.view(e, g, c, d).transpose(0, 1).reshape(g, e * c, d)  # (G, E*C, d)
        contrib = r.gate.to(xs.dtype).flatten(1).unsqueeze(-1) * out  # (G, E*C, d)
        # A token may be taken by 0..E experts: add the contributions into their tokens, in expert
        # order (index_add_ on CPU runs the indices in order, so the bits are deterministic and per
        # group; CUDA adds atomically, so a token taken by 3+ experts may differ in the last bit
        # between runs unless torch.use_deterministic_algorithms). vmoe's einsum sums over (E, C)
        # in XLA's order: equal up to float rounding.
        rows = (torch.arange(g, device=xs.device).unsqueeze(-1) * s + token).flatten()  # (G*E*C,)
        y = torch.zeros(g * s, d, dtype=contrib.dtype, device=xs.device)
        return y.index_add_(0, rows, contrib.reshape(-1, d)).view(g, s, d)

    # ------------------------------------------------------------------ routing information

    def _internals(self, gates: torch.Tensor, routing: TokensChoice | ExpertsChoice, b: int, m: int
                   ) -> dict[str, torch.Tensor]:
        """Per image: ``gates`` and ``combine_weights`` ``(B, m, E)`` (the combine weight of each
        (token, expert), summed over capacity slots, 0 where not dispatched), ``dispatched``
        ``(B, m, E)`` bool, ``dropped`` ``(B, m)`` int64 (TC: the token's choices that found no room;
        EC: 1 when no expert took the token), ``expert_load`` ``(B, E)`` (the image's tokens each
        expert processes); TC also ``dropped_choices`` ``(B, m, K)`` bool."""
        g, s, e = gates.shape
        if isinstance(routing, TokensChoice):
            dispatched = torch.zeros(g, s, e, dtype=torch.bool, device=gates.device)
            dispatched.scatter_(2, routing.expert, routing.kept)
            combine = torch.zeros_like(gates).scatter_(2, routing.expert, routing.gate * routing.kept)
            dropped_choices = ~routing.kept
            dropped = dropped_choices.sum(dim=-1)
        else:
            dispatched = torch.zeros(g, s, e, dtype=torch.bool, device=gates.device)
            dispatched.scatter_(1, routing.token.transpose(1, 2), True)
            combine = torch.where(dispatched, gates, 0)
            dropped = (~dispatched.any(dim=-1)).long()
            dropped_choices = None
        out = dict(
            gates=gates.reshape(b, m, e),
            combine_weights=combine.reshape(b, m, e),
            dispatched=dispatched.reshape(b, m, e),
            dropped=dropped.reshape(b, m),
            expert_load=dispatched.reshape(b, m, e).sum(dim=1),
        )
        if dropped_choices is not None:
            out["dropped_choices"] = dropped_choices.reshape(b, m, -1)
        return out


def sparse_moe_layers(model: nn.Module) -> list[SparseMoE]:
    """The sparse MoE layers of ``model`` in forward order."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def configure_sparse_routing(
    model: nn.Module,
    fused: bool | None = None,
    bf16_dispatch: bool | None = None,
    group_images: int | None = None,
    tokens_form: TokensForm | None = None,
    row_block: int | None = None,
) -> nn.Module:
    """Set the path, dispatcher dtype, Tokens Choice form, the routed form's GEMM row block and (for
    reproducing vmoe's grouped numbers only) the images per routing group of every sparse MoE layer
    in ``model``; returns ``model``."""
    if group_images is not None and group_images < 1:
        raise ValueError(f"group_images must be >= 1, got {group_images}")
    if tokens_form is not None and tokens_form not in ("routed", "capacity"):
        raise ValueError(f"tokens_form must be 'routed' or 'capacity', got {tokens_form!r}")
    if row_block is not None and row_block < 0:
        raise ValueError(f"row_block must be >= 0, got {row_block}")
    for layer in sparse_moe_layers(model):
        if fused is not None:
            layer.fused = fused
        if bf16_dispatch is not None:
            layer.bf16_dispatch = bf16_dispatch
        if group_images is not None:
            layer.group_images = group_images
        if tokens_form is not None:
            layer.tokens_form = tokens_form
        if row_block is not None:
            layer.row_block = row_block
    return model
